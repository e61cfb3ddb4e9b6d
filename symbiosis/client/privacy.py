"""Activation noise (paper §3.8): the executor serves forward on ``x + n``, never on ``x``.

For a base layer ``y = x Wᵀ + b`` the product is linear in ``x``, so a client can send a noisy row
and remove the noise afterwards without changing the result::

    y = ((x + n) Wᵀ + b) − n Wᵀ        # exact up to float rounding

``n Wᵀ`` (the *noise effect*) comes from the executor too, through ``Op.NOISE`` (``n Wᵀ`` without
bias). Asking for it on every call would send ``n`` right next to ``x + n``; instead, as the paper
proposes, each layer keeps a small pool of noise vectors whose effects are fetched once, and every
row picks one of them at random. The pool can be regenerated every ``refresh_every`` forward calls.

How the noise is scaled. Pool vectors ``u_k`` are Gaussian, normalised to unit RMS. A row ``x`` is
sent as ``x + c·u_k`` with ``k`` uniform in the pool, ``c = ±scale·rms(x)`` (random sign), and
``rms(x) = sqrt(mean(x²))`` of that row (1 for an all-zero row). So the noise has ``scale`` times
the row's own RMS whatever the layer's activation scale (embeddings, attention outputs and MLP
intermediates differ by orders of magnitude), and the effect to subtract is ``c·(u_k Wᵀ)``: one
scalar times a cached pool effect, so no per-row request is needed.

What is protected and what is not:

- Forward requests (``Op.FORWARD``) carry ``x + c·u_k``, never ``x``.
- Backward requests (``Op.BACKWARD``) carry ``∂L/∂y`` in clear, as without noise: ``W`` is frozen,
  so backward never needs ``x``, but gradients are data-dependent and not hidden.
- Noise requests (``Op.NOISE``) carry the pool vectors ``u_k`` themselves; an executor that keeps
  them knows the pool. It cannot tell which ``k``, sign or scale a row used, but it can project
  ``x + c·u_k`` onto the complement of the pool's span, which is ``x`` itself there: with
  ``pool_size`` much smaller than ``in_features`` this hides only the ``pool_size``-dimensional
  part of ``x`` along the pool. The mechanism is the paper's obfuscation against an observer of
  the forward traffic, not a cryptographic or differential-privacy guarantee against an executor
  that records everything. The row norm is also visible (``‖x + n‖ ≈ ‖x‖·sqrt(1 + scale²)``).
- Larger ``scale`` costs precision: the executor computes on ``x + n`` in the client's dtype, so
  rounding error grows with ``‖n‖``. In float32 ``scale`` ≤ ~10 keeps results within 1e-4; in
  bfloat16/float16 the lost bits of ``x`` are visible already at ``scale`` = 1.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass
from typing import Self

import torch
from torch import nn

from symbiosis.client.experts import expert_layers
from symbiosis.client.virt import VirtConv1D, VirtLinear
from symbiosis.errors import ConfigurationError
from symbiosis.ops import LayerLink
from symbiosis.vocabulary import LatencyClass, Op

__all__ = ["NoiseConfig", "NoisyLink", "PrivacyHandle", "enable_activation_noise"]


@dataclass(frozen=True)
class NoiseConfig:
    """How each layer's noise is drawn (validated at construction)."""

    scale: float = 1.0
    """Noise RMS as a multiple of each row's own RMS."""
    pool_size: int = 4
    """Noise vectors per layer; their effects are fetched once per pool (one NOISE request)."""
    refresh_every: int | None = None
    """Regenerate a layer's pool every this many forward calls of that layer; None: never."""
    seed: int | None = None
    """Seed for reproducible noise (tests); None draws one from the OS (``secrets``)."""

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ConfigurationError(f"scale must be > 0, got {self.scale}")
        if self.pool_size < 1:
            raise ConfigurationError(f"pool_size must be >= 1, got {self.pool_size}")
        if self.refresh_every is not None and self.refresh_every < 1:
            raise ConfigurationError(f"refresh_every must be None or >= 1, got {self.refresh_every}")


class NoisyLink:
    """A ``LayerLink`` that adds noise to forward rows and removes its effect from the result.

    Wraps the link a VirtLayer had (``inner``); backward and noise requests pass through
    unchanged. Thread-safe: the pool and the generator are guarded by a lock, the forward request
    itself runs outside it.
    """

    def __init__(self, inner: LayerLink, config: NoiseConfig, seed: int):
        self.inner = inner
        self.layer_id = inner.layer_id
        self.in_features = inner.in_features
        self.out_features = inner.out_features
        self.config = config
        self.noise_requests = 0  # Op.NOISE requests this link sent (one per pool)
        self._generator = torch.Generator().manual_seed(seed)
        self._lock = threading.Lock()
        self._pool: torch.Tensor | None = None  # [pool_size, in_features], unit RMS rows
        self._pool_effect: torch.Tensor | None = None  # [pool_size, out_features] = pool Wᵀ
        self._forward_calls = 0  # forward calls served by the current pool

    def call(self, op: Op, rows: torch.Tensor, latency_class: LatencyClass) -> torch.Tensor:
        if op is not Op.FORWARD or rows.shape[0] == 0:
            return self.inner.call(op, rows, latency_class)
        pool, pool_effect, index, sign = self._draw(rows, latency_class)
        row_rms = rows.detach().float().pow(2).mean(dim=1).sqrt()
        row_rms = torch.where(row_rms > 0, row_rms, torch.ones_like(row_rms))  # an all-zero row is noised too
        coefficient = (sign * self.config.scale * row_rms).to(rows.dtype).unsqueeze(1)
        noisy_rows = rows + coefficient * pool[index]
        out = self.inner.call(Op.FORWARD, noisy_rows, latency_class)
        out -= coefficient * pool_effect[index]
        return out

    def _draw(self, rows: torch.Tensor, latency_class: LatencyClass):
        """The pool to use for this call (made or refreshed if due) and each row's pick and sign."""
        with self._lock:
            refresh_every = self.config.refresh_every
            stale = (
                self._pool is None
                or self._pool.device != rows.device
                or self._pool.dtype != rows.dtype
                or (refresh_every is not None and self._forward_calls >= refresh_every)
            )
            if stale:
                self._refresh(rows.device, rows.dtype, latency_class)
            self._forward_calls += 1
            n = rows.shape[0]
            index = torch.randint(self.config.pool_size, (n,), generator=self._generator)
            sign = torch.randint(2, (n,), generator=self._generator, dtype=torch.float32) * 2 - 1
            return self._pool, self._pool_effect, index.to(rows.device), sign.to(rows.device)

    def _refresh(self, device: torch.device, dtype: torch.dtype, latency_class: LatencyClass) -> None:
        pool = torch.randn(self.config.pool_size, self.in_features, generator=self._generator)
        pool /= pool.pow(2).mean(dim=1, keepdim=True).sqrt()
        pool = pool.to(device=device, dtype=dtype)
        self._pool_effect = self.inner.call(Op.NOISE, pool, latency_class)
        self._pool = pool
        self._forward_calls = 0
        self.noise_requests += 1

    def __deepcopy__(self, memo) -> NoisyLink:
        return self  # like ExecutorLink: a copied model shares the connection and its noise pool


class PrivacyHandle:
    """The noisy links ``enable_activation_noise`` installed; ``disable()`` puts the old ones back."""

    def __init__(self, installed: list[tuple[nn.Module, LayerLink, NoisyLink]], config: NoiseConfig):
        self._installed = installed
        self.config = config
        self.active = True

    @property
    def layers(self) -> int:
        return len(self._installed)

    @property
    def noise_requests(self) -> int:
        """Op.NOISE requests sent so far, over all layers (≤ layers × pools per layer)."""
        return sum(noisy.noise_requests for _, _, noisy in self._installed)

    def disable(self) -> None:
        """Restore plain forward requests on every layer (idempotent). Graphs built while noise
        was on still run their backward through the noisy links, which pass backward through."""
        if not self.active:
            return
        for layer, original, noisy in self._installed:
            if layer.link is noisy:
                layer.link = original
        self.active = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.disable()


def enable_activation_noise(
    model: nn.Module,
    *,
    scale: float = 1.0,
    pool_size: int = 4,
    refresh_every: int | None = None,
    seed: int | None = None,
) -> PrivacyHandle:
    """Send every VirtLayer's forward rows to the executor as ``x + n`` instead of ``x``.

    ``model``: a split model from ``load_client_model``, or a peft model wrapping one. Outputs,
    losses and gradients are unchanged up to float rounding (see the module docstring for the
    scaling of ``n`` and for what stays visible to the executor). Each layer sends one ``Op.NOISE``
    request of ``pool_size`` rows per pool: once, or every ``refresh_every`` forward calls of that
    layer. Layers kept in the client (``client_layers``) are not VirtLayers and are untouched.
    Returns a handle whose ``disable()`` (or ``with`` exit) restores plain behaviour.
    """
    config = NoiseConfig(scale=scale, pool_size=pool_size, refresh_every=refresh_every, seed=seed)
    layers = [m for m in model.modules() if isinstance(m, (VirtLinear, VirtConv1D))] + list(expert_layers(model))
    if not layers:
        raise ConfigurationError(
            f"{type(model).__name__} has no VirtLayers: activation noise applies to a split model "
            "(symbiosis.load_client_model, optionally wrapped by peft)"
        )
    already = [layer.layer_id for layer in layers if isinstance(layer.link, NoisyLink)]
    if already:
        raise ConfigurationError(f"activation noise is already enabled on {already[:3]}; disable() the first handle")
    # Per-layer seeds from one generator: reproducible with ``seed``, unpredictable without it.
    seeds = torch.Generator().manual_seed(seed if seed is not None else secrets.randbits(63))
    installed = []
    for layer in layers:
        layer_seed = int(torch.randint(2**62, (1,), generator=seeds))
        noisy = NoisyLink(layer.link, config, layer_seed)
        installed.append((layer, layer.link, noisy))
        layer.link = noisy
    return PrivacyHandle(installed, config)
