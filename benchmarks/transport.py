"""What does each transport cost? Round trips at hidden size 4096, and whole steps split vs monolithic.

Two measurements, each side by side in one run:

* **Round trips** (the transport alone). A child process serves ``EchoService``: a minimal
  ``ExecutorService`` with one ``4096 x 4096`` layer whose "product" is a copy of the rows (one
  output buffer, like a real result), so the time is the transport's, not a GEMM's. For each row
  count (1, 16, 512, 4096 rows of 4096 float32 = 16 KiB ... 64 MiB) every transport
  (``inproc``: ``InProcTransport`` on an ``EchoService`` in this process; ``tcp``, ``ipc``,
  ``shm+ipc`` to the child; ``dist+tcp`` when ``symbiosis.transport.dist_client`` exists) is timed
  interleaved with the ceiling ``memcpy``: two ``torch`` copies of the same bytes (request there,
  result back). ``shm+ipc`` hands a large result out as the region of its segment and reuses the
  segment once the caller drops the result, which this loop does at once; ``shm+ipc kept`` is a
  second shared-memory client whose results are kept alive for the next ``KEPT_RESULTS`` calls
  (like activations saved for backward), so its segments come back late. Reported per
  transport: median / p95 round trip, throughput ``2 x bytes / median`` (GB/s), ``over_memcpy``
  (median / memcpy median). ``gemm_ms`` is, for context, what the real
  layer's product ``x Wᵀ`` costs for those rows on this machine (fewer samples).
* **Steps** (what a client feels). A real ``symbiosis serve`` child on a random-weight checkpoint
  (``--preset``, default ``small``) serves tcp and ipc; one client per transport, plus an
  in-process ``BaseExecutor``, plus the monolithic ``transformers+peft`` model (the baseline),
  all with the same LoRA adapter weights, run a training step (forward + backward + AdamW) and a
  decode step (one token per sequence, KV cache), interleaved. ``ratio_over_monolithic`` per
  transport is split median / monolithic median (> 1: splitting costs time).

Every process uses ``--threads`` torch threads (default 1: on a shared 2-core machine a second
OpenMP thread mostly waits for a busy core).

JSON (``transport.json`` in ``--output``) keys: ``benchmark, command, machine, config,
round_trip, steps, dist, wall_s``. ``round_trip[str(rows)]``: ``bytes, memcpy, gemm_ms`` and one
entry per transport with ``median_ms, p95_ms, mean_ms, min_ms, n, gbytes_per_s, over_memcpy``.
``steps``: ``train_step, decode_step`` (each ``{candidate: timing}`` with candidates
``monolithic`` and every transport, plus ``ratio_over_monolithic: {transport: ratio}``), ``check``
(loss of every candidate on one batch). ``dist``: ``{"available": bool, "reason": str}``.
Plot: ``transport.png``.

Run: ``python -m benchmarks.transport [--quick] [--preset base] --output DIR``.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import peft
import torch
from transformers import AutoConfig

import symbiosis
from benchmarks.options import add_common_arguments, checkpoint_path, resolve_common
from benchmarks.plots import Panel, plot_panels
from benchmarks.results import command_line, machine_info, print_summary, write_json
from benchmarks.split_overhead import Decoder, build_models, lora_config, train_step_fn
from benchmarks.timing import ratio, summarize, time_interleaved
from benchmarks.workers import Worker, emit_event, loopback_binds
from symbiosis.executor.process import ExecutorProcess
from symbiosis.vocabulary import LatencyClass, LayerSpec, Op

NAME = "transport"
HIDDEN = 4096
ROW_COUNTS = (1, 16, 512, 4096)
ECHO_LAYER = "echo"
REMOTE_TRANSPORTS = ("shm+ipc", "ipc", "tcp")
KEPT_RESULTS = 8  # ``shm+ipc kept``: results alive at once (more than shm_client.MAX_HANDED_OUT)
# Samples per row count: small payloads are cheap and noisy, large ones slow and steady.
FULL_REPEATS = {1: 300, 16: 300, 512: 60, 4096: 10}
QUICK_REPEATS = {1: 30, 16: 30, 512: 8, 4096: 3}


class EchoService:
    """``ExecutorService`` with one ``width x width`` layer whose every op returns a copy of the rows.

    It isolates the transport: a real executor would add a GEMM (see ``gemm_ms``). The copy
    stands for the result buffer a real product allocates — or, like ``BaseExecutor`` serving a
    lone client, for the product written straight into the channel's reply region when the
    server offers one (``try_alone`` with ``out``: shared memory). Without ``out`` it declines, and
    the request goes through ``submit`` as before (inline and dist transports).
    """

    def __init__(self, width: int = HIDDEN) -> None:
        self._specs = {ECHO_LAYER: LayerSpec(ECHO_LAYER, width, width, has_bias=False)}

    @property
    def fingerprint(self) -> str:
        return f"echo-{self._specs[ECHO_LAYER].in_features}"

    def layer_specs(self) -> Mapping[str, LayerSpec]:
        return self._specs

    def register_client(self, client_id: str) -> None:
        pass

    def unregister_client(self, client_id: str) -> None:
        pass

    def submit(
        self,
        client_id: str,
        layer_id: str,
        op: Op,
        rows: torch.Tensor,
        latency_class: LatencyClass,
        *,
        wake: bool = True,
    ) -> Future[torch.Tensor]:
        future: Future[torch.Tensor] = Future()
        future.set_result(rows.clone())
        return future

    # The driver hooks ``ZmqServer`` uses with a ``BaseExecutor`` (nothing is ever queued here).

    def attach_driver(self, wake: Callable[[], None]) -> None:
        pass

    def detach_driver(self, wake: Callable[[], None]) -> None:
        pass

    def run_ready(self) -> float | None:
        return None

    def try_alone(
        self,
        client_id: str,
        layer_id: str,
        op: Op,
        rows: torch.Tensor,
        latency_class: LatencyClass,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        if out is None or out.shape != rows.shape or out.dtype != rows.dtype:
            return None
        return out.copy_(rows)


def serve_echo(spec: Mapping[str, Any]) -> None:
    """Worker child (``benchmarks/workers.py`` protocol): serve ``EchoService`` of ``spec["width"]``
    at ``spec["binds"]``, report the bound addresses in the ``ready`` event, serve until ``exit``."""
    from symbiosis.transport.zmq import ZmqServer

    servers = [ZmqServer(EchoService(spec["width"]), bind).start() for bind in spec["binds"]]
    emit_event("ready", pid=os.getpid(), addresses=[server.address for server in servers])
    for line in sys.stdin:  # until the parent asks us to exit or closes our stdin
        if line.strip() == "exit":
            break
    for server in servers:
        server.close()


def dist_status() -> dict[str, Any]:
    """Whether the ``dist+`` (torch.distributed) transport exists in this checkout."""
    if importlib.util.find_spec("symbiosis.transport.dist_client") is None:
        return {
            "available": False,
            "reason": "symbiosis.transport.dist_client is not in this checkout yet "
            "(open_transport() names dist+ but the module is missing)",
        }
    return {"available": True, "reason": "symbiosis.transport.dist_client found"}


def open_transports(
    addresses: Mapping[str, str], include_dist: bool, **kwargs: Any
) -> tuple[dict[str, str], dict[str, Any]]:
    """Client addresses per transport name from the server's ``{"tcp": …, "ipc": …}``; dist status."""
    targets = {"shm+ipc": "shm+" + addresses["ipc"], "ipc": addresses["ipc"], "tcp": addresses["tcp"]}
    dist = dist_status()
    if include_dist and dist["available"]:
        from symbiosis.transport.schemes import open_transport

        try:  # the transport is new: if it cannot connect here, say why instead of failing the run
            open_transport("dist+" + addresses["tcp"], **kwargs).close()
            targets["dist+tcp"] = "dist+" + addresses["tcp"]
        except Exception as exc:  # noqa: BLE001 (recorded, not hidden)
            dist = {"available": False, "reason": f"dist+ connect failed: {exc!r}"[:500]}
    return targets, dist


def split_addresses(addresses: Sequence[str]) -> dict[str, str]:
    """``{"tcp": …, "ipc": …}`` from a server's bound addresses."""
    return {address.split("://", 1)[0]: address for address in addresses}


# ---- round trips ---------------------------------------------------------------------------------


def round_trips(
    targets: Mapping[str, str], *, width: int, row_counts: Sequence[int], repeats: Mapping[int, int], warmup: int
) -> dict[str, Any]:
    """Median round trip per transport and row count, interleaved with the memcpy ceiling."""
    from symbiosis.transport.inproc import InProcTransport
    from symbiosis.transport.schemes import open_transport

    transports: dict[str, Any] = {"inproc": InProcTransport(EchoService(width))}
    kept: collections.deque[torch.Tensor] = collections.deque(maxlen=KEPT_RESULTS)
    try:
        for name, address in targets.items():
            transports[name] = open_transport(address)
        if "shm+ipc" in targets:
            transports["shm+ipc kept"] = open_transport(targets["shm+ipc"])
        weight = torch.randn(width, width)
        results: dict[str, Any] = {}
        for rows in row_counts:
            x = torch.randn(rows, width)
            for name, transport in transports.items():  # exactness first: an echo must come back equal
                torch.testing.assert_close(
                    transport.call(ECHO_LAYER, Op.FORWARD, x, LatencyClass.PREFILL), x, rtol=0, atol=0, msg=name
                )
            there, back = torch.empty_like(x), torch.empty_like(x)
            candidates: dict[str, Callable[[], Any]] = {
                name: (lambda t=transport, x=x: t.call(ECHO_LAYER, Op.FORWARD, x, LatencyClass.PREFILL))
                for name, transport in transports.items()
            }
            if "shm+ipc kept" in transports:
                kept.clear()
                keeper = transports["shm+ipc kept"]
                candidates["shm+ipc kept"] = lambda t=keeper, x=x: kept.append(
                    t.call(ECHO_LAYER, Op.FORWARD, x, LatencyClass.PREFILL)
                )
            candidates["memcpy"] = lambda back=back, there=there, x=x: back.copy_(there.copy_(x))
            samples = time_interleaved(candidates, warmup=warmup, repeats=repeats[rows])
            nbytes = x.numel() * x.element_size()
            memcpy_ms = summarize(samples["memcpy"])["median_ms"]
            entry: dict[str, Any] = {"bytes": nbytes}
            for name, values in samples.items():
                timing = summarize(values)
                timing["gbytes_per_s"] = ratio(2 * nbytes / 1e9 * 1e3, timing["median_ms"])
                if name != "memcpy":
                    timing["over_memcpy"] = ratio(timing["median_ms"], memcpy_ms)
                entry[name] = timing
            gemm = time_interleaved(
                {"gemm": lambda x=x: x @ weight.t()}, warmup=1, repeats=max(2, min(5, repeats[rows] // 4))
            )["gemm"]
            entry["gemm_ms"] = summarize(gemm)["median_ms"]
            results[str(rows)] = entry
            kept.clear()
            print(
                f"  round trip {rows:>5} rows: " + ", ".join(f"{k} {entry[k]['median_ms']:.3f} ms" for k in samples),
                flush=True,
            )
        return results
    finally:
        for transport in transports.values():
            transport.close()


# ---- steps: split per transport vs monolithic ----------------------------------------------------


def step_ratios(
    path: Path,
    *,
    transports: Sequence[str] = ("inproc", *REMOTE_TRANSPORTS),
    include_dist: bool = True,
    train_batch: int,
    seq_len: int,
    decode_batch: int,
    prompt_len: int,
    warmup: int,
    repeats: int,
    threads: int = 1,
) -> dict[str, Any]:
    """Training and decode step of one client per transport vs the monolithic model, interleaved.

    Starts a ``symbiosis serve`` child (tcp + ipc) for the remote transports and an in-process
    ``BaseExecutor`` for ``inproc``; returns ``train_step, decode_step, check, dist, config``.
    """
    max_positions = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", 1024)
    decode_repeats = max(1, min(4 * repeats, max_positions - prompt_len - warmup - 2))
    with (
        tempfile.TemporaryDirectory(prefix="symbiosis-bench-") as folder,
        ExecutorProcess(path, loopback_binds(Path(folder)), threads=threads) as server,
    ):
        targets, dist = open_transports(split_addresses(server.addresses), include_dist)
        wanted = [t for t in transports if t == "inproc" or t in targets] + [
            t for t in targets if t.startswith("dist") and t not in transports
        ]
        executor = symbiosis.BaseExecutor.from_pretrained(path, device="cpu", dtype=torch.float32)
        models: dict[str, Any] = {}
        try:
            monolithic, inproc = build_models(path, executor)
            models["monolithic"] = monolithic
            adapter = peft.get_peft_model_state_dict(monolithic)
            for name in wanted:
                if name == "inproc":
                    models[name] = inproc
                    continue
                split = peft.get_peft_model(symbiosis.load_client_model(path, executor=targets[name]), lora_config())
                peft.set_peft_model_state_dict(split, adapter)
                models[name] = split
            generator = torch.Generator().manual_seed(1)
            vocab = monolithic.config.vocab_size
            batch = torch.randint(0, vocab, (train_batch, seq_len), generator=generator)
            prompt = torch.randint(0, vocab, (decode_batch, prompt_len), generator=generator)
            for model in models.values():
                model.train()
            with torch.no_grad():
                check = {name: float(model(input_ids=batch, labels=batch).loss) for name, model in models.items()}
            train = time_interleaved(
                {n: train_step_fn(m, batch) for n, m in models.items()}, warmup=warmup, repeats=repeats
            )
            for model in models.values():
                model.eval()
            decoders = {name: Decoder(model, prompt) for name, model in models.items()}
            decode = time_interleaved({n: d.step for n, d in decoders.items()}, warmup=warmup, repeats=decode_repeats)
        finally:
            for name, model in models.items():
                if name != "monolithic":
                    model.base_model.model.symbiosis_transport.close()
            executor.close()

    def summarize_step(samples: Mapping[str, list[float]]) -> dict[str, Any]:
        step = {name: summarize(values) for name, values in samples.items()}
        base = step["monolithic"]["median_ms"]
        step["ratio_over_monolithic"] = {n: ratio(step[n]["median_ms"], base) for n in samples if n != "monolithic"}
        return step

    return {
        "train_step": summarize_step(train),
        "decode_step": summarize_step(decode),
        "check": {
            "loss": check,
            "max_abs_diff_vs_monolithic": max(abs(v - check["monolithic"]) for v in check.values()),
        },
        "dist": dist,
        "config": {
            "model": str(path),
            "train_batch": train_batch,
            "seq_len": seq_len,
            "decode_batch": decode_batch,
            "prompt_len": prompt_len,
            "warmup": warmup,
            "train_repeats": repeats,
            "decode_repeats": decode_repeats,
            "threads_per_process": threads,
            "adapter": "LoRA r=8 alpha=16 on q,k,v,o_proj",
            "baseline": "monolithic transformers+peft in this process, same checkpoint and adapter weights",
        },
    }


# ---- the script ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, default_repeats=20, quick_repeats=3)
    parser.add_argument(
        "--width", type=int, default=HIDDEN, help="Hidden size of the echo layer (default: %(default)s)."
    )
    parser.add_argument(
        "--rows",
        type=int,
        nargs="+",
        default=list(ROW_COUNTS),
        help="Row counts of the round trips (default: %(default)s).",
    )
    parser.add_argument(
        "--no-steps", action="store_true", help="Only the round trips (skip the split-vs-monolithic steps)."
    )
    args = parser.parse_args(argv)
    args.threads = 1 if args.threads is None else args.threads
    return resolve_common(args)


def plot(output: Path, result: dict[str, Any]) -> None:
    rows = list(result["round_trip"])
    names = [n for n in result["round_trip"][rows[0]] if isinstance(result["round_trip"][rows[0]][n], dict)]
    panels = [
        Panel(
            "round trip (median), log scale",
            "ms",
            rows,
            {n: [result["round_trip"][r][n]["median_ms"] for r in rows] for n in names},
            kind="line",
            log_y=True,
        ),
        Panel(
            "throughput 2 x bytes / round trip",
            "GB/s",
            rows,
            {n: [result["round_trip"][r][n]["gbytes_per_s"] for r in rows] for n in names},
            kind="line",
        ),
    ]
    if result.get("steps"):
        steps = result["steps"]
        candidates = list(steps["train_step"]["ratio_over_monolithic"])
        panels.append(
            Panel(
                "split / monolithic (1.0 = no overhead)",
                "ratio of medians",
                candidates,
                {k: [steps[k]["ratio_over_monolithic"][c] for c in candidates] for k in ("train_step", "decode_step")},
            )
        )
    plot_panels(
        output / f"{NAME}.png", f"Transports at hidden {result['config']['width']} (rows on x axis)", panels, columns=3
    )


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        serve_echo(json.loads(argv[1]))
        return {}
    started = time.perf_counter()
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    repeats = {rows: (QUICK_REPEATS if args.quick else FULL_REPEATS).get(rows, args.repeats) for rows in args.rows}
    warmup = 1 if args.quick else 3
    with tempfile.TemporaryDirectory(prefix="symbiosis-echo-") as folder:
        echo = Worker(
            f"benchmarks.{NAME}",
            {"role": "echo", "width": args.width, "binds": loopback_binds(Path(folder))},
            threads=args.threads,
        )
        try:
            addresses = echo.wait_ready(180.0)["addresses"]
            targets, dist = open_transports(split_addresses(addresses), include_dist=True)
            round_trip = round_trips(targets, width=args.width, row_counts=args.rows, repeats=repeats, warmup=warmup)
        finally:
            echo.close()
    steps = None
    if not args.no_steps:
        path = checkpoint_path(args)
        steps = step_ratios(
            path,
            train_batch=2 if args.quick else 4,
            seq_len=32 if args.quick else 64,
            decode_batch=4,
            prompt_len=16 if args.quick else 32,
            warmup=warmup,
            repeats=args.repeats,
            threads=args.threads,
        )
        dist = steps["dist"]
    result = {
        "benchmark": NAME,
        "command": command_line(argv, f"benchmarks.{NAME}"),
        "machine": machine_info(),
        "config": {
            "width": args.width,
            "rows": args.rows,
            "repeats_per_rows": repeats,
            "warmup": warmup,
            "preset": args.preset,
            "arch": args.arch,
            "quick": args.quick,
            "threads_per_process": args.threads,
            "round_trip_service": "EchoService (minimal ExecutorService: one width x width layer, "
            "result = copy of the rows) in a child process; inproc = InProcTransport on an EchoService here",
            "memcpy": "two torch copy_ of the payload (request there, result back), same process",
        },
        "round_trip": round_trip,
        "steps": steps,
        "dist": dist,
        "wall_s": time.perf_counter() - started,
    }
    output = Path(args.output)
    write_json(output / f"{NAME}.json", result)
    plot(output, result)
    summary = {
        "benchmark": NAME,
        "round_trip_median_ms": {
            r: {n: v["median_ms"] for n, v in e.items() if isinstance(v, dict)} for r, e in round_trip.items()
        },
    }
    if steps:
        summary["train_ratio_over_monolithic"] = steps["train_step"]["ratio_over_monolithic"]
        summary["decode_ratio_over_monolithic"] = steps["decode_step"]["ratio_over_monolithic"]
    summary.update(dist=dist, wall_s=result["wall_s"], output=str(output / f"{NAME}.json"))
    print_summary(summary)
    return result


if __name__ == "__main__":
    main()
