"""A request no one can join is served at once, even with other clients connected.

``Scheduler.serves_at_once``: latency work whose client's peers are idle (nothing pending, nothing
sent for ``ACTIVE_CLIENT_S``) skips the queue, under every rule that would not hold it for an idle
client anyway, and leaves behind what the queue would have recorded of it.
"""

from __future__ import annotations

import pytest

from symbiosis.executor.requests import PendingRequest
from symbiosis.executor.scheduler import ACTIVE_CLIENT_S, Lane, Scheduler, SchedulerConfig
from symbiosis.vocabulary import LatencyClass, Op

D, F = LatencyClass.DECODE, LatencyClass.FINETUNE
# Rules that never hold a request for an idle client, and the two that do by definition.
SERVE_AT_ONCE = [
    {"policy": "immediate"},
    {"policy": "opportunistic"},  # adaptive: the tuner's rule of the moment
    {"policy": "opportunistic", "wait_rule": "none"},
    {"policy": "opportunistic", "wait_rule": "predicted"},
    {"policy": "opportunistic", "wait_rule": "convoy"},
]
HOLD_FOR_IDLE = [{"policy": "lockstep"}, {"policy": "opportunistic", "wait_rule": "budget"}]


def _served_by_queue(scheduler: Scheduler, request: PendingRequest) -> float:
    """Add ``request`` and run batches until it is handed out; returns the time it was."""
    scheduler.add(request)
    now = request.arrival_s
    while scheduler.pending_rows():
        now = max(now, scheduler.next_wakeup(now))
        scheduler.next_batch(now)
    return now


def _at_once(scheduler: Scheduler, client: str, now: float, rows: int = 1, cls=D, layer: str = "l0", lane=None) -> bool:
    return scheduler.serves_at_once(client, layer, Op.FORWARD, rows, cls, now, lane)


def _peer_sent_at(options: dict, sent_s: float) -> Scheduler:
    scheduler = Scheduler(SchedulerConfig(**options))
    scheduler.client_joined("a")
    scheduler.client_joined("b")
    _served_by_queue(scheduler, PendingRequest(0, "b", "l0", Op.FORWARD, 1, D, sent_s))
    return scheduler


@pytest.mark.parametrize("options", SERVE_AT_ONCE)
def test_latency_work_beside_an_idle_client_skips_the_queue(options):
    scheduler = _peer_sent_at(options, 0.0)
    assert not _at_once(scheduler, "a", 0.5 * ACTIVE_CLIENT_S)  # "b" sent within the second: it may come
    assert _at_once(scheduler, "a", 1.5 * ACTIVE_CLIENT_S)


@pytest.mark.parametrize("options", HOLD_FOR_IDLE)
def test_rules_that_wait_for_every_client_keep_the_queue(options):
    scheduler = _peer_sent_at(options, 0.0)
    assert not _at_once(scheduler, "a", 10 * ACTIVE_CLIENT_S)
    quiet = Scheduler(SchedulerConfig(**options))
    quiet.client_joined("b")  # joined, never sent: lockstep and the budget rule still wait for it
    assert not _at_once(quiet, "a", 0.0)


def test_a_client_that_joined_and_sent_nothing_is_idle():
    scheduler = Scheduler(SchedulerConfig())
    scheduler.client_joined("b")
    assert _at_once(scheduler, "a", 0.0)


def test_pending_work_bulk_work_and_a_long_lockstep_timeout_keep_the_queue():
    scheduler = _peer_sent_at({}, 0.0)
    later = 2 * ACTIVE_CLIENT_S
    assert not _at_once(scheduler, "a", later, rows=64, cls=F)  # bulk: the queue cuts it into chunks
    big = scheduler.config.decode_share_rows + 1
    assert not _at_once(scheduler, "a", later, rows=big)  # "decode" on more rows than a decoder's share is bulk
    own = _peer_sent_at({}, 0.0)
    own.add(PendingRequest(1, "a", "l1", Op.FORWARD, 1, D, later))  # e.g. held by a flood's pacing
    assert not _at_once(own, "a", later + 5.0)  # its own request pending: served before this one, not after
    scheduler.add(PendingRequest(1, "b", "l1", Op.FORWARD, 1, D, later))
    assert not _at_once(scheduler, "a", later + 5.0)  # "b" has a request pending: the queue may batch them
    # A convoy waits up to the lockstep timeout for a client on its way: a client quiet for less is not idle.
    patient = _peer_sent_at({"wait_rule": "convoy", "lockstep_timeout_ms": 3000.0}, 0.0)
    assert not _at_once(patient, "a", 2 * ACTIVE_CLIENT_S)
    assert _at_once(patient, "a", 3.5)


def test_beside_bulk_clients_only_the_latency_lane_ignores_them_even_when_active():
    scheduler = Scheduler(SchedulerConfig())
    scheduler.client_joined("a")
    _served_by_queue(scheduler, PendingRequest(0, "trainer", "l0", Op.FORWARD, 64, F, 0.0))
    _served_by_queue(scheduler, PendingRequest(1, "b", "l0", Op.FORWARD, 1, D, 0.0))  # a decoder, then quiet
    now = 2 * ACTIVE_CLIENT_S
    scheduler.add(PendingRequest(2, "trainer", "l3", Op.FORWARD, 64, F, now))  # busy, bulk
    assert not _at_once(scheduler, "a", now)  # one runner for both lanes: its rows could share the batch
    assert _at_once(scheduler, "a", now, lane=Lane.LATENCY)  # its own runner: bulk work neither shares nor delays


def _decode(scheduler: Scheduler, through_queue: bool, passes: int = 6, layers: int = 4) -> float:
    """Client "a" decodes ``passes`` tokens over ``layers`` layers (2 ms a layer, 5 ms between
    tokens), each request served at once: by the queue or without it."""
    now, request_id = 10.0, 100
    for _ in range(passes):
        for layer in range(layers):
            if through_queue:
                _served_by_queue(scheduler, PendingRequest(request_id, "a", f"l{layer}", Op.FORWARD, 2, D, now))
            else:
                assert _at_once(scheduler, "a", now, rows=2, layer=f"l{layer}")
                scheduler.served_alone("a", 2, D)
            request_id += 1
            now += 0.002
        now += 0.005
    return now


@pytest.mark.parametrize("options", [{}, {"decode_slo_ms": 30.0}])
def test_a_request_served_at_once_is_recorded_as_the_queue_records_it(options):
    """The clients that wake find this one's pace, its decoder's token times and its wait-tuner
    counts as if its requests had taken the queue: the same decisions follow."""
    queued, direct = (_peer_sent_at(options, 0.0) for _ in range(2))
    now = _decode(queued, through_queue=True)
    assert _decode(direct, through_queue=False) == now
    for scheduler in (queued, direct):
        _served_by_queue(scheduler, PendingRequest(900, "b", "l0", Op.FORWARD, 1, D, now))  # "b" wakes
    assert direct.stats()["decode_guard"] == queued.stats()["decode_guard"]
    assert direct.stats()["decode_guard"]["token_samples"] > 0
    assert direct.stats()["wait_rule"] == queued.stats()["wait_rule"]
    track, expected = direct._arrivals.tracks["a"], queued._arrivals.tracks["a"]
    assert (track.gap_s, track.repeats, track.position) == (expected.gap_s, expected.repeats, expected.position)
    assert direct._arrivals.positions == queued._arrivals.positions
    assert not _at_once(direct, "a", now)  # "b" is active now: back to the queue
