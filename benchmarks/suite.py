"""The benchmark suite (issue 6): Symbiosis against what a user would run instead, side by side.

Each scenario is a function ``scenario(ctx) -> dict`` that writes ``<output>/<scenario>/``
``result.json``, ``plot.png`` and ``table.md``. Processes are real: ``symbiosis serve`` for the
executor, one child per client or baseline job (``python -m benchmarks.suite worker SPEC``, JSON
lines on stdin/stdout, see ``benchmarks/common.py``). Every process runs ``--threads`` torch
threads (default 1: on a shared 2-core machine, more threads mostly wait for busy cores). Memory
is the sum of the processes' RSS sampled with psutil every 0.1 s (peak of the sum), next to each
process's exact ``ru_maxrss``. Compared runs alternate their order from one size to the next.

1. ``multi_job_finetune``: K LoRA fine-tuning jobs (K in 1, 2, 4, 8): one executor + K client
   processes vs K ``transformers+peft`` processes each holding the whole model. Aggregate
   training tokens/s (all tokens / span from the first job's start to the last job's end), peak
   total RSS, and how many jobs fit a memory budget from the measured per-process peaks
   (``executor + n x client <= budget`` vs ``n x job <= budget``), also for a ~1B model (full
   runs, when psutil says it fits). mLoRA: outcome of the check recorded in ``mlora``.
2. ``executor_memory``: one executor process; 0, 1, 2, 4, 8, 16 training clients (cumulative),
   each level running a few steps of every client; executor RSS per level (should stay flat).
3. ``multi_adapter_inference``: K clients, each with its own LoRA adapter, decode greedily at
   once, vs (a) one ``transformers+peft`` process decoding all K requests as one mixed-adapter
   batch (``adapter_names=``), (b) one ``transformers+peft`` process per adapter. Aggregate
   tokens/s and p50/p95 per-token latency (time of one decode step, pooled over requests).
4. ``split_overhead``: one client per transport (inproc, shm+ipc, ipc, tcp, dist+tcp when present)
   vs the monolithic model: training step and decode step, interleaved
   (``benchmarks.transport.step_ratios``).
5. ``executor_efficiency``: the executor's batched products recorded while C in-process clients
   train and decode, timed in place (``in_situ``) and replayed through the executor's own
   ``run_batch`` vs plain ``torch.matmul`` on the same shapes, interleaved, with a 1024²
   ``torch.matmul`` as the machine's ceiling.

Every ``result.json``: ``scenario, command, machine, config, results, headline, losses, wall_s``.
``results`` per scenario (keys the tests check): (1) ``runs, per_k, per_process_gib, budget,
large_model, mlora``; (2) ``levels, executor_rss_growth``; (3) ``runs, per_k``; (4) ``train_step,
decode_step, check, dist``; (5) ``phases, matmul_ceiling_gflops``. ``headline``: sentences with
the key ratios; ``losses``: where the baseline wins. ``--quick``: ``tiny`` model, fewer and smaller
runs (about 2 minutes); full: ``base`` (~105M params), about 20 minutes on 2 cores.

Run: ``symbiosis bench [SCENARIO ...] [--quick] --output DIR`` or ``python -m benchmarks.suite``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks import common

SCENARIOS = ("multi_job_finetune", "executor_memory", "multi_adapter_inference", "split_overhead", "executor_efficiency")
MODULE = "benchmarks.suite"
# The mLoRA check (brief: at most 10 minutes). Re-checked at run time only if `mlora` is installed.
MLORA_CHECK = {
    "package": "mlora 0.5.2 (PyPI; `pip download --no-deps mlora` works, a 91 kB wheel)",
    "runs_here": False,
    "why": (
        "It advertises a CPU backend, but pins torch>=2.3,<2.4 and transformers>=4.44,<4.45 (this project: "
        "torch 2.13, transformers 5.x) and needs datasets/evaluate/scikit-learn/tiktoken. Installed with "
        "--no-deps into a side folder and its missing imports stubbed, `import mlora` works, but "
        "LLMModel.from_pretrained on our Llama checkpoint fails: AttributeError: 'LlamaConfig' object has no "
        "attribute 'rope_theta' (transformers 5 moved it into rope_parameters). Running it would need a second "
        "environment with torch 2.3 / transformers 4.44, so it is not part of this comparison."
    ),
}


@dataclass(frozen=True)
class Profile:
    """Sizes of one suite run (``QUICK`` or ``FULL``)."""

    preset: str
    finetune_ks: tuple[int, ...]
    finetune_steps: int
    finetune_batch: int
    finetune_seq: int
    memory_levels: tuple[int, ...]
    memory_steps: int
    inference_ks: tuple[int, ...]
    prompt_len: int
    decode_tokens: int
    step_repeats: int
    efficiency_clients: int
    efficiency_repeats: int
    large_model: bool


QUICK = Profile("tiny", (1, 2), 2, 1, 32, (0, 1, 2), 1, (2,), 8, 8, 3, 2, 3, False)
FULL = Profile("base", (1, 2, 4, 8), 4, 1, 64, (0, 1, 2, 4, 8, 16), 2, (2, 4, 8), 32, 32, 12, 4, 8, True)


@dataclass
class Context:
    output: Path
    cache: Path
    profile: Profile
    quick: bool
    threads: int
    budget_gib: float
    command: str
    log: Callable[[str], None] = print

    def checkpoint(self, preset: str | None = None) -> Path:
        from symbiosis.modelzoo import make_model

        preset = preset or self.profile.preset
        return make_model("llama", preset, self.cache / f"llama-{preset}-seed0", seed=0)


# ---- workers (child processes) -------------------------------------------------------------------


def _peft_model(spec: dict):
    """The worker's model: split (``executor`` address) or monolithic, with adapters ``a<i>``.

    Adapter ``i`` has the same weights in every process (seeded by ``i``; LoRA B made non-zero so
    the adapter does real work).
    """
    import peft
    from transformers import AutoModelForCausalLM

    import symbiosis
    from benchmarks.split_overhead import lora_config

    if spec["mode"] == "split":
        base = symbiosis.load_client_model(spec["path"], executor=spec["executor"])
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
    prompt = torch.randint(3, model.config.vocab_size, (sequences, spec["prompt_len"]), generator=torch.Generator().manual_seed(spec["seed"]))

    @torch.no_grad()
    def generate(tokens: int) -> list[float]:
        out = model(input_ids=prompt, use_cache=True, **extra)
        latencies = []
        for _ in range(tokens):
            began = time.monotonic()
            out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True, **extra)
            latencies.append(time.monotonic() - began)
        return latencies

    generate(2)  # warm-up

    def run_once() -> dict:
        start = time.monotonic()
        latencies = generate(spec["tokens"])
        return {"t_start": start, "t_end": time.monotonic(), "token_latency_s": latencies, "sequences": sequences, "tokens": sequences * len(latencies)}

    return run_once


def worker_main(spec: dict) -> None:
    import atexit

    common.quiet_libraries()

    def setup() -> Callable[[], dict]:
        run_once = {"finetune": _finetune_worker, "decode": _decode_worker}[spec["kind"]](spec)
        return run_once

    if spec["mode"] == "split":  # close the connection cleanly when the parent says exit
        import symbiosis.client.surgery as surgery

        original = surgery.connect

        def connect_and_remember(*args, **kwargs):
            transport = original(*args, **kwargs)
            atexit.register(transport.close)
            return transport

        surgery.connect = connect_and_remember
    common.serve_worker(setup)


# ---- running groups of processes -----------------------------------------------------------------


@dataclass
class Group:
    """What one run of processes measured."""

    events: list[dict]
    sampler: common.RssSampler
    span_s: float

    def tokens_per_s(self) -> float:
        return common.ratio(sum(e["tokens"] for e in self.events), self.span_s)

    def memory(self) -> dict[str, Any]:
        roles = sorted(set(self.sampler.roles.values()))
        return {
            "peak_total_rss_gib": self.sampler.peak_total / common.GIB,
            "peak_rss_gib_by_role": {r: [b / common.GIB for b in self.sampler.peaks_of(r)] for r in roles},
            "max_rss_gib_workers": [e["max_rss_bytes"] / common.GIB for e in self.events],
            "rss_samples": self.sampler.samples,
        }


def run_group(ctx: Context, specs: Sequence[dict], *, server: common.ServerProcess | None = None) -> Group:
    """Start one worker per spec (clients of ``server`` when given) and run them once, together."""
    sampler = common.RssSampler(0.1).start()
    workers: list[common.Worker] = []
    try:
        if server:
            sampler.watch(server.pid, "executor")
        for spec in specs:
            spec = dict(spec, executor="shm+" + server.addresses[0]) if server else spec
            worker = common.Worker(MODULE, spec, threads=ctx.threads)
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
        self.server = common.executor_process(path, [f"ipc://{self._folder.name}/executor.sock"], threads=ctx.threads, wait=False)

    def __enter__(self) -> common.ServerProcess:
        return self.server

    def __exit__(self, *exc) -> None:
        self.server.close()
        self._folder.cleanup()


def finetune_spec(ctx: Context, path: Path, mode: str, index: int, steps: int | None = None, seq: int | None = None) -> dict:
    p = ctx.profile
    role = "client" if mode == "split" else "job"
    return {"kind": "finetune", "mode": mode, "role": role, "path": str(path), "adapters": [index], "seed": index,
            "batch": p.finetune_batch, "seq": seq or p.finetune_seq, "steps": steps or p.finetune_steps}


# ---- 1. multi-job fine-tuning --------------------------------------------------------------------


def multi_job_finetune(ctx: Context) -> dict:
    path = ctx.checkpoint()
    runs: dict[str, dict[str, Any]] = {"symbiosis": {}, "hf_peft": {}}
    with ScenarioExecutor(ctx, path) as server:
        for i, k in enumerate(ctx.profile.finetune_ks):
            order = ["hf_peft", "symbiosis"] if i % 2 == 0 else ["symbiosis", "hf_peft"]
            for system in order:
                mode = "split" if system == "symbiosis" else "monolithic"
                group = run_group(ctx, [finetune_spec(ctx, path, mode, j) for j in range(k)], server=server if mode == "split" else None)
                runs[system][str(k)] = {"tokens_per_s": group.tokens_per_s(), "span_s": group.span_s,
                                        "step_ms_median": 1e3 * statistics.median(s for e in group.events for s in e["step_s"]), **group.memory()}
                ctx.log(f"  {system:9s} K={k}: {runs[system][str(k)]['tokens_per_s']:.0f} tokens/s, peak RSS {runs[system][str(k)]['peak_total_rss_gib']:.2f} GiB")
    per_k = []
    for k in map(str, ctx.profile.finetune_ks):
        s, h = runs["symbiosis"][k], runs["hf_peft"][k]
        per_k.append({"k": int(k), "symbiosis_tokens_per_s": s["tokens_per_s"], "hf_peft_tokens_per_s": h["tokens_per_s"],
                      "throughput_ratio": common.ratio(s["tokens_per_s"], h["tokens_per_s"]),
                      "symbiosis_peak_total_rss_gib": s["peak_total_rss_gib"], "hf_peft_peak_total_rss_gib": h["peak_total_rss_gib"],
                      "memory_ratio": common.ratio(s["peak_total_rss_gib"], h["peak_total_rss_gib"])})
    per_process = per_process_figures(runs)
    large = large_model_memory(ctx)
    budget = {"budget_gib": ctx.budget_gib, "model": jobs_in_budget(per_process, ctx.budget_gib)}
    if large.get("per_process_gib"):
        budget["large_model"] = jobs_in_budget(large["per_process_gib"], ctx.budget_gib)
    results = {"runs": runs, "per_k": per_k, "per_process_gib": per_process, "budget": budget, "large_model": large, "mlora": mlora_status()}
    last = per_k[-1]
    headline = [
        f"K={last['k']} jobs: Symbiosis {last['symbiosis_tokens_per_s']:.0f} vs HF PEFT {last['hf_peft_tokens_per_s']:.0f} training tokens/s "
        f"(x{last['throughput_ratio']:.2f}), peak RSS {last['symbiosis_peak_total_rss_gib']:.2f} vs {last['hf_peft_peak_total_rss_gib']:.2f} GiB (x{last['memory_ratio']:.2f}).",
        f"In {ctx.budget_gib:g} GiB: {budget['model']['symbiosis_jobs']} Symbiosis jobs vs {budget['model']['hf_peft_jobs']} HF PEFT jobs ({ctx.profile.preset} model).",
    ]
    if "large_model" in budget:
        headline.append(f"In {ctx.budget_gib:g} GiB with the ~1B model: {budget['large_model']['symbiosis_jobs']} Symbiosis jobs vs {budget['large_model']['hf_peft_jobs']} HF PEFT jobs.")
    behind = [f"K={r['k']} x{r['throughput_ratio']:.2f}" for r in per_k if r["throughput_ratio"] < 1]
    losses = ["aggregate training throughput vs HF PEFT: " + ", ".join(behind) + "."] if behind else []
    heavier = [f"K={r['k']} x{r['memory_ratio']:.2f}" for r in per_k if r["memory_ratio"] > 1]
    losses += ["peak total memory vs HF PEFT: " + ", ".join(heavier) + "."] if heavier else []
    table = common_table(["K", "Symbiosis tok/s", "HF PEFT tok/s", "ratio", "Symbiosis peak GiB", "HF PEFT peak GiB", "memory ratio"],
                         [[r["k"], r["symbiosis_tokens_per_s"], r["hf_peft_tokens_per_s"], r["throughput_ratio"], r["symbiosis_peak_total_rss_gib"], r["hf_peft_peak_total_rss_gib"], r["memory_ratio"]] for r in per_k])
    table += "\n\n" + common_table(["model", "executor GiB", "client GiB", "HF PEFT job GiB", f"Symbiosis jobs in {ctx.budget_gib:g} GiB", f"HF PEFT jobs in {ctx.budget_gib:g} GiB"],
                                   [[name, f["executor"], f["client"], f["hf_job"], budget[key]["symbiosis_jobs"], budget[key]["hf_peft_jobs"]]
                                    for name, key, f in [(ctx.profile.preset, "model", per_process)] + ([("~1B", "large_model", large["per_process_gib"])] if "large_model" in budget else [])])
    labels = [str(k) for k in ctx.profile.finetune_ks]
    panels = [
        common.Panel("aggregate training tokens/s", "tokens/s", labels, {"Symbiosis": [r["symbiosis_tokens_per_s"] for r in per_k], "HF PEFT": [r["hf_peft_tokens_per_s"] for r in per_k]}),
        common.Panel("peak total RSS (sum of processes)", "GiB", labels, {"Symbiosis": [r["symbiosis_peak_total_rss_gib"] for r in per_k], "HF PEFT": [r["hf_peft_peak_total_rss_gib"] for r in per_k]}),
    ]
    return finish(ctx, "multi_job_finetune", results, headline, losses, table, panels, f"K LoRA fine-tuning jobs ({ctx.profile.preset}); x axis: K",
                  {"ks": ctx.profile.finetune_ks, "batch": ctx.profile.finetune_batch, "seq_len": ctx.profile.finetune_seq, "steps_per_job": ctx.profile.finetune_steps,
                   "model": str(path), "transport": "shm+ipc", "baseline": "K transformers+peft processes, each loading the whole model"})


def per_process_figures(runs: dict) -> dict[str, float]:
    def median_of(system: str, role: str) -> float:
        values = [v for run in runs[system].values() for v in run["peak_rss_gib_by_role"].get(role, [])]
        return statistics.median(values) if values else math.nan

    return {"executor": median_of("symbiosis", "executor"), "client": median_of("symbiosis", "client"), "hf_job": median_of("hf_peft", "job")}


def jobs_in_budget(per_process: dict[str, float], budget_gib: float) -> dict[str, int]:
    """How many jobs fit: ``executor + n x client <= budget`` vs ``n x job <= budget``."""
    symbiosis_jobs = max(0, math.floor((budget_gib - per_process["executor"]) / per_process["client"]))
    return {"symbiosis_jobs": symbiosis_jobs, "hf_peft_jobs": math.floor(budget_gib / per_process["hf_job"])}


def large_model_memory(ctx: Context) -> dict[str, Any]:
    """Per-process peak RSS with a ~1B model: 1 HF PEFT job, then 1 executor + 1 client (1 step)."""
    import psutil

    if not ctx.profile.large_model:
        return {"skipped": "quick mode: the ~1B model is measured in full runs only"}
    weights_gib = LARGE_PARAMS * 4 / common.GIB
    available_gib = psutil.virtual_memory().available / common.GIB
    needed_gib = 2.5 * weights_gib + 2.0  # building/saving the checkpoint holds ~2 copies; runs are one at a time
    if available_gib < needed_gib:
        return {"skipped": f"needs ~{needed_gib:.1f} GiB free, psutil reports {available_gib:.1f} GiB available", "available_gib": available_gib}
    path = large_checkpoint(ctx.cache)
    hf = run_group(ctx, [finetune_spec(ctx, path, "monolithic", 0, steps=1, seq=32)])
    with ScenarioExecutor(ctx, path) as server:
        split = run_group(ctx, [finetune_spec(ctx, path, "split", 0, steps=1, seq=32)], server=server)
    per_process = {"executor": max(split.sampler.peaks_of("executor")) / common.GIB, "client": max(split.sampler.peaks_of("client")) / common.GIB,
                   "hf_job": max(hf.sampler.peaks_of("job")) / common.GIB}
    ctx.log(f"  ~1B model: executor {per_process['executor']:.2f} GiB, client {per_process['client']:.2f} GiB, HF PEFT job {per_process['hf_job']:.2f} GiB")
    return {"model": str(path), "params": LARGE_PARAMS, "available_gib_before": available_gib, "per_process_gib": per_process,
            "hf_peft": hf.memory(), "symbiosis": split.memory()}


LARGE_SHAPE = dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4, intermediate_size=5632, max_position_embeddings=2048)
LARGE_PARAMS = 22 * (2 * 2048 * 2048 + 2 * 2048 * 256 + 3 * 2048 * 5632) + 2 * 1024 * 2048  # TinyLlama-1.1B shape, 1024-token vocab


def large_checkpoint(cache: Path) -> Path:
    """A random-weight Llama with TinyLlama-1.1B's shape (and our 1024-token tokenizer), made once."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from symbiosis.modelzoo import SPECIAL_TOKEN_ID, make_tokenizer

    folder = cache / "llama-1b-seed0"
    if (folder / "bench_recipe.json").is_file():
        return folder
    staging = Path(tempfile.mkdtemp(prefix=".llama-1b-", dir=cache))
    staging.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary shared folder
    tokenizer = make_tokenizer(staging, model_max_length=LARGE_SHAPE["max_position_embeddings"])
    config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), bos_token_id=SPECIAL_TOKEN_ID, eos_token_id=SPECIAL_TOKEN_ID,
                                  pad_token_id=SPECIAL_TOKEN_ID, tie_word_embeddings=False, **LARGE_SHAPE)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(staging, safe_serialization=True)
    del model
    (staging / "bench_recipe.json").write_text(json.dumps({"shape": LARGE_SHAPE, "seed": 0}) + "\n")
    staging.rename(folder)
    return folder


def mlora_status() -> dict[str, Any]:
    import importlib.util

    return dict(MLORA_CHECK, installed_here=importlib.util.find_spec("mlora") is not None)


# ---- 2. executor memory vs clients ---------------------------------------------------------------


def executor_memory(ctx: Context) -> dict:
    path = ctx.checkpoint()
    levels = []
    workers: list[common.Worker] = []
    with ScenarioExecutor(ctx, path) as server:
        server.wait_ready()  # level 0 is the loaded, idle executor
        try:
            for n in ctx.profile.memory_levels:
                sampler = common.RssSampler(0.1)
                sampler.watch(server.pid, "executor")
                for worker in workers:
                    sampler.watch(worker.pid, "client")
                sampler.start()
                while len(workers) < n:
                    spec = dict(finetune_spec(ctx, path, "split", len(workers), steps=ctx.profile.memory_steps), executor="shm+" + server.addresses[0])
                    workers.append(common.Worker(MODULE, spec, threads=ctx.threads))
                    sampler.watch(workers[-1].pid, "client")
                for worker in workers:
                    worker.wait_ready()
                for worker in workers:
                    worker.go()
                for worker in workers:
                    worker.wait_done()
                if n == 0:
                    time.sleep(1.0)
                sampler.stop()
                levels.append({"clients": n, "executor_peak_rss_gib": max(sampler.peaks_of("executor")) / common.GIB,
                               "executor_end_rss_gib": sampler.last_by_pid[server.pid] / common.GIB,
                               "client_peak_rss_gib_median": statistics.median(sampler.peaks_of("client")) / common.GIB if n else None})
                ctx.log(f"  {n:>2} clients: executor peak RSS {levels[-1]['executor_peak_rss_gib']:.3f} GiB")
        finally:
            for worker in workers:
                worker.request_exit()
            for worker in workers:
                worker.close()
    first_busy = next((lv for lv in levels if lv["clients"] > 0), levels[0])
    growth = {"last_over_first_busy": common.ratio(levels[-1]["executor_peak_rss_gib"], first_busy["executor_peak_rss_gib"]),
              "last_over_idle": common.ratio(levels[-1]["executor_peak_rss_gib"], levels[0]["executor_peak_rss_gib"]),
              "max_minus_min_mib": (max(lv["executor_peak_rss_gib"] for lv in levels) - min(lv["executor_peak_rss_gib"] for lv in levels)) * 1024}
    headline = [f"Executor peak RSS with {levels[-1]['clients']} training clients is x{growth['last_over_first_busy']:.3f} its value with {first_busy['clients']} "
                f"(x{growth['last_over_idle']:.3f} of idle); spread {growth['max_minus_min_mib']:.0f} MiB across levels."]
    losses = [] if growth["last_over_first_busy"] < 1.1 else [f"Executor memory grew x{growth['last_over_first_busy']:.2f} from 1 to {levels[-1]['clients']} clients."]
    table = common_table(["clients", "executor peak GiB", "executor end GiB", "client peak GiB (median)"],
                         [[lv["clients"], lv["executor_peak_rss_gib"], lv["executor_end_rss_gib"], lv["client_peak_rss_gib_median"]] for lv in levels])
    panels = [common.Panel("executor RSS vs training clients", "GiB", [str(lv["clients"]) for lv in levels],
                           {"peak": [lv["executor_peak_rss_gib"] for lv in levels], "end of level": [lv["executor_end_rss_gib"] for lv in levels]}, kind="line")]
    return finish(ctx, "executor_memory", {"levels": levels, "executor_rss_growth": growth}, headline, losses, table, panels,
                  f"Executor memory vs clients ({ctx.profile.preset})", {"levels": ctx.profile.memory_levels, "steps_per_level": ctx.profile.memory_steps,
                                                                         "model": str(path), "transport": "shm+ipc", "clients": "cumulative: one executor process, clients added level by level"})


# ---- 3. multi-adapter inference ------------------------------------------------------------------


def multi_adapter_inference(ctx: Context) -> dict:
    path = ctx.checkpoint()
    systems = ("symbiosis", "hf_mixed_batch", "hf_per_adapter")
    runs: dict[str, dict[str, Any]] = {s: {} for s in systems}
    rotation = ("hf_mixed_batch", "hf_per_adapter", "symbiosis")  # the executor loads while the first baseline runs
    with ScenarioExecutor(ctx, path) as server:
        for i, k in enumerate(ctx.profile.inference_ks):
            base = {"kind": "decode", "path": str(path), "prompt_len": ctx.profile.prompt_len, "tokens": ctx.profile.decode_tokens, "seed": 7}
            for system in rotation[i % 3 :] + rotation[: i % 3]:
                if system == "hf_mixed_batch":
                    specs = [dict(base, mode="monolithic", role="job", adapters=list(range(k)))]
                else:
                    mode, role = ("split", "client") if system == "symbiosis" else ("monolithic", "job")
                    specs = [dict(base, mode=mode, role=role, adapters=[j]) for j in range(k)]
                group = run_group(ctx, specs, server=server if system == "symbiosis" else None)
                latencies = [s for e in group.events for s in e["token_latency_s"] for _ in range(e["sequences"])]
                runs[system][str(k)] = {"tokens_per_s": group.tokens_per_s(), "latency_ms_p50": 1e3 * common.percentile(latencies, 50),
                                        "latency_ms_p95": 1e3 * common.percentile(latencies, 95), "span_s": group.span_s, **group.memory()}
                ctx.log(f"  {system:14s} K={k}: {runs[system][str(k)]['tokens_per_s']:.1f} tokens/s, p50 {runs[system][str(k)]['latency_ms_p50']:.1f} ms")
    per_k = []
    for k in map(str, ctx.profile.inference_ks):
        row = {"k": int(k)}
        for system in systems:
            row[f"{system}_tokens_per_s"] = runs[system][k]["tokens_per_s"]
            row[f"{system}_latency_ms_p50"] = runs[system][k]["latency_ms_p50"]
            row[f"{system}_latency_ms_p95"] = runs[system][k]["latency_ms_p95"]
        row["throughput_ratio_vs_mixed"] = common.ratio(row["symbiosis_tokens_per_s"], row["hf_mixed_batch_tokens_per_s"])
        row["throughput_ratio_vs_per_adapter"] = common.ratio(row["symbiosis_tokens_per_s"], row["hf_per_adapter_tokens_per_s"])
        per_k.append(row)
    last = per_k[-1]
    headline = [f"K={last['k']} adapters: Symbiosis {last['symbiosis_tokens_per_s']:.1f} tokens/s vs HF PEFT mixed batch {last['hf_mixed_batch_tokens_per_s']:.1f} "
                f"(x{last['throughput_ratio_vs_mixed']:.2f}) and one HF process per adapter {last['hf_per_adapter_tokens_per_s']:.1f} (x{last['throughput_ratio_vs_per_adapter']:.2f}); "
                f"p50/p95 per-token latency {last['symbiosis_latency_ms_p50']:.0f}/{last['symbiosis_latency_ms_p95']:.0f} ms vs {last['hf_mixed_batch_latency_ms_p50']:.0f}/{last['hf_mixed_batch_latency_ms_p95']:.0f} ms (mixed)."]
    losses = [f"throughput vs {name}: " + ", ".join(f"K={r['k']} x{r[key]:.2f}" for r in per_k if r[key] < 1) + "."
              for key, name in (("throughput_ratio_vs_mixed", "HF PEFT mixed-adapter batches"), ("throughput_ratio_vs_per_adapter", "one HF PEFT process per adapter"))
              if any(r[key] < 1 for r in per_k)]
    columns = [(f"{s}_{m}", f"{s} {m.replace('_', ' ')}") for s in systems for m in ("tokens_per_s", "latency_ms_p50", "latency_ms_p95")]
    table = common_table(["K", *[c[1] for c in columns]], [[r["k"], *[r[c[0]] for c in columns]] for r in per_k])
    labels = [str(k) for k in ctx.profile.inference_ks]
    panels = [common.Panel("aggregate decode tokens/s", "tokens/s", labels, {s: [runs[s][k]["tokens_per_s"] for k in labels] for s in systems}),
              common.Panel("per-token latency p50 (p95 in the table)", "ms", labels, {s: [runs[s][k]["latency_ms_p50"] for k in labels] for s in systems})]
    return finish(ctx, "multi_adapter_inference", {"runs": runs, "per_k": per_k}, headline, losses, table, panels, f"K adapters decoding at once ({ctx.profile.preset}); x axis: K",
                  {"ks": ctx.profile.inference_ks, "prompt_len": ctx.profile.prompt_len, "decode_tokens": ctx.profile.decode_tokens, "model": str(path),
                   "adapter": "LoRA r=8 on q,k,v,o_proj, one per request", "transport": "shm+ipc", "sequences_per_client": 1})


# ---- 4. split overhead per transport -------------------------------------------------------------


def split_overhead(ctx: Context) -> dict:
    from benchmarks.transport import step_ratios

    path = ctx.checkpoint()
    quick = ctx.quick
    steps = step_ratios(path, train_batch=1 if quick else 2, seq_len=32 if quick else 64, decode_batch=1, prompt_len=ctx.profile.prompt_len,
                        warmup=1 if quick else 2, repeats=ctx.profile.step_repeats, threads=ctx.threads)
    train, decode = steps["train_step"]["ratio_over_monolithic"], steps["decode_step"]["ratio_over_monolithic"]
    headline = ["Split / monolithic, training step: " + ", ".join(f"{t} x{r:.2f}" for t, r in train.items()) + "; decode step: " + ", ".join(f"{t} x{r:.2f}" for t, r in decode.items()) + "."]
    losses = [f"a {kind} step costs " + ", ".join(f"x{r:.2f} over {t}" for t, r in ratios.items() if r > 1.05) + " the monolithic time."
              for kind, ratios in (("training", train), ("decode", decode)) if any(r > 1.05 for r in ratios.values())]
    if not steps["dist"]["available"]:
        losses.append(f"dist+tcp not measured: {steps['dist']['reason']}")
    names = list(train)
    table = common_table(["candidate", "train median ms", "train ratio", "decode median ms", "decode ratio"],
                         [["monolithic", steps["train_step"]["monolithic"]["median_ms"], 1.0, steps["decode_step"]["monolithic"]["median_ms"], 1.0]]
                         + [[n, steps["train_step"][n]["median_ms"], train[n], steps["decode_step"][n]["median_ms"], decode[n]] for n in names])
    panels = [common.Panel("split / monolithic (medians, 1.0 = free)", "ratio", names, {"training step": [train[n] for n in names], "decode step": [decode[n] for n in names]})]
    results = {k: steps[k] for k in ("train_step", "decode_step", "check", "dist")}
    return finish(ctx, "split_overhead", results, headline, losses, table, panels, f"One client per transport vs monolithic ({ctx.profile.preset})", steps["config"])


# ---- 5. executor efficiency ----------------------------------------------------------------------


def executor_efficiency(ctx: Context) -> dict:
    import peft

    import symbiosis
    import symbiosis.executor.engine as engine
    from benchmarks.split_overhead import Decoder, lora_config, train_step_fn
    from symbiosis.executor.runner import run_batch

    path = ctx.checkpoint()
    torch.set_num_threads(ctx.threads)
    executor = symbiosis.BaseExecutor.from_pretrained(path, device="cpu", dtype=torch.float32)
    records: list[tuple[Any, Any, list[int], float]] = []

    def timed_run_batch(layer, op, inputs):
        began = time.perf_counter()
        out = run_batch(layer, op, inputs)
        records.append((layer, op, [t.shape[0] for t in inputs], time.perf_counter() - began))
        return out

    clients = []
    phases: dict[str, Any] = {}
    engine.run_batch = timed_run_batch  # the engine looks the name up per batch
    try:
        for index in range(ctx.profile.efficiency_clients):
            torch.manual_seed(index)
            clients.append(peft.get_peft_model(symbiosis.load_client_model(path, executor=executor), lora_config()))
        vocab = clients[0].config.vocab_size
        seq = ctx.profile.finetune_seq
        workloads = {
            "train": [train_step_fn(c.train(), torch.randint(0, vocab, (ctx.profile.finetune_batch, seq))) for c in clients],
        }
        for phase in ("train", "decode"):
            if phase == "decode":
                decoders = [Decoder(c.eval(), torch.randint(0, vocab, (1, ctx.profile.prompt_len))) for c in clients]
                workloads["decode"] = [d.step for d in decoders]
            for fn in workloads[phase]:
                fn()  # warm-up, alone
            records.clear()
            wall = time.perf_counter()
            threads = [threading.Thread(target=lambda f=fn: [f() for _ in range(2 if phase == "train" else 4)]) for fn in workloads[phase]]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - wall
            phases[phase] = efficiency_of(list(records), wall, ctx.profile.efficiency_repeats)
            ctx.log(f"  {phase}: executor products {phases[phase]['replay_executor_gflops']:.1f} GFLOP/s vs torch.matmul {phases[phase]['replay_torch_matmul_gflops']:.1f} "
                    f"(ratio {phases[phase]['executor_over_matmul']:.2f}), ceiling {phases[phase]['matmul_1024_gflops']:.1f}")
    finally:
        engine.run_batch = run_batch
        for c in clients:
            c.base_model.model.symbiosis_transport.close()
        executor.close()
    ceiling = max(p["matmul_1024_gflops"] for p in phases.values())
    headline = [f"{phase}: executor batched products {p['replay_executor_gflops']:.1f} GFLOP/s vs plain torch.matmul {p['replay_torch_matmul_gflops']:.1f} on the same shapes "
                f"(x{p['executor_over_matmul']:.2f}); in place under load {p['in_situ_gflops']:.1f}; mean {p['mean_rows_per_batch']:.1f} rows/batch; 1024² matmul ceiling {p['matmul_1024_gflops']:.1f}."
                for phase, p in phases.items()]
    losses = [f"{phase}: the executor's products run at x{p['executor_over_matmul']:.2f} of plain torch.matmul." for phase, p in phases.items() if p["executor_over_matmul"] < 0.95]
    table = common_table(["phase", "batches", "rows/batch", "GFLOP", "in situ GFLOP/s", "executor replay GFLOP/s", "torch.matmul GFLOP/s", "ratio", "1024² ceiling GFLOP/s"],
                         [[ph, p["batches"], p["mean_rows_per_batch"], p["gflop"], p["in_situ_gflops"], p["replay_executor_gflops"], p["replay_torch_matmul_gflops"], p["executor_over_matmul"], p["matmul_1024_gflops"]]
                          for ph, p in phases.items()])
    names = list(phases)
    panels = [common.Panel("GFLOP/s on the executor's shapes", "GFLOP/s", names, {k: [phases[n][g] for n in names] for k, g in
                           (("in situ", "in_situ_gflops"), ("executor replay", "replay_executor_gflops"), ("torch.matmul", "replay_torch_matmul_gflops"), ("1024² ceiling", "matmul_1024_gflops"))})]
    return finish(ctx, "executor_efficiency", {"phases": phases, "matmul_ceiling_gflops": ceiling}, headline, losses, table, panels,
                  f"Executor GEMM efficiency ({ctx.profile.preset}, {ctx.profile.efficiency_clients} in-process clients)",
                  {"clients": ctx.profile.efficiency_clients, "model": str(path), "repeats": ctx.profile.efficiency_repeats, "threads": ctx.threads})


def efficiency_of(records: list, wall_s: float, repeats: int) -> dict[str, Any]:
    """GFLOP/s of recorded batches: in place, replayed via ``run_batch``, and as plain ``torch.matmul``."""
    from symbiosis.executor.requests import Op
    from symbiosis.executor.runner import run_batch

    replays = []
    flop = 0.0
    for layer, op, pieces, _ in records:
        out_features, in_features = layer.weight.shape
        flop += 2.0 * sum(pieces) * in_features * out_features
        width = out_features if op is Op.BACKWARD else in_features
        inputs = [torch.randn(n, width) for n in pieces]
        matrix = layer.weight if op is Op.BACKWARD else layer.weight.t()
        replays.append((layer, op, inputs, torch.cat(inputs), matrix))
    probe, probe_gflop = common.square_matmul()
    samples = common.time_interleaved(
        {"executor": lambda: [run_batch(layer, op, inputs) for layer, op, inputs, _, _ in replays],
         "torch_matmul": lambda: [torch.matmul(x, m) for _, _, _, x, m in replays], "matmul_1024": probe},
        warmup=1, repeats=repeats)
    gflop = flop / 1e9
    median = {k: statistics.median(v) for k, v in samples.items()}
    rows = [sum(p) for _, _, p, _ in records]
    return {"batches": len(records), "mean_rows_per_batch": statistics.fmean(rows) if rows else math.nan, "gflop": gflop,
            "in_situ_gflops": common.ratio(gflop, sum(r[3] for r in records)), "in_situ_wall_gflops": common.ratio(gflop, wall_s),
            "replay_executor_gflops": common.ratio(gflop, median["executor"]), "replay_torch_matmul_gflops": common.ratio(gflop, median["torch_matmul"]),
            "executor_over_matmul": common.ratio(median["torch_matmul"], median["executor"]), "matmul_1024_gflops": common.ratio(probe_gflop, median["matmul_1024"]),
            "timing": {k: common.summarize(v) for k, v in samples.items()}}


# ---- output --------------------------------------------------------------------------------------


def common_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "–"
        if isinstance(value, float):
            return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def finish(ctx: Context, name: str, results: dict, headline: list[str], losses: list[str], table: str, panels: list, title: str, config: dict) -> dict:
    folder = ctx.output / name
    result = {"scenario": name, "command": ctx.command, "machine": common.machine_info(),
              "config": {"profile": asdict(ctx.profile), "quick": ctx.quick, "threads_per_process": ctx.threads, **config},
              "results": results, "headline": headline, "losses": losses}
    common.plot_panels(folder / "plot.png", title, panels, columns=min(2, len(panels)))
    (folder / "table.md").parent.mkdir(parents=True, exist_ok=True)
    (folder / "table.md").write_text(f"### {name}\n\n{table}\n")
    return result


def run(scenarios: Sequence[str] = SCENARIOS, *, quick: bool = False, output: Path = Path("bench-results"), cache: Path | None = None,
        threads: int = 1, budget_gib: float = 24.0, command: str | None = None, log: Callable[[str], None] = print,
        profile: Profile | None = None) -> dict[str, dict]:
    """Run ``scenarios`` in order; each writes ``<output>/<scenario>/result.json``, ``plot.png``, ``table.md``.

    ``profile`` overrides the sizes (``QUICK`` with ``quick``, else ``FULL``); tests pass smaller ones.
    """
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    common.quiet_libraries()
    ctx = Context(Path(output), Path(cache) if cache else common.default_cache_dir(), profile or (QUICK if quick else FULL), quick, threads, budget_gib,
                  command or "symbiosis bench " + " ".join([*scenarios, *(["--quick"] if quick else []), "--output", str(output)]), log)
    ctx.cache.mkdir(parents=True, exist_ok=True)
    results = {}
    for index, name in enumerate(scenarios, 1):
        log(f"[{index}/{len(scenarios)}] {name} ...")
        started = time.perf_counter()
        result = globals()[name](ctx)
        result["wall_s"] = time.perf_counter() - started
        common.write_json(ctx.output / name / "result.json", result)
        results[name] = result
        for line in result["headline"]:
            log(f"  {line}")
        log(f"[{index}/{len(scenarios)}] {name} done in {result['wall_s']:.0f} s -> {ctx.output / name}")
    return results


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        worker_main(json.loads(argv[1]))
        return
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="*", default=list(SCENARIOS), help=f"Scenarios to run (default: all): {', '.join(SCENARIOS)}.")
    parser.add_argument("--quick", action="store_true", help="Small model and runs (about 2 minutes in all).")
    parser.add_argument("--output", type=Path, default=Path("bench-results"), help="Folder for <scenario>/result.json, plot.png, table.md.")
    parser.add_argument("--cache", type=Path, default=None, help="Where benchmark checkpoints are made once and kept.")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every process (default: %(default)s).")
    parser.add_argument("--budget-gib", type=float, default=24.0, help="Memory budget for the jobs-that-fit count (default: %(default)s).")
    args = parser.parse_args(argv)
    run(args.scenarios or SCENARIOS, quick=args.quick, output=args.output, cache=args.cache, threads=args.threads, budget_gib=args.budget_gib,
        command=common.command_line(argv, MODULE))


if __name__ == "__main__":
    main()
