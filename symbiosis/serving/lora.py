"""Many LoRA adapters in one forward pass: each row of a batch uses its own adapter (S-LoRA style).

The server is one split client that decodes every running sequence at once, so one base-layer
request carries all their rows. Each base layer the adapters may target is wrapped in a
:class:`MultiLoraLinear`: it asks the executor for ``x Wᵀ`` once for the whole batch and adds each
row's own low-rank update. The update is three ops for any number of adapters, not one pass per
adapter: the batch's adapters at this layer are stacked along the rank axis (``A_cat [Σr, in]``,
``B_cat [out, Σr]``); ``h = x A_catᵀ`` is multiplied by a per-row column weight that is the
row's own adapter's ``scaling`` on that adapter's columns and 0 elsewhere, and ``B_cat`` adds
``h B_catᵀ`` to the base output in one ``addmm``. So ranks and target modules may differ freely,
and a row whose adapter does not target the layer (or that has none) gets an exact zero update.

peft computes ``(x Aᵀ Bᵀ) * scaling``; scaling the rank-``r`` hidden instead moves one rounding
step (the products are equal in exact arithmetic), and greedy tokens still equal those of the
monolithic ``transformers`` + ``peft`` model with that adapter (tests/serving).
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from peft.utils.other import get_pattern_key
from safetensors.torch import load_file
from torch import nn

from symbiosis.errors import SymbiosisError


class AdapterFormatError(SymbiosisError):
    """An adapter folder that this server cannot serve (not LoRA, unsupported options, bad shapes)."""


@dataclass(frozen=True)
class LoraModule:
    """One adapted layer of one adapter: ``lora_B(lora_A(x)) * scaling``."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scaling: float


class LoraAdapter:
    """One loaded LoRA adapter: its adapted layers by module name. Immutable once built.

    A replaced adapter is a new object; sequences that started with the old one keep it.
    """

    def __init__(self, name: str, path: Path, modules: dict[str, LoraModule]) -> None:
        self.name = name
        self.path = path
        self.modules = modules
        self.nbytes = sum(m.a.nbytes + m.b.nbytes for m in modules.values())

    def __repr__(self) -> str:
        return f"LoraAdapter({self.name!r}, {len(self.modules)} modules, {self.nbytes} bytes)"


_PREFIX = "base_model.model."
_UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA needs the base weights' norms, which never leave the executor",
    "modules_to_save": "modules_to_save replaces whole layers",
    "lora_bias": "a LoRA bias is not supported by the multi-adapter server",
    "target_parameters": "target_parameters (LoRA on parameters) is not supported",
    "layer_replication": "layer replication changes the model's structure",
    "trainable_token_indices": "trainable token embeddings are not supported",
}


def read_lora_config(path: Path) -> dict:
    """``adapter_config.json`` of a LoRA adapter folder, checked for what this server can serve."""
    config_file = Path(path) / "adapter_config.json"
    try:
        config = json.loads(config_file.read_text())
    except OSError:
        raise AdapterFormatError(f"adapter folder {str(path)!r} has no readable adapter_config.json") from None
    except ValueError as exc:
        raise AdapterFormatError(f"{config_file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterFormatError(f"{config_file} is not a JSON object")
    if config.get("peft_type") != "LORA":
        raise AdapterFormatError(
            f"adapter {str(path)!r} is {config.get('peft_type')!r}; the api server serves LoRA adapters "
            "(use `symbiosis generate` for other PEFT methods)"
        )
    for option, why in _UNSUPPORTED_OPTIONS.items():
        if config.get(option):
            raise AdapterFormatError(f"adapter {str(path)!r} sets {option}: {why}")
    if config.get("bias", "none") != "none":
        raise AdapterFormatError(f"adapter {str(path)!r} trains base biases (bias={config['bias']!r}); not servable")
    return config


def load_lora_adapter(
    name: str, path: Path, layer_shapes: dict[str, tuple[int, int]], *, dtype: torch.dtype, device: torch.device
) -> LoraAdapter:
    """Read a peft LoRA folder into a :class:`LoraAdapter`; ``layer_shapes``: module → (in, out)."""
    path = Path(path)
    config = read_lora_config(path)
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise AdapterFormatError(f"adapter {str(path)!r} has no adapter_model.safetensors (pickled .bin is not read)")
    try:
        tensors = load_file(str(weights_file))
    except Exception as exc:  # noqa: BLE001 (safetensors raises its own error types for corrupt files)
        raise AdapterFormatError(f"cannot read {weights_file}: {exc}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if key.startswith(_PREFIX) and key.endswith(suffix):
                pairs.setdefault(key[len(_PREFIX) : -len(suffix)], {})[part] = tensor
                break
        else:
            raise AdapterFormatError(f"adapter {str(path)!r} holds {key!r}, which is not a LoRA A/B weight")
    modules = {}
    for module, pair in pairs.items():
        modules[module] = _lora_module(path, module, pair, config, layer_shapes)
    if not modules:
        raise AdapterFormatError(f"adapter {str(path)!r} has no LoRA weights")
    return LoraAdapter(
        name, path, {k: LoraModule(m.a.to(device, dtype), m.b.to(device, dtype), m.scaling) for k, m in modules.items()}
    )


def _lora_module(path: Path, module: str, pair: dict, config: dict, layer_shapes: dict) -> LoraModule:
    if module not in layer_shapes:
        raise AdapterFormatError(
            f"adapter {str(path)!r} adapts {module!r}, which is not a base layer the server can adapt "
            "(embeddings and the output layer are not)"
        )
    if set(pair) != {"lora_A", "lora_B"}:
        raise AdapterFormatError(f"adapter {str(path)!r} has only {sorted(pair)} for {module!r}")
    a, b = pair["lora_A"], pair["lora_B"]
    in_features, out_features = layer_shapes[module]
    rank = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (out_features, rank):
        raise AdapterFormatError(
            f"adapter {str(path)!r}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; the layer needs "
            f"A [r, {in_features}] and B [{out_features}, r]"
        )
    alpha_pattern = config.get("alpha_pattern") or {}
    alpha = alpha_pattern.get(get_pattern_key(list(alpha_pattern), module), config.get("lora_alpha", 8))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoraModule(a, b, float(scaling))


class RowAdapters:
    """Which adapter each row of the current forward pass uses (set by the engine per step).

    ``per_row[i]`` is the adapter of batch row ``i`` or None. Stacked weights are built once per
    (batch composition, layer) and reused while the composition lasts.
    """

    def __init__(self, per_row: list[LoraAdapter | None]) -> None:
        self.per_row = per_row
        self._stacked: dict[str, tuple | None] = {}

    def stacked(self, module: str) -> tuple | None:
        """``(A_cat [Σr, in], B_catᵀ [Σr, out], row_weight [rows, 1, Σr])`` at ``module``, or None."""
        if module not in self._stacked:
            self._stacked[module] = self._stack(module)
        return self._stacked[module]

    def _stack(self, module: str) -> tuple | None:
        distinct: dict[int, tuple[LoraModule, int]] = {}  # id(adapter) -> (its module, first column)
        width = 0
        for adapter in self.per_row:
            if adapter is None or id(adapter) in distinct or module not in adapter.modules:
                continue
            lora = adapter.modules[module]
            distinct[id(adapter)] = (lora, width)
            width += lora.a.shape[0]
        if not distinct:
            return None
        loras = [lora for lora, _ in distinct.values()]
        a_cat = torch.cat([lora.a for lora in loras])
        b_cat_t = torch.cat([lora.b for lora in loras], dim=1).t().contiguous()
        row_weight = a_cat.new_zeros((len(self.per_row), 1, width))
        for row, adapter in enumerate(self.per_row):
            if adapter is not None and id(adapter) in distinct:
                lora, start = distinct[id(adapter)]
                row_weight[row, 0, start : start + lora.a.shape[0]] = lora.scaling
        return a_cat, b_cat_t, row_weight


class AdapterContext(threading.local):
    """The rows' adapters of the forward pass running in this thread (None: no adapters)."""

    rows: RowAdapters | None = None


class MultiLoraLinear(nn.Module):
    """A base layer plus each row's LoRA update, for a batch whose rows use different adapters."""

    def __init__(self, base: nn.Module, module_name: str, context: AdapterContext) -> None:
        super().__init__()
        self.base_layer = base
        self.module_name = module_name
        self.context = context

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        rows = self.context.rows
        stacked = rows.stacked(self.module_name) if rows is not None else None
        if stacked is None:
            return result
        a_cat, b_cat_t, row_weight = stacked
        if x.dim() != 3 or x.shape[0] != row_weight.shape[0]:
            raise RuntimeError(
                f"{self.module_name}: expected [rows={row_weight.shape[0]}, tokens, features], got {tuple(x.shape)}"
            )
        if x.dtype != a_cat.dtype:
            x = x.to(a_cat.dtype)
        hidden = torch.matmul(x, a_cat.t()).mul_(row_weight)
        out_features = result.shape[-1]
        update = torch.addmm(result.reshape(-1, out_features), hidden.view(-1, hidden.shape[-1]), b_cat_t)
        return update.view(result.shape)


def install_multi_lora(model: nn.Module, context: AdapterContext, exclude: set[str]) -> dict[str, tuple[int, int]]:
    """Wrap every base layer of ``model`` except ``exclude``; returns module name → (in, out)."""
    from symbiosis.client.virt import VirtConv1D, VirtLinear

    shapes: dict[str, tuple[int, int]] = {}
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, VirtLinear | VirtConv1D) and name not in exclude
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, MultiLoraLinear(module, name, context))
        shapes[name] = (module.link.in_features, module.link.out_features)
    return shapes
