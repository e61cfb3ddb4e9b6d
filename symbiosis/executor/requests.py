"""The scheduler's own vocabulary: pending requests, row slices and batches (no tensors, no I/O).

The vocabulary every side shares (``Op``, ``LatencyClass``, ``LayerSpec``) is in ``symbiosis/vocabulary.py``.

Named tuples, not frozen dataclasses: every queued request makes one of each, on the thread
that serves every client, and a frozen dataclass's ``__init__`` (``object.__setattr__`` per
field) cost 0.5-1.1 us each against 0.4 for a named tuple (issue 11, the queued path).
"""

from __future__ import annotations

from typing import NamedTuple

from symbiosis.vocabulary import LatencyClass, Op


class PendingRequest(NamedTuple):
    """What the scheduler needs to know about a request: no tensors, only sizes and times."""

    request_id: int
    client_id: str
    layer_id: str
    op: Op
    rows: int
    latency_class: LatencyClass
    arrival_s: float


class RowSlice(NamedTuple):
    """Rows ``[start, stop)`` of request ``request_id`` (a request may be served in chunks)."""

    request_id: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


class Batch(NamedTuple):
    """One matrix product to run: the listed row slices, all for the same layer and op, in order."""

    layer_id: str
    op: Op
    slices: tuple[RowSlice, ...]
    # Only latency work's rows (decode-sized decode and prefill requests): the engine may skip
    # timing its product (``ExecutionEngine._compute``); bulk products are always timed.
    latency_only: bool = False

    @property
    def rows(self) -> int:
        return sum(s.stop - s.start for s in self.slices)
