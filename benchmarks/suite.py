"""The benchmark suite (issue 6): Symbiosis against what a user would run instead, side by side.

Each scenario is a module of ``benchmarks/scenarios/`` whose ``run(ctx) -> dict`` writes
``<output>/<scenario>/<scenario>.json``, ``.png`` and ``.md`` (the table); this module is the driver
(``run``, the command line, the worker entry point). Processes are real: ``symbiosis serve`` for the
executor, one child per client or baseline job (``python -m benchmarks.suite worker SPEC``, JSON
lines on stdin/stdout, see ``benchmarks/workers.py`` and ``benchmarks/scenarios/processes.py``).
Every client and baseline process runs ``--threads`` torch threads (default 1: on a shared 2-core
machine, more threads mostly wait for busy cores); the executor, the one process every client
waits on, ``--executor-threads`` (default: the usable CPUs, as ``symbiosis serve`` takes them).
Memory is the sum of the processes' RSS sampled with psutil every 0.1 s (peak of the sum), next
to each process's exact ``ru_maxrss``. Compared runs alternate their order from one size to the
next.

1. ``multi_job_finetune``: K fine-tuning jobs, Symbiosis vs one ``transformers+peft`` process per
   job: throughput, peak memory, jobs that fit a memory budget (also for a ~1B model).
2. ``executor_memory``: executor RSS as training clients are added (should stay flat).
3. ``multi_adapter_inference``: K adapters decoding at once — one split client process per adapter
   (shm) and one split client decoding all K as one mixed-adapter batch with an in-process
   executor — vs HF PEFT mixed-adapter batches and one HF PEFT process per adapter: tokens/s and
   per-token latency, with PASS/MISS against the project's targets.
4. ``split_overhead``: training and decode step per transport vs the monolithic model.
5. ``executor_efficiency``: the executor's batched products vs plain ``torch.matmul`` on the same
   shapes and a 1024² matmul ceiling.

Every ``<scenario>.json``: ``scenario, command, machine, config, results, headline, losses, wall_s``.
``results`` per scenario (keys the tests check): (1) ``runs, per_k, per_process_gib, budget,
large_model, mlora, target``; (2) ``levels, executor_rss_growth``; (3) ``runs, per_k, targets``; (4) ``train_step,
decode_step, check, dist``; (5) ``phases, matmul_ceiling_gflops``. ``headline``: sentences with
the key ratios; ``losses``: where the baseline wins. ``--quick``: ``tiny`` model, fewer and smaller
runs (about 2 minutes); full: ``base`` (~105M params), about 20 minutes on 2 cores.

Run: ``symbiosis bench [SCENARIO ...] [--quick] --output DIR`` or ``python -m benchmarks.suite``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks.options import default_cache_dir, quiet_libraries
from benchmarks.results import command_line, result_file, write_json
from benchmarks.scenarios import SCENARIOS, scenario
from benchmarks.scenarios.context import FULL, QUICK, Context, Profile
from benchmarks.scenarios.processes import WORKER_MODULE, worker_main

__all__ = ["FULL", "MODULE", "QUICK", "SCENARIOS", "Context", "Profile", "main", "run"]

MODULE = (
    WORKER_MODULE  # "benchmarks.suite": this command line, and the workers' (``main`` hands them to ``worker_main``)
)


#: Said first by a ``--quick`` run: its targets are the project's, set for the full run's sizes.
QUICK_CAVEAT = (
    f"--quick: the {QUICK.preset} model, at most {max(QUICK.finetune_ks)} jobs, short runs -- to see the suite "
    f"work. Its PASS/MISS lines apply the targets set for the full run (the {FULL.preset} model, up to "
    f"{max(FULL.finetune_ks)} jobs: `symbiosis bench` without --quick), so they judge nothing here."
)


def run(
    scenarios: Sequence[str] = SCENARIOS,
    *,
    quick: bool = False,
    output: Path = Path("bench-results"),
    cache: Path | None = None,
    threads: int = 1,
    executor_threads: int | None = None,
    budget_gib: float = 24.0,
    command: str | None = None,
    log: Callable[[str], None] = print,
    profile: Profile | None = None,
) -> dict[str, dict]:
    """Run ``scenarios`` in order; each writes ``<output>/<scenario>/<scenario>.json``, ``.png``, ``.md``.

    ``profile`` overrides the sizes (``QUICK`` with ``quick``, else ``FULL``); tests pass smaller ones.
    """
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    quiet_libraries()
    ctx = Context(
        Path(output),
        Path(cache) if cache else default_cache_dir(),
        profile or (QUICK if quick else FULL),
        quick,
        threads,
        budget_gib,
        command
        or "symbiosis bench " + " ".join([*scenarios, *(["--quick"] if quick else []), "--output", str(output)]),
        log,
        executor_threads,
    )
    ctx.cache.mkdir(parents=True, exist_ok=True)
    if quick:  # its PASS/MISS lines would otherwise read as the system's verdicts
        log(QUICK_CAVEAT)
    results = {}
    for index, name in enumerate(scenarios, 1):
        log(f"[{index}/{len(scenarios)}] {name} ...")
        started = time.perf_counter()
        result = scenario(name)(ctx)
        result["wall_s"] = time.perf_counter() - started
        write_json(result_file(ctx.output / name, name), result)
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
    parser.add_argument(
        "scenarios",
        nargs="*",
        default=list(SCENARIOS),
        help=f"Scenarios to run (default: all): {', '.join(SCENARIOS)}.",
    )
    parser.add_argument("--quick", action="store_true", help="Small model and runs (about 2 minutes in all).")
    parser.add_argument(
        "--output",
        type=Path,
        default=Path("bench-results"),
        help="Folder for <scenario>/<scenario>.json, .png (plot) and .md (table).",
    )
    parser.add_argument("--cache", type=Path, default=None, help="Where benchmark checkpoints are made once and kept.")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of every client and baseline process (default: %(default)s).",
    )
    parser.add_argument(
        "--executor-threads",
        type=int,
        default=None,
        help="torch threads of the executor process (default: the usable CPUs, as symbiosis serve takes them).",
    )
    parser.add_argument(
        "--budget-gib",
        type=float,
        default=24.0,
        help="Memory budget for the jobs-that-fit count (default: %(default)s).",
    )
    args = parser.parse_args(argv)
    run(
        args.scenarios or SCENARIOS,
        quick=args.quick,
        output=args.output,
        cache=args.cache,
        threads=args.threads,
        executor_threads=args.executor_threads,
        budget_gib=args.budget_gib,
        command=command_line(argv, MODULE),
    )


if __name__ == "__main__":
    main()
