"""Where each client is in its walk over the base layers, and when it will reach a given layer.

Pure bookkeeping for the opportunistic scheduler (no I/O, no clock: times are passed in). A client
walks the base layers of one op in a fixed order every pass (forward: the model's call order;
backward: its reverse), one request at a time, since it needs each result before it can compute
the next layer's input. So from arrivals alone one can learn:

- the layer order per op: a layer first seen right after layer ``p`` of the same client and op
  gets position ``p + 1``; a client's first request of an op gets 0 (clients start a pass at the
  first layer, so the first pass anyone walks fixes the order);
- each client's pace per op (``gap``): an EWMA of the time from one of its requests being handed
  out to its next request arriving, divided by the positions it advanced.

A client behind a layer in the same pass (``hops = position(layer) - position(its last request)
> 0``) is expected there at ``(handed_out_s or now) + hops * gap``.
"""

from __future__ import annotations

from symbiosis.executor.requests import PendingRequest
from symbiosis.vocabulary import Op

# Weight of a new sample in a client's pace EWMA: the last few hops dominate, so the estimate
# follows a client whose pace changes (prefill -> decode, more load) within a few layers.
GAP_EWMA_WEIGHT = 0.25


class _Track:
    """One client's last request (op, learned position, hand-out time) and its pace per op."""

    __slots__ = ("op", "position", "request_id", "handed_out_s", "gap_s")

    def __init__(self) -> None:
        self.op: Op | None = None
        self.position = -1
        self.request_id = -1
        self.handed_out_s: float | None = None  # None while that request is pending
        self.gap_s: dict[Op, float] = {}


class ArrivalPredictor:
    """Learns layer order and client pace from arrivals; predicts who is on its way to a layer."""

    def __init__(self) -> None:
        self.positions: dict[Op, dict[str, int]] = {op: {} for op in Op}
        self.tracks: dict[str, _Track] = {}

    def arrived(self, request: PendingRequest) -> None:
        track = self.tracks.get(request.client_id)
        if track is None:
            track = self.tracks[request.client_id] = _Track()
        positions = self.positions[request.op]
        same_op = track.op is request.op
        position = positions.get(request.layer_id)
        if position is None:
            position = positions[request.layer_id] = track.position + 1 if same_op else 0
        if same_op and position > track.position and track.handed_out_s is not None:
            sample = (request.arrival_s - track.handed_out_s) / (position - track.position)
            old = track.gap_s.get(request.op)
            track.gap_s[request.op] = sample if old is None else old + GAP_EWMA_WEIGHT * (sample - old)
        track.op, track.position, track.request_id, track.handed_out_s = request.op, position, request.request_id, None

    def handed_out(self, request: PendingRequest, now_s: float) -> None:
        """``request``'s last rows were handed out at ``now_s``: its client's next step starts then."""
        track = self.tracks.get(request.client_id)
        if track is not None and track.request_id == request.request_id:
            track.handed_out_s = now_s

    def forget(self, client_id: str) -> None:
        self.tracks.pop(client_id, None)

    def expected(self, layer_id: str, op: Op, skip: dict[str, int], now_s: float) -> list[tuple[float, float]]:
        """``(expected arrival, gap)`` of every client not in ``skip`` that is on its way to the layer.

        Not on its way: a client in another op (a fine-tuning client in backward while the layer is
        wanted for forward), at or past the layer (also one idle after its pass), or whose pace is
        not known yet.
        """
        target = self.positions[op].get(layer_id)
        if target is None:
            return []
        coming = []
        for client_id, track in self.tracks.items():
            if track.op is not op or track.position >= target or client_id in skip:
                continue
            gap_s = track.gap_s.get(op)
            if gap_s is None:
                continue
            start_s = now_s if track.handed_out_s is None else track.handed_out_s  # pending: not before now
            coming.append((start_s + (target - track.position) * gap_s, gap_s))
        return coming
