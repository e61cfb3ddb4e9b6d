"""The suite's processes: worker children (model, fine-tuning and decoding loops) and the parent
side that starts a group of them, runs them together and samples their memory.

Workers run as ``python -m benchmarks.suite worker SPEC`` (``WORKER_MODULE``; JSON lines on
stdin/stdout, see ``benchmarks/workers.py``); ``benchmarks.suite.main`` hands them to
``worker_main``. Used by ``multi_job_finetune``, ``executor_memory`` and
``multi_adapter_inference``.

Worker ``mode``: ``"split"`` (a client of the scenario's executor process, over ``shm+ipc``),
``"embedded"`` (a client of a ``BaseExecutor`` loaded in the worker itself) or ``"monolithic"``
(plain ``transformers``). Environment (``worker_env``): split clients run with
``OMP_WAIT_POLICY=PASSIVE``, the project's setting for a process that shares the host with an
executor in another process (``symbiosis/threads.py``); embedded and monolithic workers keep
libgomp's default. An ``OMP_WAIT_POLICY`` already in the suite's environment wins, as on the
command line. ``env_record`` is what scenarios write into their JSON config.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.memory import GIB, RssSampler
from benchmarks.options import quiet_libraries
from benchmarks.scenarios.context import Context
from benchmarks.timing import ratio
from benchmarks.workers import Worker, serve_worker
from symbiosis.executor.process import ExecutorProcess
from symbiosis.threads import (  # no torch import: safe before OpenMP starts
    SHARED_HOST_POLICY,
    SPIN_COUNT_VARIABLE,
    WAIT_POLICY_VARIABLE,
    client_env,
)

WORKER_MODULE = "benchmarks.suite"  # the children's entry point: ``python -m benchmarks.suite worker SPEC``


# ---- workers (child processes) -------------------------------------------------------------------


def _peft_model(spec: dict):
    """The worker's model: split (``executor`` address), embedded (an in-process ``BaseExecutor``)
    or monolithic, with adapters ``a<i>``.

    Adapter ``i`` has the same weights in every process (seeded by ``i``; LoRA B made non-zero so
    the adapter does real work).
    """
    import peft
    from transformers import AutoModelForCausalLM

    import symbiosis
    from benchmarks.split_overhead import lora_config

    if spec["mode"] == "split":
        base = symbiosis.load_client_model(spec["path"], executor=spec["executor"])
    elif spec["mode"] == "embedded":
        import atexit

        executor = symbiosis.BaseExecutor.from_pretrained(spec["path"])
        atexit.register(executor.close)  # the model's transport holds it; closed when the worker exits
        base = symbiosis.load_client_model(spec["path"], executor=executor)
    else:
        base = AutoModelForCausalLM.from_pretrained(spec["path"])
    model = None
    for index in spec["adapters"]:
        torch.manual_seed(100 + index)
        if model is None:
            model = peft.get_peft_model(base, lora_config(), adapter_name=f"a{index}")
        else:
            model.add_adapter(f"a{index}", lora_config())
    generator = torch.Generator().manual_seed(200)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    if len(spec["adapters"]) == 1:
        model.set_adapter(f"a{spec['adapters'][0]}")
    return model


def _finetune_worker(spec: dict) -> Callable[[], dict]:
    from benchmarks.split_overhead import train_step_fn

    model = _peft_model(spec)
    model.train()
    generator = torch.Generator().manual_seed(spec["seed"])
    batch = torch.randint(0, model.config.vocab_size, (spec["batch"], spec["seq"]), generator=generator)
    step = train_step_fn(model, batch)
    step()  # warm-up

    def run_once() -> dict:
        step_s = []
        start = time.monotonic()
        for _ in range(spec["steps"]):
            began = time.monotonic()
            step()
            step_s.append(time.monotonic() - began)
        return {"t_start": start, "t_end": time.monotonic(), "step_s": step_s, "tokens": spec["steps"] * batch.numel()}

    return run_once


def _decode_worker(spec: dict) -> Callable[[], dict]:
    model = _peft_model(spec)
    model.eval()
    sequences = len(spec["adapters"])
    extra = {"adapter_names": [f"a{i}" for i in spec["adapters"]]} if sequences > 1 else {}
    prompt = torch.randint(
        3,
        model.config.vocab_size,
        (sequences, spec["prompt_len"]),
        generator=torch.Generator().manual_seed(spec["seed"]),
    )

    @torch.no_grad()
    def generate(tokens: int) -> list[float]:
        out = model(input_ids=prompt, use_cache=True, **extra)
        latencies = []
        for _ in range(tokens):
            began = time.monotonic()
            out = model(
                input_ids=out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True, **extra
            )
            latencies.append(time.monotonic() - began)
        return latencies

    generate(2)  # warm-up

    def run_once() -> dict:
        start = time.monotonic()
        latencies = generate(spec["tokens"])
        return {
            "t_start": start,
            "t_end": time.monotonic(),
            "token_latency_s": latencies,
            "sequences": sequences,
            "tokens": sequences * len(latencies),
        }

    return run_once


def worker_main(spec: dict) -> None:
    import atexit

    quiet_libraries()

    def setup() -> Callable[[], dict]:
        run_once = {"finetune": _finetune_worker, "decode": _decode_worker}[spec["kind"]](spec)
        return run_once

    if spec["mode"] == "split":  # close the connection cleanly when the parent says exit
        import symbiosis.client.surgery as surgery

        original = surgery.open_connection

        def connect_and_remember(*args, **kwargs):
            transport = original(*args, **kwargs)
            atexit.register(transport.close)
            return transport

        surgery.open_connection = connect_and_remember
    serve_worker(setup)


# ---- the workers' environment ---------------------------------------------------------------------


def worker_env(spec: dict) -> dict[str, str]:
    """Variables a worker gets on top of ``process_env``: split clients (the executor is another
    process on this host) get a client's OpenMP settings (``threads.client_env``:
    ``OMP_WAIT_POLICY=PASSIVE``, a short ``GOMP_SPINCOUNT``), the others nothing."""
    if spec["mode"] == "split":
        return client_env()
    return {}


def env_record(threads: int, mode: str | None = None) -> dict[str, str | None]:
    """The thread-related environment of a worker of ``mode`` (``None``: the executor, which
    ``symbiosis serve`` sets itself), for a scenario's JSON config; None means unset (libgomp's
    default wait policy)."""
    if mode is None:
        policy = os.environ.get(WAIT_POLICY_VARIABLE, SHARED_HOST_POLICY)  # symbiosis/threads.py: configure_for_command
        spin = None
    else:
        env = worker_env({"mode": mode})
        policy = env.get(WAIT_POLICY_VARIABLE, os.environ.get(WAIT_POLICY_VARIABLE))
        spin = env.get(SPIN_COUNT_VARIABLE)
    record = {WAIT_POLICY_VARIABLE: policy, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    return record if spin is None else {**record, SPIN_COUNT_VARIABLE: spin}


def start_worker(spec: dict, threads: int) -> Worker:
    """``Worker`` for ``spec`` with ``worker_env(spec)`` in its environment."""
    return Worker(WORKER_MODULE, spec, threads=threads, env=worker_env(spec))


# ---- running groups of processes -----------------------------------------------------------------


@dataclass
class Group:
    """What one run of processes measured."""

    events: list[dict]
    sampler: RssSampler
    span_s: float

    def tokens_per_s(self) -> float:
        return ratio(sum(e["tokens"] for e in self.events), self.span_s)

    def memory(self) -> dict[str, Any]:
        roles = sorted(set(self.sampler.roles.values()))
        return {
            "peak_total_rss_gib": self.sampler.peak_total / GIB,
            "peak_rss_gib_by_role": {r: [b / GIB for b in self.sampler.peaks_of(r)] for r in roles},
            "max_rss_gib_workers": [e["max_rss_bytes"] / GIB for e in self.events],
            "rss_samples": self.sampler.samples,
        }


def run_group(ctx: Context, specs: Sequence[dict], *, server: ExecutorProcess | None = None) -> Group:
    """Start one worker per spec (clients of ``server`` when given) and run them once, together."""
    sampler = RssSampler(0.1).start()
    workers: list[Worker] = []
    try:
        if server:
            sampler.watch(server.pid, "executor")
        for spec in specs:
            spec = dict(spec, executor="shm+" + server.addresses[0]) if server else spec
            worker = start_worker(spec, ctx.threads)
            sampler.watch(worker.pid, spec["role"])
            workers.append(worker)
        for worker in workers:
            worker.wait_ready()
        for worker in workers:
            worker.go()
        events = [worker.wait_done() for worker in workers]
    finally:
        for worker in workers:
            worker.request_exit()
        for worker in workers:
            worker.close()
        sampler.stop()
    span = max(e["t_end"] for e in events) - min(e["t_start"] for e in events)
    return Group(events, sampler, span)


class ScenarioExecutor:
    """One ``symbiosis serve`` child (ipc) for a whole scenario, started without waiting so its load
    overlaps the first baseline run; runs of every size reuse it (it keeps no per-client state)."""

    def __init__(self, ctx: Context, path: Path) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="symbiosis-suite-")
        self.server = ExecutorProcess(
            path, [f"ipc://{self._folder.name}/executor.sock"], threads=ctx.executor_thread_count, wait=False
        )

    def __enter__(self) -> ExecutorProcess:
        return self.server

    def __exit__(self, *exc) -> None:
        self.server.close()
        self._folder.cleanup()


def finetune_spec(
    ctx: Context, path: Path, mode: str, index: int, steps: int | None = None, seq: int | None = None
) -> dict:
    p = ctx.profile
    role = "client" if mode == "split" else "job"
    return {
        "kind": "finetune",
        "mode": mode,
        "role": role,
        "path": str(path),
        "adapters": [index],
        "seed": index,
        "batch": p.finetune_batch,
        "seq": seq or p.finetune_seq,
        "steps": steps or p.finetune_steps,
    }
