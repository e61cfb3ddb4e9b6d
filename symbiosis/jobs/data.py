"""Training data: JSONL records → token ids and labels → padded batches, in a resumable order.

Two record shapes, as in most fine-tuning tools:

- ``{"text": "..."}`` — every token is trained on (plain language modelling);
- ``{"prompt": "...", "completion": "..."}`` — only the completion (and the end-of-sequence
  token after it) is trained on: the prompt's labels are -100, so the loss teaches the answer,
  not the question.

The batch order is a pure function of ``(seed, epoch)`` (a fresh permutation per epoch), so a
resumed run only needs the position ``(epoch, index)`` to continue with exactly the batches the
uninterrupted run would have seen.

Size bounds: a line longer than ``MAX_LINE_BYTES`` is refused before it is read whole, and a text
is tokenized only as far as its first ``seq_len`` tokens need (``token_ids``), so a huge record
costs no more than a short one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from symbiosis.errors import SymbiosisError

IGNORE_INDEX = -100

#: Longest line of a JSONL (or prompts) file, in bytes. A long-context record is well under a
#: megabyte; a longer line is a broken file, and reading it whole could exhaust memory.
MAX_LINE_BYTES = 16 * 2**20
#: Tokens past ``seq_len`` that a cut text must still yield, so that the cut (which can change
#: the tokens right before it) is far from the tokens kept.
_CUT_MARGIN_TOKENS = 64


class DataError(SymbiosisError):
    """A dataset file is missing, or a line of it is not a valid training record."""

    code = "data"


@dataclass(frozen=True)
class Record:
    """One training example as text. ``prompt`` is empty for plain ``text`` records."""

    prompt: str
    completion: str


@dataclass(frozen=True)
class TokenizedExample:
    input_ids: list[int]
    labels: list[int]

    @property
    def trained_tokens(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels)


def read_lines(path: str | Path, what: str = "data file") -> Iterator[tuple[int, str]]:
    """``(number, text)`` of each line of ``path`` (UTF-8, split at newlines only).

    A line longer than ``MAX_LINE_BYTES`` raises ``DataError`` after reading at most that many
    bytes of it; so does a line that is not UTF-8 (both naming the file and the line number).
    """
    path = Path(path)
    try:
        file = path.open("rb")
    except FileNotFoundError:
        raise DataError(f"{what} {str(path)!r} does not exist") from None
    except OSError as exc:
        raise DataError(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from None
    with file:
        number = 0
        while True:
            try:
                raw = file.readline(MAX_LINE_BYTES + 1)
            except OSError as exc:  # a folder, an unreadable device
                raise DataError(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from None
            if not raw:
                return
            number += 1
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                raise DataError(f"{path}:{number}: line longer than {MAX_LINE_BYTES:,} bytes; split the record")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}:{number}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
            yield number, text.rstrip("\r\n")


def read_jsonl(path: str | Path) -> list[Record]:
    """Read ``path``; a malformed line raises ``DataError`` naming the file and the line number."""
    path = Path(path)
    records = []
    for number, line in read_lines(path):
        if line.strip():
            records.append(parse_record(line, f"{path}:{number}"))
    if not records:
        raise DataError(f"data file {str(path)!r} holds no records")
    return records


def parse_record(line: str, where: str) -> Record:
    """One JSONL line → ``Record``; ``where`` ("file:line") goes into the error message."""
    try:
        value = json.loads(line)
    except ValueError as exc:
        raise DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(value, dict):
        raise DataError(f"{where}: expected a JSON object with 'text' or 'prompt'/'completion'")
    if "text" in value:
        text = value["text"]
        if not isinstance(text, str) or not text:
            raise DataError(f"{where}: 'text' must be a non-empty string")
        return Record("", text)
    if "prompt" in value and "completion" in value:
        prompt, completion = value["prompt"], value["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str) or not completion:
            raise DataError(f"{where}: 'prompt' must be a string and 'completion' a non-empty string")
        return Record(prompt, completion)
    raise DataError(f"{where}: expected a 'text' key or both 'prompt' and 'completion' keys, got {sorted(value)}")


def tokenize(tokenizer, record: Record, seq_len: int) -> TokenizedExample:
    """Token ids of prompt + completion + eos, labels -100 on the prompt, cut to ``seq_len``.

    Prompt and completion are tokenized separately so that the prompt's tokens are exactly what
    generation will see at inference time.
    """
    prompt_ids = token_ids(tokenizer, record.prompt, seq_len)
    completion_ids = token_ids(tokenizer, record.completion, seq_len)
    if tokenizer.eos_token_id is not None:
        completion_ids = completion_ids + [tokenizer.eos_token_id]
    input_ids = (prompt_ids + completion_ids)[:seq_len]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + completion_ids)[:seq_len]
    return TokenizedExample(input_ids, labels)


def token_ids(tokenizer, text: str, limit: int) -> list[int]:
    """The first ``limit`` (or more) token ids of ``text``, tokenizing only a prefix of it.

    Tokenizing costs time and memory in proportion to the text, and records are cut to
    ``seq_len`` tokens anyway: a 10 MB line must not take seconds and gigabytes to give 16 tokens.
    The prefix starts at a few characters per token and doubles until it yields
    ``_CUT_MARGIN_TOKENS`` more tokens than ``limit`` (or is the whole text), so the cut lies far
    from the tokens kept: those are the ones the whole text would give.
    """
    if not text:
        return []
    chars = 4 * (limit + _CUT_MARGIN_TOKENS)
    while True:
        whole = chars >= len(text)
        # verbose=False: no "longer than the model's maximum" warning, the cut to ``limit`` handles it.
        ids = tokenizer(text if whole else text[:chars], add_special_tokens=False, verbose=False)["input_ids"]
        if whole:
            return ids
        if len(ids) >= limit + _CUT_MARGIN_TOKENS:
            return ids[:limit]
        chars *= 2


def tokenize_all(tokenizer, records: Iterable[Record], seq_len: int, source: str = "data") -> list[TokenizedExample]:
    examples = [tokenize(tokenizer, record, seq_len) for record in records]
    kept = [e for e in examples if e.trained_tokens > 0]
    if not kept:
        raise DataError(f"{source}: no example has a trained token within --seq-len {seq_len} (prompts too long?)")
    return kept


def collate(examples: Sequence[TokenizedExample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example; padding has attention 0 and label -100."""
    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        input_ids[row, :n] = torch.tensor(example.input_ids)
        labels[row, :n] = torch.tensor(example.labels)
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def split_eval(items: Sequence, eval_fraction: float, seed: int) -> tuple[list, list]:
    """(train, eval): a seeded shuffle, then the last ``eval_fraction`` (at least 1 if > 0) is eval."""
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"eval fraction must be in [0, 1), got {eval_fraction}")
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = 0 if eval_fraction == 0 else max(1, round(len(items) * eval_fraction))
    if n_eval >= len(items):
        n_eval = 0
    train = [items[i] for i in order[: len(items) - n_eval]]
    evaluation = [items[i] for i in order[len(items) - n_eval :]]
    return train, evaluation


@dataclass
class BatchOrder:
    """Which examples come next: a seeded permutation per epoch, and the position in it.

    The state (``epoch``, ``index``) is all a checkpoint needs: the permutation is recomputed.
    """

    size: int
    batch_size: int
    seed: int
    epoch: int = 0
    index: int = 0

    def __post_init__(self) -> None:
        if self.size < 1:
            raise DataError("no training examples")
        self._permutation: list[int] | None = None

    def _order(self) -> list[int]:
        if self._permutation is None:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
            self._permutation = torch.randperm(self.size, generator=generator).tolist()
        return self._permutation

    def next_indices(self) -> list[int]:
        """The next batch; an epoch's last short batch is served, then a new epoch starts."""
        if self.index >= self.size:
            self.epoch += 1
            self.index = 0
            self._permutation = None
        order = self._order()
        batch = order[self.index : self.index + self.batch_size]
        self.index += len(batch)
        return batch

    def steps_per_epoch(self, grad_accum: int) -> int:
        batches = -(-self.size // self.batch_size)
        return max(1, -(-batches // grad_accum))

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._permutation = None
