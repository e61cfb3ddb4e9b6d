"""Benchmark plots: one PNG of bar or line panels (matplotlib, headless)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


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
        if sum(len(label) for label in panel.labels) > 60:  # side by side they would overlap
            axis.tick_params(axis="x", labelrotation=25)
            for label in axis.get_xticklabels():
                label.set_horizontalalignment("right")
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
