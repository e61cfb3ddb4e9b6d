"""Per-request sampling parameters, choosing each row's next token from the batch's logits, and
the log-probabilities a request may ask for.

What a row's logits go through before a token is chosen, in vLLM's order:

- ``logit_bias`` (OpenAI's): added to the named tokens' logits;
- ``min_tokens`` (vLLM's extra): the end-of-sequence tokens and ``stop_token_ids`` are out of
  reach (-inf) until that many tokens were generated;

and the penalties, as vLLM (and so OpenAI) define them:

- ``repetition_penalty`` (vLLM's extra; ``transformers``' ``RepetitionPenaltyLogitsProcessor``):
  every token already in the prompt or the output has its logit divided by the penalty when
  positive, multiplied by it otherwise (1: off);
- ``frequency_penalty``: minus the penalty times how often the token was generated so far;
- ``presence_penalty``: minus the penalty once for every token generated so far.

then temperature, ``min_p`` (vLLM's extra: tokens less likely than ``min_p`` times the likeliest
are dropped), top-k and top-p; greedy (``temperature == 0``) takes the arg-max after the bias,
the ``min_tokens`` mask and the penalties. Log-probabilities are those of the *raw* model distribution (vLLM's default,
``logprobs_mode="raw_logprobs"``): what the model thinks of the token, whatever the sampling did.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

import torch

#: Most alternatives a request may ask for per token (``logprobs`` / ``top_logprobs``), as vLLM's default.
MAX_LOGPROBS = 20


#: Temperatures below this sample greedily (``SamplingParams.greedy``); vLLM's ``_SAMPLING_EPS``.
GREEDY_BELOW = 1e-5


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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: none; k: the chosen token's and the k most likely ones'
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (``echo``)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias) pairs
    min_p: float = 0.0  # 0: off
    min_tokens: int = 0  # 0: off
    include_stop_str_in_output: bool = False  # vLLM's: the text keeps the stop string that ended it

    @property
    def greedy(self) -> bool:
        # Below GREEDY_BELOW, dividing the logits by the temperature overflows float32 to inf and
        # the softmax to NaN: the limit of such a temperature is the arg-max, so take it (vLLM's rule).
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def shapes_logits(self) -> bool:
        """Whether the logits change before the choice (so greedy is not the plain arg-max)."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0


@dataclass(frozen=True)
class TokenLogprobs:
    """The log-probability of a chosen token and of the ``top`` most likely ones (most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RowSampler:
    """One sequence's sampler: its parameters, its own random stream (seeded if asked) and, for
    penalties, the tokens it has seen (``prompt_ids``, then every token it chose)."""

    params: SamplingParams
    prompt_ids: tuple[int, ...] = ()
    eos_ids: frozenset[int] = frozenset()  # what ``min_tokens`` keeps out of reach, with stop_token_ids
    generator: torch.Generator = field(init=False)
    #: Whether this row needs more than the batch's plain arg-max (fixed by ``params``; read per
    #: row per step, hence an attribute rather than a property).
    own_pass: bool = field(init=False)
    generated: int = field(init=False, default=0)
    output_counts: Counter = field(init=False, default_factory=Counter)
    _seen: torch.Tensor | None = field(init=False, default=None)  # [vocab] bool: prompt and output tokens

    def __post_init__(self) -> None:
        seed = self.params.seed if self.params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.generator = torch.Generator().manual_seed(seed)  # on the CPU: rows are sampled there
        self.own_pass = not self.params.greedy or self.params.shapes_logits
        self._penalized = self.params.penalized

    def record(self, token: int) -> None:
        """Count a token this sequence chose (penalties and ``min_tokens`` look at them)."""
        self.generated += 1
        if self._penalized:
            self.output_counts[token] += 1
            if self._seen is not None and token < self._seen.shape[0]:
                self._seen[token] = True

    def penalize(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [vocab] with this row's bias, ``min_tokens`` mask and penalties applied (a new
        tensor; ``float32``)."""
        params = self.params
        scores = logits.float().clone()
        vocab, device = scores.shape[-1], scores.device
        if params.logit_bias:  # ids past the logits (a tokenizer larger than the model's output) are ignored
            bias = [(token, value) for token, value in params.logit_bias if token < vocab]
            ids = torch.tensor([token for token, _ in bias], dtype=torch.long, device=device)
            scores[ids] += torch.tensor([value for _, value in bias], dtype=scores.dtype, device=device)
        if self.generated < params.min_tokens:
            ends = [t for t in {*self.eos_ids, *params.stop_token_ids} if t < vocab]
            scores[torch.tensor(ends, dtype=torch.long, device=device)] = float("-inf")
        if params.repetition_penalty != 1.0:
            seen, penalty = self._seen_mask(vocab, device), params.repetition_penalty
            scores = torch.where(seen, torch.where(scores > 0, scores / penalty, scores * penalty), scores)
        if (params.frequency_penalty or params.presence_penalty) and self.output_counts:
            counted = [(t, c) for t, c in self.output_counts.items() if t < vocab]
            ids = torch.tensor([t for t, _ in counted], dtype=torch.long, device=device)
            counts = torch.tensor([c for _, c in counted], dtype=scores.dtype, device=device)
            scores[ids] -= params.frequency_penalty * counts + params.presence_penalty
        return scores

    def _seen_mask(self, vocab: int, device: torch.device) -> torch.Tensor:
        """Which tokens the prompt or the output holds, kept up to date by ``record``."""
        if self._seen is None or self._seen.shape[0] != vocab or self._seen.device != device:
            seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            ids = [t for t in (*self.prompt_ids, *self.output_counts) if t < vocab]
            seen[torch.tensor(ids, dtype=torch.long, device=device)] = True
            self._seen = seen
        return self._seen

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from one row of logits ``[vocab]``."""
        params = self.params
        scores = self.penalize(logits) if params.shapes_logits else logits.float()
        if params.greedy:  # a penalty past float32's range can make 0 x inf = NaN, which argmax would pick
            return int(torch.nan_to_num(scores, nan=float("-inf")).argmax() if params.penalized else scores.argmax())
        scores = scores / params.temperature
        if params.min_p > 0:
            probs = scores.softmax(-1)
            scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
        if 0 < params.top_k < scores.shape[-1]:
            kth = torch.topk(scores, params.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if params.top_p < 1.0:
            ordered, order = torch.sort(scores, descending=True)
            cumulative = ordered.softmax(-1).cumsum(-1)
            # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
            drop = cumulative - ordered.softmax(-1) >= params.top_p
            scores = scores.scatter(0, order[drop], float("-inf"))
        probs = scores.softmax(-1).cpu()  # the generator is a CPU one, whatever the model's device
        try:
            return int(torch.multinomial(probs, 1, generator=self.generator))
        except RuntimeError:  # NaN, inf or no mass: nothing to draw from (checked by multinomial itself, for free)
            # Extreme but valid parameters (a repetition penalty past float32's range, every token
            # held back) can leave no distribution: the limit they tend to is the row's most likely token.
            return int(torch.nan_to_num(scores, nan=float("-inf")).argmax())


def choose_tokens(
    logits: torch.Tensor, samplers: list[RowSampler], failures: dict[int, Exception] | None = None
) -> list[int]:
    """Each row's next token (recorded in its sampler); plain greedy rows in one vectorized arg-max.

    ``failures``: where a row whose own choice raised (a bug one request's parameters found) is
    put, by row, instead of raising: the caller ends that request alone and the batch goes on.
    Without it, the exception propagates."""
    tokens = logits.argmax(-1).tolist()
    for row, sampler in enumerate(samplers):
        if sampler.own_pass:
            try:
                tokens[row] = sampler.choose(logits[row])
            except Exception as exc:
                if failures is None:
                    raise
                failures[row] = exc
                continue
        sampler.record(tokens[row])
    return tokens


def rows_logprobs(logits: torch.Tensor, tokens: list[int], tops: list[int]) -> list[TokenLogprobs]:
    """For each row of ``logits`` [rows, vocab]: the raw log-probability of its ``tokens`` entry
    and of its ``tops`` entry's most likely tokens (ties: the lower id first, as ``torch.topk``
    leaves them), in one log-softmax and one top-k for all rows (a row asking for fewer
    alternatives gets the first of the largest ask)."""
    logprobs = torch.log_softmax(logits.float(), -1)
    chosen = logprobs.gather(1, torch.tensor(tokens, dtype=torch.long, device=logprobs.device)[:, None])[:, 0].tolist()
    most = min(max(tops, default=0), logprobs.shape[-1])
    if most > 0:
        values, ids = torch.topk(logprobs, most, dim=-1)
        ranked = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        ranked = [[] for _ in tokens]
    return [TokenLogprobs(t, lp, tuple(r[:top])) for t, lp, r, top in zip(tokens, chosen, ranked, tops)]


def prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], top: int) -> tuple[TokenLogprobs, ...]:
    """Raw log-probabilities of a prompt's tokens after the first: ``logits`` [len(prompt_ids), vocab]
    are the logits at the prompt's positions (position i predicts token i + 1; the last one,
    which predicts the first generated token, is not used)."""
    following = list(prompt_ids[1:])
    return tuple(rows_logprobs(logits[:-1], following, [top] * len(following)))
