"""PEFT methods by name: the registry that turns ``--method NAME`` + common flags into a peft config.

Why a registry: the CLI, the demo and the tests all say "lora" or "ia3" and expect the same
config; an unknown name must fail loudly and list what is supported . The order of
``METHODS`` is the order shown to users.

Each builder takes the common options (rank, alpha, dropout, target modules, virtual tokens) and
the model's config; ``--peft-config FILE.json`` then overrides or adds any keyword the method's
peft config class accepts, so nothing peft can do is hidden behind our flags.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from symbiosis.errors import UnsupportedPeftMethodError
from symbiosis.jobs.base import _help

if TYPE_CHECKING:  # peft and torch load only when a config is built: `symbiosis --help` stays fast
    import peft
    from torch import nn

TASK = "CAUSAL_LM"  # peft.TaskType.CAUSAL_LM's value (a str enum), named without importing peft


@dataclass(frozen=True)
class MethodOptions:
    """Options shared by PEFT methods; each field's ``metadata["help"]`` is the CLI help text."""

    rank: int = field(default=8, metadata=_help("Adapter rank r (lora, adalora's init_r, loha, lokr)."))
    alpha: float = field(default=16.0, metadata=_help("Adapter scaling alpha (lora, loha, lokr; adalora)."))
    dropout: float = field(default=0.0, metadata=_help("Adapter dropout (lora, adalora, loha/lokr module dropout)."))
    target_modules: tuple[str, ...] = field(
        default=(),
        metadata=_help(
            "Module names to adapt (repeat the flag); empty: all linear layers for lora/adalora/loha/lokr, "
            "peft's per-architecture default (else attention + MLP output) for ia3."
        ),
    )
    num_virtual_tokens: int = field(default=8, metadata=_help("Virtual tokens of prefix, prompt and p_tuning."))
    total_steps: int = field(default=100, metadata=_help("Training steps (adalora's rank schedule needs it)."))

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise UnsupportedPeftMethodError(f"--rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise UnsupportedPeftMethodError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.num_virtual_tokens < 1:
            raise UnsupportedPeftMethodError(f"--num-virtual-tokens must be >= 1, got {self.num_virtual_tokens}")


Builder = Callable[[MethodOptions, "nn.Module"], dict[str, Any]]


@dataclass(frozen=True)
class Method:
    """One PEFT method: its peft config class (by name, so listing methods needs no peft import)
    and the keywords our common options map to."""

    name: str
    config_class_name: str
    defaults: Builder
    summary: str

    @property
    def config_class(self) -> type[peft.PeftConfig]:
        import peft

        return getattr(peft, self.config_class_name)


def _targets(options: MethodOptions) -> list[str] | str:
    return list(options.target_modules) or "all-linear"


def _lora(o: MethodOptions, model: nn.Module) -> dict[str, Any]:
    return dict(r=o.rank, lora_alpha=o.alpha, lora_dropout=o.dropout, target_modules=_targets(o))


def _adalora(o: MethodOptions, model: nn.Module) -> dict[str, Any]:
    # AdaLoRA prunes ranks from init_r to target_r over the run; it must know the run's length.
    total = max(o.total_steps, 3)
    return dict(
        init_r=o.rank,
        target_r=max(1, o.rank // 2),
        lora_alpha=o.alpha,
        lora_dropout=o.dropout,
        total_step=total,
        tinit=total // 10,
        tfinal=total // 10,
        target_modules=_targets(o),
    )


def _loha(o: MethodOptions, model: nn.Module) -> dict[str, Any]:
    return dict(r=o.rank, alpha=o.alpha, module_dropout=o.dropout, target_modules=_targets(o))


def _lokr(o: MethodOptions, model: nn.Module) -> dict[str, Any]:
    return dict(r=o.rank, alpha=o.alpha, module_dropout=o.dropout, target_modules=_targets(o))


def _ia3(o: MethodOptions, model: nn.Module) -> dict[str, Any]:
    targets, feedforward = ia3_modules(model)
    if o.target_modules:
        targets = list(o.target_modules)
        feedforward = [name for name in feedforward if name in targets]
    return dict(target_modules=targets, feedforward_modules=feedforward)


def _virtual(o: MethodOptions, model: nn.Module) -> dict[str, Any]:
    return dict(num_virtual_tokens=o.num_virtual_tokens)


def _p_tuning(o: MethodOptions, model: nn.Module) -> dict[str, Any]:
    hidden = getattr(model.config, "hidden_size", None) or getattr(model.config, "n_embd", 128)
    return dict(num_virtual_tokens=o.num_virtual_tokens, encoder_hidden_size=hidden)


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("lora", "LoraConfig", _lora, "low-rank update B·A added to each target linear"),
        Method("ia3", "IA3Config", _ia3, "learned per-channel scaling of attention k/v and MLP input"),
        Method("adalora", "AdaLoraConfig", _adalora, "LoRA with SVD-style rank pruned during training"),
        Method("loha", "LoHaConfig", _loha, "low-rank Hadamard product update"),
        Method("lokr", "LoKrConfig", _lokr, "low-rank Kronecker product update"),
        Method("prefix", "PrefixTuningConfig", _virtual, "learned key/value prefix in every attention layer"),
        Method("prompt", "PromptTuningConfig", _virtual, "learned soft prompt embeddings"),
        Method("p_tuning", "PromptEncoderConfig", _p_tuning, "soft prompt produced by a small MLP encoder"),
    )
}


def get_method(name: str) -> Method:
    """The registered method ``name``, or ``UnsupportedPeftMethodError`` naming the supported ones."""
    method = METHODS.get(name.lower().replace("-", "_"))
    if method is None:
        raise UnsupportedPeftMethodError(f"unknown PEFT method {name!r}; supported: {', '.join(METHODS)}")
    return method


def read_peft_config_file(path: Path) -> dict[str, Any]:
    """Keyword overrides from a JSON object (``peft_type``/``task_type`` keys are ignored)."""
    try:
        values = json.loads(Path(path).read_text())
    except OSError as exc:
        raise UnsupportedPeftMethodError(f"cannot read --peft-config {str(path)!r}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UnsupportedPeftMethodError(f"--peft-config {str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(values, dict):
        raise UnsupportedPeftMethodError(f"--peft-config {str(path)!r} must hold a JSON object of peft config keywords")
    for key in ("peft_type", "task_type", "base_model_name_or_path", "revision"):
        values.pop(key, None)
    return values


def build_peft_config(
    name: str,
    model: nn.Module,
    options: MethodOptions | None = None,
    overrides: dict[str, Any] | None = None,
    *,
    source: str | None = None,
) -> peft.PeftConfig:
    """The peft config of method ``name`` for ``model`` (a causal LM), common options then overrides.

    ``source`` names where the overrides came from (``--peft-config 'FILE'``) in error messages.
    """
    method = get_method(name)
    options = options or MethodOptions()
    where = f"{source}: " if source else ""
    kwargs = method.defaults(options, model)
    kwargs.update(overrides or {})
    known = {f.name for f in dataclasses.fields(method.config_class)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise UnsupportedPeftMethodError(
            f"{where}{method.config_class.__name__} ({method.name}) has no option(s) {unknown}; "
            "see peft's documentation"
        )
    check_override_types(method, overrides or {}, where)
    try:
        return method.config_class(task_type=TASK, **kwargs)
    except (TypeError, ValueError) as exc:
        raise UnsupportedPeftMethodError(f"{where}invalid {method.name} options: {exc}") from None


def check_override_types(method: Method, overrides: dict[str, Any], where: str = "") -> None:
    """Refuse an override whose JSON value is not of the kind its peft config field is annotated with.

    peft checks few types when a config is made: ``{"r": "x"}`` is accepted, then fails inside
    ``get_peft_model`` with a ``TypeError`` naming neither the key nor the file. Numbers are not
    told apart (peft's own defaults put floats in fields annotated ``int``, e.g. ``lora_alpha``),
    and a field whose annotation cannot be read is left to peft.
    """
    try:
        hints = typing.get_type_hints(method.config_class)
    except Exception:  # noqa: BLE001 - an annotation this Python cannot resolve: peft decides
        return
    for key, value in overrides.items():
        hint = hints.get(key)
        if hint is not None and not _json_matches(value, hint):
            raise UnsupportedPeftMethodError(
                f"{where}{key!r} must be {_describe(hint)} for {method.name}, got {json.dumps(value)}"
            )


_NUMBER_TYPES = (int, float)


def _json_matches(value: Any, hint: Any) -> bool:
    """Whether a JSON value can be what ``hint`` says (unknown kinds of hint: yes)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return True
    if hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_json_matches(value, arm) for arm in args)
    if origin is typing.Literal:  # any value of a listed kind: some are patterns ("pissa_niter_[number of iters]")
        return any(_json_matches(value, type(arg)) for arg in args)
    if origin in (list, tuple, set, frozenset) or hint in (list, tuple, set, frozenset):
        return isinstance(value, list) and (not args or all(_json_matches(item, args[0]) for item in value))
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if hint is bool:
        return isinstance(value, bool)
    if hint in _NUMBER_TYPES:
        return isinstance(value, _NUMBER_TYPES) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True


def _describe(hint: Any) -> str:
    """``hint`` in JSON words: "a list of strings or null"."""
    names = {bool: "true or false", int: "a number", float: "a number", str: "a string", type(None): "null"}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(_describe(arm) for arm in args))
    if origin is typing.Literal:
        return "one of " + ", ".join(json.dumps(arg) for arg in args)
    if origin in (list, tuple, set, frozenset) or hint in (list, tuple, set, frozenset):
        return f"a list of {_describe(args[0]).removeprefix('a ')}s" if args else "a list"
    if origin is dict or hint is dict:
        return "an object"
    return names.get(hint, getattr(hint, "__name__", str(hint)))


# ---------------------------------------------------------------------------- IA3 modules


def _linear_types() -> tuple[type[nn.Module], ...]:
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    return (nn.Linear, Conv1D)


def _in_out(module: nn.Module) -> tuple[int, int]:
    from torch import nn

    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.nx, module.nf  # Conv1D


def ia3_modules(model: nn.Module) -> tuple[list[str], list[str]]:
    """(target_modules, feedforward_modules) for IA3 on ``model``.

    IA3 scales the *output* of attention projections but the *input* of the MLP's output
    projection, so peft must be told which targets are feed-forward. Use peft's own table by
    ``model_type`` when it has one; otherwise read the structure: among the linear layers of the
    first block, the feed-forward one is the MLP projection that narrows (in > out) and is not
    attention; targets are the attention projections plus it.
    """
    from peft.utils import (
        TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING as FEEDFORWARD,
    )
    from peft.utils import (
        TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING as TARGETS,
    )

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in TARGETS and model_type in FEEDFORWARD:
        # Only the names the model has: peft's table predates transformers 5 for some models
        # (mixtral's "w2" is now one 3-D tensor of all experts, no module), and peft says nothing
        # when some targets match.
        names = [name for name, _ in model.named_modules()]
        present = [t for t in TARGETS[model_type] if any(n == t or n.endswith(f".{t}") for n in names)]
        feedforward = [f for f in FEEDFORWARD[model_type] if f in present]
        if present and len(feedforward) < len(FEEDFORWARD[model_type]):
            warnings.warn(
                f"IA3 on {model_type!r} scales {present} only: the MLP's output projection of peft's table "
                f"({FEEDFORWARD[model_type]}) is not a module of this model (MoE experts are one tensor); "
                "name others with --target-modules and feedforward_modules in --peft-config",
                stacklevel=2,
            )
        if present:
            return present, feedforward

    linear = _linear_types()
    block_linears: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if isinstance(module, linear) and ".0." in f".{name}.":
            block_linears[name.split(".0.", 1)[1]] = module
    attention = [n for n in block_linears if "attn" in n or "attention" in n]
    narrowing = [n for n, m in block_linears.items() if n not in attention and _in_out(m)[0] > _in_out(m)[1]]
    if not narrowing:
        raise UnsupportedPeftMethodError(
            f"cannot find the MLP output projection of {model_type!r} for IA3; pass --target-modules and "
            "feedforward_modules in --peft-config"
        )
    leaf = lambda n: n.rsplit(".", 1)[-1]  # noqa: E731
    feedforward = [narrowing[-1]]
    targets = [leaf(n) if sum(leaf(n) == leaf(o) for o in block_linears) == 1 else n for n in attention + feedforward]
    feedforward = [t for t in targets if feedforward[0].endswith(t)]
    return targets, feedforward
