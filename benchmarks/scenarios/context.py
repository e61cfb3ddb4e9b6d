"""What every suite scenario is handed and how it hands its results back.

A scenario is ``run(ctx: Context) -> dict``: it reads its sizes from ``ctx.profile`` (``QUICK``
or ``FULL``; tests pass smaller ones), makes its checkpoint with ``ctx.checkpoint()``, and ends
with ``finish(...)``, which writes ``<output>/<scenario>/<scenario>.png`` (plot) and ``.md``
(table) and returns the result dict (``scenario, command, machine, config, results, headline,
losses``); the driver (``benchmarks/suite.py``) adds ``wall_s`` and writes ``<scenario>.json``
(the layout of every result: ``benchmarks/results.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.plots import plot_panels
from benchmarks.results import machine_info, result_file, usable_cpus


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
    # The split systems ``split_overhead`` times (None: all of them). Each remote one costs a client
    # process and an executor process; the suite's own smoke test times fewer, since
    # ``benchmarks/split_overhead.py``'s smoke covers every transport.
    split_systems: tuple[str, ...] | None = None


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
    # torch threads of a scenario's executor process: a shared server gets the host's cores, as
    # ``symbiosis serve`` takes them by default (None: that default, ``usable_cpus()``).
    executor_threads: int | None = None

    @property
    def executor_thread_count(self) -> int:
        return self.executor_threads or usable_cpus()

    def checkpoint(self, preset: str | None = None) -> Path:
        from symbiosis.modelzoo import make_model

        preset = preset or self.profile.preset
        return make_model("llama", preset, self.cache / f"llama-{preset}-seed0", seed=0)


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


def finish(
    ctx: Context,
    name: str,
    results: dict,
    headline: list[str],
    losses: list[str],
    table: str,
    panels: list,
    title: str,
    config: dict,
) -> dict:
    folder = ctx.output / name
    result = {
        "scenario": name,
        "command": ctx.command,
        "machine": machine_info(),
        "config": {
            "profile": asdict(ctx.profile),
            "quick": ctx.quick,
            "threads_per_process": ctx.threads,
            "executor_threads": ctx.executor_thread_count,
            **config,
        },
        "results": results,
        "headline": headline,
        "losses": losses,
    }
    plot_panels(result_file(folder, name, ".png"), title, panels, columns=min(2, len(panels)))
    result_file(folder, name, ".md").write_text(f"### {name}\n\n{table}\n")
    return result
