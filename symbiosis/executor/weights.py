"""The executor's only state: the frozen base-layer weights, in one uniform layout.

Every layer is stored as ``W`` [out, in] (``nn.Linear``'s layout; ``Conv1D``'s [in, out] is
transposed once at load time) so the runner has one code path for all of them.

Sibling blocks (``vocabulary.sibling_blocks``: q/k/v/o of one attention, gate/up of one MLP) are
stored as one matrix whose row slices are the members' weights, so a *group* — a contiguous run
of a block, named by its group id — is one product against a view, with no weight held twice.
``specs`` and ``layers`` resolve group ids on lookup; iterating them lists only real layers.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from symbiosis.checkpoint import (
    Checkpoint,
    Conv1D,
    base_layer_tensor_names,
    build_skeleton,
    discover_base_layers,
    locate_tensors,
)
from symbiosis.vocabulary import GROUP_SEPARATOR, LayerSpec, group_members, sibling_blocks


@dataclass(frozen=True)
class LayerWeights:
    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None  # [out]


class _GroupResolver:
    """Group id -> (spec, weights) of a contiguous run of one sibling block, cached.

    Only ids that name such a run are resolved (and cached): there are at most ``k(k-1)/2`` of
    them per block of ``k`` members, so a client cannot grow the cache with made-up ids."""

    def __init__(self, specs: Mapping[str, LayerSpec], layers: Mapping[str, LayerWeights], blocks: list[tuple[str, ...]], block_weights: list[LayerWeights]):
        self._specs = specs
        self._layers = layers
        self._position = {member: (b, i) for b, block in enumerate(blocks) for i, member in enumerate(block)}
        self._blocks = blocks
        self._block_weights = block_weights
        self._resolved: dict[str, tuple[LayerSpec, LayerWeights]] = {}

    def resolve(self, layer_id: str) -> tuple[LayerSpec, LayerWeights] | None:
        if GROUP_SEPARATOR not in layer_id:
            return None
        found = self._resolved.get(layer_id)
        if found is not None:
            return found
        members = group_members(layer_id)
        places = [self._position.get(member) for member in members]
        if None in places or len({b for b, _ in places}) != 1:
            return None
        block, first = places[0]
        if [i for _, i in places] != list(range(first, first + len(members))):
            return None  # not a contiguous run in block order: no single view serves it
        start = sum(self._specs[m].out_features for m in self._blocks[block][:first])
        stop = start + sum(self._specs[m].out_features for m in members)
        whole = self._block_weights[block]
        weights = LayerWeights(whole.weight[start:stop], None if whole.bias is None else whole.bias[start:stop])
        head = self._specs[members[0]]
        spec = LayerSpec(layer_id, head.in_features, stop - start, head.has_bias)
        self._resolved[layer_id] = (spec, weights)
        return spec, weights


class _Registry(Mapping):
    """The real layers' mapping, plus group ids resolved on lookup (never listed)."""

    def __init__(self, real: Mapping, resolver: _GroupResolver, part: int):
        self._real = real
        self._resolver = resolver
        self._part = part  # 0: specs, 1: weights

    def __getitem__(self, layer_id: str):
        found = self._real.get(layer_id)
        if found is not None:
            return found
        resolved = self._resolver.resolve(layer_id) if isinstance(layer_id, str) else None
        if resolved is None:
            raise KeyError(layer_id)
        return resolved[self._part]

    def __iter__(self) -> Iterator[str]:
        return iter(self._real)

    def __len__(self) -> int:
        return len(self._real)


@dataclass(frozen=True)
class BaseModelWeights:
    """Base layers of one checkpoint, on the executor's device and dtype."""

    specs: Mapping[str, LayerSpec]
    layers: Mapping[str, LayerWeights]
    fingerprint: str
    model_type: str

    @classmethod
    def load(
        cls, path: str | Path, *, device: torch.device, dtype: torch.dtype, layer_ids: Collection[str] | None = None
    ) -> "BaseModelWeights":
        """``layer_ids``: read only these base layers (a shard of a sharded executor; the
        fingerprint still covers every layer, so clients of the whole model are accepted)."""
        checkpoint = Checkpoint(path)
        skeleton = build_skeleton(checkpoint.config)
        all_specs = discover_base_layers(skeleton)
        specs = all_specs if layer_ids is None else {k: v for k, v in all_specs.items() if k in layer_ids}
        tensor_names = base_layer_tensor_names(specs)
        tensors = checkpoint.read(locate_tensors(checkpoint, skeleton, tensor_names))
        conv1d_layers = {name for name, module in skeleton.named_modules() if isinstance(module, Conv1D)}
        layers: dict[str, LayerWeights] = {}
        for layer_id, spec in specs.items():
            weight = tensors.pop(f"{layer_id}.weight")
            if layer_id in conv1d_layers:
                weight = weight.t()
            bias = tensors.pop(f"{layer_id}.bias", None)
            layers[layer_id] = LayerWeights(
                weight=weight.to(device=device, dtype=dtype).contiguous(),
                bias=None if bias is None else bias.to(device=device, dtype=dtype).contiguous(),
            )
            if tuple(layers[layer_id].weight.shape) != (spec.out_features, spec.in_features):
                raise ValueError(f"weight of {layer_id} has shape {tuple(weight.shape)}, expected {spec}")
        return cls.assemble(specs, layers, checkpoint.fingerprint(all_specs), checkpoint.config.model_type)

    @classmethod
    def assemble(cls, specs: dict[str, LayerSpec], layers: dict[str, LayerWeights], fingerprint: str, model_type: str) -> "BaseModelWeights":
        """Store each sibling block as one matrix (members become row-slice views of it) and wrap
        ``specs``/``layers`` so that group ids resolve."""
        blocks = sibling_blocks(specs.values())
        block_weights = []
        for block in blocks:
            members = [layers[m] for m in block]
            weight = torch.cat([w.weight for w in members])
            bias = None if members[0].bias is None else torch.cat([w.bias for w in members])
            block_weights.append(LayerWeights(weight, bias))
            start = 0
            for member in block:  # the separate copies are dropped: each member is now a view
                stop = start + specs[member].out_features
                layers[member] = LayerWeights(weight[start:stop], None if bias is None else bias[start:stop])
                start = stop
        resolver = _GroupResolver(specs, layers, blocks, block_weights)
        return cls(_Registry(specs, resolver, 0), _Registry(layers, resolver, 1), fingerprint, model_type)

    @property
    def device(self) -> torch.device:
        first = next(iter(self.layers.values()), None)
        return first.weight.device if first is not None else torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        first = next(iter(self.layers.values()), None)
        return first.weight.dtype if first is not None else torch.float32

    def nbytes(self) -> int:
        """Bytes of the stored weights (each storage once: block members share theirs)."""
        storages = {}
        for w in self.layers.values():
            for tensor in (w.weight, w.bias):
                if tensor is not None:
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())
