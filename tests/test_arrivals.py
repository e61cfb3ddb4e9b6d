"""The arrival predictor (``symbiosis/executor/arrivals.py``): where each client is in its walk
over the base layers, and who is on its way to a layer -- fed by hand, times in seconds."""

from __future__ import annotations

import itertools

import pytest

from symbiosis.executor.arrivals import TURN_SHARE_OF_HOLD, ArrivalPredictor
from symbiosis.executor.requests import PendingRequest
from symbiosis.vocabulary import LatencyClass, Op, group_id

F = Op.FORWARD
LAYERS = ["l0.q", "l0.k", "l0.v", "l0.o", "l1.q", "l1.k", "l1.v", "l1.o", "head"]
QKV = [group_id(["l0.q", "l0.k", "l0.v"]), "l0.o", group_id(["l1.q", "l1.k", "l1.v"]), "l1.o", "head"]
HOLD_S = 0.05  # the convoy's longest hold (``lockstep_timeout_ms``)
_ids = itertools.count()


def walk(predictor: ArrivalPredictor, client: str, layers: list[str], start_s: float, gap_s: float) -> float:
    """``client`` sends ``layers`` one after the other, each ``gap_s`` after the last was handed out
    (handed out at once); returns when the last was handed out."""
    now = start_s
    for layer in layers:
        request = PendingRequest(next(_ids), client, layer, F, 1, LatencyClass.DECODE, now)
        predictor.arrived(request)
        predictor.handed_out(request, now)
        now += gap_s
    return now - gap_s


def test_a_sibling_group_takes_its_first_members_place_in_the_walk():
    # The first pass calls q, k, v one by one (a client has not yet seen them share an input);
    # later passes call them as one group. Placed after the request before it, the first layer's
    # group came after the head: the walk seemed to wrap inside the pass, after that group.
    predictor = ArrivalPredictor()
    end = walk(predictor, "a", LAYERS, 0.0, 0.001)
    walk(predictor, "a", QKV, end + 0.2, 0.001)
    positions = predictor.positions[F]
    assert positions[QKV[0]] == positions["l0.q"] == 0
    assert positions[QKV[2]] == positions["l1.q"]
    assert predictor.tracks["a"].repeats == {F}
    # The 200 ms between the passes is the client's turn, not a hop inside its pass.
    assert predictor.tracks["a"].turn_s[F] == pytest.approx(0.2)
    assert predictor.gap_s("a", F) < 0.002


def test_a_client_that_idles_between_passes_is_not_on_its_way_round_one_that_turns_at_once_is():
    def finished_pass(turn_s: float, gap_s: float = 0.001) -> tuple[ArrivalPredictor, float]:
        predictor = ArrivalPredictor()
        end = walk(predictor, "b", LAYERS, 0.0, gap_s)  # places the layers
        for _ in range(4):  # passes of a client that turns in ``turn_s``
            end = walk(predictor, "b", QKV, end + turn_s, gap_s)
        return predictor, end

    # Just after its pass, "a" waits at the first layer: is "b" coming round to it?
    back_to_back, back_to_back_end = finished_pass(0.002)  # turns like a decoder stepping back to back
    assert list(back_to_back.walking(QKV[0], F, {"a": 1}, back_to_back_end + 0.001, HOLD_S, True)) == ["b"]
    reading, end = finished_pass(0.180)  # a stream read every ~200 ms: it idles between passes
    assert list(reading.walking(QKV[0], F, {"a": 1}, end + 0.001, HOLD_S, True)) == []
    # ... whose next pass is due after a turn, not after one gap: so predicted too.
    ((expected_s, _),) = reading.expected(QKV[0], F, {"a": 1}, end + 0.001, wrap=True)
    assert expected_s == pytest.approx(end + 0.180, abs=0.02)
    # Inside its pass, a client stepping back to back is on its way to a layer ahead of it...
    walk(back_to_back, "b", QKV[:2], back_to_back_end + 0.002, 0.001)
    assert list(back_to_back.walking(QKV[3], F, {"a": 1}, back_to_back_end + 0.005, HOLD_S, True)) == ["b"]
    # ... and a stream is not: its next pass starts on its own clock, so a convoy held for it
    # now would be held for it again next pass.
    walk(reading, "b", QKV[:2], end + 0.180, 0.001)
    assert list(reading.walking(QKV[3], F, {"a": 1}, end + 0.183, HOLD_S, True)) == []
    # (but for the layer it is computing the input of: one gap away, a short wait)
    assert list(reading.walking(QKV[2], F, {"a": 1}, end + 0.183, HOLD_S, True)) == ["b"]
    # A turn over half the hold but under a pass at its own pace (client processes stepping back
    # to back while the host is overloaded) is waited for inside the pass, though not round it.
    slow, slow_end = finished_pass(1.1 * TURN_SHARE_OF_HOLD * HOLD_S, 0.010)
    assert list(slow.walking(QKV[0], F, {"a": 1}, slow_end + 0.001, HOLD_S, True)) == []
    walk(slow, "b", QKV[:2], slow_end + 0.030, 0.010)
    assert list(slow.walking(QKV[3], F, {"a": 1}, slow_end + 0.041, HOLD_S, True)) == ["b"]
    # Where the line lies: a turn longer than a pass at the client's own pace (its calls' time), or
    # than that share of the hold, whichever is shorter.
    own_pass_s = 0.001 * len(QKV)  # its calls' time: a group's jump is one call, though it skips positions
    for gap_s, line_s in ((0.001, own_pass_s), (0.010, TURN_SHARE_OF_HOLD * HOLD_S)):
        for turn_s, waited in ((0.9 * line_s, True), (1.1 * line_s, False)):
            predictor, end = finished_pass(turn_s, gap_s)
            assert bool(list(predictor.walking(QKV[0], F, {"a": 1}, end + 0.001, HOLD_S, True))) is waited


def test_a_clients_next_call_is_due_one_own_gap_after_its_last_hand_out_or_one_turn_after_its_pass():
    predictor = ArrivalPredictor()
    end = walk(predictor, "b", LAYERS, 0.0, 0.001)
    for _ in range(3):  # a stream: a pass, then 30 ms idle
        end = walk(predictor, "b", LAYERS, end + 0.030, 0.001)
    assert predictor.next_call_s("b", F) == pytest.approx(end + 0.030)  # its pass ended: a turn away
    walk(predictor, "b", LAYERS[:1], end + 0.030, 0.001)  # in its pass: one gap of its own away
    assert predictor.next_call_s("b", F) == pytest.approx(end + 0.031)
    request = PendingRequest(next(_ids), "b", LAYERS[1], F, 1, LatencyClass.DECODE, end + 0.031)
    predictor.arrived(request)
    assert predictor.next_call_s("b", F) is None  # pending: it is here, not due
    assert predictor.next_call_s("b", Op.BACKWARD) is None and predictor.next_call_s("nobody", F) is None


def test_products_without_bias_are_steps_of_the_forward_walk_asked_for_at_their_own_layers():
    """A client whose biases are its own (peft's bias="all": its biased layers ask for ``x·Wᵀ``,
    Op.NOISE) walks one forward pass, NOISE at some layers: it switched walks at each of them, so
    its pace was never learned and the decode guard took it for a fine-tuning client in backward
    (a helper's probe: an active decoder after 16 of 208 requests). It is one walk now; it is on
    its way to the NOISE products of the layers it asks those of, and to the others' products."""
    predictor = ArrivalPredictor()
    now = 0.0
    bare = {"l0.q", "l1.q"}
    for _ in range(2):  # two passes: positions placed, pace and repeats learned
        for layer in LAYERS:
            op = Op.NOISE if layer in bare else F
            request = PendingRequest(next(_ids), "b", layer, op, 1, LatencyClass.DECODE, now)
            predictor.arrived(request)
            predictor.handed_out(request, now)
            now += 0.001
    assert predictor.positions[F] == {layer: i for i, layer in enumerate(LAYERS)}
    assert predictor.gap_s("b", F) == pytest.approx(0.001) and Op.FORWARD in predictor.tracks["b"].repeats
    # At the head, about to turn: on its way to l0.q's product without bias, and l0.k's product.
    assert list(predictor.walking("l0.q", Op.NOISE, {}, now, HOLD_S)) == ["b"]
    assert list(predictor.walking("l0.q", F, {}, now, HOLD_S)) == []
    assert list(predictor.walking("l0.k", F, {}, now, HOLD_S)) == ["b"]
    assert list(predictor.walking("l0.k", Op.NOISE, {}, now, HOLD_S)) == []
    assert len(predictor.expected("l0.q", Op.NOISE, {}, now, wrap=True)) == 1
    assert predictor.expected("l0.q", F, {}, now, wrap=True) == []


def test_a_decoder_asking_for_products_without_bias_stays_a_decoder():
    from symbiosis.executor.pacing import DecodeGuard

    guard = DecodeGuard(slo_s=None, slowdown=1.5)
    for position, op in enumerate([F, Op.NOISE, F, Op.NOISE]):
        guard.arrived("d", op, True, position, 0.001 * position)
    assert guard.active(0.004) == ["d"]
    guard.arrived("d", Op.BACKWARD, False, 0, 0.005)  # backward: a fine-tuning client
    assert guard.active(0.005) == []
