"""Many LoRA adapters in one forward pass: each row of a batch uses its own adapter (S-LoRA style).

The server is one split client that decodes every running sequence at once, so one base-layer
request carries all their rows. Each base layer the adapters may target is wrapped in a
:class:`MultiLoraLinear`: it asks the executor for ``x Wᵀ`` once for the whole batch and adds each
row's own low-rank update. The update is three ops for any number of adapters, not one pass per
adapter, in one of two layouts (both built once per batch composition and layer):

- *stacked* (few distinct adapters): the batch's adapters are stacked along the rank axis
  (``A_cat [Σr, in]``, ``B_cat [out, Σr]``); ``h = x A_catᵀ`` is multiplied by a per-row column
  weight that is the row's own adapter's ``scaling`` on that adapter's columns and 0 elsewhere,
  and ``B_cat`` adds ``h B_catᵀ`` to the base output in one ``addmm``. Every row pays for every
  adapter's rank (``Σr``), but one large product is the cheapest way to use a few adapters.
- *gathered* (many distinct adapters, S-LoRA's case): each row's own ``Aᵀ`` and ``Bᵀ``, zero-padded
  to the batch's largest rank, are gathered into ``[rows, in, r_max]`` and ``[rows, r_max, out]``;
  ``bmm`` then ``baddbmm`` costs each row only ``r_max``, whatever the number of adapters -- with
  16 rank-8 adapters in a 16-row decode step it is 2.4x cheaper than stacking ``Σr = 128``.

So ranks and target modules may differ freely, and a row whose adapter does not target the layer
(or that has none) gets an exact zero update.

peft computes ``(x Aᵀ Bᵀ) * scaling``; scaling the rank-``r`` hidden instead moves one rounding
step (the products are equal in exact arithmetic), and greedy tokens still equal those of the
monolithic ``transformers`` + ``peft`` model with that adapter (tests/serving).
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from symbiosis.errors import SymbiosisError
from symbiosis.jobs.adapters import read_adapter_config


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
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA needs the base weights' norms, which never leave the executor",
    "modules_to_save": "modules_to_save replaces whole layers",
    "lora_bias": "a LoRA bias is not supported by the multi-adapter server",
    "target_parameters": (
        "LoRA on parameters (MoE experts: peft's all-linear adds it on MoE models) is not supported by the "
        "multi-adapter server; serve it with `symbiosis generate`, or train with --target-modules naming "
        "linear layers (q_proj v_proj ...)"
    ),
    "layer_replication": "layer replication changes the model's structure",
    "trainable_token_indices": "trainable token embeddings are not supported",
}


def _label(name: str | None, path: Path) -> str:
    """How errors name an adapter: by its served name when it has one. Those errors reach HTTP
    clients (a 400 for a request naming it), who have no business seeing the server's folders."""
    return repr(name) if name is not None else repr(str(path))


def read_lora_config(path: Path, name: str | None = None) -> dict:
    """``adapter_config.json`` of a LoRA adapter folder, checked for what this server can serve;
    errors name the adapter ``name`` (else the folder)."""
    label = _label(name, path)
    config = read_adapter_config(path, AdapterFormatError, label)
    reason = unservable(config)
    if reason is not None:
        raise AdapterFormatError(f"adapter {label} {reason}")
    return config


def unservable(config: dict) -> str | None:
    """Why this server cannot serve an adapter of this ``adapter_config.json`` content (a clause
    after "adapter X"), or None. Also asked by ``finetune --publish-to`` before it trains."""
    if config.get("peft_type") != "LORA":
        return (
            f"is {config.get('peft_type')!r}; the api server serves LoRA adapters "
            "(use `symbiosis generate` for other PEFT methods)"
        )
    for option, why in _UNSUPPORTED_OPTIONS.items():
        if config.get(option):
            return f"sets {option}: {why}"
    if config.get("bias", "none") != "none":
        return (
            f"trains the base layers' biases (bias={config['bias']!r}), which this server's requests share "
            "between adapters; serve it with `symbiosis generate`"
        )
    return None


def _weights_file(path: Path, label: str) -> Path:
    weights_file = Path(path) / WEIGHTS_FILE
    if not weights_file.is_file():
        raise AdapterFormatError(f"adapter {label} has no {WEIGHTS_FILE} (pickled .bin is not read)")
    return weights_file


def check_lora_files(name: str | None, path: Path) -> None:
    """The least a folder needs to be servable: a LoRA config this server serves and a weights file."""
    read_lora_config(path, name)
    _weights_file(path, _label(name, path))


def check_lora_adapter(
    name: str | None, path: Path, layer_shapes: dict[str, tuple[int, int]], other_modules: frozenset[str] = frozenset()
) -> None:
    """Whether :func:`load_lora_adapter` would take the folder, but from its config and the
    safetensors header only (names and shapes, no tensor: ~0.15 ms an adapter on this host): modules of
    this model, shapes that fit its layers, ranks that are the config's. Only non-finite weights
    are found by loading alone. ``AdapterFormatError`` saying why not."""
    label = _label(name, path)
    config = read_lora_config(path, name)
    weights_file = _weights_file(path, label)
    try:
        with safe_open(str(weights_file), framework="pt") as weights:
            shapes = {key: tuple(weights.get_slice(key).get_shape()) for key in weights.keys()}
    except Exception as exc:  # noqa: BLE001 (safetensors raises its own error types for corrupt files)
        raise AdapterFormatError(f"adapter {label}: cannot read {WEIGHTS_FILE}: {exc}") from None
    _fit(label, config, shapes, layer_shapes, other_modules)


def load_lora_adapter(
    name: str,
    path: Path,
    layer_shapes: dict[str, tuple[int, int]],
    *,
    dtype: torch.dtype,
    device: torch.device,
    other_modules: frozenset[str] = frozenset(),
) -> LoraAdapter:
    """Read a peft LoRA folder into a :class:`LoraAdapter`; ``layer_shapes``: module → (in, out) of
    the layers an adapter may target, ``other_modules``: the model's other modules (an adapter of
    a module in neither was made for another model)."""
    path = Path(path)
    label = _label(name, path)
    config = read_lora_config(path, name)
    weights_file = _weights_file(path, label)
    try:
        tensors = load_file(str(weights_file))
    except Exception as exc:  # noqa: BLE001 (safetensors raises its own error types for corrupt files)
        raise AdapterFormatError(f"adapter {label}: cannot read {WEIGHTS_FILE}: {exc}") from None
    fitted = _fit(label, config, {key: tuple(t.shape) for key, t in tensors.items()}, layer_shapes, other_modules)
    modules = {}
    for module, (a_key, b_key, scaling) in fitted.items():
        a, b = tensors[a_key], tensors[b_key]
        # One adapter's NaN or infinity would not stay in its own rows: the stacked layout multiplies
        # every row by every adapter's columns (masked by 0, and 0 x NaN is NaN), so a diverged
        # fine-tuning job's adapter would turn its batch-mates' logits to NaN.
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
            raise AdapterFormatError(f"adapter {label}: {module} holds NaN or infinite weights")
        modules[module] = LoraModule(a.to(device, dtype), b.to(device, dtype), scaling)
    return LoraAdapter(name, path, modules)


def _fit(
    label: str,
    config: dict,
    shapes: dict[str, tuple[int, ...]],
    layer_shapes: dict[str, tuple[int, int]],
    other_modules: frozenset[str],
) -> dict[str, tuple[str, str, float]]:
    """Check an adapter's tensor names and ``shapes`` against the model; module → (A's key, B's
    key, scaling). An adapter of modules this model lacks, or of other sizes, was made for
    another model: the error says which one, when its config says (``base_model_name_or_path``)."""
    pairs: dict[str, dict[str, str]] = {}
    for key in shapes:
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if key.startswith(_PREFIX) and key.endswith(suffix):
                pairs.setdefault(key[len(_PREFIX) : -len(suffix)], {})[part] = key
                break
        else:
            raise AdapterFormatError(f"adapter {label} holds {key!r}, which is not a LoRA A/B weight")
    if not pairs:
        raise AdapterFormatError(f"adapter {label} has no LoRA weights")
    missing = [module for module in pairs if module not in layer_shapes and module not in other_modules]
    if missing:
        others = f" (and {len(missing) - 1} other module{'s' if len(missing) > 2 else ''})" if len(missing) > 1 else ""
        reason = f"it adapts {missing[0]!r}{others}, which this model does not have"
        raise AdapterFormatError(_does_not_fit(label, config, reason))
    fitted = {}
    for module, pair in pairs.items():
        if module not in layer_shapes:
            raise AdapterFormatError(
                f"adapter {label} adapts {module!r}, which is not a base layer the server can adapt "
                "(embeddings and the output layer are not)"
            )
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterFormatError(f"adapter {label} has only {sorted(pair)} for {module!r}")
        a, b = shapes[pair["lora_A"]], shapes[pair["lora_B"]]
        in_features, out_features = layer_shapes[module]
        rank = a[0] if len(a) == 2 else -1  # -1: not a matrix, refused just below
        if len(a) != 2 or len(b) != 2 or a[1] != in_features or b != (out_features, rank):
            reason = f"{module} has A {a} and B {b}; the layer needs A [r, {in_features}] and B [{out_features}, r]"
            raise AdapterFormatError(_does_not_fit(label, config, reason))
        if rank == 0:
            raise AdapterFormatError(f"adapter {label}: {module} has rank 0")
        # peft scales by the config's rank, and refuses weights of another: so do we, rather than
        # serve an update whose scale no monolithic model would use.
        rank_pattern = _pattern(label, config, "rank_pattern", module)
        configured = rank_pattern.get(_pattern_key(rank_pattern, module), config.get("r", 8))
        if configured != rank:
            raise AdapterFormatError(
                f"adapter {label}: {module} has rank {rank} weights but its {CONFIG_FILE} says r={configured}"
            )
        alpha_pattern = _pattern(label, config, "alpha_pattern", module)
        alpha = alpha_pattern.get(_pattern_key(alpha_pattern, module), config.get("lora_alpha", 8))
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        fitted[module] = (pair["lora_A"], pair["lora_B"], float(scaling))
    return fitted


def _does_not_fit(label: str, config: dict, reason: str) -> str:
    """As ``symbiosis generate`` says it (``jobs.adapters``), naming the model the adapter was
    made for. A local path there is shortened to its folder's name: it is a path on the machine
    that trained the adapter (often this one), and the message may go to an HTTP client."""
    made_for = config.get("base_model_name_or_path")
    if isinstance(made_for, str) and made_for and (Path(made_for).is_absolute() or made_for.startswith(("~", "."))):
        made_for = Path(made_for).name or made_for
    origin = f" (it was made for {made_for!r})" if isinstance(made_for, str) and made_for else ""
    return f"adapter {label} does not fit this model{origin}: {reason}"


def _pattern(label: str, config: dict, option: str, module: str) -> dict:
    """``config[option]`` (peft's per-module ``rank_pattern``/``alpha_pattern``), checked: a
    pattern that is not a JSON object of valid regular expressions is the adapter's fault (400)."""
    pattern = config.get(option) or {}
    try:
        if not isinstance(pattern, dict):
            raise TypeError(f"expected an object, got {type(pattern).__name__}")
        _pattern_key(pattern, module)
    except (TypeError, re.error) as exc:
        raise AdapterFormatError(f"adapter {label}: {option} is not usable: {exc}") from None
    return pattern


def _pattern_key(pattern: dict, module: str) -> str:
    """peft's ``get_pattern_key``: the key of ``pattern`` that names ``module``, else ``module``.
    Without a pattern (most adapters) peft is not imported: its import is ~2 s of a server's
    start on this host, in the API process and again in its engine process."""
    if not pattern:
        return module
    from peft.utils.other import get_pattern_key

    return get_pattern_key(list(pattern), module)


# A gathered layout costs each row ~4 ranks' worth of a stacked one (small batched products run
# slower per flop than one large one, measured on a CPU with rank 8 at hidden 512): stack while
# the batch's total rank is at most this many times its largest, gather beyond.
GATHER_ABOVE_RANK_RATIO = 4


class StackedUpdate:
    """Every row times every adapter's ``A`` (``Σr`` columns), masked to its own, then ``B``."""

    def __init__(self, loras: list[LoraModule], column_of: dict[int, int], per_row: list[LoraModule | None]) -> None:
        self.a_cat = torch.cat([lora.a for lora in loras])  # [Σr, in]
        self.b_cat_t = torch.cat([lora.b for lora in loras], dim=1).t().contiguous()  # [Σr, out]
        self.row_weight = self.a_cat.new_zeros((len(per_row), 1, self.a_cat.shape[0]))
        for row, lora in enumerate(per_row):
            if lora is not None:
                start = column_of[id(lora)]
                self.row_weight[row, 0, start : start + lora.a.shape[0]] = lora.scaling
        self.dtype = self.a_cat.dtype

    def add_to(self, result: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.matmul(x, self.a_cat.t()).mul_(self.row_weight)
        out_features = result.shape[-1]
        update = torch.addmm(result.reshape(-1, out_features), hidden.view(-1, hidden.shape[-1]), self.b_cat_t)
        return update.view(result.shape)


class GatheredUpdate:
    """Each row times its own ``A`` and ``B`` only (zero-padded to the largest rank)."""

    def __init__(self, loras: list[LoraModule], per_row: list[LoraModule | None]) -> None:
        rank = max(lora.a.shape[0] for lora in loras)
        first = loras[0]
        a_t = first.a.new_zeros((len(loras) + 1, first.a.shape[1], rank))  # slot 0: no update
        b_t = first.a.new_zeros((len(loras) + 1, rank, first.b.shape[0]))
        scaling = first.a.new_zeros(len(loras) + 1)
        slot_of = {}
        for slot, lora in enumerate(loras, start=1):
            a_t[slot, :, : lora.a.shape[0]] = lora.a.t()
            b_t[slot, : lora.a.shape[0]] = lora.b.t()
            scaling[slot] = lora.scaling
            slot_of[id(lora)] = slot
        slots = torch.tensor([0 if lora is None else slot_of[id(lora)] for lora in per_row], device=first.a.device)
        self.a_rows = a_t.index_select(0, slots)  # [rows, in, r_max]
        self.b_rows = b_t.index_select(0, slots)  # [rows, r_max, out]
        self.row_scaling = scaling.index_select(0, slots).view(-1, 1, 1)
        self.dtype = self.a_rows.dtype

    def add_to(self, result: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(result, torch.bmm(x, self.a_rows).mul_(self.row_scaling), self.b_rows)


def choose_layout(ranks: list[int]) -> type[StackedUpdate] | type[GatheredUpdate]:
    """Stacked for few distinct adapters, gathered for many (``ranks``: the distinct adapters')."""
    return GatheredUpdate if sum(ranks) > GATHER_ABOVE_RANK_RATIO * max(ranks) else StackedUpdate


class RowAdapters:
    """Which adapter each row of the current forward pass uses (set by the engine per step).

    ``per_row[i]`` is the adapter of batch row ``i`` or None. Each layer's update (stacked or
    gathered weights) is built once per batch composition and reused while the composition lasts.
    """

    def __init__(self, per_row: list[LoraAdapter | None]) -> None:
        self.per_row = per_row
        self._updates: dict[str, StackedUpdate | GatheredUpdate | None] = {}

    def update(self, module: str) -> StackedUpdate | GatheredUpdate | None:
        """The rows' LoRA update at ``module``, or None when no row's adapter targets it."""
        if module not in self._updates:
            self._updates[module] = self._build(module)
        return self._updates[module]

    def _build(self, module: str) -> StackedUpdate | GatheredUpdate | None:
        per_row = [None if a is None else a.modules.get(module) for a in self.per_row]
        column_of: dict[int, int] = {}  # id(module of a distinct adapter) -> its first stacked column
        loras: list[LoraModule] = []
        for lora in per_row:
            if lora is not None and id(lora) not in column_of:
                column_of[id(lora)] = sum(known.a.shape[0] for known in loras)
                loras.append(lora)
        if not loras:
            return None
        layout = choose_layout([lora.a.shape[0] for lora in loras])
        return StackedUpdate(loras, column_of, per_row) if layout is StackedUpdate else GatheredUpdate(loras, per_row)


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
        update = rows.update(self.module_name) if rows is not None else None
        if update is None:
            return result
        if x.dim() != 3 or x.shape[0] != len(rows.per_row):
            raise RuntimeError(
                f"{self.module_name}: expected [rows={len(rows.per_row)}, tokens, features], got {tuple(x.shape)}"
            )
        if x.dtype != update.dtype:
            x = x.to(update.dtype)
        return update.add_to(result, x)


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
