"""The vocabulary every side shares: ops, latency classes and layer specs.

Clients (VirtLayers, transports), the wire protocol and the executor all speak it, so it lives
outside ``executor/`` and is free of torch and I/O. The scheduler's own types (pending requests,
row slices, batches) stay in ``executor/requests.py``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


class Op(enum.StrEnum):
    """What the executor computes for a base layer with weight ``W`` [out, in] and bias ``b``."""

    FORWARD = "forward"  # y = x Wᵀ + b         rows of width in  -> rows of width out
    BACKWARD = "backward"  # grad_input = g W    rows of width out -> rows of width in
    NOISE = "noise"  # n Wᵀ (no bias)           rows of width in  -> rows of width out

    def input_width(self, spec: LayerSpec) -> int:
        return spec.out_features if self is Op.BACKWARD else spec.in_features

    def output_width(self, spec: LayerSpec) -> int:
        return spec.in_features if self is Op.BACKWARD else spec.out_features


class LatencyClass(enum.StrEnum):
    """How urgent a request is; the scheduler serves lower ``priority`` first."""

    DECODE = "decode"
    PREFILL = "prefill"
    FINETUNE = "finetune"

    @property
    def priority(self) -> int:
        return _PRIORITY[self]  # a StrEnum hashes and compares as its value


_PRIORITY = {"decode": 0, "prefill": 1, "finetune": 2}  # (once, not a new dict per ask: a hot path)


#: Wire value -> enum, for hot paths: a dict lookup is ~20x cheaper than ``Op(value)``.
OPS_BY_VALUE: dict[str, Op] = {op.value: op for op in Op}
LATENCY_CLASSES_BY_VALUE: dict[str, LatencyClass] = {c.value: c for c in LatencyClass}


@dataclass(frozen=True)
class LayerSpec:
    """Shape facts about one base layer; the executor's registry maps ``layer_id`` to these."""

    layer_id: str
    in_features: int
    out_features: int
    has_bias: bool


# ---- sibling groups -----------------------------------------------------------------------------
# Base layers that read the same input (q/k/v, gate/up) can be served by one request and one
# product. The executor stores each *block* of candidate siblings as one weight matrix (members'
# weights are row slices of it, so nothing is duplicated); a client that sees members called on
# the same input asks for a contiguous run of a block under a *group id*: the member ids, in block
# order, joined by GROUP_SEPARATOR. The result rows are the members' outputs side by side.

GROUP_SEPARATOR = "+"


def sibling_blocks(specs: Iterable[LayerSpec]) -> list[tuple[str, ...]]:
    """Blocks of candidate siblings, in the order ``specs`` lists them (the model's module order).

    Candidates are layers of the same parent module with the same input width and bias presence;
    whether they really read the same input is learned by each client at run time (llama's
    ``o_proj`` is a candidate next to q/k/v but never called on their input, so no client asks
    for it with them). Not the members of a module list (a name ending in a number): an MoE's
    experts (``experts.gate_up_proj.3``) each read tokens of their own, and a block of E of them
    would cost what blocks cost -- every contiguous run timed at warm-up, the whole block gathered
    or placed at once by a sharded executor -- for nothing. Both sides compute this from the same
    ordered specs."""
    blocks: dict[tuple[str, int, bool], list[str]] = {}
    for spec in specs:
        if module_list_of(spec.layer_id) is not None:
            continue
        parent = spec.layer_id.rpartition(".")[0]
        blocks.setdefault((parent, spec.in_features, spec.has_bias), []).append(spec.layer_id)
    return [tuple(members) for members in blocks.values() if len(members) > 1]


def module_list_of(layer_id: str) -> str | None:
    """The module list a layer is a member of (its name ends in a number: an MoE's experts,
    ``experts.gate_up_proj.3`` -> ``experts.gate_up_proj``), else None. Such members are in no
    sibling block, and count under the list's name in metrics."""
    head, _, last = layer_id.rpartition(".")
    return head if head and last.isdigit() else None


def module_lists(specs: Iterable[LayerSpec]) -> dict[str, tuple[LayerSpec, ...]]:
    """The module lists of base layers (an MoE's experts: ``experts.gate_up_proj`` -> the specs of
    ``experts.gate_up_proj.0`` ... ``.E-1``, in index order) whose members are numbered from 0
    without a gap and have one shape: those a request with ``expert_rows`` may name (one request
    for the rows of several members, each multiplied by its own; ``protocol.Request``)."""
    members: dict[str, dict[int, LayerSpec]] = {}
    for spec in specs:
        name = module_list_of(spec.layer_id)
        if name is not None:
            members.setdefault(name, {})[int(spec.layer_id.rpartition(".")[2])] = spec
    lists = {}
    for name, by_index in members.items():
        ordered = tuple(by_index[i] for i in range(len(by_index)) if i in by_index)
        if len(ordered) == len(by_index) and len({(m.in_features, m.out_features, m.has_bias) for m in ordered}) == 1:
            lists[name] = ordered
    return lists


def expert_parts(expert_rows: Iterable[int]) -> list[tuple[int, int, int]]:
    """``(expert, first row, end row)`` of each expert with rows in an ``expert_rows`` request's
    rows (each expert's after the one before's), in row order: how both sides split them."""
    parts, start = [], 0
    for expert, count in enumerate(expert_rows):
        if count:
            parts.append((expert, start, start + count))
            start += count
    return parts


def module_list_spec(name: str, specs: Mapping[str, LayerSpec]) -> LayerSpec | None:
    """The spec of module list ``name`` (its members' widths) if ``specs`` has its first member,
    else None. What a client sizes an ``expert_rows`` request's rows and result by; the executor
    checks the whole list (``module_lists``)."""
    first = specs.get(f"{name}.0")
    if first is None:
        return None
    return LayerSpec(name, first.in_features, first.out_features, first.has_bias)


def group_id(members: Iterable[str]) -> str:
    return GROUP_SEPARATOR.join(members)


def group_members(layer_id: str) -> list[str]:
    return layer_id.split(GROUP_SEPARATOR)


def spec_of(layer_id: str, specs: Mapping[str, LayerSpec]) -> LayerSpec | None:
    """The spec of a layer, of a sibling group id (its members' outputs side by side) or of a
    module list's name (``module_list_spec``), from the executor's layer list; None if unknown.
    The executor has the last word on which groups it serves (contiguous runs of one block);
    clients use this to size payloads and results."""
    spec = specs.get(layer_id)
    if spec is not None:
        return spec
    if GROUP_SEPARATOR not in layer_id:
        return module_list_spec(layer_id, specs)
    members = [specs.get(member) for member in group_members(layer_id)]
    if any(m is None for m in members) or len({(m.in_features, m.has_bias) for m in members}) != 1:
        return None
    head = members[0]
    return LayerSpec(layer_id, head.in_features, sum(m.out_features for m in members), head.has_bias)
