"""The vocabulary every side shares: ops, latency classes and layer specs.

Clients (VirtLayers, transports), the wire protocol and the executor all speak it, so it lives
outside ``executor/`` and is free of torch and I/O. The scheduler's own types (pending requests,
row slices, batches) stay in ``executor/requests.py``.
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
