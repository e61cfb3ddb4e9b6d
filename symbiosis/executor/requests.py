"""The scheduler's own vocabulary: pending requests, row slices and batches (no tensors, no I/O).

The vocabulary every side shares (``Op``, ``LatencyClass``, ``LayerSpec``) is in ``symbiosis/vocabulary.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from symbiosis.vocabulary import LatencyClass, Op


@dataclass(frozen=True)
class PendingRequest:
    """What the scheduler needs to know about a request: no tensors, only sizes and times."""

    request_id: int
    client_id: str
    layer_id: str
    op: Op
    rows: int
    latency_class: LatencyClass
    arrival_s: float


@dataclass(frozen=True)
class RowSlice:
    """Rows ``[start, stop)`` of request ``request_id`` (a request may be served in chunks)."""

    request_id: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Batch:
    """One matrix product to run: the listed row slices, all for the same layer and op, in order."""

    layer_id: str
    op: Op
    slices: tuple[RowSlice, ...]

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.slices)
