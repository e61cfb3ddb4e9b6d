"""The autograd Function that makes a frozen linear layer remote and lockstep-free.

forward:  ``y = x Wᵀ + b``   — one executor call (op FORWARD).
backward: ``∂L/∂x = ∂L/∂y · W`` — one executor call (op BACKWARD), made only when ``x`` needs a
          gradient.

Nothing is saved for backward, on either side. ``W`` is frozen, so there is no ``∂L/∂W`` to
compute (which would need ``x``); and ``∂y/∂x = W`` does not depend on ``x`` or ``y``, so the
gradient needs only ``grad_output`` and the weight the executor already holds. Saving nothing is
what frees the executor from lockstep (paper §3.6): a fine-tuning request's backward can be
batched with whatever else is pending, not with the requests it was batched with in forward.
"""

from __future__ import annotations

from typing import Protocol

import torch

from symbiosis.vocabulary import LatencyClass, Op


class LayerLink(Protocol):
    """How a VirtLayer reaches its base layer (``client.virt.ExecutorLink`` implements it)."""

    layer_id: str
    in_features: int
    out_features: int

    def call(self, op: Op, rows: torch.Tensor, latency_class: LatencyClass) -> torch.Tensor: ...


def latency_class_for(x: torch.Tensor, training: bool) -> LatencyClass:
    """Fine-tuning when a gradient will flow, decode for one token per sequence, else prefill."""
    if training and torch.is_grad_enabled():
        return LatencyClass.FINETUNE
    tokens_per_sequence = x.shape[-2] if x.dim() >= 3 else 1
    return LatencyClass.DECODE if tokens_per_sequence == 1 else LatencyClass.PREFILL


class FrozenLinearFunction(torch.autograd.Function):
    """Works on 2-D rows ``[n, features]``; reshaping happens outside, so outputs are not views
    (autograd forbids in-place ops on views created inside a custom Function, and peft adds
    adapter outputs in place)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, link: LayerLink, latency_class: LatencyClass) -> torch.Tensor:
        ctx.link = link
        ctx.latency_class = latency_class
        return link.call(Op.FORWARD, rows, latency_class)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None, None
        return ctx.link.call(Op.BACKWARD, grad_output.contiguous(), ctx.latency_class), None, None


def frozen_linear(x: torch.Tensor, link: LayerLink, training: bool) -> torch.Tensor:
    """Apply the remote base layer to ``x`` [..., in_features]."""
    latency_class = latency_class_for(x, training)
    rows = x.reshape(-1, link.in_features)
    if torch.is_grad_enabled() and x.requires_grad:
        out = FrozenLinearFunction.apply(rows, link, latency_class)
    else:  # no gradient can flow to x: skip the autograd node and its per-call overhead
        out = link.call(Op.FORWARD, rows, latency_class)
    return out.view(*x.shape[:-1], link.out_features)
