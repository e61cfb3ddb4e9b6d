"""Turning a sequence's tokens into text as they come: deltas, stop strings, held-back suffixes.

A delta is released only when it is final: text ending in an incomplete UTF-8 character (U+FFFD)
waits for the next token, and a suffix that could be the start of a stop string waits until it
either completes the stop string (which is then cut, with everything after it; kept, and only what
follows it cut, with vLLM's ``include_stop_str_in_output``) or cannot. With
``min_tokens`` (vLLM's), stop strings count only once that many tokens are out: one that ends
before then is passed over, as vLLM passes over it.
"""

from __future__ import annotations


class IncrementalText:
    """The text of one sequence's generated tokens, released in final deltas."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), min_tokens: int = 0, keep_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.min_tokens = min_tokens  # stop strings count from this many tokens on (vLLM's min_tokens)
        self.keep_stop = keep_stop  # the text ends with the stop string found (vLLM's include_stop_str_in_output)
        self.token_ids: list[int] = []
        self.text = ""  # final text so far (stop string cut)
        self.released = 0  # characters of ``text`` handed out
        self.stopped = False
        self.search_from = 0  # stop strings are looked for in text that ends after this

    def add(self, token_id: int | None) -> str:
        """Append a token (None: no token, just settle); the newly final text. Sets ``stopped``."""
        if token_id is not None:
            self.token_ids.append(token_id)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if len(self.token_ids) < self.min_tokens:  # too early for stop strings: none found here counts
            self.text, self.search_from = text, len(text)
            return self._release(len(text) - (1 if text.endswith("\ufffd") else 0))
        for stop in self.stop:
            at = text.find(stop, max(0, self.search_from - len(stop) + 1))
            if at >= 0:
                text, self.stopped = text[: at + len(stop) if self.keep_stop else at], True
        self.text = text
        if self.stopped:
            return self._release(len(text))
        hold = 1 if text.endswith("\ufffd") else 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:length]):
                    hold = length
                    break
        return self._release(len(text) - hold)

    def finish(self) -> str:
        """Everything not yet released (the sequence ended)."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.released:
            return ""
        delta = self.text[self.released : upto]
        self.released = upto
        return delta
