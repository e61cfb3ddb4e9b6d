"""The executor's only state: the frozen base-layer weights, in one uniform layout.

Every layer is stored as ``W`` [out, in] (``nn.Linear``'s layout; ``Conv1D``'s [in, out] is
transposed once at load time) so the runner has one code path for all of them.
"""

from __future__ import annotations

from collections.abc import Mapping
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
from symbiosis.vocabulary import LayerSpec


@dataclass(frozen=True)
class LayerWeights:
    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None  # [out]


@dataclass(frozen=True)
class BaseModelWeights:
    """Base layers of one checkpoint, on the executor's device and dtype."""

    specs: Mapping[str, LayerSpec]
    layers: Mapping[str, LayerWeights]
    fingerprint: str
    model_type: str

    @classmethod
    def load(cls, path: str | Path, *, device: torch.device, dtype: torch.dtype) -> "BaseModelWeights":
        checkpoint = Checkpoint(path)
        skeleton = build_skeleton(checkpoint.config)
        specs = discover_base_layers(skeleton)
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
        return cls(specs, layers, checkpoint.fingerprint(specs), checkpoint.config.model_type)

    def nbytes(self) -> int:
        return sum(
            w.weight.nbytes + (0 if w.bias is None else w.bias.nbytes) for w in self.layers.values()
        )
