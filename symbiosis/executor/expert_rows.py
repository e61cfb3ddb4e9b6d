"""Requests for the rows of several experts at once (``protocol.Request.expert_rows``).

An MoE layer's tokens go to a few of its experts; a client that called each chosen expert on its
own paid a round trip per expert and layer (a 128-expert, top-8 model: about 16 per layer and
decoded token). A request naming the experts tensor (a module list of base layers,
``vocabulary.module_lists``) carries every chosen expert's rows, expert after expert, and how
many are whose. The engine serves it as one request *per expert* internally -- each part is an
ordinary request of that expert's layer, batched with other clients' rows for the same expert by
the same scheduler -- and answers once, when every part is done. Nothing here computes: this
module only splits a request into its parts and joins their results.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from symbiosis.errors import ShapeError, UnknownLayerError
from symbiosis.vocabulary import expert_parts


def parts_of(members: Sequence[str], expert_rows: Sequence[int]) -> list[tuple[str, int, int]]:
    """``(member layer id, first row, end row)`` of each expert with rows, in row order."""
    return [(members[e], start, stop) for e, start, stop in expert_parts(expert_rows)]


def check_takes(layer_id: str, members: Sequence[str] | None, expert_rows: Sequence[int]) -> None:
    """That ``layer_id`` and ``expert_rows`` go together: a module list named with its rows'
    counts, at most one count per member; typed errors otherwise (the counts' sum is checked with
    the rows: ``protocol.check_expert_rows``)."""
    if members is None:
        raise UnknownLayerError(
            f"{layer_id!r} is not a served module list of base layers (an MoE's experts tensor), the only "
            "kind of layer a request with expert_rows may name"
        )
    if not expert_rows:
        raise ShapeError(
            f"{layer_id!r} names the {len(members)} experts of a tensor: a request for it says how many of "
            "its rows are each expert's (expert_rows); or name one expert's layer"
        )
    if len(expert_rows) > len(members):
        raise ShapeError(f"expert_rows of {layer_id!r} has {len(expert_rows)} counts; it has {len(members)} experts")


class JoinedResult:
    """Where the parts of one expert-rows request put their results: one buffer in the request's
    dtype and device, answered (``target``: a ``Future`` or the caller's ``ResultSink``) once all
    parts are in, or failed at the first part that fails. The engine calls each part's sink from
    whichever thread ran its batch, possibly several at once: the count is locked."""

    def __init__(self, target, output: torch.Tensor, parts: int):
        self.target = target
        self.output = output
        self._left = parts
        self._failed = False
        self._lock = threading.Lock()

    def part(self, start: int, stop: int) -> _PartSink:
        return _PartSink(self, start, stop)

    def _set(self, start: int, stop: int, result: torch.Tensor) -> None:
        self.output[start:stop] = result
        with self._lock:
            self._left -= 1
            last = self._left == 0 and not self._failed
        if last and not self.target.done():
            self.target.set_result(self.output)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            first, self._failed = not self._failed, True
        if first and not self.target.done():
            self.target.set_exception(error)


class _PartSink:
    """One part's ``ResultSink`` (``engine.ResultSink``): copies its rows into the joined buffer at
    once, so a view of a shared batch output is fine (``takes_views``)."""

    takes_views = True

    def __init__(self, joined: JoinedResult, start: int, stop: int):
        self._joined, self._start, self._stop = joined, start, stop

    def done(self) -> bool:
        return self._joined._failed or self._joined.target.done()

    def set_result(self, result: torch.Tensor) -> None:
        try:
            self._joined._set(self._start, self._stop, result)
        except Exception as exc:  # (a copy that fails: memory) fails the request, not the runner
            self._joined._fail(exc)

    def set_exception(self, error: BaseException) -> None:
        self._joined._fail(error)
