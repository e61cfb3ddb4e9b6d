"""Batching and sharing policies under many concurrent clients (paper §4.4-4.5, Table 5; FlexLLM co-serving).

Clients are threads of this process, each a plain ``transformers`` model with its own PEFT
adapter and KV cache, all served by one ``BaseExecutor`` (in-process transport); with
``--clients-as processes`` each client and the executor run in their own process, over ``ipc://``
(``batching_processes.py``; the executor's weights on ``--executor-device``, the CPU by default);
with ``--executor ADDRESS`` they connect to a running executor there (its policy is fixed and its
stats are not visible: one "remote" variant, rows per batch null).
The clients are in ``batching_clients.py``. Every run starts a fresh executor over the same
loaded weights and fresh clients; each client warms up, all start together, and the run
measures a window of ``--window-s`` seconds after ``--warmup-s`` seconds of running (a steady
state). Runs of different policies are interleaved (order rotated each repeat) and each figure
is the median over ``--repeats`` runs.

Scenarios:

(a) ``inference`` (heterogeneous clients): 8 inference clients with batch sizes 1, 2, 4, 8, 16, 1,
    2, 4 and alternating adapters (LoRA r=8 on q_proj; LoRA r=64 on q,k,v,o_proj) decode greedily.
    Reported: aggregate tokens/s, mean/median/p95 per-token latency (one decode step of one
    client, pooled), mean rows per executor batch, the opportunistic waiting rule chosen.
(b) mixed load: ``inference_alone`` (the first 6 of those clients), ``inference_with_finetune``
    (the same 6 plus 2 fine-tuning clients: LoRA r=16 on q,k,v,o, AdamW, ``--ft-batch`` x
    ``--ft-seq-len`` tokens per step) and ``finetune_alone`` (the 2 fine-tuning clients). Reported:
    inference p95 latency mixed / alone, fine-tuning tokens/s mixed / alone. The variant
    ``opportunistic-slo`` runs the mixed scenario with ``decode_slo_ms`` set to ``--slo-factor``
    (1.2) x the p95 per-token latency opportunistic measured for the same 6 clients alone in the
    same repeat (or ``--decode-slo-ms``): the target of issue 11, asked of the executor directly.
(c) flood: ``bystander_alone`` (one inference client, batch 1), ``flood_finetune`` and
    ``flood_decode`` (the same bystander while a client keeps ``--flood-depth`` requests of
    ``--flood-rows`` rows for one base layer outstanding, labelled finetune or decode). Reported:
    the bystander's p95 per-token latency flood / alone, the flood's rows/s.

Targets (issue 11), each reported PASS/MISS in ``summary.targets``: (a) opportunistic >= immediate
on tokens/s and <= lockstep on mean per-token latency; (b) fine-tuning keeps >= 85% of its solo
tokens/s while inference p95 is <= 1.2x alone (opportunistic), or within the set target
(opportunistic-slo); (c) the bystander's p95 <= 3x alone under either flood (opportunistic).
(a) compares the medians of each policy's repeats, (b) and (c) take the median of the ratios of
each repeat's runs; beside every target, ``per_repeat`` holds that ratio in each repeat (the
runs of one repeat run side by side, in an order rotated from repeat to repeat), so a miss can
be read against this host's round-to-round noise: five repeats of client threads (2026-12-06)
met (a)'s latency target at x0.969 of lockstep's median while their repeats said x1.11, 1.04,
0.96, 0.96, 1.24.

Every client above is a closed loop (it steps back to back); with ``--decode-interval-ms MS`` every
inference client is an open loop instead -- a step started at most every MS, the streams' first
steps spread over the interval (``spread_phases``) -- so that the decoders leave the host idle
time, as inference below its peak does; each target's name then says so.

Threads share one Python interpreter: the GIL serializes client-side Python and the products'
dispatch; on a 2-core machine this bounds what any policy can gain. The numbers are what this
machine gives, with the load average at the start and end recorded next to them.

JSON (``batching.json`` in ``--output``): ``benchmark, command, machine, config, runs_by_scenario,
inference, mixed, flood, summary, wall_s``; ``summary`` holds the headline figures and
``targets`` (name, value, target, met, per_repeat). Plot: ``batching.png``.

Run: ``python -m benchmarks.batching [--quick] [--clients-as processes] [--scenarios ...] --output DIR``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from transformers import AutoConfig

import symbiosis
from benchmarks import timing
from benchmarks.batching_clients import (
    ClientRecord,
    ClientSpec,
    counters_from_stats,
    make_client,
    remote_counters,
    run_measured,
    summarize_run,
    warm_up,
)
from benchmarks.options import add_common_arguments, checkpoint_path, resolve_common
from benchmarks.plots import Panel, plot_panels
from benchmarks.results import command_line, machine_info, print_summary, write_json
from symbiosis.executor.scheduler import SchedulerConfig
from symbiosis.executor.scheduler_config import BULK_LANES

NAME = "batching"
INFERENCE_BATCH_SIZES = (1, 2, 4, 8, 16, 1, 2, 4)
INFERENCE_ADAPTERS = ("lora_r8_q", "lora_r64_qkvo")
MIXED_INFERENCE_CLIENTS = 6
FINETUNE_CLIENTS = 2
FINETUNE_ADAPTER = "lora_r16_qkvo"
SCENARIOS = (
    "inference",
    "inference_alone",
    "inference_with_finetune",
    "finetune_alone",
    "bystander_alone",
    "flood_finetune",
    "flood_decode",
)
FLOOD_SCENARIOS = ("bystander_alone", "flood_finetune", "flood_decode")
SLO_VARIANT = "opportunistic-slo"
# What is compared: a name -> the SchedulerConfig fields that make it.
VARIANTS: dict[str, dict] = {
    "immediate": {"policy": "immediate"},
    "lockstep": {"policy": "lockstep"},
    "opportunistic": {"policy": "opportunistic"},  # the default: adapts its waiting rule
    # Each waiting rule the adaptive default chooses from, fixed ("predicted" was the default before).
    "opportunistic-none": {"policy": "opportunistic", "wait_rule": "none"},
    "opportunistic-predicted": {"policy": "opportunistic", "wait_rule": "predicted"},
    "opportunistic-convoy": {"policy": "opportunistic", "wait_rule": "convoy"},
    SLO_VARIANT: {"policy": "opportunistic"},  # + decode_slo_ms, in the mixed scenario only
}
# Which variants run where: the SLO variant only where fine-tuning meets inference; the flood only
# for the two policies a provider would run (lockstep waits for the flooder at every layer).
VARIANT_SCENARIOS = {
    SLO_VARIANT: ("inference_with_finetune",),
    "lockstep": SCENARIOS[:4],
    "opportunistic-none": SCENARIOS[:4],
    "opportunistic-predicted": SCENARIOS[:4],
    "opportunistic-convoy": SCENARIOS[:4],
}
TARGETS = {"finetune_kept": 0.85, "inference_p95_ratio": 1.2, "flood_p95_ratio": 3.0}


def clients_for(scenario: str, args: argparse.Namespace) -> list[ClientSpec]:
    interval_s = (args.decode_interval_ms or 0.0) / 1e3
    inference = [
        ClientSpec("inference", INFERENCE_ADAPTERS[i % 2], size, interval_s=interval_s)
        for i, size in enumerate(INFERENCE_BATCH_SIZES)
    ]
    finetune = [ClientSpec("finetune", FINETUNE_ADAPTER, args.ft_batch, args.ft_seq_len)] * FINETUNE_CLIENTS
    bystander = [ClientSpec("inference", "lora_r8_q", 1, interval_s=interval_s)]
    flood = {
        label: [ClientSpec("flood", batch_size=args.flood_rows, depth=args.flood_depth, label=label)]
        for label in ("finetune", "decode")
    }
    specs = {
        "inference": inference,
        "inference_alone": inference[:MIXED_INFERENCE_CLIENTS],
        "inference_with_finetune": inference[:MIXED_INFERENCE_CLIENTS] + finetune,
        "finetune_alone": finetune,
        "bystander_alone": bystander,
        "flood_finetune": bystander + flood["finetune"],
        "flood_decode": bystander + flood["decode"],
    }[scenario]
    return spread_phases(specs)


def spread_phases(specs: list[ClientSpec]) -> list[ClientSpec]:
    """Open-loop inference clients with their first steps spread evenly over one interval (client
    i of n waits i/n of it): streams read at one rate are not in step with each other, and the
    same phases for every policy keep the runs comparable."""
    streams = [i for i, spec in enumerate(specs) if spec.kind == "inference" and spec.interval_s]
    for n, i in enumerate(streams):
        specs[i] = dataclasses.replace(specs[i], phase=n / len(streams))
    return specs


def runs_in(variant: str, scenario: str, slo_given: bool = False) -> bool:
    """Whether ``variant`` runs in ``scenario``; the SLO variant runs under the flood too when its
    target is given (``--decode-slo-ms``: the derived one comes from the mixed scenario)."""
    if variant == SLO_VARIANT and slo_given and scenario in FLOOD_SCENARIOS:
        return True
    return scenario in VARIANT_SCENARIOS.get(variant, SCENARIOS)


# ---- one run (threads) ---------------------------------------------------------------------------


def run_once(path: Path, target, specs: Sequence[ClientSpec], args: argparse.Namespace, seed: int) -> dict:
    """Start the clients of ``specs`` as threads against ``target`` (executor or address), measure one window."""
    made = [
        make_client(path, target, spec, seed + i, args.prompt_len, args.segment_tokens) for i, spec in enumerate(specs)
    ]
    records = [ClientRecord(spec) for spec in specs]
    executor = target if isinstance(target, symbiosis.BaseExecutor) else None
    counters: dict[str, dict] = {}
    window = {"end_s": float("inf")}
    stop = threading.Event()

    def start_window() -> None:  # runs once, when every client is warm and waiting
        counters["start"] = counters_from_stats(executor.stats()["scheduler"]) if executor else remote_counters()
        window["end_s"] = time.perf_counter() + args.window_s

    barrier = threading.Barrier(len(made), action=start_window)

    def client_thread(client, close, record: ClientRecord) -> None:
        try:
            warm_up(client, record.spec, args.warmup_s)
            barrier.wait()
            run_measured(client, record, window["end_s"], stop.is_set)
        except BaseException as exc:  # reported by the main thread
            record.error = exc
            barrier.abort()
        finally:
            close()  # unregister at once, so that lockstep stops waiting for this client

    threads = [
        threading.Thread(target=client_thread, args=(client, close, record), name=f"client-{i}", daemon=True)
        for i, ((client, close), record) in enumerate(zip(made, records))
    ]
    for thread in threads:
        thread.start()
    while "start" not in counters and not any(r.error for r in records):
        time.sleep(0.005)
    if "start" in counters:
        time.sleep(max(0.0, window["end_s"] - time.perf_counter()))
        counters["end"] = counters_from_stats(executor.stats()["scheduler"]) if executor else remote_counters()
    stop.set()
    for thread in threads:
        thread.join(timeout=120)
    errors = [r.error for r in records if r.error is not None and not isinstance(r.error, threading.BrokenBarrierError)]
    if errors or any(t.is_alive() for t in threads):
        raise RuntimeError(f"a client failed or hung: {errors[:1]!r}") from (errors[0] if errors else None)
    return summarize_run(records, counters, args.window_s, executor is not None)


# ---- aggregation ---------------------------------------------------------------------------------

SCALARS = (
    "tokens_per_s",
    "latency_ms_mean",
    "latency_ms_median",
    "latency_ms_p95",
    "finetune_tokens_per_s",
    "finetune_step_ms_median",
    "flood_rows_per_s",
    "mean_rows_per_batch",
    "batches",
    "cpu_cores_busy",
)


def aggregate(runs: Sequence[dict]) -> dict:
    """Median over repeated runs of every scalar, and of every client's numbers."""
    # None (not applicable, or nothing finished inside the window) is skipped; all None gives null.
    result = {key: timing.median_or_nan([run[key] for run in runs]) for key in SCALARS}
    per_client = []
    for index, first in enumerate(runs[0]["per_client"]):
        client = {k: first[k] for k in ("kind", "adapter", "batch_size")}
        for key in ("steps", "step_ms_mean", "step_ms_p95"):
            client[key] = timing.median_or_nan([run["per_client"][index][key] for run in runs])
        per_client.append(client)
    result["per_client"] = per_client
    result["wait_rules"] = [_rule_in_use(run) for run in runs]
    result["runs"] = runs
    return result


def per_repeat_ratios(numerators: Sequence[dict], denominators: Sequence[dict], key: str) -> list[float]:
    """The ratio of ``key`` in each repeat (its runs ran side by side), for the repeats in which both
    runs have the figure. Their spread says what the host's noise did to a ratio of medians."""
    return timing.finite(timing.ratio(n[key], d[key]) for n, d in zip(numerators, denominators) if n[key] and d[key])


def median_ratio(numerators: Sequence[dict], denominators: Sequence[dict], key: str) -> float:
    """Median over repeats of the per-repeat ratio (runs of one repeat ran side by side)."""
    return timing.median_or_nan(per_repeat_ratios(numerators, denominators, key))


def summarize(
    runs: dict[tuple[str, str], list[dict]],
    variants: list[str],
    slo_ms: list[float],
    decode_interval_ms: float | None = None,
) -> dict:
    have = {key for key, value in runs.items() if value}
    agg = {key: aggregate(value) for key, value in runs.items() if value}
    summary: dict = {"inference": {}, "mixed": {}, "flood": {}, "targets": []}
    for v in variants:
        if ("inference", v) in have:
            a = agg["inference", v]
            summary["inference"][v] = {
                k: a[k]
                for k in (
                    "tokens_per_s",
                    "latency_ms_mean",
                    "latency_ms_median",
                    "latency_ms_p95",
                    "mean_rows_per_batch",
                )
            } | {"wait_rules": a["wait_rules"]}
    # The heterogeneous targets compare medians; what each repeat's side-by-side runs said is kept
    # beside them (``per_repeat``), so a miss by less than the host's noise reads as one.
    opportunistic = summary["inference"].get("opportunistic")
    if opportunistic is not None:
        opportunistic["per_repeat"] = {
            f"{key}_vs_{other}": per_repeat_ratios(runs["inference", "opportunistic"], runs["inference", other], key)
            for key, other in (("tokens_per_s", "immediate"), ("latency_ms_mean", "lockstep"))
            if ("inference", other) in have
        }
    for v in variants:
        base = "opportunistic" if v == SLO_VARIANT else v
        if (
            ("inference_with_finetune", v) not in have
            or ("inference_alone", base) not in have
            or ("finetune_alone", base) not in have
        ):
            continue
        mixed, alone, ft_alone = (
            runs["inference_with_finetune", v],
            runs["inference_alone", base],
            runs["finetune_alone", base],
        )
        slo_ratios = (
            timing.finite(timing.ratio(r["latency_ms_p95"], s) for r, s in zip(mixed, slo_ms) if r["latency_ms_p95"])
            if v == SLO_VARIANT
            else []
        )
        summary["mixed"][v] = {
            "inference_latency_ms_p95_alone": agg["inference_alone", base]["latency_ms_p95"],
            "inference_latency_ms_p95_mixed": agg["inference_with_finetune", v]["latency_ms_p95"],
            "inference_p95_ratio": median_ratio(mixed, alone, "latency_ms_p95"),
            "inference_mean_ratio": median_ratio(mixed, alone, "latency_ms_mean"),
            "finetune_tokens_per_s_alone": agg["finetune_alone", base]["finetune_tokens_per_s"],
            "finetune_tokens_per_s_mixed": agg["inference_with_finetune", v]["finetune_tokens_per_s"],
            "finetune_kept": median_ratio(mixed, ft_alone, "finetune_tokens_per_s"),
            # Cores busy (of the host's): closed-loop decoders alone leave idle only what they
            # cannot use, and that is all background fine-tuning gets without slowing them.
            "cpu_cores_busy_inference_alone": agg["inference_alone", base]["cpu_cores_busy"],
            "cpu_cores_busy_finetune_alone": agg["finetune_alone", base]["cpu_cores_busy"],
            "cpu_cores_busy_mixed": agg["inference_with_finetune", v]["cpu_cores_busy"],
            "decode_slo_ms": timing.median_or_nan(slo_ms) if v == SLO_VARIANT else None,
            "slo_p95_ratio": timing.median_or_nan(slo_ratios) if v == SLO_VARIANT else None,
            "per_repeat": {
                "finetune_kept": per_repeat_ratios(mixed, ft_alone, "finetune_tokens_per_s"),
                "inference_p95_ratio": per_repeat_ratios(mixed, alone, "latency_ms_p95"),
            }
            | ({"slo_p95_ratio": slo_ratios} if v == SLO_VARIANT else {}),
        }
    for v in variants:
        if ("bystander_alone", v) not in have:
            continue
        entry = {"bystander_p95_ms_alone": agg["bystander_alone", v]["latency_ms_p95"]}
        for label in ("finetune", "decode"):
            scenario = f"flood_{label}"
            if (scenario, v) in have:
                entry[f"bystander_p95_ms_{scenario}"] = agg[scenario, v]["latency_ms_p95"]
                ratios = per_repeat_ratios(runs[scenario, v], runs["bystander_alone", v], "latency_ms_p95")
                entry[f"p95_ratio_{scenario}"] = timing.median_or_nan(ratios)
                entry.setdefault("per_repeat", {})[f"p95_ratio_{scenario}"] = ratios
                entry[f"flood_rows_per_s_{scenario}"] = agg[scenario, v]["flood_rows_per_s"]
        summary["flood"][v] = entry
    summary["targets"] = targets(summary, decode_interval_ms)
    return summary


def targets(summary: dict, decode_interval_ms: float | None = None) -> list[dict]:
    """Each target's verdict. With open-loop decoders (``decode_interval_ms``) every name says so:
    the issue set its targets for closed-loop clients, and an open-loop verdict must not be read
    as one of those."""
    found = []
    setting = f"decoders open loop, a step every {decode_interval_ms:g} ms: " if decode_interval_ms else ""

    def check(name: str, value: float | None, target: float, met: bool | None, per_repeat: list | None) -> None:
        name = setting + name
        entry = {"name": name, "value": value, "target": target, "met": bool(met) if met is not None else None}
        if per_repeat is not None:  # the same ratio in each repeat's side-by-side runs (``per_repeat_ratios``)
            entry["per_repeat"] = per_repeat
        found.append(entry)

    inference = summary["inference"]
    repeats = inference.get("opportunistic", {}).get("per_repeat", {})
    if {"opportunistic", "immediate"} <= set(inference):
        ratio = timing.ratio(inference["opportunistic"]["tokens_per_s"], inference["immediate"]["tokens_per_s"])
        check(
            "heterogeneous: opportunistic tokens/s / immediate >= 1",
            ratio,
            1.0,
            ratio >= 1.0,
            repeats.get("tokens_per_s_vs_immediate"),
        )
    if {"opportunistic", "lockstep"} <= set(inference):
        ratio = timing.ratio(inference["opportunistic"]["latency_ms_mean"], inference["lockstep"]["latency_ms_mean"])
        check(
            "heterogeneous: opportunistic mean per-token latency / lockstep <= 1",
            ratio,
            1.0,
            ratio <= 1.0,
            repeats.get("latency_ms_mean_vs_lockstep"),
        )
    for v, figures in summary["mixed"].items():
        if v not in ("opportunistic", SLO_VARIANT):
            continue
        repeats = figures.get("per_repeat", {})
        kept = figures["finetune_kept"]
        check(
            f"mixed ({v}): fine-tuning kept >= {TARGETS['finetune_kept']:.0%} of solo",
            kept,
            TARGETS["finetune_kept"],
            kept >= TARGETS["finetune_kept"],
            repeats.get("finetune_kept"),
        )
        if v == SLO_VARIANT:
            ratio = figures["slo_p95_ratio"]
            check(
                f"mixed ({v}): inference p95 / the set target <= 1",
                ratio,
                1.0,
                ratio <= 1.0,
                repeats.get("slo_p95_ratio"),
            )
        else:
            ratio = figures["inference_p95_ratio"]
            check(
                f"mixed ({v}): inference p95 mixed / alone <= {TARGETS['inference_p95_ratio']}",
                ratio,
                TARGETS["inference_p95_ratio"],
                ratio <= TARGETS["inference_p95_ratio"],
                repeats.get("inference_p95_ratio"),
            )
    flood = summary["flood"].get("opportunistic", {})
    for label in ("finetune", "decode"):
        ratio = flood.get(f"p95_ratio_flood_{label}")
        if ratio is not None:
            check(
                f"flood labelled {label} (opportunistic): bystander p95 / alone <= {TARGETS['flood_p95_ratio']:g}",
                ratio,
                TARGETS["flood_p95_ratio"],
                ratio <= TARGETS["flood_p95_ratio"],
                flood.get("per_repeat", {}).get(f"p95_ratio_flood_{label}"),
            )
    return found


# ---- driver --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, default_repeats=3, quick_repeats=1)
    parser.add_argument(
        "--executor",
        default=None,
        metavar="ADDRESS",
        help="Connect clients to a running executor at ADDRESS (e.g. tcp://127.0.0.1:7000) instead of an "
        "in-process one; needs --model with its checkpoint.",
    )
    parser.add_argument(
        "--policies",
        nargs="+",
        choices=list(VARIANTS),
        default=list(VARIANTS),
        help="Variants to compare (default: all).",
    )
    parser.add_argument(
        "--scenarios",
        nargs="+",
        choices=list(SCENARIOS),
        default=list(SCENARIOS),
        help="Scenarios to run (default: all).",
    )
    parser.add_argument(
        "--clients-as",
        choices=("threads", "processes"),
        default="threads",
        help="Run each client as a thread of this process with an in-process executor (default; one GIL for all), "
        "or each client and the executor as its own process, connected over ipc:// (benchmarks/batching_processes.py).",
    )
    parser.add_argument(
        "--scheme",
        choices=("ipc", "shm+ipc", "tcp"),
        default="ipc",
        help="With --clients-as processes: how clients reach the executor process: ipc:// (default), shm+ipc:// "
        "(large payloads in shared memory, read and written in place by the executor) or tcp:// on loopback "
        "(what remote clients would use, minus the network).",
    )
    parser.add_argument(
        "--executor-device",
        default="cpu",
        help="With --clients-as processes: device of the executor's base weights (`symbiosis serve --device`: "
        "cpu, cuda, cuda:1, ...); the clients stay on the CPU, as remote clients of a GPU service would "
        "(default: %(default)s).",
    )
    parser.add_argument(
        "--finetune-cpu-priority",
        choices=("background", "normal"),
        default="background",
        help="With --clients-as processes: CPU priority of the fine-tuning client processes (default: "
        "background, what `symbiosis finetune --executor` gives a job on an executor's host; "
        "threads share this process's priority).",
    )
    parser.add_argument(
        "--max-wait-ms", type=float, default=None, help="Executor max_wait_ms (default: SchedulerConfig's)."
    )
    parser.add_argument(
        "--bulk-lane",
        choices=BULK_LANES,
        default=None,
        help="Executor bulk_lane: who runs fine-tuning and flood products (default: SchedulerConfig's, 'auto').",
    )
    parser.add_argument(
        "--window-s", type=float, default=None, help="Measured seconds per run (default 6; 0.6 with --quick)."
    )
    parser.add_argument(
        "--warmup-s",
        type=float,
        default=None,
        help="Seconds each client runs before the window, the same for every policy (default 2; 0 with --quick).",
    )
    parser.add_argument(
        "--prompt-len", type=int, default=16, help="Prompt tokens per inference sequence (default: %(default)s)."
    )
    parser.add_argument(
        "--ft-batch", type=int, default=None, help="Sequences per fine-tuning step (default 4; 2 with --quick)."
    )
    parser.add_argument(
        "--ft-seq-len", type=int, default=None, help="Tokens per fine-tuning sequence (default 64; 16 with --quick)."
    )
    parser.add_argument(
        "--flood-rows", type=int, default=None, help="Rows per flood request (default 16384; 512 with --quick)."
    )
    parser.add_argument(
        "--flood-depth", type=int, default=None, help="Flood requests kept outstanding (default 8; 2 with --quick)."
    )
    parser.add_argument(
        "--decode-interval-ms",
        type=float,
        default=None,
        metavar="MS",
        help="Open loop: every inference client starts a step at most every MS milliseconds (a stream read at "
        "a set rate; its steps spread over the interval), and waits for it when a step took less. Its "
        "per-token latency is still the step's own time. Default: closed loop, each client steps back to "
        "back, as fast as the executor and the host let it (all targets were set for that).",
    )
    parser.add_argument(
        "--decode-slo-ms",
        type=float,
        default=None,
        help=f"decode_slo_ms of the {SLO_VARIANT} variant (default: --slo-factor x the p95 measured alone).",
    )
    parser.add_argument(
        "--slo-factor",
        type=float,
        default=1.2,
        help="Without --decode-slo-ms: the target as a multiple of inference alone's p95 (default: %(default)s).",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="With --clients-as processes: sample the executor and every client process over each window with "
        "py-spy (pip install py-spy) into DIR, one raw stack file per process and run; "
        "`python -m benchmarks.window_profile FILE...` says where each thread spent it.",
    )
    args = resolve_common(parser.parse_args(argv))
    if args.profile is not None and args.clients_as != "processes":
        parser.error("--profile is for --clients-as processes (threads share one process: use py-spy on it)")
    if args.profile is not None:
        from benchmarks.window_profile import py_spy

        py_spy()  # missing: say so now, not after the first run
    if args.clients_as == "processes" and args.quick:
        parser.error("--clients-as processes is for full runs; --quick uses threads")
    if args.executor_device != "cpu" and args.clients_as != "processes":
        parser.error("--executor-device is for --clients-as processes (threads share this process's CPU executor)")
    if args.executor and args.model is None:
        parser.error("--executor needs --model DIR: the checkpoint the executor at ADDRESS serves")
    if args.decode_interval_ms is not None and not args.decode_interval_ms > 0:
        parser.error("--decode-interval-ms must be a positive number of milliseconds")
    args.window_s = args.window_s or (0.6 if args.quick else 6.0)
    args.warmup_s = args.warmup_s if args.warmup_s is not None else (0.0 if args.quick else 2.0)
    args.ft_batch = args.ft_batch or (2 if args.quick else 4)
    args.ft_seq_len = args.ft_seq_len or (16 if args.quick else 64)
    args.flood_rows = args.flood_rows or (512 if args.quick else 16384)
    args.flood_depth = args.flood_depth or (2 if args.quick else 8)
    return args


def _load() -> list[float]:
    return list(os.getloadavg())


def main(argv: Sequence[str] | None = None) -> dict:
    started = time.perf_counter()
    args = parse_args(argv)
    path = checkpoint_path(args)
    max_positions = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", 1024)
    args.segment_tokens = max(8, min(512, max_positions - args.prompt_len - 8))
    load_start = _load()

    variants = ["remote"] if args.executor else list(args.policies)
    options = {} if args.max_wait_ms is None else {"max_wait_ms": args.max_wait_ms}
    if args.bulk_lane is not None:
        options["bulk_lane"] = args.bulk_lane
    scenarios = [s for s in SCENARIOS if s in args.scenarios]
    if SLO_VARIANT in variants and "inference_with_finetune" in scenarios and args.decode_slo_ms is None:
        if "opportunistic" not in variants or "inference_alone" not in scenarios:
            raise SystemExit(
                f"{SLO_VARIANT} derives its target from opportunistic's inference_alone run: "
                "include both, or pass --decode-slo-ms"
            )
    weights, pool = None, None
    if args.clients_as == "processes":
        from benchmarks.batching_processes import ProcessPool

        pool = ProcessPool(path, [clients_for(s, args) for s in scenarios], args)
    elif args.executor is None:
        executor = symbiosis.BaseExecutor.from_pretrained(path)
        weights = executor.weights  # loaded once, shared by every run
        # As `serve` does before it says ready: otherwise the first runs time their products' forms
        # (kept process-wide) inside their windows, ~50 ms a trial while every client waits.
        executor.warm_up()
        executor.close()

    runs: dict[tuple[str, str], list[dict]] = {(s, v): [] for s in scenarios for v in variants}
    slo_ms: list[float] = []
    try:
        for repeat in range(args.repeats):
            for scenario in scenarios:
                shift = repeat % len(variants)
                for variant in variants[shift:] + variants[:shift]:
                    if variant != "remote" and not runs_in(variant, scenario, args.decode_slo_ms is not None):
                        continue
                    config = None
                    if variant != "remote":
                        fields = dict(VARIANTS[variant], **options)
                        if variant == SLO_VARIANT:
                            slo = (
                                args.decode_slo_ms
                                or args.slo_factor * runs["inference_alone", "opportunistic"][-1]["latency_ms_p95"]
                            )
                            slo_ms.append(slo)
                            fields["decode_slo_ms"] = slo
                        config = SchedulerConfig(**fields)
                    specs, seed = clients_for(scenario, args), 100 * repeat
                    if pool is not None:
                        result = pool.run_once(config, specs, seed, label=f"{repeat}-{scenario}-{variant}")
                    else:
                        target = args.executor or symbiosis.BaseExecutor(weights, config)
                        try:
                            result = run_once(path, target, specs, args, seed=seed)
                        finally:
                            if not isinstance(target, str):
                                target.close()
                    result["config"] = None if config is None else dataclasses.asdict(config)
                    runs[scenario, variant].append(result)
                    print(f"[{repeat}] {scenario:24s} {variant:24s} {_brief(result)}", flush=True)
    finally:
        if pool is not None:
            pool.close()

    summary = summarize(runs, variants, slo_ms, args.decode_interval_ms)
    summary.update(
        {
            "benchmark": NAME,
            "preset": args.preset,
            "clients_as": args.clients_as,
            "executor_device": args.executor_device,
            "transport": args.executor or (args.scheme if pool else "inproc"),
            "window_s": args.window_s,
            "repeats": args.repeats,
            "decode_interval_ms": args.decode_interval_ms,
            "load_average_1min_start_end": [load_start[0], _load()[0]],
        }
    )
    result = {
        "benchmark": NAME,
        "command": command_line(argv, f"benchmarks.{NAME}"),
        "machine": machine_info(),
        "config": {
            "model": str(path),
            "arch": args.arch,
            "preset": args.preset,
            "quick": args.quick,
            "transport": args.executor
            or (
                f"{args.scheme} (executor and each client in its own process)"
                if pool
                else "inproc (client threads in this process)"
            ),
            "clients_as": args.clients_as,
            "executor_device": args.executor_device,
            "finetune_cpu_priority": args.finetune_cpu_priority if pool else "that of this process",
            "variants": variants,
            "scenarios": scenarios,
            "window_s": args.window_s,
            "warmup_s": args.warmup_s,
            "repeats": args.repeats,
            "prompt_len": args.prompt_len,
            "segment_tokens": args.segment_tokens,
            "decode_interval_ms": args.decode_interval_ms,
            "clients": {s: [vars(c) for c in clients_for(s, args)] for s in scenarios},
            "baselines": "(a) immediate and lockstep; (b) the same inference clients alone, the same "
            "fine-tuning clients alone; (c) the bystander alone",
        },
        "runs_by_scenario": {s: {v: runs[s, v] for v in variants if runs[s, v]} for s in scenarios},
        "summary": summary,
    }
    result["wall_s"] = summary["wall_s"] = time.perf_counter() - started
    output = Path(args.output)
    write_json(output / f"{NAME}.json", result)
    plot(output / f"{NAME}.png", result)
    print_summary(summary)
    return result


def _brief(run: dict) -> str:
    parts = []
    for key, label in (
        ("tokens_per_s", "tok/s"),
        ("latency_ms_mean", "mean"),
        ("latency_ms_p95", "p95"),
        ("finetune_tokens_per_s", "ft tok/s"),
        ("flood_rows_per_s", "flood rows/s"),
        ("mean_rows_per_batch", "rows/batch"),
        ("cpu_cores_busy", "cores busy"),
    ):
        if run.get(key) is not None:
            parts.append(f"{label} {run[key]:.1f}")
    rule = _rule_in_use(run)
    return " ".join(parts) + (f" rule {rule}" if rule else "")


def _rule_in_use(run: dict) -> str | None:
    """The waiting rule a run ended with: the one the tuner uses between its trials (a run that
    ends during a trial epoch would otherwise name the rule on trial), else the policy's own."""
    wait_rule = run.get("wait_rule") or {}
    return wait_rule.get("chosen") or wait_rule.get("rule")


def plot(path: Path, result: dict) -> None:
    summary = result["summary"]
    inference, mixed, flood = summary["inference"], summary["mixed"], summary["flood"]
    panels = []
    names = list(inference)
    if names:
        panels += [
            Panel(
                "(a) heterogeneous clients: aggregate throughput",
                "tokens/s",
                names,
                {"tokens/s": [inference[v]["tokens_per_s"] for v in names]},
            ),
            Panel(
                "(a) per-token latency",
                "ms",
                names,
                {
                    "mean": [inference[v]["latency_ms_mean"] for v in names],
                    "p95": [inference[v]["latency_ms_p95"] for v in names],
                },
            ),
        ]
    names = list(mixed)
    if names:
        panels += [
            Panel(
                "(b) 6 inference + 2 fine-tuning: inference p95 and fine-tuning kept, vs alone",
                "ratio",
                names,
                {
                    "inference p95 / alone": [mixed[v]["inference_p95_ratio"] for v in names],
                    "fine-tuning kept": [mixed[v]["finetune_kept"] for v in names],
                },
            ),
        ]
    names = list(flood)
    if names:
        panels += [
            Panel(
                "(c) bystander p95 under a flood / alone",
                "ratio",
                names,
                {label: [flood[v].get(f"p95_ratio_flood_{label}") for v in names] for label in ("finetune", "decode")},
            ),
        ]
    if not panels:
        return
    config = result["config"]
    plot_panels(
        path,
        f"Batching and sharing, {config['arch']} {config['preset']}, clients as {config['clients_as']}"
        f"{', executor on ' + config['executor_device'] if config.get('executor_device', 'cpu') != 'cpu' else ''}, "
        f"{config['window_s']} s windows, median of {config['repeats']}",
        panels,
        columns=2,
    )


if __name__ == "__main__":
    main()
