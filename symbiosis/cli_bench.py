"""``symbiosis bench``: run the benchmark suite (``benchmarks/suite.py``) from the command line.

The suite lives in the repository's ``benchmarks/`` folder, next to this package, not inside it:
it is a development tool that needs a checkout. This verb finds it there.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from symbiosis.errors import ConfigurationError, MissingFileError

SCENARIOS = (
    "multi_job_finetune",
    "executor_memory",
    "multi_adapter_inference",
    "split_overhead",
    "executor_efficiency",
)

#: ``symbiosis bench --help`` (typer keeps a docstring's line breaks, so the text lives here).
BENCH_HELP = (
    "Benchmark Symbiosis against HF PEFT baselines: multi-job fine-tuning, executor memory, multi-adapter "
    "inference, split overhead per transport, executor GEMM efficiency.\n\n"
    "Full runs use the base preset (~105M params; about 20 minutes on 2 cores) plus a ~1B model where memory is "
    "measured. Render the README section afterwards with: python -m benchmarks.report --results DIR"
)


def _import_suite():
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "benchmarks" / "suite.py").is_file() and str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    try:
        from benchmarks import suite
    except ModuleNotFoundError as exc:
        raise MissingFileError(
            f"the benchmark suite needs a source checkout with benchmarks/suite.py next to symbiosis/ ({exc})"
        ) from None
    return suite


def bench(
    scenarios: Annotated[
        list[str] | None,
        typer.Argument(help=f"Scenarios to run, in order (default: all): {', '.join(SCENARIOS)}.", show_default=False),
    ] = None,
    quick: Annotated[
        bool,
        typer.Option(
            help=(
                "Small model (tiny preset) and short runs: about 2 minutes for everything. Numbers are for smoke tests."
            )
        ),
    ] = False,
    output: Annotated[
        Path, typer.Option(help="Folder for <scenario>/<scenario>.json, .png and .md (created if missing).")
    ] = Path("bench-results"),
    cache: Annotated[
        Path | None,
        typer.Option(
            help=(
                "Folder where the random-weight benchmark checkpoints are made once and kept (default: "
                "$SYMBIOSIS_BENCH_CACHE or ~/.cache/symbiosis/bench)."
            )
        ),
    ] = None,
    threads: Annotated[int, typer.Option(help="torch threads of every client and baseline process.")] = 1,
    executor_threads: Annotated[
        int | None,
        typer.Option(
            min=1,
            help=(
                "torch threads of the executor process (default: the usable CPUs, as `symbiosis serve` takes them: "
                "it is the one process every client waits on)."
            ),
        ),
    ] = None,
    budget_gib: Annotated[
        float, typer.Option(help="Memory budget (GiB) for counting how many fine-tuning jobs fit.")
    ] = 24.0,
) -> None:
    """Run the benchmark scenarios (``--help`` shows ``BENCH_HELP``)."""
    names = list(scenarios or SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ConfigurationError(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    suite = _import_suite()
    command = "symbiosis bench " + " ".join(
        [*(scenarios or []), *(["--quick"] if quick else []), "--output", str(output)]
    )
    suite.run(
        names,
        quick=quick,
        output=output,
        cache=cache,
        threads=threads,
        executor_threads=executor_threads,
        budget_gib=budget_gib,
        command=command,
        log=lambda line: typer.echo(line),
    )
    typer.echo(f"results in {output}")


def register(app: typer.Typer) -> None:
    app.command("bench", help=BENCH_HELP)(bench)
