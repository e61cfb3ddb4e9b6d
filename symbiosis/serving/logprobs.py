"""Log-probabilities in OpenAI's two response formats (the engine computes them: ``sampling.py``).

- ``/v1/completions`` (``logprobs: k``): ``{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}``, the legacy format: ``top_logprobs`` maps each alternative's text to its
  log-probability -- the ``k`` most likely tokens, plus the chosen one when it is not among them
  (as vLLM does; two tokens with the same text give one key, the likelier one's);
  ``text_offset`` is where each token's text starts in the completion. With ``echo`` the prompt's
  tokens come first, the first of them with ``null`` log-probabilities (nothing predicts it).
- ``/v1/chat/completions`` (``logprobs: true, top_logprobs: k``): ``{"content": [{"token",
  "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...k]}]}``.

A token's text is what the tokenizer decodes it to alone (special tokens included); a token that
is part of a multi-byte character decodes to U+FFFD, which is why the chat format carries the
UTF-8 ``bytes`` as well. A stream carries the entries of the tokens each chunk adds.
"""

from __future__ import annotations

from collections.abc import Sequence

from symbiosis.serving.sampling import TokenLogprobs


class LogprobFormatter:
    """Formats ``TokenLogprobs`` for one tokenizer (token texts are decoded once and kept)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self._tokenizer.decode([token])
        return text

    def completion(
        self, entries: Sequence[TokenLogprobs], offset: int = 0, first_prompt_token: int | None = None
    ) -> tuple[dict, int]:
        """The legacy ``logprobs`` object of ``entries``, whose first token's text starts at
        ``offset`` in the completion; and the offset after the last one (for the next chunk).
        ``first_prompt_token`` (an echoed prompt's first token, which has no log-probability:
        nothing comes before it) leads with ``null`` log-probabilities, as OpenAI's does."""
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        if first_prompt_token is not None:
            text = self.text(first_prompt_token)
            tokens.append(text)
            token_logprobs.append(None)
            top_logprobs.append(None)
            text_offset.append(offset)
            offset += len(text)
        for entry in entries:
            text = self.text(entry.token)
            tokens.append(text)
            token_logprobs.append(entry.logprob)
            top: dict[str, float] = {}
            for token, logprob in entry.top:  # most likely first: a text two tokens share keeps the likelier
                top.setdefault(self.text(token), logprob)
            top.setdefault(text, entry.logprob)
            top_logprobs.append(top)
            text_offset.append(offset)
            offset += len(text)
        body = {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }
        return body, offset

    def chat(self, entries: Sequence[TokenLogprobs]) -> dict:
        """The chat ``logprobs`` object of ``entries``."""
        return {"content": [self._chat_entry(e.token, e.logprob, e.top) for e in entries]}

    def _chat_entry(self, token: int, logprob: float, top: Sequence[tuple[int, float]] | None = ()) -> dict:
        text = self.text(token)
        entry = {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
        if top is not None:
            entry["top_logprobs"] = [self._chat_entry(t, lp, None) for t, lp in top]
        return entry
