"""Sharded executor (issue 12): what spreading the base weights over N processes costs and saves.

Systems, all started by ``symbiosis serve`` and all up at once (idle while another is measured):
``N=1`` (one executor process, today's deployment) and ``N=2``/``N=4`` ranks under each strategy,
``layers`` (each rank owns whole layers, rows travel) and ``fsdp`` (every layer row-sharded, gathered
per batch), started with ``--shards N --shard-strategy S``.

Measured, side by side in one run:

* **Throughput of 4 client processes**: each client process holds a LoRA client of every system;
  in each round, for each mode (``decode``: greedy decode steps with a KV cache, batch 1;
  ``train``: LoRA training steps of 1 x 32 tokens), the four clients run together against one
  system for ``--window-s`` seconds, systems in rotating order. Aggregate tokens/s, medians over
  rounds, and the ratio to ``N=1`` (the target: the default strategy's decode at N=2 >= 0.7x).
  Everything shares this machine's cores, so this measures the overhead of sharding, not scaling.
* **Per-call cost**: a 1-row forward from this process to a layer that rank 0 runs and to one
  that another rank runs (``layers`` forwards it; ``fsdp`` gathers it), interleaved, medians.
  These are the per-call overheads ``docs/scaling.md`` projects from.
* **Memory**: per rank, the base-weight bytes it keeps (tensors counted by the executor) and its
  peak RSS after the runs; for ``fsdp`` also the most gathered-weight bytes alive at once. With
  ``--large`` (full runs), the same for a ~1B Llama (TinyLlama-1.1B's shape), one system at a time.

Threads: the N=1 executor gets one torch thread per core (its default); each rank of N ranks gets
cores/N (at least 1), as ``--shards`` gives them; clients get one each.

    python -m benchmarks.sharded --output docs/benchmarks/sharded          # ~105M model, ~25 min
    python -m benchmarks.sharded --quick --output /tmp/sharded              # tiny model, N <= 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.memory import GIB, MIB, own_memory
from benchmarks.options import add_common_arguments, checkpoint_path, quiet_libraries, resolve_common
from benchmarks.plots import Panel, plot_panels
from benchmarks.results import command_line, machine_info, usable_cpus, write_json
from benchmarks.timing import percentile, time_interleaved
from benchmarks.workers import Worker, emit_event

MODES = ("decode", "train")
CLIENTS = 4
PROMPT_TOKENS = 8
DECODE_RESET_TOKENS = 32  # a decode stream starts over (new prompt, empty cache) after this many tokens
TRAIN_TOKENS = 32


def systems(quick: bool) -> list[dict[str, Any]]:
    """The configurations compared: name, ranks, strategy."""
    found = [{"name": "N=1", "ranks": 1, "strategy": None}]
    for ranks in (2,) if quick else (2, 4):
        for strategy in ("layers", "fsdp"):
            found.append({"name": f"N={ranks} {strategy}", "ranks": ranks, "strategy": strategy})
    return found


def start_system(path: Path, system: dict[str, Any], address: str, serve_args: Sequence[str] = ()):
    from symbiosis.executor.process import ExecutorProcess

    cores = usable_cpus()
    extra: list[str] = list(serve_args)
    if system["ranks"] > 1:
        extra += ["--shards", str(system["ranks"]), "--shard-strategy", system["strategy"], "--max-restarts", "0"]
    threads = max(1, cores // system["ranks"])
    return ExecutorProcess(
        path, [address], extra_args=extra, threads=threads, metrics=True, timeout_s=600, wait=False
    ), threads


# ---- the client worker (python -m benchmarks.sharded worker SPEC) --------------------------------


def worker_main(spec: dict[str, Any]) -> None:
    """One client process: a LoRA client of every system; a line ``{"system": ..., "mode": ...}``
    runs that mode against that system for the window and reports the tokens; ``exit`` ends."""
    import traceback

    try:
        torch.set_num_threads(1)
        quiet_libraries()
        clients = {name: _client(spec["path"], address, spec["seed"]) for name, address in spec["addresses"].items()}
        emit_event("ready", pid=os.getpid())
        for line in sys.stdin:
            if line.strip() == "exit":
                break
            command = json.loads(line)  # {"system": NAME, "mode": MODE}
            tokens, elapsed = clients[command["system"]].run(command["mode"], spec["window_s"])
            emit_event("done", tokens=tokens, elapsed_s=elapsed, **own_memory())
    except Exception:  # noqa: BLE001 - reported to the parent, which quotes it
        emit_event("error", error=traceback.format_exc()[-3000:])
        raise SystemExit(1) from None


class _Client:
    def __init__(self, model, seed: int):
        self.model = model
        self.generator = torch.Generator().manual_seed(seed)
        self.optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def run(self, mode: str, window_s: float) -> tuple[int, float]:
        started = time.perf_counter()
        deadline = started + window_s
        tokens = 0
        while time.perf_counter() < deadline:
            tokens += self._decode(deadline) if mode == "decode" else self._train_step()
        return tokens, time.perf_counter() - started

    def _train_step(self) -> int:
        ids = torch.randint(3, 1000, (1, TRAIN_TOKENS), generator=self.generator)
        self.optimizer.zero_grad()
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.optimizer.step()
        return TRAIN_TOKENS

    @torch.no_grad()
    def _decode(self, deadline: float) -> int:
        """Greedy decode steps with a KV cache until ``deadline`` or ``DECODE_RESET_TOKENS``."""
        from transformers import DynamicCache

        ids = torch.randint(3, 1000, (1, PROMPT_TOKENS), generator=self.generator)
        cache = DynamicCache()
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
        done = 0
        while done < DECODE_RESET_TOKENS and time.perf_counter() < deadline:
            token = out.logits[:, -1:].argmax(-1)
            out = self.model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
            done += 1
        return done


def _client(path: str, address: str, seed: int) -> _Client:
    import peft

    import symbiosis

    torch.manual_seed(seed)
    model = symbiosis.load_client_model(path, executor=address)
    model = peft.get_peft_model(
        model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")
    )
    return _Client(model, seed)


# ---- measurements ------------------------------------------------------------------------------------


def call_costs(path: Path, addresses: dict[str, str], repeats: int) -> dict[str, Any]:
    """Median µs of a 1-row forward, per system: to a layer rank 0 runs, and to one the last rank
    owns, sent the way a client of the address does (``routed``: straight to that rank) and over a
    plain connection to rank 0 (``relayed``: rank 0 passes it on). Under ``fsdp`` both gather."""
    from symbiosis.checkpoint import Checkpoint, build_skeleton, discover_base_layers
    from symbiosis.sharding.placement import Layout, place_units
    from symbiosis.transport.schemes import open_transport
    from symbiosis.transport.zmq_client import ZmqTransport

    specs = discover_base_layers(build_skeleton(Checkpoint(path).config))
    layout = Layout(specs)
    owners = place_units([u.numel for u in layout.units], 2)
    assert owners[0] == 0 and owners[-1] != 0, "rank 0 owns the first unit, another rank the last"
    first, last = layout.units[0].layer_ids[0], layout.units[-1].layer_ids[0]
    transports = []
    candidates = {}
    for name, address in addresses.items():
        routed, plain = open_transport(address), ZmqTransport(address)
        transports += [routed, plain]
        for label, transport, layer in (
            ("rank 0's layer", routed, first),
            ("another rank's layer, routed", routed, last),
            ("another rank's layer, relayed", plain, last),
        ):
            rows = torch.randn(1, specs[layer].in_features)
            candidates[f"{name} | {label}"] = lambda t=transport, layer=layer, rows=rows: t.call(
                layer, "forward", rows, "decode"
            )
    try:
        samples = time_interleaved(candidates, warmup=3, repeats=repeats)
    finally:
        for transport in transports:
            transport.close()
    return {
        "layers": {"rank 0's layer": first, "another rank's layer": last},
        "median_us": {name: 1e6 * statistics.median(s) for name, s in samples.items()},
        "p95_us": {name: 1e6 * percentile(s, 95) for name, s in samples.items()},
    }


def _run_window(workers, name: str, mode: str) -> float:
    """All workers run ``mode`` against system ``name`` for a window at once: aggregate tokens/s."""
    for worker in workers:
        worker.process.stdin.write(json.dumps({"system": name, "mode": mode}) + "\n")
        worker.process.stdin.flush()
    done = [worker.wait_done(timeout_s=900) for worker in workers]
    return sum(d["tokens"] for d in done) / max(d["elapsed_s"] for d in done)


def throughput(workers, names: list[str], rounds: int) -> dict[str, Any]:
    """Aggregate tokens/s of all workers per (mode, system), rotating the system order each round,
    after one untimed window of each (first gathers, allocator growth, the schedulers' learning)."""
    for mode in MODES:
        for name in names:
            _run_window(workers, name, mode)
    samples: dict[str, dict[str, list[float]]] = {mode: {name: [] for name in names} for mode in MODES}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for mode in MODES:
            for name in names[shift:] + names[:shift]:
                samples[mode][name].append(_run_window(workers, name, mode))
                print(
                    f"  round {round_index + 1}/{rounds} {mode:6s} {name:10s} {samples[mode][name][-1]:8.1f} tokens/s",
                    flush=True,
                )
    # Ratios to N=1 round by round (the systems of a round ran minutes apart at most, under similar
    # load), then their median: steadier than a ratio of medians on a machine whose load swings.
    return {
        mode: {
            name: {
                "median_tokens_per_s": statistics.median(v),
                "ratio_to_n1": statistics.median(x / b for x, b in zip(v, by_name["N=1"])),
                "samples": v,
            }
            for name, v in by_name.items()
        }
        for mode, by_name in samples.items()
    }


def memory_of(executor, system: dict[str, Any]) -> dict[str, Any]:
    """Per rank: weights kept, peak RSS, peak gathered bytes (fsdp)."""
    stats = executor.stats()
    if system["ranks"] == 1:
        return {
            "ranks": [{"rank": 0, "weights_bytes": stats["weights_bytes"], "peak_rss_bytes": stats["peak_rss_bytes"]}]
        }
    ranks = []
    for shard in stats["shards"]:
        info = shard["shard"]
        gathers = info.get("gathers") or {}
        ranks.append(
            {
                "rank": info["rank"],
                "weights_bytes": info["resident_weight_bytes"],
                "peak_rss_bytes": info["peak_rss_bytes"],
                "peak_gathered_bytes": gathers.get("peak_gathered_bytes"),
                "mean_gather_ms": gathers.get("mean_gather_ms"),
                "gathers": gathers.get("gathers"),
                "gathered_bytes": gathers.get("gathered_bytes"),
                "relayed_requests": info["relayed_requests"],
                "served_for_peers": info["served_for_peers"],
            }
        )
    return {"ranks": ranks, "total_weight_bytes": stats["shards"][0]["shard"]["total_weight_bytes"]}


def large_model_memory(cache: Path, folder: Path) -> dict[str, Any]:
    """Per-rank weight bytes and peak RSS of a ~1B Llama at N = 1, 2, 4 (layers and fsdp), one at a time."""
    import psutil

    from benchmarks.scenarios.multi_job_finetune import LARGE_PARAMS, large_checkpoint

    needed_gib = 2.5 * LARGE_PARAMS * 4 / GIB + 2.0
    available_gib = psutil.virtual_memory().available / GIB
    if available_gib < needed_gib:
        return {"skipped": f"needs ~{needed_gib:.1f} GiB free, {available_gib:.1f} GiB available"}
    path = large_checkpoint(cache)
    found = {}
    for system in [{"name": "N=1", "ranks": 1, "strategy": None}] + [
        {"name": f"N={n} {s}", "ranks": n, "strategy": s} for n in (2, 4) for s in ("layers", "fsdp")
    ]:
        executor, _ = start_system(path, system, f"ipc://{folder}/large.sock")
        try:
            executor.wait_ready()
            found[system["name"]] = memory_of(executor, system)
        finally:
            executor.close()
        print(
            f"  ~1B {system['name']}: "
            + ", ".join(
                f"{r['weights_bytes'] / GIB:.2f}/{r['peak_rss_bytes'] / GIB:.2f}"
                for r in found[system["name"]]["ranks"]
            )
            + " GiB weights/peak RSS",
            flush=True,
        )
    return {"model": str(path), "params": LARGE_PARAMS, "systems": found}


# ---- report ------------------------------------------------------------------------------------------


def summarize(result: dict[str, Any]) -> list[str]:
    from symbiosis.sharding.placement import DEFAULT_STRATEGY

    lines = []
    tp = result["throughput"]
    for mode in MODES:
        parts = [f"{name} {v['median_tokens_per_s']:.1f} (x{v['ratio_to_n1']:.2f})" for name, v in tp[mode].items()]
        lines.append(f"{mode}, 4 clients (tokens/s; median of per-round ratios to N=1): " + ", ".join(parts))
    winners = {
        mode: max((n for n in tp[mode] if n != "N=1"), key=lambda n: tp[mode][n]["median_tokens_per_s"])
        for mode in MODES
    }
    machine = result["machine"]
    lines.append(f"Load average at the start: {machine['load_average_1_5_15min']} on {machine['usable_cpus']} CPUs.")
    lines.append(
        f"Fastest sharded system: decode {winners['decode']}, train {winners['train']}; "
        f"default strategy: {DEFAULT_STRATEGY}."
    )
    key = f"N=2 {DEFAULT_STRATEGY}"
    ratio = tp["decode"][key]["ratio_to_n1"]
    lines.append(
        f"Target: default strategy's decode at N=2 >= 0.7x N=1: {'PASS' if ratio >= 0.7 else 'MISS'} (x{ratio:.2f})."
    )
    for name, memory in result["memory"].items():
        ranks = memory["ranks"]
        lines.append(
            f"{name}: weights per rank "
            + "/".join(f"{r['weights_bytes'] / MIB:.0f}" for r in ranks)
            + " MiB, peak RSS "
            + "/".join(f"{r['peak_rss_bytes'] / MIB:.0f}" for r in ranks)
            + " MiB"
            + (
                f", peak gathered {max(r['peak_gathered_bytes'] or 0 for r in ranks) / MIB:.0f} MiB"
                if any(r.get("peak_gathered_bytes") for r in ranks)
                else ""
            )
        )
    costs = result["call_costs"]["median_us"]
    lines.append("1-row forward (median µs): " + ", ".join(f"{k} {v:.0f}" for k, v in costs.items()))
    return lines


def plot(result: dict[str, Any], path: Path) -> None:
    tp = result["throughput"]
    names = list(tp["decode"])
    panels = [
        Panel(f"{mode}: 4 clients", "tokens/s", names, {"median": [tp[mode][n]["median_tokens_per_s"] for n in names]})
        for mode in MODES
    ]
    memory = result["memory"]
    panels.append(
        Panel(
            "base weights kept per rank",
            "MiB",
            names,
            {
                f"rank {r}": [
                    (m["ranks"][r]["weights_bytes"] / MIB if r < len(m["ranks"]) else None) for m in memory.values()
                ]
                for r in range(4)
            },
        )
    )
    panels.append(
        Panel(
            "peak RSS per rank",
            "MiB",
            names,
            {
                f"rank {r}": [
                    (m["ranks"][r]["peak_rss_bytes"] / MIB if r < len(m["ranks"]) else None) for m in memory.values()
                ]
                for r in range(4)
            },
        )
    )
    plot_panels(path, "Sharded executor: cost of sharding on one 2-core host (medians)", panels)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_arguments(parser, default_repeats=5, quick_repeats=1)
    parser.add_argument(
        "--window-s", type=float, default=None, help="Seconds each measurement runs (default 15, 1.5 with --quick)."
    )
    parser.add_argument(
        "--serve-args", default="", help="More `symbiosis serve` flags for every system, e.g. '--policy immediate'."
    )
    parser.add_argument(
        "--large",
        action="store_true",
        help="Also measure per-rank memory with a ~1B Llama (full runs; needs ~13 GiB free).",
    )
    args = parser.parse_args(argv)
    if args.preset is None and not args.quick:
        args.preset = "base"
    args = resolve_common(args)
    window_s = args.window_s or (1.5 if args.quick else 15.0)
    started = time.monotonic()
    machine = machine_info()
    path = checkpoint_path(args)
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"sharded-bench-{os.getpid()}"
    folder.mkdir(parents=True, exist_ok=True)
    chosen = systems(args.quick)
    executors = {}
    threads = {}
    workers = []
    try:
        for system in chosen:  # loaded one after another: each reads the checkpoint
            socket_name = system["name"].replace(" ", "-").replace("=", "")
            executor, threads[system["name"]] = start_system(
                path, system, f"ipc://{folder}/{socket_name}.sock", args.serve_args.split()
            )
            executor.wait_ready()
            executors[system["name"]] = executor
        addresses = {name: executor.address for name, executor in executors.items()}
        print(f"{len(executors)} systems up; per-call costs", flush=True)
        costs = call_costs(path, addresses, repeats=50 if args.quick else 300)
        spec = {"path": str(path), "addresses": addresses, "window_s": window_s}
        workers = [Worker("benchmarks.sharded", dict(spec, seed=seed, role=f"client{seed}")) for seed in range(CLIENTS)]
        for worker in workers:
            worker.wait_ready(timeout_s=900)
        print(f"{CLIENTS} clients up; throughput, {args.repeats} rounds of {window_s:g} s windows", flush=True)
        tp = throughput(workers, list(executors), args.repeats)
        memory = {name: memory_of(executors[name], system) for name, system in ((s["name"], s) for s in chosen)}
    finally:
        for worker in workers:
            worker.request_exit()
        for worker in workers:
            worker.close()
        for executor in executors.values():
            executor.close()
    large = (
        large_model_memory(args.cache, folder)
        if args.large and not args.quick
        else {"skipped": "run with --large (full runs)"}
    )
    result = {
        "benchmark": "sharded",
        "command": command_line(argv, "benchmarks.sharded"),
        "machine": machine,
        "model": str(path),
        "preset": args.preset,
        "clients": CLIENTS,
        "window_s": window_s,
        "rounds": args.repeats,
        "threads_per_process": {"executor_rank": threads, "client": 1},
        "systems": chosen,
        "throughput": tp,
        "call_costs": costs,
        "memory": memory,
        "large_model_memory": large,
        "wall_s": time.monotonic() - started,
    }
    result["summary"] = summarize(result)
    args.output.mkdir(parents=True, exist_ok=True)
    write_json(args.output / "sharded.json", result)
    plot(result, args.output / "sharded.png")
    for line in result["summary"]:
        print(line)
    return result


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "worker":
        worker_main(json.loads(sys.argv[2]))
    else:
        main()
