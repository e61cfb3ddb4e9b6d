"""Timing what benchmarks compare: interleaved samples, medians and percentiles, ratios, the matmul ceiling.

Things that are compared are measured in the same process, interleaved round by round
(``time_interleaved`` rotates the order every round), after a warm-up, and reported as medians with
p95 next to them. The machines these run on are shared and noisy; a median of interleaved samples
survives that, a mean of back-to-back blocks does not. Every result names its baseline and carries
the ratio to it, plus a hardware ceiling (``matmul_ceiling_gflops``: plain ``torch.matmul`` on a
square product) where FLOPs matter.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch


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


def finite(values: Iterable[float | None]) -> list[float]:
    """``values`` without the missing (None) and the undefined (NaN) ones."""
    return [v for v in values if v is not None and not math.isnan(v)]


def median_or_nan(values: Sequence[float]) -> float:
    present = finite(values)
    return statistics.median(present) if present else math.nan


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator and not math.isnan(denominator) else math.nan


def time_interleaved(
    candidates: Mapping[str, Callable[[], Any]], *, warmup: int, repeats: int
) -> dict[str, list[float]]:
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
