"""Where the base layers of a sharded executor live: pure bookkeeping, no torch, no I/O.

The unit of placement is what the single executor stores as one matrix (``executor/weights.py``):
a *sibling block* (q/k/v/o of one attention, gate/up of one MLP) or a lone layer. A sibling
group id (a contiguous run of a block, ``vocabulary.group_id``) is therefore always served from
one unit, under either strategy.

Two strategies (``STRATEGIES``):

- ``"layers"``: each rank owns whole units, cut into contiguous runs of the model's layer order
  balanced by bytes (``place_units``); requests travel to the owner, weights never move.
- ``"fsdp"``: every unit is split by rows across all ranks the way FSDP2's ``fully_shard`` splits a
  parameter (``Shard(0)``: ``ceil(rows / N)`` rows per rank, the last ranks padded or empty,
  ``row_range``); a rank gathers a unit's shards to run a batch and drops them after.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from symbiosis.vocabulary import GROUP_SEPARATOR, LayerSpec, group_members, sibling_blocks

STRATEGIES = ("layers", "fsdp")
DEFAULT_STRATEGY = "layers"  # measured faster for decode and training (docs/scaling.md)


@dataclass(frozen=True)
class Unit:
    """Base layers stored (and placed, and gathered) together: one matrix of ``out_features`` rows
    whose row slices are the members' weights, in member order."""

    layer_ids: tuple[str, ...]
    in_features: int
    out_features: int
    has_bias: bool

    @property
    def numel(self) -> int:
        """Elements of the weight and bias."""
        return self.out_features * (self.in_features + (1 if self.has_bias else 0))


class Layout:
    """The units of a model (in the model's layer order) and where each layer id and sibling group
    id sits in them. Both strategies and every rank derive the same layout from the same specs."""

    def __init__(self, specs: Mapping[str, LayerSpec]):
        self.specs = dict(specs)
        blocks = {block[0]: block for block in sibling_blocks(self.specs.values())}
        in_block = {member for block in blocks.values() for member in block}
        units: list[Unit] = []
        for layer_id, spec in self.specs.items():
            if layer_id in blocks:
                members = blocks[layer_id]
                out = sum(self.specs[m].out_features for m in members)
                units.append(Unit(members, spec.in_features, out, spec.has_bias))
            elif layer_id not in in_block:
                units.append(Unit((layer_id,), spec.in_features, spec.out_features, spec.has_bias))
        self.units: tuple[Unit, ...] = tuple(units)
        # layer id -> (unit index, member position, first row in the unit)
        self._position: dict[str, tuple[int, int, int]] = {}
        for index, unit in enumerate(self.units):
            row = 0
            for position, member in enumerate(unit.layer_ids):
                self._position[member] = (index, position, row)
                row += self.specs[member].out_features

    def locate(self, layer_id: str) -> tuple[int, int, int] | None:
        """(unit index, first row, stop row) of a layer or of a sibling group id (a contiguous run
        of one block, in block order, as the single executor serves them); None if unknown."""
        found = self._position.get(layer_id)
        if found is not None:
            index, _, start = found
            return index, start, start + self.specs[layer_id].out_features
        if GROUP_SEPARATOR not in layer_id:
            return None
        members = group_members(layer_id)
        places = [self._position.get(member) for member in members]
        if any(place is None for place in places) or len({place[0] for place in places}) != 1:
            return None
        positions = [place[1] for place in places]
        if positions != list(range(positions[0], positions[0] + len(members))):
            return None
        index, _, start = places[0]
        return index, start, start + sum(self.specs[m].out_features for m in members)

    def spec(self, layer_id: str) -> LayerSpec | None:
        """The spec of a layer or of a group id the executor serves; None if unknown."""
        spec = self.specs.get(layer_id)
        if spec is not None:
            return spec
        located = self.locate(layer_id)
        if located is None:
            return None
        unit = self.units[located[0]]
        return LayerSpec(layer_id, unit.in_features, located[2] - located[1], unit.has_bias)

    def unit_of(self, layer_id: str) -> int | None:
        located = self.locate(layer_id)
        return None if located is None else located[0]


class SpecRegistry(Mapping):
    """Every base layer's spec by id; sibling group ids resolve on lookup but are never listed
    (the registry a server validates requests against, like ``BaseModelWeights.specs``)."""

    def __init__(self, layout: Layout):
        self._layout = layout
        self._resolved: dict[str, LayerSpec] = {}

    def __getitem__(self, layer_id: str) -> LayerSpec:
        spec = self._layout.specs.get(layer_id) if isinstance(layer_id, str) else None
        if spec is not None:
            return spec
        spec = self._resolved.get(layer_id)
        if spec is None:
            spec = self._layout.spec(layer_id) if isinstance(layer_id, str) else None
            if spec is None:
                raise KeyError(layer_id)
            self._resolved[layer_id] = spec  # bounded: only runs of real blocks resolve
        return spec

    def __iter__(self) -> Iterator[str]:
        return iter(self._layout.specs)

    def __len__(self) -> int:
        return len(self._layout.specs)


def place_units(unit_sizes: list[int], world_size: int) -> list[int]:
    """The rank owning each unit: contiguous runs in order, balanced by size.

    Unit ``i`` goes to the rank whose equal share of the total its midpoint falls in, so each
    rank's total is within half a unit of ``total / world_size`` at each end: no rank holds more
    than ``total / world_size`` plus the largest unit. A rank may own nothing when there are
    fewer units than ranks."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    total = sum(unit_sizes)
    owners: list[int] = []
    before = 0
    for size in unit_sizes:
        midpoint = before + size / 2
        owners.append(min(world_size - 1, int(midpoint * world_size / total)) if total else 0)
        before += size
    return owners


def row_range(rows: int, world_size: int, rank: int) -> tuple[int, int, int]:
    """(first row, stop row, rows per rank) of ``rank``'s share of a unit of ``rows`` rows, as
    FSDP2 shards a parameter on dim 0 (``torch.chunk``): ``ceil(rows / world_size)`` rows each,
    the last ranks short or empty. Every rank stores ``rows per rank`` rows (zero padding), so the
    shards all-gather into one ``[world_size * rows per rank, in]`` tensor."""
    chunk = -(-rows // world_size)
    start = min(rows, rank * chunk)
    return start, min(rows, start + chunk), chunk


def resident_numel(layout: Layout, strategy: str, world_size: int, rank: int, owners: list[int] | None = None) -> int:
    """Elements of base weights ``rank`` keeps for good under ``strategy``."""
    if strategy == "layers":
        assert owners is not None
        return sum(unit.numel for unit, owner in zip(layout.units, owners) if owner == rank)
    if strategy == "fsdp":
        return sum(row_range(u.out_features, world_size, rank)[2] * (u.in_features + u.has_bias) for u in layout.units)
    raise ValueError(f"unknown sharding strategy {strategy!r}; use one of {list(STRATEGIES)}")
