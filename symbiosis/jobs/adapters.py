"""Loading PEFT adapter folders onto a model, and refusing those made for another model.

Adapters are loaded with plain peft (``PeftModel.from_pretrained`` for the first, ``load_adapter``
for the others). peft fails on an adapter of another base model in three ways, none of them a
message a user can act on: another architecture leaves it no module to adapt
(``NoMatchingPeftModuleError``), another size makes ``load_state_dict`` refuse the tensors
(``RuntimeError: size mismatch``), and a prefix/prompt adapter loads fine and fails only in the
first forward, with a shape error deep in attention. The first two are caught and reworded here;
the third is checked before loading, from the sizes peft itself would derive for this model.
"""

from __future__ import annotations

import functools
import json
import re
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from symbiosis.errors import CheckpointError, SymbiosisError

#: The sizes a prefix/prompt adapter records from the model it was made for (peft derives them in
#: ``_prepare_prompt_learning_config``). A prefix is a key/value cache for every layer, so all must
#: match; a soft prompt is a row of input embeddings, so only their width must.
_PROMPT_LEARNING_SIZES = ("num_layers", "token_dim", "num_attention_heads")
_SIZES_THAT_MATTER = {"PREFIX_TUNING": _PROMPT_LEARNING_SIZES, "CARTRIDGE": _PROMPT_LEARNING_SIZES}
_EMBEDDING_WIDTH = ("token_dim",)
_SIZE_MISMATCH = re.compile(
    r"size mismatch for (\S+): copying a param with shape torch\.Size\((\[[^\]]*\])\) from checkpoint, "
    r"the shape in current model is torch\.Size\((\[[^\]]*\])\)"
)


def read_adapter_config(
    folder: Path, error: type[SymbiosisError] = CheckpointError, label: str | None = None
) -> dict[str, Any]:
    """The parsed ``adapter_config.json`` of an adapter folder; ``error`` (the caller's type: the
    API server answers its own with a 400) when it is missing, not JSON or not an object, naming
    the adapter ``label`` (default: its folder; the API server's names it as it is served)."""
    label = label or repr(str(folder))
    try:
        value = json.loads((Path(folder) / "adapter_config.json").read_text())
    except OSError:
        raise error(f"adapter {label} has no readable adapter_config.json") from None
    except ValueError as exc:
        raise error(f"adapter {label}: adapter_config.json is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise error(f"adapter {label}: adapter_config.json must hold a JSON object")
    return value


def adapter_type(folder: Path) -> str:
    return str(read_adapter_config(folder).get("peft_type", "?"))


def trains_base_biases(folder: Path) -> bool:
    """Whether the adapter changes its base layers' biases (peft's ``bias="all"`` or
    ``"lora_only"``): those are the model's own parameters, shared by every adapter loaded beside
    it, so it needs a model of its own to run as itself."""
    return read_adapter_config(folder).get("bias", "none") not in (None, "none")


def virtual_tokens(folder: Path) -> int:
    """Positions a prefix/prompt adapter takes before the prompt (0 for every other method)."""
    value = read_adapter_config(folder).get("num_virtual_tokens")
    return value if isinstance(value, int) and value > 0 else 0


def attach_adapters(model, folders: list[Path], names: list[str], model_dir: Path | None = None):
    """``model`` with the adapters in ``folders`` (all of one peft type) loaded as ``names``.

    An adapter that does not fit ``model`` (made for another architecture or size) raises
    ``CheckpointError`` naming the model it was made for; ``model_dir`` names this one.
    """
    if not folders:
        return model
    from peft import PeftModel

    for folder in folders:
        check_prompt_learning_fits(model, folder, model_dir)
    first = functools.partial(PeftModel.from_pretrained, model, str(folders[0]), adapter_name=names[0])
    peft_model = _load(first, folders[0], model_dir)
    for folder, name in zip(folders[1:], names[1:]):
        _load(functools.partial(peft_model.load_adapter, str(folder), adapter_name=name), folder, model_dir)
    peft_model.eval()
    return peft_model


def check_prompt_learning_fits(model, folder: Path, model_dir: Path | None = None) -> None:
    """Refuse a prefix/prompt adapter whose recorded sizes are not the ones ``model`` needs."""
    try:  # peft's own sizing function: private, so a peft without it skips this check
        from peft.utils import _prepare_prompt_learning_config
    except ImportError:
        return
    config = read_adapter_config(folder)
    if not all(name in config for name in _PROMPT_LEARNING_SIZES):
        return  # not a prompt-learning adapter: peft's own loading notices a mismatch
    # What peft would record for this model: its sizing function fills exactly the fields left None.
    needed = types.SimpleNamespace(peft_type=config.get("peft_type"), encoder_hidden_size=0)
    needed.__dict__.update(dict.fromkeys(_PROMPT_LEARNING_SIZES))
    try:
        _prepare_prompt_learning_config(needed, model.config)
    except Exception:  # noqa: BLE001 - a private function: whatever it does now, loading still runs
        return  # peft cannot size one for this model (or has changed): loading will say why
    wrong = [
        f"{name} {config[name]} (this model: {getattr(needed, name)})"
        for name in _SIZES_THAT_MATTER.get(str(config.get("peft_type")), _EMBEDDING_WIDTH)
        if config[name] != getattr(needed, name)
    ]
    if wrong:
        raise CheckpointError(_does_not_fit(folder, model_dir, ", ".join(wrong)))


def _load(load: Callable[[], Any], folder: Path, model_dir: Path | None) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return load()
        except SymbiosisError:
            raise  # ours (some are ValueError or RuntimeError too): already says what is wrong
        except (ValueError, RuntimeError) as exc:  # see the module docstring: peft's two mismatch errors
            reason = _mismatch_reason(exc)
            if reason is None:
                raise  # another failure: not ours to reword as a user's mistake
            raise CheckpointError(_does_not_fit(folder, model_dir, reason)) from exc


def _mismatch_reason(exc: Exception) -> str | None:
    """Why the adapter does not fit, when ``exc`` is one of peft's two mismatch errors; else None."""
    import peft

    message = str(exc)
    # peft's ValueError for "no target module found" (older peft: a plain ValueError saying so).
    no_match = getattr(peft, "NoMatchingPeftModuleError", ())
    if isinstance(exc, no_match) or "not found in the base model" in message:
        return "none of the modules it adapts exists in this model"
    found = _SIZE_MISMATCH.search(message)
    if found:
        name, saved, here = found.groups()
        return f"its tensor shapes differ from this model's ({name}: {saved} in the adapter, {here} here)"
    return None


def _does_not_fit(folder: Path, model_dir: Path | None, reason: str) -> str:
    made_for = read_adapter_config(folder).get("base_model_name_or_path")
    model = f"model {str(model_dir)!r}" if model_dir is not None else "this model"
    origin = f" (it was made for {made_for!r})" if made_for else ""
    return f"adapter {str(folder)!r} does not fit {model}{origin}: {reason}"
