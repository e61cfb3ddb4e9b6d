"""A checkpoint's context length: how many positions its config says the model covers.

Why jobs check it: a model with learned positions (GPT-2, OPT) fails past its last position with
an ``IndexError`` deep inside ``transformers``, and a rotary one (LLaMA) runs on silently into
positions it was never trained on. ``generate`` refuses a prompt that would not fit (as vLLM's
OpenAI server and ``symbiosis api`` do) and ``finetune`` cuts examples to the context, as it cuts
them to ``--seq-len``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from symbiosis.errors import CheckpointError
from symbiosis.jobs.data import TokenizedExample
from symbiosis.jobs.train_options import TrainOptions

#: Where configs name their context, in the order they are read (``symbiosis api`` reads it here too).
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def context_length(config: Mapping[str, Any]) -> int | None:
    """The context length in a ``config.json`` mapping (a multimodal one's ``text_config``), or
    None where the config names none."""
    text_config = config.get("text_config")
    if isinstance(text_config, Mapping):
        config = text_config
    for name in CONTEXT_FIELDS:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def read_context_length(model_dir: Path) -> int | None:
    """``context_length`` of the checkpoint folder ``model_dir``'s ``config.json``."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except OSError as exc:
        raise CheckpointError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise CheckpointError(f"{str(path)!r} is not valid JSON: {exc}") from None
    return context_length(config) if isinstance(config, dict) else None


def cap_seq_len(train: TrainOptions, context: int | None) -> TrainOptions:
    """``train`` with ``seq_len`` capped to the model's context: a longer example has no positions
    past it, so it is cut there like any example longer than ``seq_len``."""
    if context is None or train.seq_len <= context:
        return train
    return dataclasses.replace(train, seq_len=context)


def note_cut_to_context(seq_len: int, context: int, model: Path, examples: Sequence[TokenizedExample]) -> None:
    """Say on stderr that the context, not --seq-len, cut some examples. Only when one reached
    the context: the default --seq-len exceeds a small model's context, and a run whose examples
    are all shorter trains exactly as asked."""
    cut = sum(len(example.input_ids) >= context for example in examples)
    if cut:
        print(
            f"note: --seq-len {seq_len} is more than the {context}-token context of {str(model)!r}; "
            f"{cut} example(s) reached it (longer ones were cut there)",
            file=sys.stderr,
        )
