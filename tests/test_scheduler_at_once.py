"""A request no one else can join is served at once, without the queue.

``Scheduler.serves_at_once``: latency work with nothing pending skips the queue when the rule in
force would not hold it for any other client (``immediate`` and ``none``: never; ``convoy``: for
a client walking towards the layer; ``predicted``: for one expected within its wait budget), and
leaves behind what the queue would have recorded of it. The property test checks the decision
against the queue's own on random walks of several decoders.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from symbiosis.executor.requests import PendingRequest
from symbiosis.executor.scheduler import ACTIVE_CLIENT_S, Lane, Scheduler, SchedulerConfig
from symbiosis.vocabulary import LatencyClass, Op

D, F = LatencyClass.DECODE, LatencyClass.FINETUNE
# Rules that hold a request for no one, those that hold it for a client on its way, and the two
# that hold it for every joined client by definition.
HOLD_FOR_NO_ONE = [{"policy": "immediate"}, {"policy": "opportunistic", "wait_rule": "none"}]
HOLD_FOR_THOSE_COMING = [
    {"policy": "opportunistic", "wait_rule": "predicted"},
    {"policy": "opportunistic", "wait_rule": "convoy"},
]
HOLD_FOR_EVERYONE = [{"policy": "lockstep"}, {"policy": "opportunistic", "wait_rule": "budget"}]
LAYERS = 4


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


def _peer_decoding(options: dict, passes: int = 3, gap_s: float = 0.002) -> tuple[Scheduler, float]:
    """Client "b" decodes ``passes`` tokens over ``LAYERS`` layers, ``gap_s`` between its calls,
    alone (served by the queue); returns the scheduler and when its last call was handed out:
    "b" then computes its next layer's input, nothing pending."""
    scheduler = Scheduler(SchedulerConfig(**options))
    scheduler.client_joined("a")
    now, request_id = 0.0, 0
    for _ in range(passes):
        for layer in range(LAYERS):
            now = _served_by_queue(scheduler, PendingRequest(request_id, "b", f"l{layer}", Op.FORWARD, 1, D, now))
            request_id += 1
            now += gap_s
    return scheduler, now - gap_s


@pytest.mark.parametrize("options", HOLD_FOR_NO_ONE)
def test_rules_that_hold_for_no_one_serve_at_once_beside_an_active_client(options):
    scheduler, now = _peer_decoding(options)
    assert _at_once(scheduler, "a", now, layer="l1")  # "b" walks towards l1 right now: nobody waits for it


@pytest.mark.parametrize("options", HOLD_FOR_EVERYONE)
def test_rules_that_wait_for_every_client_keep_the_queue(options):
    scheduler = _peer_sent_at(options, 0.0)
    assert not _at_once(scheduler, "a", 10 * ACTIVE_CLIENT_S)
    quiet = Scheduler(SchedulerConfig(**options))
    quiet.client_joined("b")  # joined, never sent: lockstep and the budget rule still wait for it
    assert not _at_once(quiet, "a", 0.0)


@pytest.mark.parametrize("options", HOLD_FOR_THOSE_COMING)
def test_a_client_on_its_way_keeps_the_queue_and_one_that_is_not_does_not(options):
    scheduler, now = _peer_decoding(options)  # "b"'s last call: l3; its next pass starts at l0
    assert not _at_once(scheduler, "a", now, layer="l0")  # "b" is due there in one call (2 ms)
    # Two calls away (4 ms): the convoy waits for it however far; the predicted rule only within
    # the request's wait budget (3 ms).
    assert _at_once(scheduler, "a", now, layer="l1") == (options["wait_rule"] == "predicted")
    # The layer "b" called last: a whole pass away, beyond half a pass (it is ahead, not coming).
    assert _at_once(scheduler, "a", now, layer="l3")
    # "b" quiet past the lockstep timeout (convoy) and past its predicted arrival plus a gap.
    assert _at_once(scheduler, "a", now + 2 * ACTIVE_CLIENT_S, layer="l0")


@pytest.mark.parametrize("options", HOLD_FOR_THOSE_COMING + HOLD_FOR_NO_ONE)
def test_a_layer_not_yet_placed_in_the_walk_keeps_the_queue_unless_no_one_is_waited_for(options):
    scheduler, now = _peer_decoding(options)
    assert _at_once(scheduler, "a", now, layer="new") == (options in HOLD_FOR_NO_ONE)


def test_a_client_that_joined_and_sent_nothing_is_not_waited_for():
    for options in HOLD_FOR_NO_ONE + HOLD_FOR_THOSE_COMING:
        scheduler = Scheduler(SchedulerConfig(**options))
        scheduler.client_joined("b")
        # The first pass places the layers in the walk (predicted, convoy: the queue decides until then).
        assert _at_once(scheduler, "a", 0.0) == (options in HOLD_FOR_NO_ONE)
        for layer in range(LAYERS):
            _served_by_queue(scheduler, PendingRequest(layer, "a", f"l{layer}", Op.FORWARD, 1, D, 0.001 * layer))
        assert _at_once(scheduler, "a", 0.01, layer="l0")


def test_pending_work_and_bulk_work_keep_the_queue():
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


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    options=st.sampled_from(HOLD_FOR_NO_ONE + HOLD_FOR_THOSE_COMING + HOLD_FOR_EVERYONE + [{}]),
    clients=st.lists(
        st.tuples(
            st.floats(0.0005, 0.006),  # time between its calls (s)
            st.integers(1, 5),  # tokens it decodes, then it stops
            st.floats(0.0, 0.02),  # when it starts (s)
            st.integers(1, 4),  # rows a call
        ),
        min_size=2,
        max_size=4,
    ),
    lanes_apart=st.booleans(),
)
def test_served_at_once_exactly_when_the_queue_would_hand_it_out_at_once_alone(options, clients, lanes_apart):
    """Decoders walk ``LAYERS`` layers at their own paces, served by the queue (products take no
    time). Whenever one calls with nothing pending, ``serves_at_once`` must agree with the queue
    itself (a copy of the scheduler, the request added, ``next_batch`` at that time): at once only
    if the queue hands it out at once, on its own -- and always then, but on a layer not yet placed
    in the walk (the first pass), where it leaves the decision to the queue. ``lanes_apart``: an
    engine whose bulk work has its own runner (``Lane.LATENCY`` asked), beside a fine-tuning
    client whose bulk request stays pending all along (its runner's business)."""
    scheduler = Scheduler(SchedulerConfig(**options))
    names = [f"c{i}" for i in range(len(clients))]
    for name in names:
        scheduler.client_joined(name)
    lane = Lane.LATENCY if lanes_apart else None
    if lanes_apart:
        # On a layer of its own: a group's hold counts from its oldest entry, bulk ones too, so the
        # queue serves a latency request beside one that old at once as overdue, where
        # ``serves_at_once`` asks the rule and leaves it to the queue (conservative, allowed).
        scheduler.add(PendingRequest(10**7, "trainer", "adapter", Op.FORWARD, 64, F, 0.0))
    next_call = {name: start for name, (_, _, start, _) in zip(names, clients)}
    calls_left = {name: tokens * LAYERS for name, (_, tokens, _, _) in zip(names, clients)}
    pending: dict[int, str] = {}  # request id -> its client, while queued
    request_ids = iter(range(10**6))
    compared = 0

    def run_batches(now: float) -> None:
        while (batch := scheduler.next_batch(now, lane)) is not None:
            for part in batch.slices:
                if part.request_id in pending and part.stop == requests[part.request_id].rows:
                    client = pending.pop(part.request_id)
                    next_call[client] = now + clients[names.index(client)][0]

    requests: dict[int, PendingRequest] = {}
    while any(calls_left.values()) or pending:
        waiting = [n for n in names if calls_left[n] and n not in pending.values()]
        call_s = min((next_call[n] for n in waiting), default=float("inf"))
        wakeup_s = scheduler.next_wakeup(call_s if call_s < float("inf") else 1e9, lane) if pending else None
        if wakeup_s is not None and wakeup_s <= call_s:
            run_batches(wakeup_s)
            continue
        client = min(waiting, key=next_call.__getitem__)
        gap_s, _, _, rows = clients[names.index(client)]
        done = LAYERS * clients[names.index(client)][1] - calls_left[client]
        calls_left[client] -= 1
        request = PendingRequest(next(request_ids), client, f"l{done % LAYERS}", Op.FORWARD, rows, D, call_s)
        if not scheduler.has_pending(Lane.LATENCY):
            queue = copy.deepcopy(scheduler)
            placed = scheduler._arrivals.placed(request.layer_id, Op.FORWARD)  # before it arrives
            at_once = scheduler.serves_at_once(client, request.layer_id, Op.FORWARD, rows, D, call_s, lane)
            queue.add(request)
            batch = queue.next_batch(call_s, lane)
            queue_at_once = batch is not None and [(p.request_id, p.stop) for p in batch.slices] == [
                (request.request_id, rows)
            ]
            assert at_once <= queue_at_once, (options, client, request)
            if placed:
                assert at_once == queue_at_once, (options, client, request)
            compared += 1
            if at_once:
                scheduler.served_alone(client, rows, D)
                next_call[client] = call_s + gap_s
                continue
        requests[request.request_id] = request
        pending[request.request_id] = client
        scheduler.add(request)
        run_batches(call_s)
    assert compared


def _decoder_beside_a_spent_flood(options: dict) -> tuple[Scheduler, float]:
    """Client "a" decodes 1 row a call over ``LAYERS`` layers (the queue serves it: "f" has joined);
    then client "f" floods layer l1 with three 16,384-row requests, and one flood product of 10 ms
    spends the flood's allowance (``Scheduler._allowed``): "a" is an active decoder, so the flood
    is held until the allowance fills again (at 5% of the wall clock). Returns the scheduler and
    the time just after that product."""
    scheduler = Scheduler(SchedulerConfig(**options))
    scheduler.client_joined("f")
    now, request_id = 0.0, 0
    for _ in range(3):
        for layer in range(LAYERS):
            now = _served_by_queue(scheduler, PendingRequest(request_id, "a", f"l{layer}", Op.FORWARD, 1, D, now))
            request_id += 1
            now += 0.0005
    scheduler._guard.backlog_share = 0.05  # as the decoder's slowed tokens would have brought it down
    for i in range(3):
        scheduler.add(PendingRequest(1000 + i, "f", "l1", Op.FORWARD, 16_384, F, now))
    batch = scheduler.next_batch(now)
    assert batch is not None and {s.request_id for s in batch.slices} <= {1000, 1001, 1002}
    scheduler.batch_done(batch, 0.010, now + 0.010)
    return scheduler, now + 0.0101


@pytest.mark.parametrize("options", HOLD_FOR_NO_ONE)
def test_a_decoder_beside_a_flood_its_pacing_holds_is_served_at_once(options):
    """A flood held by its pacing would neither lead a batch nor ride along in the decoder's, so
    the decoder's request is served as with nothing pending: at once, skipping the queue (in
    process, the queue's path cost a decoder beside a held flood twice its time per call). The
    queue agrees, on a copy; once the allowance has filled, the flood's rows may ride along and
    the request keeps the queue."""
    scheduler, now = _decoder_beside_a_spent_flood(options)
    queue = copy.deepcopy(scheduler)
    assert _at_once(scheduler, "a", now, layer="l1")
    queue.add(PendingRequest(5000, "a", "l1", Op.FORWARD, 1, D, now))
    assert [(p.request_id, p.stop) for p in queue.next_batch(now).slices] == [(5000, 1)]

    scheduler, now = _decoder_beside_a_spent_flood(options)
    assert not _at_once(scheduler, "a", now + 0.5, layer="l1")  # refilled
