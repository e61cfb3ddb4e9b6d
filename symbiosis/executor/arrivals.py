"""Where each client is in its walk over the base layers, and when it will reach a given layer.

Pure bookkeeping for the opportunistic scheduler (no I/O, no clock: times are passed in). A client
walks the base layers of one op in a fixed order every pass (forward: the model's call order;
backward: its reverse), one request at a time, since it needs each result before it can compute
the next layer's input. So from arrivals alone one can learn:

- the layer order per op: a layer first seen right after layer ``p`` of the same client and op
  gets position ``p + 1`` (a sibling group: its first member's, ``_first_member_position``); a
  client's first request of an op gets 0 (clients start a pass at the first layer, so the first
  pass anyone walks fixes the order), but only provisionally: a client
  that calls one layer again and again (a flood) may come first, and a layer whose 0 came that
  way takes ``p + 1`` from the first client that walks onto it (else a decoder's pass would look
  cut in two there, and its token time half what it is);
- each client's pace per op (``gap``): an EWMA of the time from one of its requests being handed
  out to its next request arriving, divided by the positions it advanced;
- each client's *own* time per layer call (``own_gap``): the same samples, but a lower envelope
  (a smaller sample is taken at once, a larger one only slowly), because every delay the executor
  adds (a product it waited behind, requests read late) lands in the sample too. The decode guard
  sizes bulk chunks from it (``pacing.DecodeGuard``); from the plain EWMA, a flood fed back on
  itself: longer chunks delayed the decoder, which looked slower, which allowed longer chunks
  (measured: a bystander's "gap" of 34 ms against ~1 ms alone, decode x40 under a flood);
- whether a client *repeats* an op: a decoding client starts its next forward pass after the
  last one (it wraps around to position 0), a fine-tuning client turns to backward instead;
- how long a client that repeats an op takes between passes (``turn``: an EWMA of the time from
  its last request of a pass being handed out to the first request of its next pass). A decoder
  stepping back to back turns in about one gap (sampling, the next token's embedding); a stream
  read at a set rate (a user reading tokens: an open loop) waits out its interval there, often
  longer than any hold -- measured on this 2-core host (issue 11, 6 client processes each
  stepping every 200 ms): a convoy that waited for such clients as if they were coming took the
  decoders from 20 ms a token to 37 ms (p95 28 -> 122 ms), and beside fine-tuning to 96-115 ms
  (p95 x4 of alone); in the simulator (``tests/sched_sim.py``) x2.8 of not waiting.

A client behind a layer in the same pass (``hops = position(layer) - position(its last request)
> 0``) is expected there at ``(handed_out_s or now) + hops * gap``. A client that repeats the op
and is at or past the layer is on its way too, through the end of its pass and the start of the
next one (``hops = positions - position + position(layer)``), if that is at most half a pass: a
client further round is rather ahead, and waiting for it would make two clients wait for each other.
Its turn between the passes takes the place of one gap there; and a client that idles between
passes (``_idles_between_passes``) is not on its way to a layer it must turn to reach
(``walking``). Inside its pass, one whose turn is longer than a pass at its own pace
(``_turns_longer_than_its_pass``) is not on its way either, but to the layer it is computing the
input of (one hop: a short wait): its next pass starts on its own clock, not when a convoy's
results come, so a convoy that held for it would have to hold for it again every pass. In the
simulator, streams every 15 ms, 2.5 ms apart: passes p95 x1.57 of the immediate policy's when
waited for, x1.25 not; beside fine-tuning x1.84 -> x1.59 of alone; with a 1.2x target,
fine-tuning kept 10% -> 23%. Streams every 30 ms, ~5 ms apart, with that target: p95 x1.16 ->
x1.04 of it, fine-tuning kept 7% -> 17%. Without the one-hop wait, streams stepping together
(0.1 ms apart) no longer formed their convoy (beside fine-tuning p95 x1.24 -> x1.30 of alone;
with it x1.25).
Back-to-back clients stay waited for there, even while their turns run over half the hold: that
line, applied inside passes too, broke the convoys of client processes on this host (25-28 rows a
batch against 37.3 for the fixed convoy: their turns ran 26-42 ms for a while, the benchmark's
warm-up). Against a pass at its own pace their turns stay short: measured (8 client processes
of batch 1-16 stepping back to back, this 2-core host overloaded, 2026-12-07) 0.04-0.73 of it,
mostly 0.1-0.4, the top after a stall of all clients.

When a client's next request is due (``next_call_s``) tells the scheduler how long the executor
is free of latency work, for bulk work to fill (``Scheduler._free_until_s``).
"""

from __future__ import annotations

from collections.abc import Iterator

from symbiosis.executor.requests import PendingRequest
from symbiosis.vocabulary import GROUP_SEPARATOR, Op

# Weight of a new sample in a client's pace EWMA: the last few hops dominate, so the estimate
# follows a client whose pace changes (prefill -> decode, more load) within a few layers.
GAP_EWMA_WEIGHT = 0.25
# A client whose turn between passes takes over this share of the longest hold (the convoy's
# ``idle_s``, ``lockstep_timeout_ms``), or longer than a pass at its own pace, idles between them
# -- an open loop -- and is not on its way to a layer it must turn to reach. Measured turns of
# clients stepping back to back (this 2-core host, 8 decoders of batch 1-16, 2026-12-06): client
# processes 3.4-5.8 ms (median; p90 up to 7.3), client threads sharing one interpreter lock
# 9.5-11.8 ms (p90 up to 14.6); against a pass at their own pace, 0.07-0.25 of it (client
# threads), ~0.1 (client processes). An open-loop stream's turn is its interval less its pass, and
# a hold lengthens the pass: half the hold keeps a stream that a convoy slowed from looking like
# one stepping back to back (streams every 100 ms in the simulator: passes of 58 ms under the
# convoy, turns of 42, against 20 ms passes not waiting; skipping only streams that would start
# after the hold ended kept that state).
TURN_SHARE_OF_HOLD = 0.5
# Weight of a larger sample in a client's own-gap lower envelope (a smaller one replaces it): a
# client that really slowed down is followed within a few dozen calls, a delay is mostly ignored.
OWN_GAP_RISE_WEIGHT = 0.05


def _envelope(estimates: dict[Op, float], op: Op, sample: float) -> None:
    """Move ``op``'s lower envelope towards ``sample``: a smaller one replaces it, a larger one
    raises it slowly (``OWN_GAP_RISE_WEIGHT``)."""
    old = estimates.get(op)
    estimates[op] = sample if old is None or sample < old else old + OWN_GAP_RISE_WEIGHT * (sample - old)


def _follow(estimates: dict[Op, float], op: Op, sample: float) -> None:
    """Move ``op``'s estimate (an EWMA, ``GAP_EWMA_WEIGHT``) towards ``sample``; the first sample sets it."""
    old = estimates.get(op)
    estimates[op] = sample if old is None else old + GAP_EWMA_WEIGHT * (sample - old)


#: The walk an op's requests step along: a product without the layer's bias (``Op.NOISE``: a layer
#: whose bias the client holds, asking for ``x·Wᵀ``; activation noise's pools) is a step of the forward
#: walk, at that layer's place in it. Were it a walk of its own, a decoder with trained biases would
#: switch walks at every biased layer: its pace never learned, and the decode guard, which takes a
#: client in another op for a fine-tuning one in backward, would not protect it (a helper measured
#: opt with bias="all": an active decoder after 16 of its 208 decode requests).
_WALK = {Op.FORWARD: Op.FORWARD, Op.BACKWARD: Op.BACKWARD, Op.NOISE: Op.FORWARD}


class _Track:
    """One client's last request (op, learned position, hand-out time) and its pace per op."""

    __slots__ = (
        "op",
        "layer_id",
        "position",
        "request_id",
        "handed_out_s",
        "gap_s",
        "own_gap_s",
        "turn_s",
        "own_turn_s",
        "own_call_s",
        "calls",
        "pass_calls",
        "repeats",
        "walks",
        "latency",
        "bare_layers",
    )

    def __init__(self) -> None:
        self.op: Op | None = None
        self.layer_id: str | None = None
        self.position = -1
        self.request_id = -1
        self.handed_out_s: float | None = None  # None while that request is pending
        self.gap_s: dict[Op, float] = {}
        self.own_gap_s: dict[Op, float] = {}  # lower envelope of the same samples (module doc)
        self.turn_s: dict[Op, float] = {}  # time between its passes of an op it repeats (module doc)
        self.own_turn_s: dict[Op, float] = {}  # lower envelope of the same samples (``next_call_s``)
        # A pass at its own pace (``_idles_between_passes``): the lower envelope of its time per
        # call (not per position: a group's jump skips positions), and the calls of its last pass.
        self.own_call_s: dict[Op, float] = {}
        self.calls = 0  # calls in the pass under way
        self.pass_calls = 0  # calls in its last whole pass
        self.repeats: set[Op] = set()  # ops this client was seen to walk pass after pass
        self.walks = False  # its last request moved on to another layer (a flood of one layer does not)
        self.latency = True  # its last request was latency work (decode, prefill), not bulk
        self.bare_layers: set[str] = set()  # layers it asks for products without their bias (``_WALK``)


class ArrivalPredictor:
    """Learns layer order and client pace from arrivals; predicts who is on its way to a layer."""

    def __init__(self) -> None:
        self.positions: dict[Op, dict[str, int]] = {op: {} for op in Op}
        self._provisional: dict[Op, set[str]] = {op: set() for op in Op}  # positions no walk has set yet
        self._last_position: dict[Op, int] = {op: -1 for op in Op}  # the end of a pass (``next_call_s``)
        self.tracks: dict[str, _Track] = {}

    def arrived(self, request: PendingRequest, latency: bool = True) -> int:
        """Learn from an arrival (``latency``: it is latency work, not bulk); returns the request's
        position in its op's pass."""
        track = self.tracks.get(request.client_id)
        if track is None:
            track = self.tracks[request.client_id] = _Track()
        op = _WALK[request.op]
        if request.op is Op.NOISE:
            track.bare_layers.add(request.layer_id)
        elif track.bare_layers:
            track.bare_layers.discard(request.layer_id)
        positions = self.positions[op]
        same_op = track.op is op
        position = positions.get(request.layer_id)
        provisional = self._provisional[op]
        moved_on = same_op and request.layer_id != track.layer_id
        if moved_on and track.layer_id in provisional:
            provisional.discard(track.layer_id)  # a pass really starts there: a client walked on from it
        if moved_on and request.layer_id in provisional:
            provisional.discard(request.layer_id)  # a walk reached it: its place is after the last layer
            position = positions[request.layer_id] = track.position + 1
        elif position is None:
            position = self._first_member_position(op, request.layer_id)
            if position is None:
                position = track.position + 1 if same_op else 0
                if not same_op:
                    provisional.add(request.layer_id)
            positions[request.layer_id] = position
        if same_op and position > track.position and track.handed_out_s is not None:
            sample = (request.arrival_s - track.handed_out_s) / (position - track.position)
            _follow(track.gap_s, op, sample)
            _envelope(track.own_gap_s, op, sample)
            _envelope(track.own_call_s, op, request.arrival_s - track.handed_out_s)
        elif same_op and position < track.position:
            track.repeats.add(op)  # a new pass of the same op: it walks this op again and again
            track.pass_calls, track.calls = track.calls, 0
            if track.handed_out_s is not None:
                _follow(track.turn_s, op, request.arrival_s - track.handed_out_s)
                _envelope(track.own_turn_s, op, request.arrival_s - track.handed_out_s)
        elif not same_op and track.op is not None:
            track.repeats.discard(track.op)  # it left that op for another one
        if position > self._last_position[op]:
            self._last_position[op] = position
        track.walks = not same_op or position != track.position
        track.calls = track.calls + 1 if same_op else 1
        track.latency = latency
        track.op, track.position, track.request_id, track.handed_out_s = op, position, request.request_id, None
        track.layer_id = request.layer_id
        return position

    def _first_member_position(self, op: Op, layer_id: str) -> int | None:
        """A sibling group's place in the walk: its first member's, when that member has one for
        good (``vocabulary.group_id``). A client calls the members one by one in its first pass
        (its prefill) and as a group once it has seen them share an input; placed after the
        request before it, the group of a decoder's first layer came after the last one (the
        ``lm_head``), so its passes seemed to wrap one request late and its turn between tokens
        read as a hop inside the pass (measured, client processes: turns of ~2 ms and a gap of
        ~30 ms, where the clients idled 180 ms between tokens)."""
        if GROUP_SEPARATOR not in layer_id:
            return None
        first = layer_id.partition(GROUP_SEPARATOR)[0]
        position = self.positions[op].get(first)
        return None if position is None or first in self._provisional[op] else position

    def handed_out(self, request: PendingRequest, now_s: float) -> None:
        """``request``'s last rows were handed out at ``now_s``: its client's next step starts then."""
        track = self.tracks.get(request.client_id)
        if track is not None and track.request_id == request.request_id:
            track.handed_out_s = now_s

    def forget(self, client_id: str) -> None:
        self.tracks.pop(client_id, None)

    def placed(self, layer_id: str, op: Op) -> bool:
        """Whether the layer has its place in ``op``'s walk for good: seen, and not only as the
        provisional start of a pass (see the module doc)."""
        op = _WALK[op]
        return layer_id in self.positions[op] and layer_id not in self._provisional[op]

    def pass_length(self, op: Op) -> int:
        """Layers in one pass of ``op`` seen so far (base-layer calls per decoded token for forward)."""
        return len(self.positions[_WALK[op]])

    def gap_s(self, client_id: str, op: Op) -> float | None:
        track = self.tracks.get(client_id)
        return None if track is None else track.gap_s.get(_WALK[op])

    def own_gap_s(self, client_id: str, op: Op) -> float | None:
        """The client's own time per layer call of ``op`` without the delays the executor adds
        (a lower envelope of the pace samples, see the module doc); None before any sample."""
        track = self.tracks.get(client_id)
        return None if track is None else track.own_gap_s.get(_WALK[op])

    def next_call_s(self, client_id: str, op: Op) -> float | None:
        """When the client's next request of ``op`` is due: from its last request's hand-out, one
        of its own gaps (the lower envelope: rather too early than too late), or its turn when
        that request ended a pass of an op it repeats. None when it has a request pending, is in
        another op, or its pace is not known yet."""
        op = _WALK[op]
        track = self.tracks.get(client_id)
        if track is None or track.op is not op or track.handed_out_s is None:
            return None
        gap_s = track.own_gap_s.get(op)
        if op in track.repeats and track.position >= self._last_position[op]:
            gap_s = track.own_turn_s.get(op, gap_s)
        return None if gap_s is None else track.handed_out_s + gap_s

    def _turn_s(self, track: _Track, target: int) -> float | None:
        """The time ``track``'s client takes between two passes, when it must make that turn to
        reach position ``target`` (it is at or past it: ``_hops`` wrapped) and it was measured."""
        return track.turn_s.get(track.op) if track.position >= target else None

    @staticmethod
    def _idles_between_passes(track: _Track, turn_s: float, idle_s: float) -> bool:
        """Whether a client that turns ``turn_s`` between passes idles there rather than stepping
        back to back: its turn is over ``TURN_SHARE_OF_HOLD`` of the longest hold, or longer than
        a pass at its own pace (the lower envelope of its time per call, times the calls of its
        last pass; not per position, as ``own_gap``: a group's jump skips positions). The second
        holds however slow a convoy made its passes: the pass at its own pace stays, the turn
        only shrinks towards interval less pass. With the first alone, streams read every 30 ms
        with their phases spread (the simulator, beside two fine-tuning walkers) turned ~20 ms,
        under half the 50 ms hold, and the convoy waited for them: their passes x5.5 of alone.
        Back-to-back clients on this host turned in 0.07-0.25 of a pass at their own pace."""
        return turn_s > TURN_SHARE_OF_HOLD * idle_s or ArrivalPredictor._turns_longer_than_its_pass(track, turn_s)

    @staticmethod
    def _turns_longer_than_its_pass(track: _Track, turn_s: float | None) -> bool:
        """Whether a client's turn between passes (``turn_s``) is longer than a pass at its own
        pace: the lower envelope of its time per call times the calls of its last pass."""
        own_call_s = track.own_call_s.get(track.op) if track.op is not None else None
        return (
            turn_s is not None
            and own_call_s is not None
            and track.pass_calls > 0
            and turn_s > own_call_s * track.pass_calls
        )

    def _hops(self, track: _Track, target: int, length: int, wrap: bool) -> int | None:
        """Layers ``track``'s client still has to walk to reach position ``target``; None when it is
        not on its way: not walking (it sent its last two requests for one layer, as a client
        flooding that layer does), ahead in its pass (and not repeating the op, or ``wrap`` off),
        or more than half a pass away round the ring (then it is rather *ahead* and would lap the
        layer: the client waited for must be the one behind, or two clients would wait for each other)."""
        if not track.walks:
            return None
        if track.position < target:
            hops = target - track.position
        elif wrap and track.op in track.repeats:
            hops = length - track.position + target
        else:
            return None
        return hops if not wrap or 2 * hops <= length else None

    def walking(
        self, layer_id: str, op: Op, skip: dict[str, int], now_s: float, idle_s: float, latency_only: bool = False
    ) -> Iterator[str]:
        """The clients not in ``skip`` on their way to the layer in their walk of ``op`` (see
        ``_hops``) and not idle (a request pending, or one handed out within ``idle_s``), nor
        idling between passes when they must turn to reach the layer (``_idles_between_passes``:
        the module doc); with ``latency_only``, only
        those whose last request was latency work. No pace is needed: the convoy rule waits for them
        however slow they are within a pass. Lazily: the convoy asks whether one of them can
        come, and the first that can ends the look (``Scheduler._convoy_waits_for``). A client
        comes to a layer's products without bias (``Op.NOISE``) where it asked for those there
        last, else to its products (``_WALK``)."""
        bare, op = op is Op.NOISE, _WALK[op]
        target = self.positions[op].get(layer_id)
        if target is None:
            return
        length = len(self.positions[op])
        for client_id, track in self.tracks.items():
            if track.op is not op or client_id in skip or (layer_id in track.bare_layers) is not bare:
                continue
            handed_out_s = track.handed_out_s
            if handed_out_s is not None and now_s - handed_out_s > idle_s:
                continue
            if latency_only and not track.latency:
                continue
            hops = self._hops(track, target, length, wrap=True)
            if hops is None:
                continue
            turn_s = self._turn_s(track, target)
            if turn_s is not None and self._idles_between_passes(track, turn_s, idle_s):
                continue  # a stream read at a set rate (module doc)
            if (
                turn_s is None
                and hops > 1
                and op in track.repeats
                and self._turns_longer_than_its_pass(track, track.turn_s.get(op))
            ):
                continue  # the same stream inside its pass: held for, it would be held for again next pass
            yield client_id

    def expected(
        self, layer_id: str, op: Op, skip: dict[str, int], now_s: float, wrap: bool = False, latency_only: bool = False
    ) -> list[tuple[float, float]]:
        """``(expected arrival, gap)`` of every client not in ``skip`` that is on its way to the layer.

        Not on its way: a client in another op (a fine-tuning client in backward while the layer is
        wanted for forward), at or past the layer (also one idle after its pass) unless ``wrap`` and
        it repeats the op, whose pace is not known yet, or (``latency_only``) whose last request
        was bulk work; a client that asks the layer for the other kind of product (``walking``).
        """
        bare, op = op is Op.NOISE, _WALK[op]
        target = self.positions[op].get(layer_id)
        if target is None:
            return []
        length = len(self.positions[op])
        coming = []
        for client_id, track in self.tracks.items():
            if track.op is not op or client_id in skip or (latency_only and not track.latency):
                continue
            if (layer_id in track.bare_layers) is not bare:
                continue
            hops = self._hops(track, target, length, wrap)
            if hops is None:
                continue
            gap_s = track.gap_s.get(op)
            if gap_s is None:
                continue
            start_s = now_s if track.handed_out_s is None else track.handed_out_s  # pending: not before now
            turn_s = self._turn_s(track, target)
            walk_s = hops * gap_s if turn_s is None else (hops - 1) * gap_s + turn_s  # the turn is one hop
            coming.append((start_s + walk_s, gap_s))
        return coming
