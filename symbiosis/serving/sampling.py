"""Per-request sampling parameters and choosing each row's next token from the batch's logits."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """What one request asked for; ``temperature == 0`` is greedy. Validated by the API layer."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RowSampler:
    """One sequence's sampler: its parameters and its own random stream (seeded if asked)."""

    params: SamplingParams
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        seed = self.params.seed if self.params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.generator = torch.Generator().manual_seed(seed)

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from one row of logits ``[vocab]``."""
        params = self.params
        if params.greedy:
            return int(logits.argmax())
        scores = logits.float() / params.temperature
        if 0 < params.top_k < scores.shape[-1]:
            kth = torch.topk(scores, params.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if params.top_p < 1.0:
            ordered, order = torch.sort(scores, descending=True)
            cumulative = ordered.softmax(-1).cumsum(-1)
            # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
            drop = cumulative - ordered.softmax(-1) >= params.top_p
            scores = scores.scatter(0, order[drop], float("-inf"))
        probs = scores.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def choose_tokens(logits: torch.Tensor, samplers: list[RowSampler]) -> list[int]:
    """Each row's next token; greedy rows in one vectorized argmax."""
    tokens = logits.argmax(-1).tolist()
    for row, sampler in enumerate(samplers):
        if not sampler.params.greedy:
            tokens[row] = sampler.choose(logits[row])
    return tokens
