"""Sibling fusion: base layers that read the same input are served by one request and one product.

q/k/v of an attention and gate/up of an MLP each read the same tensor; calling the executor once
per layer costs a round trip each. Each VirtLayer stays its own module (peft wraps it and its
adapter sees only its own layer's output), but a client model's VirtLayers share one
``SiblingFusion``, which:

1. **learns** which layers read the same input: consecutive base-layer calls on the very same
   tensor object (same ``_version``: not modified in between) whose layers form a contiguous run
   of one executor sibling block (``vocabulary.sibling_blocks``). A run seen twice becomes a
   group. Nothing is assumed from layer names: llama's ``o_proj`` shares a block with q/k/v but is
   never called on their input, so it never joins their group.
2. **serves** a group: the first member called on ``x`` asks the executor for the whole group
   (one request, one product against the block's weight; the result rows are the members'
   outputs side by side) and keeps the other members' outputs, keyed by ``x``, for their calls.
   With gradients, one autograd node covers the group, and its backward is one request too:
   ``∂L/∂x = [g_q g_k g_v] · [W_q; W_k; W_v]``.
3. **backs off**: a member called on another input than the one its outputs were computed for
   (the model stopped sharing inputs, e.g. an adapter that rescales one member's input) counts a
   miss; after ``MAX_MISSES`` the group is dissolved and its layers are called one by one again.
   An executor that refuses a group id dissolves it at once.

State is per thread (several threads may drive one client model), and a member's kept output is
released when it is consumed or the next group call replaces it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from symbiosis.errors import ShapeError, UnknownLayerError
from symbiosis.ops import latency_class_for
from symbiosis.transport.base import Transport
from symbiosis.vocabulary import LatencyClass, LayerSpec, Op, group_id, sibling_blocks

SIGHTINGS_TO_FUSE = 2  # a run of same-input calls seen this often becomes a group
MAX_MISSES = 3  # kept outputs wasted this often dissolve a group


@dataclass(eq=False)
class _Group:
    layer_id: str  # the group id the executor resolves
    members: tuple[str, ...]  # in block order: the order of the result's column blocks
    widths: tuple[int, ...]
    in_features: int
    misses: int = 0
    dissolved: bool = False


@dataclass(eq=False)
class _Kept:
    """Outputs of one group call not yet handed to their members."""

    group: _Group
    source: weakref.ref  # the input tensor they were computed from
    version: int
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)

    def matches(self, x: torch.Tensor) -> bool:
        return self.source() is x and _version(x) == self.version


def _version(x: torch.Tensor) -> int:
    try:
        return x._version
    except RuntimeError:  # an inference-mode tensor has no version counter
        return -1


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.kept: _Kept | None = None
        self.run: list[str] = []  # layers called on ``run_source`` so far, in call order
        self.run_source: weakref.ref | None = None
        self.run_version = -1
        # (source, its version, source cast): the last autocast cast, kept until the next (one
        # input's cast a thread, as ``kept`` keeps one group's outputs)
        self.cast: tuple[weakref.ref, int, torch.Tensor] | None = None


class SiblingFusion:
    """Shared by the VirtLayers of one client model; see the module docstring."""

    def __init__(self, specs: Mapping[str, LayerSpec], transport: Transport, virt_layers: Sequence[str]):
        self.transport = transport
        self._specs = dict(specs)
        served = set(virt_layers)
        self._block_of: dict[str, tuple[int, int]] = {}
        for b, block in enumerate(sibling_blocks(specs.values())):
            for i, member in enumerate(block):
                if member in served:
                    self._block_of[member] = (b, i)
        self._groups: dict[str, _Group] = {}  # member -> its group
        self._sightings: dict[tuple[str, ...], int] = {}
        self._lock = threading.Lock()  # guards learning (groups, sightings); calls are lock-free
        self._state = _ThreadState()

    def __deepcopy__(self, memo) -> SiblingFusion:
        return self  # like the transport: a copied model shares its connection and what it learned

    def cast(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``x.to(dtype)`` (autocast's cast of a base layer's input), the same tensor again for the
        same ``x``: siblings are recognized by their input's identity, and a cast for each of
        them made three inputs of one (no group ever formed under autocast)."""
        state = self._state
        if state.cast is not None:
            source, version, cast = state.cast
            if source() is x and _version(x) == version and cast.dtype == dtype:
                return cast
        cast = x.to(dtype)
        state.cast = (weakref.ref(x), _version(x), cast)
        return cast

    def groups(self) -> list[tuple[str, ...]]:
        """The groups in use (members in block order)."""
        return sorted({g.members for g in self._groups.values() if not g.dissolved})

    def forward(self, layer_id: str, x: torch.Tensor, training: bool, call_single) -> torch.Tensor:
        """Output of base layer ``layer_id`` on ``x``; ``call_single(x)`` serves it alone."""
        if layer_id not in self._block_of:
            self._end_run()
            return call_single(x)
        state = self._state
        kept = state.kept
        if kept is not None and layer_id in kept.outputs and kept.matches(x):
            output = kept.outputs.pop(layer_id)
            if not kept.outputs:
                state.kept = None
            return output
        group = self._groups.get(layer_id)
        if group is not None and not group.dissolved:
            self._discard_kept()
            try:
                outputs = self._call_group(group, x, training)
            except (UnknownLayerError, ShapeError):  # an executor that does not serve this group
                self._dissolve(group)
                return call_single(x)
            output = outputs.pop(layer_id)
            if outputs:
                state.kept = _Kept(group, weakref.ref(x), _version(x), outputs)
            return output
        self._learn(layer_id, x)
        return call_single(x)

    # ---- serving ---------------------------------------------------------------------------------

    def _call_group(self, group: _Group, x: torch.Tensor, training: bool) -> dict[str, torch.Tensor]:
        latency_class = latency_class_for(x, training)
        rows = x.reshape(-1, group.in_features)
        if torch.is_grad_enabled() and x.requires_grad:
            pieces = FusedFrozenLinearFunction.apply(rows, self.transport, group, latency_class)
        else:
            pieces = _split(self.transport.call(group.layer_id, Op.FORWARD, rows, latency_class), group.widths)
        lead = x.shape[:-1]
        return {m: p.view(*lead, w) for m, p, w in zip(group.members, pieces, group.widths)}

    def _discard_kept(self) -> None:
        kept = self._state.kept
        if kept is None:
            return
        self._state.kept = None
        kept.group.misses += 1
        if kept.group.misses >= MAX_MISSES:
            self._dissolve(kept.group)

    def _dissolve(self, group: _Group) -> None:
        with self._lock:
            group.dissolved = True
            for member in group.members:
                if self._groups.get(member) is group:
                    del self._groups[member]
                self._block_of.pop(member, None)  # never learned again: the model does not share here

    # ---- learning --------------------------------------------------------------------------------

    def _learn(self, layer_id: str, x: torch.Tensor) -> None:
        state = self._state
        source = state.run_source() if state.run_source is not None else None
        if source is x and _version(x) == state.run_version:
            state.run.append(layer_id)
            return
        self._end_run()
        state.run = [layer_id]
        state.run_source = weakref.ref(x)
        state.run_version = _version(x)

    def _end_run(self) -> None:
        state = self._state
        run, state.run, state.run_source = state.run, [], None
        if len(run) < 2:
            return
        places = [self._block_of.get(m) for m in run]
        if None in places or len({b for b, _ in places}) != 1:
            return
        ordered = sorted(zip(places, run))
        positions = [i for (_, i), _ in ordered]
        if positions != list(range(positions[0], positions[0] + len(run))):
            return  # not a contiguous run of the block: one weight view cannot serve it
        members = tuple(m for _, m in ordered)
        with self._lock:
            if any(m in self._groups for m in members):
                return
            seen = self._sightings[members] = self._sightings.get(members, 0) + 1
            if seen < SIGHTINGS_TO_FUSE:
                return
            widths = tuple(self._specs[m].out_features for m in members)
            group = _Group(group_id(members), members, widths, self._specs[members[0]].in_features)
            for member in members:
                self._groups[member] = group


def _split(result: torch.Tensor, widths: Sequence[int]) -> list[torch.Tensor]:
    """The members' column blocks as tensors of their own (contiguous, not views: models reshape
    them freely and peft adds to them in place; the copy is one pass over the output)."""
    return [piece.clone(memory_format=torch.contiguous_format) for piece in torch.split(result, list(widths), dim=1)]


class FusedFrozenLinearFunction(torch.autograd.Function):
    """Forward of a sibling group (one request) with one backward request for all its members."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, transport: Transport, group: _Group, latency_class: LatencyClass):
        ctx.transport, ctx.group, ctx.latency_class = transport, group, latency_class
        result = transport.call(group.layer_id, Op.FORWARD, rows, latency_class)
        return tuple(_split(result, group.widths))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        grad_rows = torch.cat([g.reshape(-1, w) for g, w in zip(grads, ctx.group.widths)], dim=1)
        return ctx.transport.call(ctx.group.layer_id, Op.BACKWARD, grad_rows, ctx.latency_class), None, None, None
