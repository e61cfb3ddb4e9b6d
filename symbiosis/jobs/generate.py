"""Inference job: a split client model with zero or more PEFT adapters, streaming tokens as they come.

Adapters are loaded with plain peft (``adapters.py``; each named after its folder) and chosen per
prompt with ``set_adapter``; the split model makes no difference to that code. peft cannot hold
adapters of different types (LoRA and IA3) in one model, so each type gets its own client model:
clients are cheap here, since they share the executor's base weights. Tokens are decoded
incrementally and written as soon as they form complete characters, like
``transformers.TextStreamer`` but without waiting for a whole word (task outputs such as "CBA"
have no spaces).

Every prompt is checked against the model's context before anything connects: prompt, new tokens
and an adapter's virtual tokens must fit its positions (``context.py``), as vLLM's OpenAI server
and ``symbiosis api`` require. An empty prompt starts from BOS, as ``symbiosis api`` does.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch
from transformers.generation.streamers import BaseStreamer

from symbiosis.jobs.adapters import adapter_type, attach_adapters, trains_base_biases, virtual_tokens
from symbiosis.jobs.base import JobError, flag
from symbiosis.jobs.client import (
    ClientOptions,
    ExecutorTarget,
    executor_restart_hint,
    load_tokenizer,
    require_model_dir,
    start_token_id,
)
from symbiosis.jobs.context import read_context_length
from symbiosis.jobs.data import DataError, read_lines


@dataclass(frozen=True)
class SamplingOptions:
    """Decoding parameters; ``temperature == 0`` means greedy."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        problems = [
            f"{flag(name)} must be {rule}, got {getattr(self, name)}"
            for name, rule, ok in (
                ("max_new_tokens", ">= 1", self.max_new_tokens >= 1),
                ("temperature", ">= 0", self.temperature >= 0),
                ("top_p", "in (0, 1]", 0 < self.top_p <= 1),
                ("top_k", ">= 0", self.top_k >= 0),
            )
            if not ok
        ]
        if problems:
            raise JobError("; ".join(problems))

    def generate_kwargs(self) -> dict:
        if self.temperature == 0:
            return {"do_sample": False, "max_new_tokens": self.max_new_tokens}
        return {
            "do_sample": True,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k or None,
            "max_new_tokens": self.max_new_tokens,
        }


@dataclass(frozen=True)
class PromptJob:
    prompt: str
    adapter: str | None = None  # None: every loaded adapter (or the base model if none)


@dataclass
class GenerateOptions:
    model: Path
    client: ClientOptions
    prompts: list[str] = field(default_factory=list)
    prompts_file: Path | None = None
    adapters: list[Path] = field(default_factory=list)
    sampling: SamplingOptions = field(default_factory=SamplingOptions)


@dataclass(frozen=True)
class Completion:
    prompt: str
    adapter: str | None
    text: str
    new_tokens: int


class TextWriterStreamer(BaseStreamer):
    """Writes decoded text to ``write`` as tokens arrive (batch size 1), skipping the prompt.

    Decodes the whole generated sequence each time and emits only the new suffix, holding back a
    trailing incomplete character (U+FFFD) until the next token completes it.
    """

    def __init__(self, tokenizer, write: Callable[[str], None]) -> None:
        self.tokenizer = tokenizer
        self.write = write
        self._prompt_pending = True
        self._tokens: list[int] = []
        self._emitted = 0

    def put(self, value: torch.Tensor) -> None:
        if value.dim() > 1 and value.shape[0] > 1:
            raise ValueError("TextWriterStreamer supports batch size 1 only")
        if self._prompt_pending:  # generate() first puts the prompt
            self._prompt_pending = False
            return
        self._tokens.extend(value.reshape(-1).tolist())
        text = self.tokenizer.decode(self._tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        if len(text) > self._emitted:
            self.write(text[self._emitted :])
            self._emitted = len(text)

    def end(self) -> None:
        text = self.tokenizer.decode(self._tokens, skip_special_tokens=True)
        if len(text) > self._emitted:
            self.write(text[self._emitted :])
        self._emitted = len(text)

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self._tokens, skip_special_tokens=True)


def read_prompts(path: Path) -> list[PromptJob]:
    """Plain lines, or JSONL objects with ``prompt`` (and optional ``adapter``)."""
    jobs = []
    for number, line in read_lines(path, "prompts file"):  # lines are capped at MAX_LINE_BYTES
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                value = json.loads(line)
            except ValueError as exc:
                raise DataError(f"{path}:{number}: not valid JSON ({exc})") from None
            if not isinstance(value.get("prompt"), str):
                raise DataError(f"{path}:{number}: expected a 'prompt' string")
            jobs.append(PromptJob(value["prompt"], value.get("adapter")))
        else:
            jobs.append(PromptJob(line))
    return jobs


def adapter_names(folders: list[Path]) -> list[str]:
    """A unique name per adapter folder: its folder name, suffixed if two folders share it."""
    names: list[str] = []
    for folder in folders:
        base = Path(folder).name or "adapter"
        name, n = base, 2
        while name in names:
            name, n = f"{base}_{n}", n + 1
        names.append(name)
    return names


def prompt_ids(tokenizer, prompt: str) -> torch.Tensor:
    """The prompt's token ids, shape (1, n); an empty prompt is BOS (else EOS), as in ``symbiosis api``."""
    # verbose=False: a prompt longer than the model's context is refused by ``check_context`` in
    # one line, without the tokenizer's own warning about it.
    input_ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt", verbose=False)["input_ids"]
    return input_ids if input_ids.shape[1] > 0 else torch.tensor([[start_token_id(tokenizer)]])


def check_context(
    jobs: list[PromptJob], tokenizer, context: int, sampling: SamplingOptions, reserved: dict[str | None, int]
) -> None:
    """Refuse a prompt whose tokens, new tokens and virtual tokens (``reserved``: per adapter name,
    for each name the prompt runs with) exceed ``context`` positions, naming the first such prompt."""
    for number, job in enumerate(jobs, 1):
        names = [job.adapter] if job.adapter else list(reserved)
        virtual = max(reserved.get(name, 0) for name in names)
        length = prompt_ids(tokenizer, job.prompt).shape[1]
        total = length + sampling.max_new_tokens + virtual
        if total > context:
            extra = f" + {virtual} virtual tokens of its adapter" if virtual else ""
            raise JobError(
                f"prompt {number}: this model's maximum context length is {context} tokens, but {length} prompt "
                f"tokens + {sampling.max_new_tokens} new tokens (--max-new-tokens){extra} = {total} were requested; "
                "shorten the prompt or lower --max-new-tokens"
            )


@torch.no_grad()
def generate_one(
    model, tokenizer, prompt: str, sampling: SamplingOptions, write: Callable[[str], None] | None = None
) -> Completion:
    """Generate a continuation of ``prompt``, streaming it to ``write`` token by token."""
    input_ids = prompt_ids(tokenizer, prompt)
    device = next(model.parameters()).device
    streamer = TextWriterStreamer(tokenizer, write or (lambda s: None))
    torch.manual_seed(sampling.seed)
    output = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=torch.ones_like(input_ids).to(device),
        pad_token_id=tokenizer.pad_token_id,
        streamer=streamer,
        **sampling.generate_kwargs(),
    )
    new_tokens = output.shape[1] - input_ids.shape[1]
    return Completion(prompt, None, streamer.text, new_tokens)


def generate(options: GenerateOptions, out: TextIO | None = None) -> list[Completion]:
    """Run every prompt with every chosen adapter, streaming to ``out`` (stdout by default)."""
    out = out or sys.stdout
    jobs = [PromptJob(p) for p in options.prompts]
    if options.prompts_file is not None:
        jobs += read_prompts(options.prompts_file)
    if not jobs:
        raise JobError("give --prompt TEXT or --prompts FILE")
    tokenizer = load_tokenizer(require_model_dir(options.model))  # a local folder, never a hub id
    names = adapter_names(options.adapters)
    for folder in options.adapters:
        adapter_type(folder)  # a bad adapter folder fails before connecting
    for job in jobs:
        if job.adapter is not None and job.adapter not in names:
            raise JobError(f"prompt names adapter {job.adapter!r}, but the loaded adapters are {names}")
    context = read_context_length(options.model)
    if context is not None:  # so does a prompt the model has no positions for
        reserved = {name: virtual_tokens(folder) for name, folder in zip(names, options.adapters)} or {None: 0}
        check_context(jobs, tokenizer, context, options.sampling, reserved)

    def write(text: str) -> None:
        out.write(text)
        out.flush()

    completions = []
    with ExecutorTarget(options.model, options.client) as target:
        model_of: dict[str | None, object] = {}
        # One model per peft type, its adapters switched with set_adapter; one of its own for an
        # adapter that changes the base layers' biases (shared by all of a model's adapters: the
        # others' prompts ran with its biases, and a second such adapter failed in peft).
        groups: dict[tuple[str, int], list[int]] = {}
        for i, folder in enumerate(options.adapters):
            groups.setdefault((adapter_type(folder), i if trains_base_biases(folder) else -1), []).append(i)
        for indices in groups.values():
            folders, group_names = [options.adapters[i] for i in indices], [names[i] for i in indices]
            model = attach_adapters(target.client(), folders, group_names, options.model)
            model_of.update({names[i]: model for i in indices})
        if not names:
            model_of[None] = target.client()
        with executor_restart_hint(options.client):
            for job in jobs:
                for name in [job.adapter] if job.adapter else (names or [None]):
                    model = model_of[name]
                    if name is not None:
                        model.set_adapter(name)
                    header = f"[{name}] " if len(names) > 1 else ""
                    write(f"{header}{job.prompt}")
                    try:
                        completion = generate_one(model, tokenizer, job.prompt, options.sampling, write)
                    finally:
                        write("\n")  # a failure's message (stderr) starts on a line of its own
                    completions.append(Completion(job.prompt, name, completion.text, completion.new_tokens))
    return completions
