"""What every benchmark script shares: arguments, checkpoints, timing, machine facts, JSON and plots.

Conventions (STYLE habit 9), so that two numbers in one result file can be compared:

* Things that are compared are measured in the same process, interleaved round by round
  (``time_interleaved`` rotates the order every round), after a warm-up, and reported as medians
  with p95 next to them. The machines these run on are shared and noisy; a median of interleaved
  samples survives that, a mean of back-to-back blocks does not.
* Every result names its baseline and carries the ratio to it, plus a hardware ceiling
  (``matmul_ceiling_gflops``: plain ``torch.matmul`` on a square product) where FLOPs matter.
* ``--quick`` means: the ``tiny`` preset and few iterations, so the script finishes in seconds; it
  exists for smoke tests (``tests/test_benchmarks_quick.py``), its numbers mean little.
* Checkpoints are random-weight ``symbiosis.modelzoo`` models, made once and cached under
  ``--cache`` (default ``$SYMBIOSIS_BENCH_CACHE`` or ``~/.cache/symbiosis/bench``); ``--model DIR``
  uses an existing checkpoint folder instead.
* A result is one JSON file (``<benchmark>.json``) plus one PNG (``<benchmark>.png``) in
  ``--output``; the JSON records the command line, the machine and the wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DEFAULT_PRESET = "small"
QUICK_PRESET = "tiny"


# ---- arguments -----------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    env = os.environ.get("SYMBIOSIS_BENCH_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "symbiosis" / "bench"


def add_common_arguments(parser: argparse.ArgumentParser, *, default_repeats: int, quick_repeats: int) -> None:
    """The flags every benchmark takes (``--quick --output --cache --preset --repeats --model --threads``)."""
    parser.add_argument("--quick", action="store_true", help=f"Smoke-test mode: the {QUICK_PRESET!r} preset and few iterations.")
    parser.add_argument("--output", type=Path, default=Path("bench-results"), help="Folder for the JSON result and PNG plot.")
    parser.add_argument(
        "--cache", type=Path, default=None, help="Folder where benchmark checkpoints are made once and kept (default: $SYMBIOSIS_BENCH_CACHE or ~/.cache/symbiosis/bench)."
    )
    parser.add_argument(
        "--preset", choices=("tiny", "small", "base"), default=None, help=f"Model size (default {DEFAULT_PRESET!r}, or {QUICK_PRESET!r} with --quick)."
    )
    parser.add_argument("--arch", default="llama", help="Architecture of the random-weight checkpoint (default: %(default)s).")
    parser.add_argument(
        "--repeats", type=int, default=None, help=f"Measured repetitions, medians taken over them (default {default_repeats}, {quick_repeats} with --quick)."
    )
    parser.add_argument("--model", type=Path, default=None, help="Use this existing checkpoint folder instead of making one.")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N) before measuring (default: torch's choice).")
    parser.set_defaults(_default_repeats=default_repeats, _quick_repeats=quick_repeats)


def resolve_common(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on ``--quick`` and apply ``--threads``."""
    if args.preset is None:
        args.preset = QUICK_PRESET if args.quick else DEFAULT_PRESET
    if args.repeats is None:
        args.repeats = args._quick_repeats if args.quick else args._default_repeats
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    if args.cache is None:
        args.cache = default_cache_dir()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    quiet_libraries()
    return args


def checkpoint_path(args: argparse.Namespace, seed: int = 0) -> Path:
    """``--model`` if given, else a cached random-weight checkpoint of ``--arch``/``--preset``."""
    if args.model is not None:
        return Path(args.model)
    from symbiosis.modelzoo import make_model

    return make_model(args.arch, args.preset, Path(args.cache) / f"{args.arch}-{args.preset}-seed{seed}", seed=seed)


# ---- timing --------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(samples_s: Sequence[float]) -> dict[str, float]:
    """Median, p95, mean and min of time samples, in milliseconds, and their count."""
    if not samples_s:
        return {"median_ms": math.nan, "p95_ms": math.nan, "mean_ms": math.nan, "min_ms": math.nan, "n": 0}
    return {
        "median_ms": 1e3 * statistics.median(samples_s),
        "p95_ms": 1e3 * percentile(samples_s, 95),
        "mean_ms": 1e3 * statistics.fmean(samples_s),
        "min_ms": 1e3 * min(samples_s),
        "n": len(samples_s),
    }


def median_or_nan(values: Sequence[float]) -> float:
    finite = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator and not math.isnan(denominator) else math.nan


def time_interleaved(candidates: Mapping[str, Callable[[], Any]], *, warmup: int, repeats: int) -> dict[str, list[float]]:
    """Time each candidate ``repeats`` times, one sample of each per round, in rotating order.

    Every candidate first runs ``warmup`` untimed calls. Interleaving puts the candidates under the
    same background load (other processes, thermal state), so their ratio is meaningful even when
    the absolute times drift.
    """
    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            candidates[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            candidates[name]()
            samples[name].append(time.perf_counter() - start)
    return samples


def square_matmul(size: int = 1024, dtype: torch.dtype = torch.float32) -> tuple[Callable[[], Any], float]:
    """A plain ``torch.matmul`` of two ``size``² matrices and its GFLOP: the hardware-ceiling probe.

    Time it among the candidates (``time_interleaved``) so the ceiling is measured under the same
    background load as the numbers it is compared with.
    """
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    return (lambda: torch.matmul(a, b)), 2.0 * size**3 / 1e9


def matmul_ceiling_gflops(size: int = 1024, repeats: int = 10, dtype: torch.dtype = torch.float32) -> float:
    """Hardware ceiling on its own: GFLOP/s of the best of ``repeats`` square matmuls."""
    probe, gflop = square_matmul(size, dtype)
    samples = time_interleaved({"matmul": probe}, warmup=1, repeats=repeats)["matmul"]
    return gflop / min(samples)


# ---- machine facts and results -------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: CPU count and affinity, torch threads, library versions, load."""
    import peft
    import transformers

    try:
        usable_cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable_cpus = os.cpu_count()
    try:
        load_average = list(os.getloadavg())
    except OSError:
        load_average = None
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus,
        "load_average_1_5_15min": load_average,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda_available": torch.cuda.is_available(),
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }


def _jsonable(value: Any) -> Any:
    """NaN/inf become null (strict JSON); tuples become lists; paths and dtypes become strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (Path, torch.dtype, torch.device)):
        return str(value)
    return value


def write_json(path: Path, result: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(result), indent=2, allow_nan=False) + "\n")
    return path


def command_line(argv: Sequence[str] | None, module: str) -> str:
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python", "-m", module, *args])


# ---- plots ---------------------------------------------------------------------------------------


@dataclass
class Panel:
    """One subplot: grouped bars (``kind="bar"``) or lines (``kind="line"``) over ``labels``.

    ``series`` maps a legend name to one value per label (None/NaN draws nothing).
    """

    title: str
    ylabel: str
    labels: list[str]
    series: dict[str, list[float | None]] = field(default_factory=dict)
    kind: str = "bar"
    log_y: bool = False


def _short_number(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def plot_panels(path: Path, title: str, panels: Sequence[Panel], *, columns: int = 2) -> Path:
    """Write a PNG with one subplot per panel (matplotlib, headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 3.8 * rows), squeeze=False)
    for axis, panel in zip(axes.flat, panels):
        positions = list(range(len(panel.labels)))
        names = list(panel.series)
        if panel.kind == "bar":
            width = 0.8 / max(1, len(names))
            for index, name in enumerate(names):
                values = [math.nan if v is None else v for v in panel.series[name]]
                offsets = [p + (index - (len(names) - 1) / 2) * width for p in positions]
                bars = axis.bar(offsets, values, width=width, label=name)
                axis.bar_label(bars, fmt=_short_number, fontsize=7)
        elif panel.kind == "line":
            for name in names:
                values = [math.nan if v is None else v for v in panel.series[name]]
                axis.plot(positions, values, marker="o", label=name)
        else:
            raise ValueError(f"unknown panel kind {panel.kind!r}; use 'bar' or 'line'")
        axis.set_xticks(positions, panel.labels, fontsize=8)
        axis.set_title(panel.title, fontsize=10)
        axis.set_ylabel(panel.ylabel)
        if panel.log_y:
            axis.set_yscale("log")
        if len(names) > 1:
            axis.legend(fontsize=8)
        axis.grid(axis="y", alpha=0.3)
    for axis in list(axes.flat)[len(panels) :]:
        axis.set_visible(False)
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def quiet_libraries() -> None:
    """No progress bars or deprecation chatter from transformers/peft in benchmark output."""
    import warnings

    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)


def print_summary(summary: Mapping[str, Any]) -> None:
    print(json.dumps(_jsonable(summary), indent=2, allow_nan=False), flush=True)
