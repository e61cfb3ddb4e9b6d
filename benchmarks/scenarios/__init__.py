"""The suite's scenarios, one module each, in the order ``symbiosis bench`` runs them.

Each module's ``run(ctx: Context) -> dict`` is one scenario (see ``benchmarks/scenarios/context.py``
for the contract); its docstring says what it compares and which ``results`` keys it writes.
"""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.scenarios import (
    executor_efficiency,
    executor_memory,
    multi_adapter_inference,
    multi_job_finetune,
    split_overhead,
)
from benchmarks.scenarios.context import Context

REGISTRY: dict[str, Callable[[Context], dict]] = {
    "multi_job_finetune": multi_job_finetune.run,
    "executor_memory": executor_memory.run,
    "multi_adapter_inference": multi_adapter_inference.run,
    "split_overhead": split_overhead.run,
    "executor_efficiency": executor_efficiency.run,
}
SCENARIOS: tuple[str, ...] = tuple(REGISTRY)


def scenario(name: str) -> Callable[[Context], dict]:
    """The scenario called ``name``; an unknown name is an error that lists the known ones."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}") from None
