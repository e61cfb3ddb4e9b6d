"""The executor's math: one matrix product per batch of rows gathered from many requests.

Base layers are row-independent (a token's output depends only on that token's input), so rows
from any clients, sequences and phases can be stacked into one matrix without padding and split
back afterwards; this is what makes cross-client batching exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from symbiosis.executor.weights import LayerWeights
from symbiosis.vocabulary import Op


def apply_op(layer: LayerWeights, op: Op, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` [n, width] in the weights' dtype/device -> result [n, out_width].

    forward ``x Wᵀ + b``; backward ``g W`` (∂(xWᵀ+b)/∂x = W, so no saved input is needed);
    noise ``n Wᵀ`` without bias, so a client can subtract the noise's effect exactly.
    """
    if op is Op.FORWARD:
        if layer.bias is None:
            return rows @ layer.weight.t()
        return torch.addmm(layer.bias, rows, layer.weight.t())
    if op is Op.BACKWARD:
        return rows @ layer.weight
    if op is Op.NOISE:
        return rows @ layer.weight.t()
    raise ValueError(f"unknown op {op!r}")


def run_batch(layer: LayerWeights, op: Op, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Concatenate ``inputs`` by rows, run one product, and split the result back in order."""
    if len(inputs) == 1:
        return [apply_op(layer, op, inputs[0])]
    stacked = torch.cat(list(inputs), dim=0)
    result = apply_op(layer, op, stacked)
    return list(torch.split(result, [t.shape[0] for t in inputs], dim=0))
