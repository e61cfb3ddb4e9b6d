"""The batching scheduler is pure policy: drive it with a fake clock (plain floats) and check invariants.

``simulate`` plays the executor's loop: add arrivals, call ``next_batch`` until None, then jump the
clock to ``next_wakeup`` or the next arrival. Batches take ``exec_s`` of fake time to run.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest

from symbiosis.executor.requests import Batch, PendingRequest
from symbiosis.executor.scheduler import POLICIES, Scheduler, SchedulerConfig
from symbiosis.vocabulary import LatencyClass, Op

D, P, F = LatencyClass.DECODE, LatencyClass.PREFILL, LatencyClass.FINETUNE
EPS = 1e-12


def req(request_id, client="a", layer="l0", op=Op.FORWARD, rows=1, cls=D, at=0.0) -> PendingRequest:
    return PendingRequest(request_id, client, layer, op, rows, cls, at)


@dataclass
class Run:
    batches: list[tuple[float, Batch]] = field(default_factory=list)
    dropped: set[int] = field(default_factory=set)
    scheduler: Scheduler | None = None

    def slices_of(self, request_id: int) -> list[tuple[float, int, int]]:
        return [(t, s.start, s.stop) for t, b in self.batches for s in b.slices if s.request_id == request_id]

    def first_served_s(self, request_id: int) -> float:
        return self.slices_of(request_id)[0][0]

    def finished_s(self, request_id: int) -> float:
        return self.slices_of(request_id)[-1][0]


def simulate(
    config: SchedulerConfig,
    arrivals: list[PendingRequest],
    joins: tuple[str, ...] = (),
    leaves: tuple[tuple[float, str], ...] = (),
    exec_s: float = 0.0,
    horizon_s: float = math.inf,
) -> Run:
    """The executor loop with a fake clock; stops when nothing is pending or past ``horizon_s``."""
    scheduler = Scheduler(config)
    for client in joins:
        scheduler.client_joined(client)
    arrivals = sorted(arrivals, key=lambda r: r.arrival_s)
    leaves = tuple(sorted(leaves))
    run = Run(scheduler=scheduler)
    now, next_arrival, next_leave = 0.0, 0, 0
    for _ in range(1_000_000):
        while next_arrival < len(arrivals) and arrivals[next_arrival].arrival_s <= now:
            scheduler.add(arrivals[next_arrival])
            next_arrival += 1
        while next_leave < len(leaves) and leaves[next_leave][0] <= now:
            run.dropped.update(scheduler.client_left(leaves[next_leave][1]))
            next_leave += 1
        if now > horizon_s:
            return run
        batch = scheduler.next_batch(now)
        if batch is not None:
            run.batches.append((now, batch))
            now += exec_s
            continue
        wakeup = scheduler.next_wakeup(now)
        assert wakeup is None or wakeup > now, "next_wakeup said 'now' but next_batch returned None"
        events = [wakeup] if wakeup is not None else []
        if next_arrival < len(arrivals):
            events.append(arrivals[next_arrival].arrival_s)
        if next_leave < len(leaves):
            events.append(leaves[next_leave][0])
        if not events:
            return run
        now = min(events)
    raise AssertionError("simulation did not terminate")


def check_invariants(config: SchedulerConfig, arrivals: list[PendingRequest], run: Run) -> None:
    """Every request not dropped is served exactly once, in order; batches are homogeneous and bounded."""
    by_id = {r.request_id: r for r in arrivals}
    for _, batch in run.batches:
        assert batch.slices, "empty batch"
        assert batch.rows <= config.row_budget
        for s in batch.slices:
            r = by_id[s.request_id]
            assert (r.layer_id, r.op) == (batch.layer_id, batch.op), "batch mixes layers or ops"
    for r in arrivals:
        chunks = [(start, stop) for _, start, stop in run.slices_of(r.request_id)]
        if r.request_id in run.dropped:
            assert sum(stop - start for start, stop in chunks) < max(r.rows, 1), "dropped after completion"
            continue
        if r.rows == 0:
            assert chunks == [(0, 0)]
            continue
        assert chunks, f"request {r.request_id} never served"
        assert chunks[0][0] == 0 and chunks[-1][1] == r.rows
        for (_, stop), (start, _) in zip(chunks, chunks[1:]):
            assert start == stop, f"request {r.request_id} rows not contiguous: {chunks}"
        assert all(stop > start for start, stop in chunks), "empty slice of a non-empty request"
    assert run.scheduler is not None
    assert run.scheduler.pending_rows() == 0
    assert run.scheduler.next_wakeup(1e9) is None
    assert run.scheduler.next_batch(1e9) is None


def wait_bound_s(config: SchedulerConfig, r: PendingRequest) -> float:
    """The longest a request may be held back to grow a batch (with the executor otherwise idle)."""
    opportunistic = config.wait_budget_s(r.rows, r.latency_class)
    if config.wait_rule in ("adaptive", "convoy"):  # the convoy rule waits up to the lockstep timeout
        opportunistic = max(opportunistic, config.lockstep_timeout_ms / 1000.0)
    return {"immediate": 0.0, "lockstep": config.lockstep_timeout_ms / 1000.0, "opportunistic": opportunistic}[
        config.policy
    ]


def random_workload(seed: int, n: int = 120) -> tuple[list[PendingRequest], tuple[tuple[float, str], ...]]:
    rng = random.Random(seed)
    clients = [f"c{i}" for i in range(4)]
    arrivals = [
        req(
            i,
            client=rng.choice(clients),
            layer=rng.choice(["q", "k", "v"]),
            op=rng.choice(list(Op)),
            rows=rng.choice([0, 1, 1, 3, 7, 16, 40]),
            cls=rng.choice(list(LatencyClass)),
            at=rng.uniform(0.0, 0.05),
        )
        for i in range(n)
    ]
    leaves = ((rng.uniform(0.0, 0.05), rng.choice(clients)),)
    return arrivals, leaves


# ------------------------------------------------------------------------------------ tables

SCENARIOS: dict[str, list[PendingRequest]] = {
    "empty": [],
    "single": [req(1, rows=3)],
    "single_zero_rows": [req(1, rows=0)],
    "larger_than_budget": [req(1, rows=37, cls=F)],
    "mixed_classes_one_group": [req(1, rows=9, cls=F), req(2, rows=2, cls=P, at=0.001), req(3, cls=D, at=0.002)],
    "zero_rows_behind_full_batch": [req(1, rows=16, cls=F), req(2, rows=0, cls=F), req(3, rows=5, at=0.0001)],
    "many_clients_layers_ops": [
        req(
            i,
            client=f"c{i % 3}",
            layer=f"l{i % 2}",
            op=list(Op)[i % 3],
            rows=i % 5,
            cls=list(LatencyClass)[i % 3],
            at=i * 0.0007,
        )
        for i in range(30)
    ],
}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_request_served_once_in_order_within_wait_bound(policy, scenario):
    config = SchedulerConfig(policy=policy, row_budget=16)
    arrivals = SCENARIOS[scenario]
    run = simulate(config, arrivals, joins=("a", "b"))
    check_invariants(config, arrivals, run)
    for r in arrivals:
        assert run.first_served_s(r.request_id) - r.arrival_s <= wait_bound_s(config, r) + EPS
    if not arrivals:
        assert run.batches == []


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(4))
def test_randomized_workload_keeps_invariants(policy, seed):
    config = SchedulerConfig(policy=policy, row_budget=32, aging_ms=20.0)
    arrivals, leaves = random_workload(seed)
    run = simulate(config, arrivals, joins=("c0", "c1", "c2", "c3", "idle"), leaves=leaves)
    check_invariants(config, arrivals, run)
    for r in arrivals:
        if r.request_id not in run.dropped:
            assert run.first_served_s(r.request_id) - r.arrival_s <= wait_bound_s(config, r) + EPS
    # With batches taking time, waits are no longer bounded, but completeness and order still hold.
    slow = simulate(config, arrivals, joins=("c0", "c1"), leaves=leaves, exec_s=0.0004)
    check_invariants(config, arrivals, slow)


# ------------------------------------------------------------------------------------ readiness per policy


def test_immediate_serves_at_once_even_with_other_clients_joined():
    scheduler = Scheduler(SchedulerConfig(policy="immediate"))
    for c in ("a", "b"):
        scheduler.client_joined(c)
    scheduler.add(req(1, client="a", at=1.0))
    assert scheduler.next_wakeup(1.0) == 1.0
    batch = scheduler.next_batch(1.0)
    assert batch is not None and [s.request_id for s in batch.slices] == [1]


def test_lockstep_waits_for_every_joined_client_or_timeout():
    config = SchedulerConfig(policy="lockstep", lockstep_timeout_ms=50.0)
    scheduler = Scheduler(config)
    for c in ("a", "b", "c"):
        scheduler.client_joined(c)
    scheduler.add(req(1, client="a", at=0.0))
    scheduler.add(req(2, client="b", at=0.001))
    assert scheduler.next_batch(0.002) is None
    assert scheduler.next_wakeup(0.002) == pytest.approx(0.050)
    scheduler.add(req(3, client="c", at=0.003))  # the last joined client arrives: no one else can come
    batch = scheduler.next_batch(0.003)
    assert batch is not None and [s.request_id for s in batch.slices] == [1, 2, 3]
    # A stalled client costs at most the timeout.
    scheduler.add(req(4, client="a", at=1.0))
    assert scheduler.next_batch(1.049) is None
    assert [s.request_id for s in scheduler.next_batch(1.050).slices] == [4]


def test_lockstep_counts_unjoined_senders_and_forgets_leavers():
    scheduler = Scheduler(SchedulerConfig(policy="lockstep"))
    scheduler.add(req(1, client="a"))  # implicit join of "a": alone, so ready at once
    assert scheduler.next_batch(0.0) is not None
    scheduler.add(req(2, client="b", at=0.1))  # implicit join of "b"; "a" is still joined
    assert scheduler.next_batch(0.1) is None
    assert scheduler.client_left("a") == []
    assert scheduler.next_batch(0.1) is not None  # only "b" is left, and it is present


def test_opportunistic_fixed_waits_its_budget_unless_waiting_cannot_help():
    config = SchedulerConfig(policy="opportunistic", row_budget=64, wait_rule="budget")
    scheduler = Scheduler(config)
    for c in ("a", "b"):
        scheduler.client_joined(c)
    scheduler.add(req(1, client="a", rows=4, at=0.0))
    assert scheduler.next_batch(0.0) is None
    wakeup = scheduler.next_wakeup(0.0)
    assert wakeup == pytest.approx(config.wait_budget_s(4, D))
    assert scheduler.next_batch(wakeup) is not None
    # Every joined client is present: serve at once.
    scheduler.add(req(2, client="a", at=1.0))
    scheduler.add(req(3, client="b", at=1.0))
    assert sorted(s.request_id for s in scheduler.next_batch(1.0).slices) == [2, 3]
    # The group already fills the row budget: serve at once.
    scheduler.add(req(4, client="a", rows=64, cls=F, at=2.0))
    assert scheduler.next_batch(2.0).rows == 64


def test_opportunistic_wait_budget_grows_with_rows_and_class_and_is_capped():
    config = SchedulerConfig(max_wait_ms=5.0)
    decode_1, decode_256 = config.wait_budget_s(1, D), config.wait_budget_s(256, D)
    assert 0 < decode_1 < decode_256
    assert decode_1 < config.wait_budget_s(1, P) < config.wait_budget_s(1, F)
    assert config.wait_budget_s(1_000_000, F) == pytest.approx(0.005)
    assert config.wait_budget_s(100, P) == pytest.approx(min(5.0, config.prefill_base_wait_ms + 0.002 * 100) / 1000)
    assert SchedulerConfig(decode_base_wait_ms=0.25, prefill_base_wait_ms=1.0).wait_budget_s(100, P) == pytest.approx(
        (1.0 + 0.002 * 100) / 1000
    )


# ------------------------------------------------------------------------------------ ordering and splitting


def test_batch_orders_decode_first_and_splits_the_finetune_request():
    scheduler = Scheduler(SchedulerConfig(policy="immediate", row_budget=8))
    scheduler.add(req(1, rows=10, cls=F, at=0.0))
    scheduler.add(req(2, rows=3, cls=P, at=0.0001))
    scheduler.add(req(3, rows=2, cls=D, at=0.0002))
    first = scheduler.next_batch(0.001)
    assert [(s.request_id, s.start, s.stop) for s in first.slices] == [(3, 0, 2), (2, 0, 3), (1, 0, 3)]
    assert scheduler.pending_rows() == 7
    scheduler.add(req(4, rows=1, cls=D, at=0.002))  # a new decode still goes before the split rest
    second = scheduler.next_batch(0.002)
    assert [(s.request_id, s.start, s.stop) for s in second.slices] == [(4, 0, 1), (1, 3, 10)]
    assert scheduler.next_batch(0.002) is None and scheduler.pending_rows() == 0


def test_a_batch_says_whether_it_carries_only_latency_work_and_an_untimed_one_keeps_its_estimate():
    scheduler = Scheduler(SchedulerConfig(policy="immediate", row_budget=8))
    scheduler.add(req(1, rows=2, cls=D, at=0.0))
    scheduler.add(req(2, rows=3, cls=P, at=0.0))
    decode = scheduler.next_batch(0.001)
    assert decode.latency_only and decode.rows == 5
    scheduler.batch_done(decode, None, 0.001)  # the engine sampled it out: nothing learned
    assert scheduler._cost.line(("l0", Op.FORWARD)) is None and scheduler._last_fill is None
    scheduler.add(req(3, rows=1, cls=D, at=0.002))
    scheduler.add(req(4, rows=4, cls=F, at=0.002))  # fine-tuning rides along: the product is timed
    mixed = scheduler.next_batch(0.002)
    assert not mixed.latency_only and mixed.rows == 5
    scheduler.batch_done(mixed, 5e-6, 0.002)
    assert scheduler._cost.line(("l0", Op.FORWARD)) == pytest.approx((0.0, 1e-6))


def test_split_request_rest_is_served_at_once_without_waiting_again():
    scheduler = Scheduler(SchedulerConfig(policy="lockstep", row_budget=8))
    for c in ("a", "b"):
        scheduler.client_joined(c)
    scheduler.add(req(1, client="a", rows=10, cls=F))
    scheduler.add(req(2, client="b", rows=1, cls=D))
    first = scheduler.next_batch(0.0)
    assert [(s.request_id, s.start, s.stop) for s in first.slices] == [(2, 0, 1), (1, 0, 7)]
    assert scheduler.next_wakeup(0.0) == 0.0
    rest = scheduler.next_batch(0.0)  # only "a" is still in the group, but its service has begun
    assert [(s.request_id, s.start, s.stop) for s in rest.slices] == [(1, 7, 10)]


def test_requests_added_out_of_arrival_order_are_served_by_arrival():
    scheduler = Scheduler(SchedulerConfig(policy="immediate"))
    scheduler.add(req(1, at=0.002))
    scheduler.add(req(2, at=0.001))
    scheduler.add(req(3, at=0.003))
    assert [s.request_id for s in scheduler.next_batch(0.003).slices] == [2, 1, 3]


def test_ready_decode_group_goes_before_older_finetune_group():
    scheduler = Scheduler(SchedulerConfig(policy="immediate"))
    scheduler.add(req(1, layer="a", cls=F, at=0.0))
    scheduler.add(req(2, layer="b", cls=D, at=0.01))
    assert scheduler.next_batch(0.01).layer_id == "b"
    assert scheduler.next_batch(0.01).layer_id == "a"


def test_aged_request_goes_before_class_priority():
    scheduler = Scheduler(SchedulerConfig(policy="immediate", aging_ms=100.0))
    scheduler.add(req(1, layer="a", cls=F, at=0.0))
    scheduler.add(req(2, layer="b", cls=D, at=0.1))
    assert scheduler.next_batch(0.1).layer_id == "a"


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("same_group", [False, True])
@pytest.mark.parametrize("finetune_client", ["a", "ft"])
def test_no_starvation_of_finetune_under_steady_decode_stream(policy, same_group, finetune_client):
    """Each 1 ms tick a decode arrives and each batch takes 1 ms; the fine-tuning request must still finish."""
    budget, tick = 8, 0.001
    decode_rows = budget if same_group else 1  # in one group, decodes alone fill every batch
    decodes = [req(i, layer="a", rows=decode_rows, at=i * tick) for i in range(1, 400)]
    finetune = req(0, client=finetune_client, layer="a" if same_group else "b", rows=3 * budget, cls=F, at=0.0)
    arrivals = [finetune] + decodes

    config = SchedulerConfig(policy=policy, row_budget=budget, aging_ms=100.0)
    run = simulate(config, arrivals, exec_s=tick, horizon_s=0.3)
    assert sum(stop - start for _, start, stop in run.slices_of(0)) == finetune.rows
    bound_s = config.aging_ms / 1000 + config.lockstep_timeout_ms / 1000 + 5 * tick
    assert run.finished_s(0) <= bound_s

    if finetune_client == "a":
        # One client: every policy finds the decode group always ready, so only aging saves fine-tuning.
        no_aging = SchedulerConfig(policy=policy, row_budget=budget, aging_ms=1e6)
        starved = simulate(no_aging, arrivals, exec_s=tick, horizon_s=0.3)
        assert sum(stop - start for _, start, stop in starved.slices_of(0)) < finetune.rows


# ------------------------------------------------------------------------------------ clients, validation, stats


def test_client_left_drops_its_pending_requests_including_a_split_one():
    scheduler = Scheduler(SchedulerConfig(policy="immediate", row_budget=4))
    scheduler.add(req(1, client="a", rows=10, cls=F))
    scheduler.add(req(2, client="b", rows=2, layer="other"))
    scheduler.add(req(3, client="a", rows=1, layer="third", cls=F, at=0.001))
    first = scheduler.next_batch(0.0)
    assert first.layer_id == "other"
    split = scheduler.next_batch(0.0)
    assert [(s.request_id, s.start, s.stop) for s in split.slices] == [(1, 0, 4)]
    assert scheduler.client_left("a") == [1, 3]
    assert scheduler.client_left("a") == []
    assert scheduler.pending_rows() == 0
    assert scheduler.next_batch(0.0) is None and scheduler.next_wakeup(0.0) is None
    assert scheduler.stats()["dropped_requests"] == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"policy": "eager"}, "policy"),
        ({"row_budget": 0}, "row_budget"),
        ({"row_budget": 2.5}, "row_budget"),
        ({"row_budget": True}, "row_budget"),
        ({"max_wait_ms": -1.0}, "max_wait_ms"),
        ({"max_wait_ms": float("nan")}, "max_wait_ms"),
        ({"lockstep_timeout_ms": float("inf")}, "lockstep_timeout_ms"),
        ({"aging_ms": -5}, "aging_ms"),
        ({"wait_per_row_ms": -0.1}, "wait_per_row_ms"),
        ({"decode_base_wait_ms": 3.0, "prefill_base_wait_ms": 1.0}, "decode <= prefill <= finetune"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**kwargs)


def test_add_rejects_negative_rows_and_duplicate_pending_ids():
    scheduler = Scheduler(SchedulerConfig())
    with pytest.raises(ValueError, match="rows"):
        scheduler.add(req(1, rows=-1))
    scheduler.add(req(1))
    with pytest.raises(ValueError, match="already pending"):
        scheduler.add(req(1))


def test_help_texts_cover_every_field():
    texts = SchedulerConfig.help_texts()
    assert set(texts) == set(SchedulerConfig.__dataclass_fields__)
    assert all(texts.values())


def test_stats_report_policy_and_counts():
    scheduler = Scheduler(SchedulerConfig(policy="immediate", row_budget=4))
    scheduler.add(req(1, rows=6, cls=F))
    scheduler.add(req(2, rows=1, cls=D, layer="x"))
    before = scheduler.stats()
    assert before["policy"] == "immediate" and before["config"]["row_budget"] == 4
    assert before["pending_requests"] == {"decode": 1, "prefill": 0, "finetune": 1}
    assert before["pending_rows"] == {"decode": 1, "prefill": 0, "finetune": 6}
    while scheduler.next_batch(0.0) is not None:
        pass
    after = scheduler.stats()
    assert after["completed_requests"] == {"decode": 1, "prefill": 0, "finetune": 1}
    assert after["batches"] == 3 and after["rows_served"] == 7


# ------------------------------------------------------------------------------------ predicted arrivals

LAYERS = ("l0", "l1", "l2", "l3")
FIVE_MS = dict(
    decode_base_wait_ms=5.0, prefill_base_wait_ms=5.0, finetune_base_wait_ms=5.0, max_wait_ms=5.0, wait_rule="predicted"
)


class Walker:
    """Drives a scheduler by hand: each added request must be served at once (asserted)."""

    def __init__(self, config: SchedulerConfig):
        self.scheduler = Scheduler(config)
        self.ids = iter(range(1_000_000))

    def serve(self, client: str, layer: str, at: float, op: Op = Op.FORWARD) -> Batch:
        self.scheduler.add(req(next(self.ids), client=client, layer=layer, op=op, at=at))
        batch = self.scheduler.next_batch(at)
        assert batch is not None, f"{client}@{layer} was held back"
        return batch

    def walk(self, client: str, start: float, gap: float, op: Op = Op.FORWARD) -> None:
        layers = LAYERS if op is Op.FORWARD else tuple(reversed(LAYERS))
        for index, layer in enumerate(layers):
            self.serve(client, layer, start + index * gap, op)


def warmed_walker(**overrides) -> Walker:
    """Layer order l0..l3 learned; client a walks 1 ms per layer, client b 2 ms per layer."""
    walker = Walker(SchedulerConfig(policy="opportunistic", **{**FIVE_MS, **overrides}))
    walker.walk("a", 0.0, 0.001)  # alone: nobody to wait for
    walker.walk("b", 0.1, 0.002)  # a is past every layer (ahead): nobody to wait for
    return walker


# (b's requests, each served at once: (layer, time, op)), a's request (layer, time), expected
# hold-until (None: served at once). b walks 2 ms per layer and is expected at layer ``n`` of its
# pass at ``last hand-out + hops * 2 ms``; a group holds until min(deadline, expected + 2 ms).
PREDICTION_CASES = {
    "b_one_layer_behind": ([("l0", 1.0, Op.FORWARD)], ("l1", 1.0015), 1.004),
    "b_two_layers_behind_capped_by_deadline": ([("l0", 1.0, Op.FORWARD)], ("l2", 1.0005), 1.0055),
    "b_ahead": ([("l0", 1.0, Op.FORWARD), ("l1", 1.002, Op.FORWARD), ("l2", 1.004, Op.FORWARD)], ("l1", 1.0045), None),
    "b_served_at_this_layer": ([("l0", 1.0, Op.FORWARD), ("l1", 1.002, Op.FORWARD)], ("l1", 1.0025), None),
    "b_too_far_behind_for_budget": ([("l0", 1.0, Op.FORWARD)], ("l3", 1.0005), None),
    # b walked its second pass right after its first: it repeats the forward op (a decoder) and
    # turns between passes in one gap, so it comes round again to l1 in 2 hops (l3 -> l0 -> l1),
    # expected at 0.114 + 2 ms + its 2 ms turn; held until the deadline.
    "b_finished_its_pass_comes_round_again": (
        [(layer, 0.108 + i * 0.002, Op.FORWARD) for i, layer in enumerate(LAYERS)],
        ("l1", 0.115),
        0.120,
    ),
    # ... but b idled 0.9 s between its passes (a stream read at a set rate): not coming soon.
    "b_idles_between_its_passes": (
        [(layer, 1.0 + i * 0.002, Op.FORWARD) for i, layer in enumerate(LAYERS)],
        ("l1", 1.007),
        None,
    ),
    "b_idle_after_its_only_pass": ([], ("l1", 1.0), None),
    "b_in_backward": ([("l3", 1.0, Op.BACKWARD)], ("l1", 1.0005), None),
    "b_overdue": ([("l0", 1.0, Op.FORWARD)], ("l1", 1.0045), None),
}


@pytest.mark.parametrize("case", PREDICTION_CASES)
def test_opportunistic_holds_only_for_a_client_on_its_way(case):
    b_moves, (a_layer, a_at), hold_until = PREDICTION_CASES[case]
    walker = warmed_walker()
    for layer, at, op in b_moves:
        walker.serve("b", layer, at, op)
    scheduler = walker.scheduler
    scheduler.add(req(900, client="a", layer=a_layer, at=a_at))
    batch = scheduler.next_batch(a_at)
    if hold_until is None:
        assert batch is not None and [s.request_id for s in batch.slices] == [900]
        return
    assert batch is None
    assert scheduler.next_wakeup(a_at) == pytest.approx(hold_until)
    assert hold_until - a_at <= scheduler.config.wait_budget_s(1, D) + EPS
    assert scheduler.next_batch(hold_until - 1e-6) is None
    assert [s.request_id for s in scheduler.next_batch(hold_until).slices] == [900]


def test_expected_client_arriving_joins_the_held_batch():
    walker = warmed_walker()
    walker.serve("b", "l0", 1.0)
    scheduler = walker.scheduler
    before = scheduler.stats()["ready_reasons"]["all_clients"]
    scheduler.add(req(900, client="a", layer="l1", at=1.0015))
    assert scheduler.next_batch(1.0015) is None
    scheduler.add(req(901, client="b", layer="l1", at=1.002))
    batch = scheduler.next_batch(1.002)
    assert [s.request_id for s in batch.slices] == [900, 901]
    assert scheduler.stats()["ready_reasons"]["all_clients"] == before + 1


def test_late_client_is_given_up_at_expected_arrival_plus_one_gap():
    walker = warmed_walker()
    walker.serve("b", "l0", 1.0)
    scheduler = walker.scheduler
    scheduler.add(req(900, client="a", layer="l1", at=1.0015))
    before = scheduler.stats()["ready_reasons"]["overdue"]
    assert scheduler.next_batch(1.0039) is None
    assert scheduler.next_batch(1.004) is not None  # deadline 1.0065 not reached: given up on b
    assert scheduler.stats()["ready_reasons"]["overdue"] == before + 1


def test_joined_client_without_requests_is_not_waited_for_unless_prediction_is_off():
    for rule, held in (("predicted", False), ("convoy", False), ("budget", True)):
        scheduler = Scheduler(SchedulerConfig(policy="opportunistic", **{**FIVE_MS, "wait_rule": rule}))
        scheduler.client_joined("idle")
        scheduler.add(req(1, client="a"))
        assert (scheduler.next_batch(0.0) is None) == held


def test_layer_order_and_pace_are_learned_per_op():
    walker = warmed_walker()
    walker.walk("b", 1.0, 0.003, Op.BACKWARD)  # backward walks l3..l0: its own order, its own pace
    scheduler = walker.scheduler
    assert scheduler._arrivals.positions[Op.FORWARD] == {"l0": 0, "l1": 1, "l2": 2, "l3": 3}
    assert scheduler._arrivals.positions[Op.BACKWARD] == {"l3": 0, "l2": 1, "l1": 2, "l0": 3}
    assert scheduler._arrivals.tracks["b"].gap_s[Op.FORWARD] == pytest.approx(0.002)
    assert scheduler._arrivals.tracks["b"].gap_s[Op.BACKWARD] == pytest.approx(0.003)
    assert scheduler.client_left("b") == [] and "b" not in scheduler._arrivals.tracks


def closed_loop(
    config: SchedulerConfig,
    gaps_s: dict[str, float],
    starts_s: dict[str, float],
    passes: int,
    layers: int = 8,
    exec_s: float = 0.0001,
    joins: tuple[str, ...] = (),
    one_plan: bool = False,
) -> tuple[list[Batch], dict, float]:
    """Clients walk ``layers`` layers ``passes`` times; each sends its next request ``gap`` after its
    previous one's batch finished (the executor runs one batch at a time, ``exec_s`` each).
    Returns the batches, each request's wait (arrival -> first hand-out) and its budget, and the end time.
    ``one_plan``: the executor asks ``next_batch_or_wakeup`` (as the engine does), not the two in turn."""
    scheduler = Scheduler(config)
    for client in joins:
        scheduler.client_joined(client)
    next_at = dict(starts_s)
    step = {c: 0 for c in gaps_s}
    ids = iter(range(1_000_000))
    owner: dict[int, tuple[str, float]] = {}
    waits: dict[int, tuple[float, float]] = {}
    batches, now = [], 0.0
    for _ in range(100_000):
        for client, at in list(next_at.items()):
            if at is not None and at <= now:
                rid = next(ids)
                scheduler.add(req(rid, client=client, layer=f"l{step[client] % layers}", at=at))
                owner[rid] = (client, at)
                next_at[client] = None
        if one_plan:
            batch, wakeup = scheduler.next_batch_or_wakeup(now)
        else:
            batch = scheduler.next_batch(now)
            wakeup = None if batch is not None else scheduler.next_wakeup(now)
        if batch is not None:
            batches.append(batch)
            now += exec_s
            for s in batch.slices:
                client, at = owner.pop(s.request_id)
                waits[s.request_id] = (now - exec_s - at, config.wait_budget_s(1, D))
                step[client] += 1
                if step[client] < passes * layers:
                    next_at[client] = now + gaps_s[client]
            continue
        events = [t for t in next_at.values() if t is not None]
        if wakeup is not None:
            events.append(wakeup)
        if not events:
            return batches, waits, now
        now = max(now, min(events))
    raise AssertionError("closed loop did not terminate")


@pytest.mark.parametrize(
    "kwargs",
    [{"policy": p} for p in POLICIES if p != "opportunistic"]
    + [
        {"policy": "opportunistic", "wait_rule": rule} for rule in ("adaptive", "none", "predicted", "convoy", "budget")
    ],
    ids=lambda kwargs: kwargs.get("wait_rule", kwargs["policy"]),
)
def test_one_plan_for_batch_and_wakeup_decides_as_the_two_calls(kwargs):
    """``next_batch_or_wakeup`` (one plan; what the engine asks) hands out the same batches at the
    same times as ``next_batch`` then ``next_wakeup``, under every policy and waiting rule: clients
    of different paces walking in convoys, one joined and idle, each request's next one sent after
    its batch ran."""
    gaps = {"a": 0.0010, "b": 0.0012, "c": 0.0009, "d": 0.0031}
    starts = {"a": 0.0, "b": 0.0004, "c": 0.0011, "d": 0.0002}
    config = SchedulerConfig(**{**FIVE_MS, "adapt_epoch_ms": 5.0, **kwargs})
    two_calls = closed_loop(config, gaps, starts, passes=12, joins=("idle",))
    one_plan = closed_loop(config, gaps, starts, passes=12, joins=("idle",), one_plan=True)
    assert len(two_calls[0]) > 12 * 8 / 4  # convoys or not, every request was served
    assert one_plan == two_calls


def test_predicted_arrivals_form_convoys_within_budget_and_skip_idle_clients():
    gaps = {"a": 0.0010, "b": 0.0012, "c": 0.0009}
    starts = {"a": 0.0, "b": 0.0004, "c": 0.0011}
    runs = {
        name: closed_loop(SchedulerConfig(**{**FIVE_MS, **kwargs}), gaps, starts, passes=6, joins=("idle",))
        for name, kwargs in {
            "immediate": {"policy": "immediate"},
            "predicted": {"policy": "opportunistic"},
            "fixed": {"policy": "opportunistic", "wait_rule": "budget"},
        }.items()
    }
    rows_per_batch = {name: sum(b.rows for b in run[0]) / len(run[0]) for name, run in runs.items()}
    assert rows_per_batch["immediate"] < 1.5 < 2.0 < rows_per_batch["predicted"]
    assert all(wait <= budget + EPS for wait, budget in runs["predicted"][1].values())
    # The fixed budget waits for the idle client at every layer; predictions never do.
    assert runs["predicted"][2] < 0.7 * runs["fixed"][2]
    # Same inputs, same decisions: the policy is a function of its inputs and the clock.
    again = closed_loop(SchedulerConfig(policy="opportunistic", **FIVE_MS), gaps, starts, passes=6, joins=("idle",))
    assert again[0] == runs["predicted"][0]
