"""The vocabulary shared by the executor's parts: ops, latency classes, layer specs, requests.

Kept free of torch and I/O so the scheduler (pure policy) and the wire protocol can import it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Op(str, enum.Enum):
    """What the executor computes for a base layer with weight ``W`` [out, in] and bias ``b``."""

    FORWARD = "forward"  # y = x Wᵀ + b         rows of width in  -> rows of width out
    BACKWARD = "backward"  # grad_input = g W    rows of width out -> rows of width in
    NOISE = "noise"  # n Wᵀ (no bias)           rows of width in  -> rows of width out

    def input_width(self, spec: "LayerSpec") -> int:
        return spec.out_features if self is Op.BACKWARD else spec.in_features

    def output_width(self, spec: "LayerSpec") -> int:
        return spec.in_features if self is Op.BACKWARD else spec.out_features


class LatencyClass(str, enum.Enum):
    """How urgent a request is; the scheduler serves lower ``priority`` first."""

    DECODE = "decode"
    PREFILL = "prefill"
    FINETUNE = "finetune"

    @property
    def priority(self) -> int:
        return {"decode": 0, "prefill": 1, "finetune": 2}[self.value]


@dataclass(frozen=True)
class LayerSpec:
    """Shape facts about one base layer; the executor's registry maps ``layer_id`` to these."""

    layer_id: str
    in_features: int
    out_features: int
    has_bias: bool


@dataclass(frozen=True)
class PendingRequest:
    """What the scheduler needs to know about a request: no tensors, only sizes and times."""

    request_id: int
    client_id: str
    layer_id: str
    op: Op
    rows: int
    latency_class: LatencyClass
    arrival_s: float


@dataclass(frozen=True)
class RowSlice:
    """Rows ``[start, stop)`` of request ``request_id`` (a request may be served in chunks)."""

    request_id: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Batch:
    """One matrix product to run: the listed row slices, all for the same layer and op, in order."""

    layer_id: str
    op: Op
    slices: tuple[RowSlice, ...]

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.slices)
