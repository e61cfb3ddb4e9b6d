"""The executor's only state: the frozen base-layer weights, in one uniform layout.

Every layer is stored as ``W`` [out, in] (``nn.Linear``'s layout; ``Conv1D``'s [in, out] is
transposed once at load time) so the runner has one code path for all of them.

Sibling blocks (``vocabulary.sibling_blocks``: q/k/v/o of one attention, gate/up of one MLP) are
stored as one matrix whose row slices are the members' weights, so a *group* — a contiguous run
of a block, named by its group id — is one product against a view, with no weight held twice.
``specs`` and ``layers`` resolve group ids on lookup; iterating them lists only real layers.

A quantized base (``quantization="int8"`` or ``"fp8-rowwise"``, see ``quantized.py``) stores each
layer as codes and per-row scales instead, quantized tensor by tensor while the checkpoint is
read. Its blocks keep the property above: codes and scales are concatenated like float weights
(members become row views), except fbgemm packs, which cannot be sliced: their block is the run of
the members' own packs (``StackedWeights``), so a group's product runs member by member.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from symbiosis.checkpoint import (
    Checkpoint,
    Conv1D,
    ExpertTensor,
    base_layer_tensor_names,
    build_skeleton,
    discover_base_layers,
    expert_tensors,
    locate_tensors,
)
from symbiosis.errors import CheckpointError
from symbiosis.executor.matmul_forms import MATMUL_FORMS
from symbiosis.executor.packed_weights import WEIGHT_PACKING, packed_nbytes
from symbiosis.executor.quantized import (
    FbgemmInt8Weights,
    QuantizedWeights,
    Quantizer,
    RowwiseQuantizedWeights,
    StackedWeights,
    parse_quantization,
)
from symbiosis.vocabulary import (
    GROUP_SEPARATOR,
    LayerSpec,
    group_id,
    group_members,
    module_list_spec,
    module_lists,
    sibling_blocks,
)


@dataclass(frozen=True)
class LayerWeights:
    """A full-precision layer, or a run of a block (row views). ``quantized.py``'s stored forms
    offer the same ``device``, ``dtype``, ``rows`` and ``storage_items``, and an ``apply``."""

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None  # [out]
    # Whether forwards may pack this weight on first use (``packed_weights.py``): not for the
    # weights an fsdp rank gathers per call, which a pack would outlive by one product.
    packable: bool = field(default=True, compare=False)
    # ``weight.t()``, made once: a forward product uses it, and making the view is a torch call
    # per product (a few µs of a lone decode call, see ``runner.apply_op``).
    weight_t: torch.Tensor = field(init=False, repr=False, compare=False)
    # (has bias, rows, torch threads) -> the form its forwards run (``matmul_forms.py``), kept
    # here so that a product looks it up in one small dict.
    forms: dict = field(init=False, repr=False, compare=False)
    # The weight in oneDNN's blocked layout for forward products (``packed_weights.py``): None
    # until the first forward, then the packed tensor, or False where packing does not apply.
    packed: torch.Tensor | bool | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "weight_t", self.weight.t())
        object.__setattr__(self, "forms", {})
        object.__setattr__(self, "packed", None if self.packable else False)

    def pack(self) -> torch.Tensor | bool:
        """The packed weight, made now if this is the first forward; False where it does not
        apply. Two threads racing here both pack and one copy is kept: no lock on the hot path."""
        packed = self.packed
        if packed is None:
            made = WEIGHT_PACKING.pack(self.weight)
            packed = False if made is None else made
            object.__setattr__(self, "packed", packed)
        return packed

    kernel = "matmul"  # what computes its products (stats)

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def rows(self, start: int, stop: int) -> LayerWeights:
        bias = None if self.bias is None else self.bias[start:stop]
        return LayerWeights(self.weight[start:stop], bias, packable=self.packable)

    def storage_items(self) -> Iterator[tuple[object, int]]:
        for tensor in (self.weight, self.bias):
            if tensor is not None:
                storage = tensor.untyped_storage()
                yield ("storage", storage.data_ptr()), storage.nbytes()

    def packed_nbytes(self) -> int:
        """Bytes of this layer's packed copy (0 until a forward made one)."""
        packed = self.packed
        return packed_nbytes(packed) if isinstance(packed, torch.Tensor) else 0


StoredLayer = LayerWeights | QuantizedWeights


class _GroupResolver:
    """Group id -> (spec, weights) of a contiguous run of one sibling block, cached.

    Only ids that name such a run are resolved (and cached): there are at most ``k(k-1)/2`` of
    them per block of ``k`` members, so a client cannot grow the cache with made-up ids. A module
    list's name (an MoE's experts tensor, named by requests with ``expert_rows``) resolves to its
    members' spec and no weights: the engine serves each member's rows with the member's own."""

    def __init__(
        self,
        specs: Mapping[str, LayerSpec],
        layers: Mapping[str, StoredLayer],
        blocks: list[tuple[str, ...]],
        block_weights: list[StoredLayer],
    ):
        self._specs = specs
        self._layers = layers
        self._position = {member: (b, i) for b, block in enumerate(blocks) for i, member in enumerate(block)}
        self._blocks = blocks
        self._block_weights = block_weights
        self._resolved: dict[str, tuple[LayerSpec, StoredLayer]] = {}
        self._lists = {name: module_list_spec(name, specs) for name in module_lists(specs.values())}

    def resolve(self, layer_id: str) -> tuple[LayerSpec, StoredLayer | None] | None:
        if GROUP_SEPARATOR not in layer_id:
            spec = self._lists.get(layer_id)
            return None if spec is None else (spec, None)
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
        weights = self._block_weights[block].rows(start, stop)
        if type(weights) is LayerWeights:
            MATMUL_FORMS.remember([weights.weight])  # peers for timing its shape (``matmul_forms.py``)
        head = self._specs[members[0]]
        spec = LayerSpec(layer_id, head.in_features, stop - start, head.has_bias)
        self._resolved[layer_id] = (spec, weights)
        return spec, weights

    def resolved_layers(self) -> list[StoredLayer]:
        """The weights of every group resolved so far."""
        return [weights for _, weights in list(self._resolved.values())]


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
        if resolved is None or resolved[self._part] is None:
            raise KeyError(layer_id)
        return resolved[self._part]

    def __iter__(self) -> Iterator[str]:
        return iter(self._real)

    def __len__(self) -> int:
        return len(self._real)


@dataclass(frozen=True)
class BaseModelWeights:
    """Base layers of one checkpoint, on the executor's device and dtype (the compute dtype of a
    quantized base: rows arrive and results leave in it)."""

    specs: Mapping[str, LayerSpec]
    layers: Mapping[str, StoredLayer]
    fingerprint: str
    model_type: str
    quantization: str | None = None  # None: full precision; else a name from quantized.FORMATS

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        device: torch.device,
        dtype: torch.dtype,
        layer_ids: Collection[str] | None = None,
        quantization: str | None = None,
    ) -> BaseModelWeights:
        """``layer_ids``: read only these base layers (a shard of a sharded executor; the
        fingerprint still covers every layer, so clients of the whole model are accepted).
        ``quantization``: None, "int8" or "fp8-rowwise" (``quantized.py``); each weight is stored
        as soon as it is read, so at most one full-precision tensor is in memory at a time."""
        quantization = parse_quantization(quantization)
        quantize = Quantizer(quantization, device, dtype) if quantization else None
        checkpoint = Checkpoint(path)
        skeleton = build_skeleton(checkpoint.config)
        all_specs = discover_base_layers(skeleton)
        specs = all_specs if layer_ids is None else {k: v for k, v in all_specs.items() if k in layer_ids}
        experts = {
            name: tensor
            for name, tensor in expert_tensors(skeleton).items()
            if any(layer_id in specs for layer_id in tensor.layer_ids)
        }
        names = base_layer_tensor_names(specs, experts)
        located = locate_tensors(checkpoint, skeleton, [*names, *experts])  # (one scan of the checkpoint's keys)
        sources = {name: located[name] for name in names}
        is_weight = {name: name == f"{layer_id}.weight" for name, layer_id in names.items()}
        conv1d_layers = {name for name, module in skeleton.named_modules() if isinstance(module, Conv1D)}
        biases = {  # first, so that each layer is stored whole as its weight arrives
            names[name]: bias.to(device=device, dtype=dtype).contiguous()
            for name, bias in checkpoint.iter_tensors({n: src for n, src in sources.items() if not is_weight[n]})
        }
        layers: dict[str, StoredLayer] = {}

        def store(layer_id: str, weight: torch.Tensor) -> None:
            spec = specs[layer_id]
            if tuple(weight.shape) != (spec.out_features, spec.in_features):
                raise CheckpointError(f"weight of {layer_id} has shape {tuple(weight.shape)}, expected {spec}")
            bias = biases.pop(layer_id, None)
            if quantize is not None:
                layers[layer_id] = quantize(layer_id, weight, bias)
            else:
                layers[layer_id] = LayerWeights(weight.to(device=device, dtype=dtype).contiguous(), bias)

        for name, weight in checkpoint.iter_tensors({n: src for n, src in sources.items() if is_weight[n]}):
            layer_id = names[name]
            store(layer_id, weight.t() if layer_id in conv1d_layers else weight)
            del weight  # the full-precision tensor goes before the next one is read

        # Experts: one tensor each for all of an experts module's experts (joined from the
        # checkpoint's per-expert matrices by transformers' converter), a base layer per expert.
        def store_experts(tensor: ExpertTensor, stacked: torch.Tensor) -> None:
            for layer_id, matrix in zip(tensor.layer_ids, stacked, strict=True):
                if layer_id in specs:  # (copies, not views: the whole tensor goes when this returns)
                    store(layer_id, matrix.t().contiguous() if tensor.transposed else matrix.clone())

        for name, stacked in checkpoint.iter_tensors({name: located[name] for name in experts}):
            store_experts(experts[name], stacked)
            del stacked  # before the next one is read
        layers = {layer_id: layers[layer_id] for layer_id in specs}  # registry order, not file order
        return cls.assemble(
            specs, layers, checkpoint.fingerprint(all_specs), checkpoint.config.model_type, quantization
        )

    @classmethod
    def assemble(
        cls,
        specs: dict[str, LayerSpec],
        layers: dict[str, StoredLayer],
        fingerprint: str,
        model_type: str,
        quantization: str | None = None,
    ) -> BaseModelWeights:
        """Store each sibling block as one matrix (members become row-slice views of it; fbgemm
        packs become the run of the members' packs) and wrap ``specs``/``layers`` so that group
        ids resolve."""
        blocks = sibling_blocks(specs.values())
        block_weights = []
        for block in blocks:
            whole = _concatenate([layers[m] for m in block])
            block_weights.append(whole)
            if isinstance(whole, StackedWeights):
                continue  # the members keep their own packs: nothing to drop
            start = 0
            for member in block:  # the separate copies are dropped: each member is now a view
                stop = start + specs[member].out_features
                layers[member] = whole.rows(start, stop)
                start = stop
        MATMUL_FORMS.remember(w.weight for w in [*layers.values(), *block_weights] if type(w) is LayerWeights)
        resolver = _GroupResolver(specs, layers, blocks, block_weights)
        return cls(_Registry(specs, resolver, 0), _Registry(layers, resolver, 1), fingerprint, model_type, quantization)

    def forward_shapes(self) -> list[LayerWeights]:
        """A full-precision layer of each weight shape a forward may be asked for: the layers, and
        every sibling group a client may fuse (each contiguous run of a block, resolved here as on
        its first request). For ``MatmulForms.warm_up``: one per shape is enough."""
        ids = list(self.specs)
        for block in sibling_blocks(self.specs.values()):
            ids += [group_id(block[i:j]) for i in range(len(block)) for j in range(i + 2, len(block) + 1)]
        found: dict[tuple, LayerWeights] = {}
        for layer_id in ids:
            layer = self.layers[layer_id]
            if type(layer) is LayerWeights:
                found.setdefault((tuple(layer.weight.shape), layer.bias is not None, layer.packable), layer)
        return list(found.values())

    @property
    def device(self) -> torch.device:
        first = next(iter(self.layers.values()), None)
        return first.device if first is not None else torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        first = next(iter(self.layers.values()), None)
        return first.dtype if first is not None else torch.float32

    def kernels(self) -> dict[str, int]:
        """How many layers each kernel serves (``quantized.py``; "matmul": full precision)."""
        counts: dict[str, int] = {}
        for layer in self.layers.values():
            counts[layer.kernel] = counts.get(layer.kernel, 0) + 1
        return counts

    def nbytes(self) -> int:
        """Bytes of the stored weights, scales and biases (each storage once: block members share theirs)."""
        stored = dict(item for layer in self.layers.values() for item in layer.storage_items())
        return sum(stored.values())

    def packed_nbytes(self) -> int:
        """Bytes of the packed copies forwards made so far (``packed_weights.py``): real layers
        and resolved sibling groups alike."""
        layers = list(self.layers.values())
        if isinstance(self.layers, _Registry):
            layers += self.layers._resolver.resolved_layers()
        return sum(layer.packed_nbytes() for layer in layers if type(layer) is LayerWeights)


def _concatenate(members: list[StoredLayer]) -> StoredLayer:
    """One stored form for a block from its members' (see the module docstring)."""
    if all(type(m) is LayerWeights for m in members):
        bias = None if members[0].bias is None else torch.cat([m.bias for m in members])
        return LayerWeights(torch.cat([m.weight for m in members]), bias)
    if all(type(m) is RowwiseQuantizedWeights for m in members) and len({m.codes.dtype for m in members}) == 1:
        return RowwiseQuantizedWeights.concatenate(members)
    if all(type(m) in (FbgemmInt8Weights, RowwiseQuantizedWeights) for m in members):
        return StackedWeights(tuple(members))
    raise ValueError(f"a sibling block mixes stored forms {sorted({type(m).__name__ for m in members})}")
