"""Small synthetic tasks whose accuracy can be measured: the demo's proof that adapters learn.

A random-weight model knows nothing, so the demo needs tasks it can learn in a minute or two on
a CPU and whose success is unambiguous. Each task maps a short string of letters to another one
("CAB=" → "ABC" for sort). The letters are upper-case because the project tokenizer never merges
two of them, so one letter is one token and the tasks stay short.

Train and held-out examples are disjoint sets of inputs (all inputs of the given length over the
alphabet are enumerated, shuffled with a seed, and split), so the accuracy after fine-tuning
measures a learned rule, not memorized examples.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from symbiosis.errors import ConfigurationError
from symbiosis.jobs.data import Record

ALPHABET = "ABCDEF"
SEPARATOR = "="


def _cipher(alphabet: str) -> Callable[[str], str]:
    # A fixed derangement (no letter maps to itself), the same for every run.
    mapping = dict(zip(alphabet, alphabet[2:] + alphabet[:2]))
    return lambda s: "".join(mapping.get(c, c) for c in s)


def _successors(alphabet: str) -> Callable[[str], str]:
    def rule(s: str) -> str:
        i = alphabet.index(s[-1])
        return "".join(alphabet[(i + k) % len(alphabet)] for k in range(1, len(s) + 1))

    return rule


@dataclass(frozen=True)
class Task:
    """A string-to-string rule over ``alphabet``."""

    name: str
    description: str
    rule: Callable[[str], str]
    separator: str = SEPARATOR  # between input and answer; "" makes the answer continue the input


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("copy", "repeat the letters", lambda s: s),
        Task("reverse", "the letters in reverse order", lambda s: s[::-1]),
        Task("sort", "the letters in alphabetical order", lambda s: "".join(sorted(s))),
        Task("map", "each letter shifted by two (A→C, F→B)", _cipher(ALPHABET)),
        Task("first", "the first letter, repeated", lambda s: s[0] * len(s)),
        Task("last", "the last letter, repeated", lambda s: s[-1] * len(s)),
        # No separator: each answer letter follows from the letter just before it, a rule that
        # even methods which cannot re-route attention (prefix tuning) can learn.
        Task(
            "next",
            "continue the alphabet after the last letter (F is followed by A)",
            _successors(ALPHABET),
            separator="",
        ),
    )
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ConfigurationError(f"unknown task {name!r}; available: {', '.join(TASKS)}")
    return TASKS[name]


@dataclass(frozen=True)
class TaskSplit:
    """Disjoint train and held-out examples of one task."""

    task: Task
    train: list[Record]
    held_out: list[Record]


def make_split(
    task: Task, *, length: int = 3, alphabet: str = ALPHABET, n_held_out: int = 48, seed: int = 0
) -> TaskSplit:
    """Every input of ``length`` letters, shuffled by ``seed``; the first ``n_held_out`` are held out."""
    inputs = ["".join(letters) for letters in itertools.product(alphabet, repeat=length)]
    random.Random(seed).shuffle(inputs)
    if not 0 < n_held_out < len(inputs):
        raise ConfigurationError(f"n_held_out must be between 1 and {len(inputs) - 1}")
    records = [Record(s + task.separator, task.rule(s)) for s in inputs]
    return TaskSplit(task, train=records[n_held_out:], held_out=records[:n_held_out])


@torch.no_grad()
def exact_match_accuracy(model, tokenizer, records: Sequence[Record], *, batch_size: int = 48) -> float:
    """Fraction of ``records`` whose greedy continuation starts with exactly the completion's tokens.

    Generation is greedy for as many tokens as the expected answer has (an early end-of-sequence
    counts as wrong). Prompts are batched only
    with prompts of the same token length, so no padding is involved and the figure is the same
    as one-by-one generation.
    """
    if not records:
        return 0.0
    was_training = model.training
    model.eval()
    by_length: dict[int, list[tuple[list[int], list[int]]]] = {}
    for record in records:
        prompt = tokenizer(record.prompt, add_special_tokens=False, verbose=False)["input_ids"]
        answer = tokenizer(record.completion, add_special_tokens=False, verbose=False)["input_ids"]
        by_length.setdefault(len(prompt), []).append((prompt, answer))
    correct = 0
    for items in by_length.values():
        for start in range(0, len(items), batch_size):
            chunk = items[start : start + batch_size]
            width = max(len(answer) for _, answer in chunk)
            input_ids = torch.tensor([prompt for prompt, _ in chunk])
            output = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=width,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
            generated = output[:, input_ids.shape[1] :].tolist()
            correct += sum(tokens[: len(answer)] == answer for tokens, (_, answer) in zip(generated, chunk))
    model.train(was_training)
    return correct / len(records)
