"""Log-probabilities in OpenAI's two response formats (the engine computes them: ``sampling.py``).

- ``/v1/completions`` (``logprobs: k``): ``{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}``, the legacy format: ``top_logprobs`` maps each alternative's text to its
  log-probability -- the ``k`` most likely tokens, plus the chosen one when it is not among them
  (as vLLM does; two tokens with the same text give one key, the likelier one's);
  ``text_offset`` is where each token's text starts in the completion. With ``echo`` the prompt's
  tokens come first, the first of them with ``null`` log-probabilities (nothing predicts it).
- ``/v1/chat/completions`` (``logprobs: true, top_logprobs: k``): ``{"content": [{"token",
  "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...k]}]}``.

A token's ``bytes`` are its own UTF-8 bytes: for a byte-level BPE tokenizer (GPT-2's, Llama 3's)
its symbols mapped back to the bytes they stand for, for a SentencePiece one its ``<0xNN>`` byte
or its piece with ``▁`` as a space; joined, a completion's tokens' bytes are its text. A token's
text is those bytes decoded (U+FFFD for a token that is part of a multi-byte character), a
special token's its own name (``<s>``). A stream carries the entries of the tokens each chunk adds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from transformers.convert_slow_tokenizer import bytes_to_unicode

from symbiosis.serving.sampling import TokenLogprobs

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        return backend is not None and "ByteLevel" in json.dumps(json.loads(backend.to_str()).get("decoder"))
    except (TypeError, ValueError, AttributeError):
        return False


class LogprobFormatter:
    """Formats ``TokenLogprobs`` for one tokenizer (each token's bytes and text are made once)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        # byte-level BPE (GPT-2's alphabet): the character that stands for each byte, inverted
        self._alphabet = {ch: b for b, ch in bytes_to_unicode().items()} if _is_byte_level(tokenizer) else None
        self._tokens: dict[int, tuple[str, bytes]] = {}

    def text(self, token: int) -> str:
        return self._token(token)[0]

    def _token(self, token: int) -> tuple[str, bytes]:
        known = self._tokens.get(token)
        if known is None:
            known = self._tokens[token] = self._describe(token)
        return known

    def _describe(self, token: int) -> tuple[str, bytes]:
        piece = self._tokenizer.convert_ids_to_tokens(token)
        if not isinstance(piece, str) or token in self._special:
            text = piece if isinstance(piece, str) else self._tokenizer.decode([token])
            return text, text.encode("utf-8")
        if self._alphabet is not None and all(ch in self._alphabet for ch in piece):
            raw = bytes(self._alphabet[ch] for ch in piece)
        elif match := _BYTE_PIECE.fullmatch(piece):
            raw = bytes([int(match.group(1), 16)])
        elif self._alphabet is None and "▁" in piece:
            raw = piece.replace("▁", " ").encode("utf-8")
        else:  # a tokenizer of another kind: what it decodes the token to alone
            raw = self._tokenizer.decode([token]).encode("utf-8")
        return raw.decode("utf-8", errors="replace"), raw

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
        text, raw = self._token(token)
        entry = {"token": text, "logprob": logprob, "bytes": list(raw)}
        if top is not None:
            entry["top_logprobs"] = [self._chat_entry(t, lp, None) for t, lp in top]
        return entry
