"""Sharing the executor between clients, with a fake clock (``tests/sched_sim.py``; issue 11 acceptance).

- A client that floods the executor (any latency class it claims) cannot raise another client's
  wait beyond the product running when its request arrives, and two clients that both have a
  backlog share the rows about equally, whatever they label their work. Decode goes first, but
  bulk work keeps its fair share of the executor's time.
- With ``decode_slo_ms``, decoders meet the per-token target (p95) next to a fine-tuning backlog,
  and fine-tuning gets the rest: it progresses at the rate the target leaves, more when the target
  is looser, and never stops, even when the target cannot be met at all.
- The opportunistic policy stops waiting when waiting does not pay (``wait_tuner.py``).
"""

from __future__ import annotations

import bisect
import math
import random
import statistics
import time
from collections.abc import Callable

import pytest

from symbiosis.executor import pacing
from symbiosis.executor.pacing import MIN_BULK_SHARE, CostModel, DecodeGuard
from symbiosis.executor.requests import PendingRequest
from symbiosis.executor.scheduler import Scheduler, SchedulerConfig
from symbiosis.executor.wait_tuner import EXPLORE_EVERY, FIRST_TRIALS, RARE_FACTOR, RULES, WaitTuner
from symbiosis.vocabulary import LatencyClass, Op
from tests.sched_sim import Flood, Simulation, Walker, p95

D, F = LatencyClass.DECODE, LatencyClass.FINETUNE


# ------------------------------------------------------------------------------------ flood


def bystander() -> Walker:
    """Decodes one sequence over 8 layers; 0.5 ms of its own work per layer."""
    return Walker("bystander", rows=1, gap_s=0.0005)


@pytest.mark.parametrize("label", [D, F])
@pytest.mark.parametrize("policy", ["immediate", "opportunistic"])
@pytest.mark.parametrize("per_row_s", [1e-6, 25e-6])
def test_a_flood_cannot_raise_a_bystanders_wait_beyond_one_product(policy, label, per_row_s):
    """40 requests of 16,384 rows (16 or 400 ms of products each) against one decoding bystander.
    (At 25 us a row, a whole 4096-row chunk lasts longer than a decoder may be silent and still
    count as decoding: a waiting decoder must count, or it would never get its chunks cut.)"""
    config = SchedulerConfig(policy=policy)
    solo = bystander()
    Simulation(config, [solo], per_row_s=per_row_s).run(2.0)
    alone_p95 = p95(solo.token_times())

    victim, flood = bystander(), Flood("flood", rows=16_384, depth=40, latency_class=label)
    sim = Simulation(config, [victim, flood], per_row_s=per_row_s).run(2.0)
    assert sim.busy_fraction("flood") > 0.8  # the flood really keeps the executor busy ...
    assert flood.rows_done > 0.04 / per_row_s  # ... and gets through its work
    # Once the scheduler has measured a product and the bystander's pace (its first token), each
    # of the bystander's requests waits at most for the product running when it arrives, which
    # is cut to what fits in the bystander's own time per call (decode_slowdown = 1): 0.5 ms.
    first_token = victim.steps().__len__()
    assert max(victim.waits[first_token:]) <= config.decode_slowdown * victim.gap_s + sim.fixed_s + 1e-9
    after_first_token = [end - start for start, end, _ in sim.batches if start > victim.pass_ends[0]]
    assert max(after_first_token) < 0.001  # the flood's 16 ms products were cut into chunks
    # So a token takes at most twice its time alone (here much less: a chunk is half over, on average).
    assert p95(victim.token_times()) <= 2.0 * alone_p95


@pytest.mark.parametrize("policy", ["immediate", "opportunistic"])
def test_a_flood_that_takes_the_hosts_cores_is_paced_to_keep_a_decoder_near_its_own_pace(policy, monkeypatch):
    """Clients as processes on one host: a flood also slows a decoder outside the executor's queue,
    where no chunking reaches (measured, issue 11: a bystander's p95 x7.7 while its requests waited
    ~0.07 ms in the queue); modelled here as the flood's work on each result slowing the decoder's own.
    Without a target, the flood's share of the executor's time while a decoder is active follows
    that decoder's tokens against (1 + decode_slowdown) x its fastest token
    (``DecodeGuard.backlog_share``): the bystander stays within 3x its p95 alone (the issue's
    target), and the flood still progresses (never below ``MIN_BULK_SHARE``)."""
    config = SchedulerConfig(policy=policy)
    solo = bystander()
    Simulation(config, [solo]).run(3.0)

    def flooded() -> tuple[float, Flood]:
        victim = bystander()
        flood = Flood("flood", rows=16_384, depth=8, latency_class=F, host_s_per_row=1e-6)
        Simulation(config, [victim, flood], contention=8.0).run(3.0)
        return p95(victim.token_times()) / p95(solo.token_times()), flood

    ratio, flood = flooded()
    assert ratio <= 3.0
    assert flood.rows_done >= 0.9 * MIN_BULK_SHARE * 3.0 / 1e-6  # at least its least share of 3 s at 1 us a row

    monkeypatch.setattr(pacing, "FLOOD_MISS_FACTOR", 1.0)  # no feedback: the flood keeps its whole share
    monkeypatch.setattr(pacing, "FLOOD_HIT_FACTOR", 1.0)
    unpaced_ratio, unpaced = flooded()
    assert unpaced_ratio > 5.0 and unpaced.rows_done > 3 * flood.rows_done


def test_a_flood_that_comes_first_does_not_cut_a_decoders_pass_in_two():
    """The layer order is learned from walks; a flood's first request (on a middle layer, before
    anyone walked) only places its layer provisionally, so the decoder's token times, which its
    protection is sized from, are whole tokens, not halves."""
    victim = bystander()
    victim.start_s = 0.001  # the flood's request arrives first
    flood = Flood("flood", rows=16_384, depth=2, latency_class=F, layer_id="l3")
    sim = Simulation(SchedulerConfig(policy="immediate"), [victim, flood]).run(1.0)
    positions = sim.scheduler._arrivals.positions[Op.FORWARD]
    assert [positions[f"l{i}"] for i in range(8)] == list(range(8))
    seen_ms = sim.scheduler.stats()["decode_guard"]["token_ms_ewma_max"]
    assert seen_ms == pytest.approx(1e3 * statistics.median(victim.token_times()), rel=0.2)


def test_two_flooders_share_rows_equally_whatever_their_labels():
    """A client labelling its flood 'decode' gets its head start once, then the same share as the other."""
    honest = Flood("honest", rows=4096, depth=8, latency_class=F)
    claims_decode = Flood("claims-decode", rows=4096, depth=8, latency_class=D, layer_id="l5")
    sim = Simulation(SchedulerConfig(policy="immediate"), [honest, claims_decode]).run(1.0)
    total = honest.rows_done + claims_decode.rows_done
    assert total > 500_000
    assert 0.45 <= honest.rows_done / total <= 0.55
    assert 0.45 <= sim.busy_fraction("honest") <= 0.55


def test_decode_goes_first_but_bulk_work_gets_its_fair_share_of_time():
    """Three decoders back to back (alone they would fill the executor) and a fine-tuning backlog:
    decode requests wait at most about one fine-tuning chunk, and the fine-tuning client, one of four
    active clients, gets at least its quarter of the executor's time."""
    decoders = [Walker(f"d{i}", rows=16, gap_s=0.0) for i in range(3)]
    finetune = Flood("finetune", rows=512, depth=4, latency_class=F)
    sim = Simulation(SchedulerConfig(policy="immediate"), [*decoders, finetune]).run(1.0)
    chunk_s = max(
        end - start for start, end, b in sim.batches if start > 0.1 and sim.owners[b.slices[0].request_id] == "finetune"
    )
    assert statistics.median(w for d in decoders for w in d.waits) <= chunk_s + 3 * (sim.fixed_s + 48 * sim.per_row_s)
    assert sim.busy_fraction("finetune", since_s=0.1) >= 0.25 * 0.95
    assert sim.scheduler.stats()["batches_led_by_lane"]["latency"] > 0


# ------------------------------------------------------------------------------------ decode SLO

DECODER_ROWS = (1, 4, 16)


def coserving(
    config: SchedulerConfig,
    decoders: bool = True,
    finetune: bool = True,
    decoder_gap_s: float = 0.0003,
    products_share_client_cores: bool = False,
):
    clients = []
    if decoders:
        clients += [
            Walker(f"d{i}", rows=r, gap_s=decoder_gap_s, pass_gap_s=0.0005, start_s=i * 1e-4)
            for i, r in enumerate(DECODER_ROWS)
        ]
    if finetune:
        clients += [Walker(f"ft{i}", rows=512, gap_s=0.001, latency_class=F, start_s=2e-4 * i) for i in range(2)]
    sim = Simulation(config, clients, products_share_client_cores=products_share_client_cores).run(2.0)
    tokens = [t for c in clients if c.latency_class is D for t in c.token_times(skip=20)]
    steps = sum(len(c.pass_ends) for c in clients if c.latency_class is F)
    return tokens, steps, sim


@pytest.mark.parametrize("policy", ["immediate", "opportunistic"])
@pytest.mark.slow
def test_decode_slo_is_met_next_to_a_finetuning_backlog(policy):
    alone, _, _ = coserving(SchedulerConfig(policy=policy), finetune=False)
    _, finetune_alone, _ = coserving(SchedulerConfig(policy=policy), decoders=False)
    slo_ms = 1.2 * 1e3 * p95(alone)

    unguarded, _, _ = coserving(SchedulerConfig(policy=policy, decode_slowdown=1000.0))
    assert p95(unguarded) * 1e3 > 1.3 * slo_ms  # without a target, fine-tuning's products hurt decode

    tokens, steps, sim = coserving(SchedulerConfig(policy=policy, decode_slo_ms=slo_ms))
    assert p95(tokens) * 1e3 <= slo_ms * 1.02  # met at p95 (2% for the sampling of a p95)
    # Fine-tuning gets what the target leaves: most of it in the decoders' free time, which an
    # executor on an accelerator counts whole (79-82% kept here; 46-58% when it counted at the
    # target's share, as it still does on a CPU: the next assertion).
    assert steps >= 0.7 * finetune_alone
    # ... in row chunks, or whole in the decoders' free time: no decode request arrived while a
    # product of a whole 512-row fine-tuning request ran.
    arrivals = sorted(a for c in sim.clients if c.latency_class is D for a in c.arrivals if a > 0.5)
    whole = [(start, end) for start, end, b in sim.batches if start > 0.5 and b.rows >= 512]
    # (but in its last 5 us: a decoder's next call is foreseen from the lower envelope of its gaps,
    # which its own product's size moves by a few microseconds; seen: 3.8 us of a 632 us product)
    trimmed = [(start, end - 5e-6) for start, end in whole]
    assert not any(bisect.bisect_right(arrivals, start) < bisect.bisect_left(arrivals, end) for start, end in trimmed)
    stats = sim.scheduler.stats()
    assert stats["chunks_cut_for_decode"] > 0
    assert 0 < stats["bulk_batches_in_free_time"] <= stats["batches_led_by_lane"]["bulk"]

    # An executor on a CPU (its products take the cores the clients' own work needs) counts the
    # free time at the feedback's share: the target is met too, with less fine-tuning kept.
    tokens, steps_on_cpu, _ = coserving(
        SchedulerConfig(policy=policy, decode_slo_ms=slo_ms), products_share_client_cores=True
    )
    assert p95(tokens) * 1e3 <= slo_ms * 1.02
    assert 0.25 * finetune_alone <= steps_on_cpu < 0.9 * steps


@pytest.mark.slow
def test_finetuning_progresses_at_the_rate_the_slo_leaves_and_never_stops():
    alone, _, _ = coserving(SchedulerConfig(), finetune=False)
    alone_p95_ms = 1e3 * p95(alone)
    steps = {}
    for factor in (0.8, 1.2, 2.0):  # 0.8: tighter than decode alone can go; 2.0: loose
        # On a CPU's terms (the decoders' free time at the feedback's share): what fine-tuning gets
        # is the share the target leaves.
        config = SchedulerConfig(decode_slo_ms=factor * alone_p95_ms)
        tokens, steps[factor], sim = coserving(config, products_share_client_cores=True)
        if factor == 0.8:
            assert sim.scheduler.stats()["decode_guard"]["bulk_share"] < 0.2  # it gave decode all it could
    assert 0 < steps[0.8] < steps[1.2] < steps[2.0]
    # On an accelerator the free time is fine-tuning's whatever the target (it delays no decoder):
    # even a target decode cannot meet leaves it that (~80% of its solo rate here, about what a
    # target of 1.2x leaves), and a loose one more.
    _, on_accelerator, _ = coserving(SchedulerConfig(decode_slo_ms=0.8 * alone_p95_ms))
    _, loose_on_accelerator, _ = coserving(SchedulerConfig(decode_slo_ms=2.0 * alone_p95_ms))
    assert steps[0.8] < on_accelerator < loose_on_accelerator


def streams_beside_finetuning(
    config: SchedulerConfig, decoders: bool = True, finetune: bool = True, phase_s: float = 1e-4
):
    """Six streams read at a set rate (a pass at most every 30 ms, ``phase_s`` apart) on 12 layers,
    and two fine-tuning walkers of 512 rows: the streams leave the executor idle most of the time."""
    clients = []
    if decoders:
        clients += [
            Walker(f"d{i}", rows=r, gap_s=3e-4, layers=12, start_s=phase_s * i, interval_s=0.03)
            for i, r in enumerate((1, 2, 4, 8, 16, 1))
        ]
    if finetune:
        clients += [
            Walker(f"ft{i}", rows=512, gap_s=0.002, layers=12, latency_class=F, start_s=2e-4 * i) for i in range(2)
        ]
    Simulation(config, clients, fixed_s=100e-6, per_row_s=2e-6).run(3.0)
    passes = [t for c in clients if c.latency_class is D for t in c.pass_times(skip=5)]
    steps = sum(len(c.pass_ends) for c in clients if c.latency_class is F)
    return passes, steps


@pytest.mark.parametrize("policy", ["immediate", "opportunistic"])
@pytest.mark.slow
def test_finetuning_fills_the_time_until_the_decoders_next_calls_are_due(policy):
    """With a target, fine-tuning beside streams that leave the executor idle most of the time
    gets most of its solo rate: a chunk that ends before any decoder's next call is due
    (``ArrivalPredictor.next_call_s``) delays none of them, so it needs no allowance. Before,
    every bulk product while a decoder was active spent the target's share: 10% (immediate) and
    17% (opportunistic) kept here at the same p95, against 62% and 80%."""
    alone, _ = streams_beside_finetuning(SchedulerConfig(policy=policy), finetune=False)
    _, finetune_alone = streams_beside_finetuning(SchedulerConfig(policy=policy), decoders=False)
    slo_ms = 1.2 * 1e3 * p95(alone)
    passes, steps = streams_beside_finetuning(SchedulerConfig(policy=policy, decode_slo_ms=slo_ms))
    # (5%: a p95 of ~500 samples, which the feedback aims at the target itself)
    assert p95(passes) * 1e3 <= slo_ms * 1.05
    assert steps >= 0.5 * finetune_alone


@pytest.mark.slow
def test_streams_out_of_phase_beside_finetuning_are_not_held_for_each_other():
    """The same streams 5 ms apart: each stream's pass is a convoy of its own, and the others idle.
    Taken for decoders on their way (a turn of ~25 ms, under half the 50 ms hold), the convoy
    waited for them beside fine-tuning: passes x5.5 of alone at p95. A client that turns for
    longer than a pass at its own pace idles between passes (``arrivals.py``)."""
    config = SchedulerConfig(policy="opportunistic")
    alone, _ = streams_beside_finetuning(config, finetune=False, phase_s=5e-3)
    passes, _ = streams_beside_finetuning(config, phase_s=5e-3)
    assert p95(passes) <= 1.5 * p95(alone)
    # With a target, neither inside their passes (not waited for but one hop away, ``arrivals.py``):
    # before, the convoy still waited for streams behind in their passes, the feedback blamed
    # fine-tuning for it: p95 x1.16 of the target with 7% of its solo rate kept, now x1.04 and 17%.
    _, finetune_alone = streams_beside_finetuning(config, decoders=False, phase_s=5e-3)
    slo_ms = 1.2 * 1e3 * p95(alone)
    targeted = SchedulerConfig(policy="opportunistic", decode_slo_ms=slo_ms)
    passes, steps = streams_beside_finetuning(targeted, phase_s=5e-3)
    # Fine-tuning's chunks are not cut below the rows that cost its product's fixed part
    # (``CostModel.break_even_rows``): cut to the per-call budget (the minimal chunk here), a
    # chunk cost the executor x1.6 its rows' time, and the target's feedback held the share down:
    # p95 x1.07 of the target with 40% kept, now x1.02 and 47% (free time counted whole, as on
    # an accelerator; 7% and 17% before that, 2026-12-07).
    assert p95(passes) * 1e3 <= 1.05 * slo_ms
    assert steps >= 0.35 * finetune_alone


@pytest.mark.slow
def test_streams_whose_passes_overlap_are_not_held_for_each_other():
    """Six streams every 15 ms, 2.5 ms apart, each pass ~5 ms: a stream behind in its pass starts
    its next pass on its own clock, so a convoy held for it once per pass would hold for it every
    pass. Waited for, their p95 was x1.57 of the immediate policy's; now x1.25 (the first passes,
    before their turns are known)."""

    def streams(policy: str) -> list[float]:
        clients = [
            Walker(f"d{i}", rows=r, gap_s=3e-4, layers=12, start_s=2.6e-3 * i, interval_s=0.015)
            for i, r in enumerate((1, 2, 4, 8, 16, 1))
        ]
        Simulation(SchedulerConfig(policy=policy), clients, fixed_s=100e-6, per_row_s=2e-6).run(3.0)
        return [t for c in clients for t in c.pass_times(skip=5)]

    assert p95(streams("opportunistic")) <= 1.35 * p95(streams("immediate"))


def test_a_decode_target_never_cuts_the_decoders_holds_for_each_other():
    """``decode_slo_ms`` paces and cuts bulk work; the decoders' holds for each other stay the
    policy's. Cutting them to the decoders' slack (the target's share of a call less their time
    per call, which the convoy's own holds are part of) broke the convoys that made decoders fast:
    7 rows a batch instead of 22 here, p95 +6% at a target of 1.2x alone's, and the same when the
    cap applied only while a decoder missed the target (0.8x)."""

    def convoy(**target):
        walkers = [Walker(f"d{i}", rows=1 + 3 * i, gap_s=0.0004 + 0.0002 * i, start_s=1e-4 * i) for i in range(4)]
        config = SchedulerConfig(policy="opportunistic", wait_rule="convoy", **target)
        sim = Simulation(config, walkers, fixed_s=400e-6).run(2.0)
        rows = statistics.fmean(b.rows for start, _, b in sim.batches if start > 0.5)
        return rows, p95([t for w in walkers for t in w.token_times(skip=20)])

    rows, alone_p95 = convoy()
    for factor in (0.8, 1.05, 1.2):
        with_target_rows, with_target_p95 = convoy(decode_slo_ms=factor * 1e3 * alone_p95)
        assert with_target_rows >= 0.95 * rows and with_target_p95 <= 1.01 * alone_p95


# ------------------------------------------------------------------------------------ pacing units


def test_cost_model_learns_a_line_and_inverts_it():
    cost = CostModel()
    key = ("l0", Op.FORWARD)
    assert cost.rows_within(key, 0.01) is None  # nothing measured: no guess
    assert cost.break_even_rows(key) == 0
    for rows in (1, 16, 256, 1024, 4096):
        cost.observe(key, rows, 50e-6 + 2e-6 * rows)
    fixed_s, per_row_s = cost.line(key)
    assert fixed_s == pytest.approx(50e-6, rel=1e-6) and per_row_s == pytest.approx(2e-6, rel=1e-6)
    assert cost.rows_within(key, 50e-6 + 2e-6 * 300) == 300
    assert cost.rows_within(key, 10e-6) == 0
    # Rows whose time equals the fixed part: a chunk cut below it is mostly fixed cost.
    assert cost.break_even_rows(key) in (24, 25)
    # ... at most twice the largest product measured: where a product's time hardly grows with its
    # rows (a GPU), the line says nothing about products far larger than those seen.
    flat = ("l2", Op.FORWARD)
    for rows in (1, 4, 16, 1, 4, 16):
        cost.observe(flat, rows, 100e-6 + 0.02e-6 * rows)
    assert cost.break_even_rows(flat) == 32
    assert cost.break_even_rows(("l9", Op.FORWARD)) == 0  # not measured: no borrowed line
    # A layer never measured borrows the most expensive per-row cost seen (a conservative guess).
    cost.observe(("l1", Op.FORWARD), 1000, 1e-3)
    assert cost.line(("l9", Op.BACKWARD))[1] == pytest.approx(2e-6, rel=1e-6)


def test_decode_guard_budget_from_slowdown_or_slo():
    guard = DecodeGuard(slo_s=None, slowdown=1.5)
    gaps = {"d": 0.001}
    assert guard.delay_budget_s(0.0, gaps.get, 10) is None  # nobody decoding
    guard.arrived("d", Op.FORWARD, True, 0, 0.0)
    assert guard.delay_budget_s(0.0, gaps.get, 10) == pytest.approx(0.0015)
    assert guard.delay_budget_s(0.0, gaps.get, 10, exclude="d") is None
    assert guard.delay_budget_s(1.0, gaps.get, 10) == pytest.approx(0.0015)  # its request still waits: active
    guard.handed_out("d", 0.001)
    assert guard.delay_budget_s(1.0, gaps.get, 10) is None  # served, then idle for a second: not decoding any more
    guard.arrived("ft", Op.FORWARD, False, 0, 0.0)  # fine-tuning forward: not a decoder
    assert guard.active(0.0) == ["d"]

    slo = DecodeGuard(slo_s=0.02, slowdown=1.0)
    slo.arrived("d", Op.FORWARD, True, 0, 0.0)
    assert slo.delay_budget_s(0.0, gaps.get, 10) == pytest.approx(0.02 / 10 - 0.001)
    for token in range(1, 40):  # every token misses: the share falls to its floor, never to zero
        slo.arrived("d", Op.FORWARD, True, 0, 0.03 * token)
    assert slo.bulk_share == pytest.approx(0.05)


def test_without_a_target_a_flood_is_cut_to_a_decoders_own_pace_not_its_starved_one():
    """No ``decode_slo_ms``: for a client with a backlog, the budget is slowdown x the decoder's
    own time per call, from its fastest token (over its calls per token) when its observed pace is
    slower: tokens slowed by bulk work never raise that floor, so a starved decoder does not buy
    the flood longer chunks; a decoder really slower when nothing else runs is followed."""
    guard = DecodeGuard(slo_s=None, slowdown=1.0)
    now = 0.0
    for _ in range(5):  # alone: 10 ms tokens
        guard.arrived("d", Op.FORWARD, True, 0, now)
        now += 0.010
    for _ in range(400):  # starved by bulk work: 100 ms tokens
        guard.bulk_ran(now)
        guard.arrived("d", Op.FORWARD, True, 0, now)
        now += 0.100
    assert guard._decoders["d"].floor_token_s == pytest.approx(0.010)
    starved_pace = {"d": 0.020}  # what its pace looks like while starved: 20 ms per call
    # A product for a client with a backlog (a flood) fits the decoder's own pace: 10 ms / 10 calls ...
    assert guard.delay_budget_s(now, starved_pace.get, 10, backlog=True) == pytest.approx(0.001)
    assert guard.delay_budget_s(now, {"d": 0.0005}.get, 10, backlog=True) == pytest.approx(0.0005)  # or its pace
    # ... other bulk work (a fine-tuning client walking its layers) its pace as seen, as before.
    assert guard.delay_budget_s(now, starved_pace.get, 10) == pytest.approx(0.020)
    assert guard.bulk_share == 1.0  # no target: nothing is paced
    for _ in range(60):  # alone but really slower now (30 ms tokens, no bulk batch ran)
        guard.arrived("d", Op.FORWARD, True, 0, now)
        now += 0.030
    assert guard._decoders["d"].floor_token_s == pytest.approx(0.030, rel=0.05)


def test_the_recent_pace_forgets_a_slow_start_within_three_tokens():
    """The wait tuner sizes its epochs by the slowest decoder's recent pace. Its token-time EWMA
    kept the clients' first tokens (5-8x the steady ones, beside processes still loading models)
    for five or six epochs, so the first trials after them lasted 1.5 s where the steady epochs
    last 0.4 s; the median of the last ``RECENT_TOKENS`` follows the steady pace from the third
    fast token on, and a real slow-down as fast."""
    guard, now = DecodeGuard(slo_s=None, slowdown=1.0), 0.0

    def tokens(count, token_s):
        nonlocal now
        for _ in range(count):
            for position in range(4):
                guard.arrived("d", Op.FORWARD, True, position, now)
                guard.handed_out("d", now + 0.001)
                now += token_s / 4

    tokens(6, 0.500)  # the start: 5 samples of 500 ms (a token is sampled when the next one starts)
    assert guard.longest_token_s(now) == pytest.approx(0.500)
    tokens(3, 0.080)  # the first of these closes the last slow token: two fast samples so far
    assert guard.longest_token_s(now) == pytest.approx(0.500)
    tokens(1, 0.080)
    assert guard.longest_token_s(now) == pytest.approx(0.080)
    assert guard._decoders["d"].token_s > 0.2  # the EWMA, by contrast, still remembers the start
    tokens(4, 0.160)  # slower for real (a longer context, more clients): three samples of it
    assert guard.longest_token_s(now) == pytest.approx(0.160)


def test_a_decoder_that_pauses_between_tokens_keeps_its_token_time():
    """A client that stops between two tokens (it waits for its own next job, or for the other
    clients at a start line) was timed as if that pause were one token: its token time (an
    average) rose to seconds, the wait tuner's epochs -- five of the slowest decoder's tokens --
    with it, so one trial rule could hold for most of a run (seen once with 8 client processes
    that wait for each other at a benchmark's start line: 7 epochs counted in 8 s, the window
    served "not waiting", 397 tokens/s against 503-540 in the runs beside it). A pass during
    which the decoder paused (quiet between two calls for ``PAUSE_S`` or two of its tokens) is no
    token sample: not a token time, not a miss of a target."""
    for slo_s in (None, 0.05):
        guard = DecodeGuard(slo_s=slo_s, slowdown=1.0)
        now = 0.0

        def token(pause_s=0.0, guard=guard):  # 4 layer calls of 1 ms, 1.5 ms of its own work between
            nonlocal now
            for position in range(4):
                guard.arrived("d", Op.FORWARD, True, position, now)
                guard.handed_out("d", now + 0.001)
                now += 0.0025 + (pause_s if position == 1 else 0.0)

        for _ in range(20):  # a token is sampled when the next one starts: 19 samples
            token()
        assert guard.longest_token_s(now) == pytest.approx(0.010) and guard.tokens_seen == 19
        now += 3.0  # a pause between two tokens: inactive meanwhile
        assert guard.active(now) == []
        for _ in range(3):  # the pass spanning the pause is no sample
            token()
        assert guard.tokens_seen == 19 + 2
        token(pause_s=1.0)  # a pause within a pass (between its layer calls)
        token()
        token()
        assert guard.tokens_seen == 19 + 2 + 1 + 1  # the pass before, and the one after it
        assert guard.longest_token_s(now) == pytest.approx(0.010)
        assert guard.backlog_share == 1.0 and guard.bulk_share == 1.0 and guard.slo_misses == 0

    # A pause before the first sample is no token either.
    guard, now = DecodeGuard(slo_s=None, slowdown=1.0), 0.0
    for pause_s in (0.0, 3.0) + (0.0,) * 4:  # its first pass, then a pause: no token time known yet
        now += pause_s
        for position in range(4):
            guard.arrived("d", Op.FORWARD, True, position, now)
            guard.handed_out("d", now + 0.001)
            now += 0.0025
    assert guard.longest_token_s(now) == pytest.approx(0.010) and guard.tokens_seen == 4


def test_a_stream_read_at_a_set_rate_is_timed_by_its_passes_and_stays_active_while_it_idles():
    """A decoder that steps every 200 ms (a user reading: an open loop) in passes of ~10 ms was
    timed at 200 ms a token: over a 20 ms target at every token, so fine-tuning's share fell to
    its floor while the decoder met the target by far. Its token is its pass when it idled longer
    than the pass took; it stays active through the idle time (so bulk work stays paced for its
    next token), and the wait tuner's epochs still span its tokens (its period)."""
    guard, now = DecodeGuard(slo_s=0.02, slowdown=1.0), 0.0
    for token in range(30):
        start = now
        for position in range(4):  # 4 layer calls of 1 ms, 1.5 ms of its own work between
            guard.arrived("d", Op.FORWARD, True, position, now)
            guard.handed_out("d", now + 0.001)
            now += 0.0025
        if token > 0:  # once its period is known: idle, but due again
            assert guard.active(start + 0.15) == ["d"]
        now = start + 0.2
    assert guard.tokens_seen == 29 and guard.slo_misses == 0 and guard.bulk_share == 1.0
    assert guard.stats()["token_ms_ewma_max"] == pytest.approx(8.5)  # its passes: 3 x 2.5 ms + 1 ms
    assert guard.longest_token_s(now) == pytest.approx(0.2)
    # A decoder stepping back to back keeps the time from one token's start to the next, its
    # own work between the passes included (that work is part of what its user waits for).
    back_to_back, now = DecodeGuard(slo_s=0.02, slowdown=1.0), 0.0
    for _ in range(10):
        for position in range(4):
            back_to_back.arrived("d", Op.FORWARD, True, position, now)
            back_to_back.handed_out("d", now + 0.001)
            now += 0.0025
        now += 0.004  # its sampling and the next token's embedding
    assert back_to_back.stats()["token_ms_ewma_max"] == pytest.approx(14.0)


def test_a_decoder_starved_between_its_calls_is_timed_not_taken_for_paused():
    """A decoder whose client is starved of CPU (bulk work on its cores) goes quiet between calls
    too: its slow tokens are what a target's feedback must see, so only a gap of ``PAUSE_S`` or
    two of its tokens is a pause. Here 10 ms tokens, then 60 ms between calls (240 ms tokens)
    against a 50 ms target: every slow token counts, and fine-tuning's share falls."""
    guard, now = DecodeGuard(slo_s=0.05, slowdown=1.0), 0.0
    for gap_s in (0.0015,) * 20 + (0.059,) * 50:
        for position in range(4):
            guard.arrived("d", Op.FORWARD, True, position, now)
            guard.handed_out("d", now + 0.001)
            now += 0.001 + gap_s
    assert guard.tokens_seen == 69 and guard.slo_misses >= 49
    assert guard.longest_token_s(now) == pytest.approx(0.240, rel=0.01)
    assert guard.bulk_share < 0.1


def test_a_decoders_prefill_pass_keeps_it_protected():
    """A serving client admits new sequences with a prefill pass between its decode passes, and its
    running sequences wait for that pass too: bulk products must stay within their budget then."""
    guard = DecodeGuard(slo_s=None, slowdown=1.0)
    gaps = {"d": 0.001}
    guard.arrived("d", Op.FORWARD, True, 0, 0.0)
    guard.handed_out("d", 0.001)
    guard.arrived("d", Op.FORWARD, False, 0, 1.0, is_latency=True)  # a prefill pass a second later
    assert guard.active(1.0) == ["d"]
    assert guard.delay_budget_s(1.0, gaps.get, 10) == pytest.approx(0.001)
    guard.arrived("d", Op.FORWARD, False, 0, 2.0, is_latency=False)  # bulk work (a long prompt): not protected
    guard.handed_out("d", 2.0)
    assert guard.active(3.0) == []
    guard.arrived("p", Op.FORWARD, False, 0, 3.0, is_latency=True)  # only ever prefilled: no decoder
    assert guard.active(3.0) == []

    scheduler = Scheduler(SchedulerConfig(policy="immediate", decode_share_rows=256))
    scheduler.add(PendingRequest(1, "server", "l0", Op.FORWARD, 4, LatencyClass.DECODE, 0.0))
    scheduler.next_batch(0.0)
    scheduler.add(PendingRequest(2, "server", "l0", Op.FORWARD, 16, LatencyClass.PREFILL, 1.0))
    assert scheduler._guard.active(1.0) == ["server"]


def test_a_client_labelling_bulk_work_decode_is_no_decoder():
    scheduler = Scheduler(SchedulerConfig(policy="immediate", decode_share_rows=256))
    scheduler.add(PendingRequest(1, "flooder", "l0", Op.FORWARD, 16384, LatencyClass.DECODE, 0.0))
    scheduler.add(PendingRequest(2, "bystander", "l1", Op.FORWARD, 1, LatencyClass.DECODE, 0.0))
    assert scheduler._guard.active(0.0) == ["bystander"]


# ------------------------------------------------------------------------------------ wait tuner


def run_epochs(
    tuner: WaitTuner, epochs: int, load: Callable[[int, str], tuple[float, int]], start_s: float = 0.0
) -> tuple[list[str], list[str | None], float]:
    """Run ``epochs`` epochs; in epoch ``i`` under rule ``r`` two clients complete requests at
    ``load(i, r)[0]`` per second, of ``load(i, r)[1]`` rows each. Returns the rule of each epoch,
    the rule chosen after each, and the clock at the end."""
    now, used, chosen = start_s, [], []
    tuner.tick(now)
    for epoch in range(epochs):
        rule = tuner.rule
        used.append(rule)
        rate, rows = load(epoch, rule)
        end = now + tuner.epoch_s
        while now < end:
            now += 1.0 / rate
            tuner.handed_out("a" if int(now * rate) % 2 else "b", 1, rows, now)
        tuner.tick(now)
        chosen.append(tuner.chosen)
    return used, chosen, now


def feed(tuner: WaitTuner, epochs: int, rate_of: dict[str, float], start_s: float = 0.0) -> tuple[list[str], float]:
    """Run ``epochs`` epochs in which two clients complete requests at ``rate_of[rule]`` per second."""
    used, _, now = run_epochs(tuner, epochs, lambda _, rule: (rate_of[rule], 4), start_s)
    return used, now


def test_tuner_compares_adjacent_epochs_so_a_drift_in_load_does_not_fool_it():
    """The machine slows down steadily (x0.5 over the run) while 'convoy' is always 30% better
    than the rule next to it: rules tried late look worse on average, never next to each other."""
    tuner = WaitTuner(epoch_s=0.2)
    gain = {"none": 1.0, "predicted": 1.0, "convoy": 1.3}
    used, _, _ = run_epochs(tuner, 60, lambda epoch, rule: (2000.0 * (1.0 - epoch / 120) * gain[rule], 4))
    assert used[-15:].count("convoy") >= 12
    assert tuner.ratings["convoy"] - max(tuner.ratings["none"], tuner.ratings["predicted"]) == pytest.approx(
        math.log(1.3), abs=0.05
    )


def run_client_epochs(
    tuner: WaitTuner, epochs: int, load: Callable[[int, str], dict[str, tuple[float, int]]]
) -> list[str]:
    """Run ``epochs`` epochs; in epoch ``i`` under rule ``r`` each client ``c`` of ``load(i, r)``
    completes requests at ``load(i, r)[c][0]`` per second, of ``load(i, r)[c][1]`` rows each.
    Returns the rule of each epoch."""
    now, used = 0.0, []
    tuner.tick(now)
    for epoch in range(epochs):
        rule = tuner.rule
        used.append(rule)
        end = (epoch + 1) * tuner.epoch_s  # exact with an epoch_s like 0.25: each tick ends an epoch
        events = sorted(
            (now + (k - 0.5) / rate, client, rows)
            for client, (rate, rows) in load(epoch, rule).items()
            for k in range(1, int((end - now) * rate) + 1)
        )
        for at, client, rows in events:
            tuner.handed_out(client, 1, rows, at)
        now = end
        tuner.tick(now)
    return used


def test_tuner_is_not_swayed_by_noise_between_epochs():
    """Each epoch's rate is off by up to +-40% at random (a shared machine); 'none' is truly 25%
    better. Over thirty runs of 120 epochs, the tuner uses it for most of the second half and ends
    on it (all but one or two runs: noise this large can hide a 25% gain for a while), and its
    choice between trials changes rarely. (Thirty seeds, not ten: with ten, one seed more or less
    on the wrong rule moved the mean by 0.08.)"""
    in_use, switches, ends = [], [], []
    gain = {"none": 1.25, "predicted": 1.0, "convoy": 1.0}
    for seed in range(30):
        noise = random.Random(seed)
        _, chosen, _ = run_epochs(
            WaitTuner(epoch_s=0.2), 120, lambda _, rule, rng=noise: (2000.0 * gain[rule] * rng.uniform(0.6, 1.4), 4)
        )
        ends.append(chosen[-1])
        in_use.append(chosen[60:].count("none") / 60)
        switches.append(sum(a != b for a, b in zip(chosen, chosen[1:])))
    assert ends.count("none") >= 28, ends
    assert statistics.fmean(in_use) >= 0.85 and max(switches) <= 6


def test_tuner_keeps_the_rule_that_serves_most_and_follows_a_change():
    tuner = WaitTuner(epoch_s=0.2)
    used, now = feed(tuner, 40, {"none": 1000.0, "predicted": 1100.0, "convoy": 2000.0})
    assert used[: len(FIRST_TRIALS)] == list(FIRST_TRIALS) and set(FIRST_TRIALS) == set(RULES)  # each rule tried first
    assert used[-12:].count("convoy") >= 10  # then mostly the best, with a rare trial of the others
    # The load changes: waiting stops paying. Within a few trials the tuner stops waiting.
    used, _ = feed(tuner, 60, {"none": 2000.0, "predicted": 1500.0, "convoy": 800.0}, start_s=now)
    assert used[-12:].count("none") >= 10


@pytest.mark.parametrize("convoy_slower", [1.4, 10.0])
def test_decoders_are_compared_on_their_tokens_time_where_their_rate_is_their_own(convoy_slower):
    """Open-loop decoders (streams read at a set rate) complete the same requests per second under
    every rule, so rated on that the tuner kept its start rule, the convoy, whatever the convoy
    cost them: it saw no difference. Their tokens' time shows it: here the convoy's tokens take
    x1.4 (or x10: streams it holds in step) of not waiting's, and the tuner chooses not waiting.
    (A swing of x3 or more was taken for a stall, judged on tokens' time too, and never counted
    towards a switch: at x10 the tuner stayed on the convoy or went to "predicted".)"""
    tuner = WaitTuner(epoch_s=0.2)
    token_s = {"none": 0.010, "predicted": 0.010 * convoy_slower**0.5, "convoy": 0.010 * convoy_slower}
    now, chosen = 0.0, []
    tuner.tick(now)
    for _ in range(60):
        rule, end = tuner.rule, now + tuner.epoch_s
        events = sorted(
            [(now + (k + 0.5) / 2000.0, "request", client) for k in range(400) for client in "ab"]
            + [(now + (k + 1) * 0.02, "token", client) for k in range(10) for client in "ab"]
        )
        for at, kind, client in events:
            if kind == "request":
                tuner.handed_out(client, 1, 1, at)
            else:
                tuner.token(client, token_s[rule], at)
        now = end
        tuner.tick(now)
        chosen.append(tuner.chosen)
    assert chosen[-1] == "none" and chosen[-20:].count("none") == 20, chosen
    assert tuner.ratings["none"] - tuner.ratings["convoy"] > math.log(1.2)


def test_a_rule_whose_trial_lost_badly_is_tried_only_at_the_rare_pace_until_one_does_not():
    """'predicted' serves x0.45 of the convoy, 'none' x0.95 (within noise). After its first trial,
    'predicted' is tried only every EXPLORE_EVERY * RARE_FACTOR epochs (before: again five epochs
    later, its rating not yet fallen x1.25 below), 'none' at the usual pace. Once 'predicted'
    serves as the others do, its next (rare) trial brings it back to the usual pace."""
    tuner = WaitTuner(epoch_s=0.2)
    rare = EXPLORE_EVERY * RARE_FACTOR
    used, now = feed(tuner, 3 * rare, {"none": 1900.0, "predicted": 900.0, "convoy": 2000.0})
    later = range(len(FIRST_TRIALS), len(used))
    assert [i for i in later if used[i] == "predicted"] == list(range(rare, len(used), rare))
    assert [i for i in later if used[i] == "none"] == [i for i in later if i % EXPLORE_EVERY == 0 and i % rare]
    assert tuner.stats()["trial_every"] == {"none": EXPLORE_EVERY, "predicted": rare}
    used, _ = feed(tuner, 2 * rare, {"none": 1900.0, "predicted": 1900.0, "convoy": 2000.0}, start_s=now)
    assert used[0] == "predicted" and used.count("predicted") >= 4  # its rare trial, then every other trial
    assert tuner.stats()["trial_every"] == {"none": EXPLORE_EVERY, "predicted": EXPLORE_EVERY}


def test_the_trials_of_rules_that_keep_losing_back_off_and_a_rule_that_became_better_is_still_found():
    """'none' and 'predicted' serve x0.85 of the convoy: not clearly worse by their ratings
    (x1.25), so before they took turns every fifth epoch for the whole run (19 slow epochs in
    96; measured with client processes: "none" at x0.8 of the convoy, every fifth epoch). Each
    lost trial raises that rule's level, tried at every 5th, 10th, then 20th epoch only. When not
    waiting becomes x1.5 better -- at any epoch of the rare period -- the tuner still switches to
    it within two rare periods and two trials more."""
    rare = EXPLORE_EVERY * RARE_FACTOR
    for extra in range(rare):
        tuner = WaitTuner(epoch_s=0.2)
        used, now = feed(tuner, 5 * rare + extra, {"none": 1700.0, "predicted": 1700.0, "convoy": 2000.0})
        trials = [i for i in range(len(FIRST_TRIALS), len(used)) if used[i] != "convoy"]
        assert len(trials) <= 2 + len(used) // rare and all(i % rare == 0 for i in trials[3:]), trials
        assert tuner.chosen == "convoy" and tuner.stats()["trial_every"] == {"none": rare, "predicted": rare}
        _, chosen, _ = run_epochs(tuner, 3 * rare, lambda _, rule: (3000.0 if rule == "none" else 2000.0, 4), now)
        assert "none" in chosen[: 2 * rare + 2 * EXPLORE_EVERY] and chosen[-1] == "none", (extra, chosen)


def test_a_trial_is_judged_by_its_worse_comparison_as_the_chosen_rules_epoch_after_it_pays_for_it():
    """Not waiting serves x0.75 of the convoy, and it scatters the convoy: the convoy's first epoch
    after a "none" epoch runs at x0.6 while the clients meet again (measured with client processes
    over tcp://, 2026-12-01). Compared with that epoch, the trial gains what it lost against the
    epoch before it; judged by the mean of the two it never lost, and was tried every fifth epoch
    for the whole run. Judged by the worse of the two, its trials back off to the rare pace."""
    rare = EXPLORE_EVERY * RARE_FACTOR
    tuner = WaitTuner(epoch_s=0.2)
    previous = ["none"]

    def load(_, rule: str) -> tuple[float, int]:
        rate = {"none": 1500.0, "predicted": 1500.0, "convoy": 2000.0}[rule]
        if rule == "convoy" and previous[0] != "convoy":
            rate *= 0.6  # the convoy forms again
        previous[0] = rule
        return rate, 4

    used, _, _ = run_epochs(tuner, 4 * rare, load)
    assert tuner.chosen == "convoy"
    trials = [i for i in range(2 * rare, len(used)) if used[i] != "convoy"]
    assert len(trials) <= 2, (trials, used)


def test_tuner_does_not_compare_a_prefill_epoch_with_a_decode_epoch():
    """The clients prefill (100 rows a request, few requests) for two epochs, then decode (5 rows
    a request), where convoy serves 60% more than the other rules. Compared with the decode epoch
    after it, a prefill epoch made its rule look three times worse (measured with client
    processes: the convoy rule, tried first during the prefill, was hardly tried again in a 6 s
    run of ~10 epochs); rows per request tells the phases apart, so the rules are rated on decode
    epochs only and convoy is kept from the first trials on."""
    tuner = WaitTuner(epoch_s=0.2)
    gain = {"none": 1.0, "predicted": 1.0, "convoy": 1.6}
    used, _, _ = run_epochs(tuner, 20, lambda epoch, rule: (300.0, 100) if epoch < 2 else (1000.0 * gain[rule], 5))
    assert used[1] == "convoy" and tuner.chosen == "convoy"  # convoy's first trial was a prefill epoch
    assert used[len(FIRST_TRIALS) :].count("convoy") >= 13
    assert tuner.ratings["convoy"] > max(tuner.ratings["none"], tuner.ratings["predicted"])


def test_tuner_is_not_decided_by_one_epoch_in_which_the_clients_stalled():
    """Eight decoding clients; the convoy serves each 20% faster than "predicted" and 40% faster
    than not waiting. After two epochs of prefill, in the third (a "none" trial) the clients
    stall at a seventh of their speed -- they wait for each other at a start line, or for the
    host -- whatever the rule. Compared with that epoch, the "predicted" trial after it looked
    seven times faster; taken at face value, that one comparison rated it above the convoy by
    more than the switching margin and the tuner kept "predicted" for the rest of the run
    (measured with 8 client processes of batch 1-16 on a 2-core host: x0.85 of the convoy's
    tokens/s). No waiting rule changes every client's speed sevenfold; a comparison counts at
    most ``MAX_SPEEDUP`` either way, so one such epoch cannot decide and the tuner keeps the
    convoy."""
    tuner = WaitTuner(epoch_s=0.25)
    gain = {"none": 1.0, "predicted": 1.4 / 1.2, "convoy": 1.4}

    def load(epoch, rule):
        if epoch < 2:  # the start: prefill (not compared with decoding)
            return {f"c{k}": (15.0, 80) for k in range(8)}
        stall = 0.15 if epoch == 2 else 1.0
        return {f"c{k}": (150.0 * gain[rule] * stall, 4) for k in range(8)}

    used = run_client_epochs(tuner, 30, load)
    assert used[2:4] == ["none", "predicted"]  # the stalled epoch, then the trial compared with it
    assert tuner.chosen == "convoy" and used[len(FIRST_TRIALS) :].count("convoy") >= 20
    assert tuner.ratings["convoy"] > max(tuner.ratings["none"], tuner.ratings["predicted"])


def test_a_stalled_epoch_moves_the_ratings_once_though_it_is_compared_on_both_sides():
    """A stalled epoch is compared with the epoch before it and with the one after; each
    comparison is bounded (``MAX_SPEEDUP``), but two bounded comparisons against one rule moved
    the gap past the switching margin. Measured (client processes of batch 1-16, 2026-11-29
    18:00): the first convoy epoch after the first trials served 138 requests/s between a
    "predicted" trial at 686 and a "none" one at 1395 (the clients' start: others still loading
    their models); the tuner left the convoy for the rest of the run at x0.74 of lockstep's
    tokens/s. A swing of x3 or more is a stall, not a rule: an epoch takes part in one such
    comparison at most, and the tuner keeps the convoy."""
    tuner = WaitTuner(epoch_s=0.25)
    gain = {"none": 1.0, "predicted": 1.0, "convoy": 1.35}

    def load(epoch, rule):
        if epoch < 2:  # the start: prefill (not compared with decoding)
            return {f"c{k}": (15.0, 80) for k in range(8)}
        stall = 0.15 if epoch == len(FIRST_TRIALS) else 1.0  # the first epoch of the rule chosen
        return {f"c{k}": (150.0 * gain[rule] * stall, 4) for k in range(8)}

    used = run_client_epochs(tuner, 30, load)
    assert used[len(FIRST_TRIALS) - 1 : len(FIRST_TRIALS) + 2] == ["predicted", "convoy", "none"]  # as measured
    assert tuner.chosen == "convoy" and used[len(FIRST_TRIALS) :].count("convoy") >= 20, used
    assert tuner.ratings["convoy"] > max(tuner.ratings["none"], tuner.ratings["predicted"])


def test_tuner_rates_each_clients_speed_not_the_total_a_racing_small_client_inflates():
    """Clients of batch 1 and 16 (most of the tokens). Not waiting lets the small one race ahead
    (1100 steps/s) while the large one crawls (150); the convoy steps both at 500/s: fewer
    requests in all, but every large step is faster and the mean step time lower. Rated on total
    requests/s the tuner chose not waiting (measured with client processes: x1.6 fewer tokens/s
    than the convoy); rated client by client it keeps the convoy."""
    tuner = WaitTuner(epoch_s=0.25)

    def load(_, rule):
        return (
            {"small": (500.0, 1), "large": (500.0, 16)}
            if rule == "convoy"
            else {"small": (1100.0, 1), "large": (150.0, 16)}
        )

    used = run_client_epochs(tuner, 40, load)
    assert tuner.chosen == "convoy" and used[-12:].count("convoy") >= 10
    assert tuner.ratings["convoy"] - tuner.ratings["none"] == pytest.approx(
        0.5 * math.log(500 / 1100 * 500 / 150), abs=0.05
    )


def test_tuner_does_not_credit_a_rule_with_the_clients_that_joined_under_it():
    """Every rule serves each client alike, and a client joins every epoch for the first ten
    (with a slow first epoch: its start). Rated on the total, each rule got the credit of the
    clients that joined while it ran; compared client by client, and without a client's first
    epoch, the ratings stay level."""
    tuner = WaitTuner(epoch_s=0.25)

    def load(epoch, _):  # c0 and c1 from the start, then c2 at epoch 1, c3 at epoch 2, ...
        present = range(min(epoch, 10) + 2)
        return {f"c{k}": (100.0 if epoch == max(0, k - 1) else 400.0, 4) for k in present}

    run_client_epochs(tuner, 30, load)
    assert max(tuner.ratings.values()) - min(tuner.ratings.values()) < 0.02


def test_tuner_does_not_compare_epochs_whose_clients_differ():
    """Clients start one by one, each warming up while the next loads (the load of the machine
    jumps with each arrival, here against whichever rule ran then: the convoy's epochs at half
    speed); then all eight decode, and the convoy serves 35% more. Compared across those
    arrivals, the warm-up rated the convoy far below the others and the tuner left it
    (measured with 8 client processes of one sequence each: 16-20 tokens/s under the rule it
    kept, 25 with the convoy fixed). Epochs with other clients at work are not compared, so the
    convoy is kept from the first trials on."""
    tuner = WaitTuner(epoch_s=0.25)
    gain = {"none": 1.0, "predicted": 1.0, "convoy": 1.35}

    def load(epoch, rule):
        if epoch < 8:  # c0 alone at first, then one more client each epoch, all at a changing load
            return {f"c{k}": (300.0 * (0.5 if rule == "convoy" else 1.0), 1) for k in range(epoch + 1)}
        return {f"c{k}": (150.0 * gain[rule], 1) for k in range(8)}

    used = run_client_epochs(tuner, 40, load)
    assert tuner.chosen == "convoy" and used[8:].count("convoy") >= 25
    assert tuner.ratings["convoy"] > max(tuner.ratings["none"], tuner.ratings["predicted"])


def test_tuner_starts_over_for_a_new_set_of_clients():
    """Two clients, under which "predicted" serves 40% more, leave; eight new ones arrive, under
    which the convoy serves 35% more. Kept, the first pair's ratings held the eight on "predicted"
    (rated clearly better: the convoy retried only every 20th epoch; measured with client
    processes, 42 tokens/s against 53 with the convoy). Ratings measured on clients of whom none
    is left are dropped: the tuner starts the new clients on the convoy, tries each rule again on
    them and keeps the convoy."""
    tuner = WaitTuner(epoch_s=0.25)
    first = {"none": 1.0, "predicted": 1.4, "convoy": 1.0}
    second = {"none": 1.0, "predicted": 1.0, "convoy": 1.35}

    def load(epoch, rule):
        if epoch < 20:
            return {"a0": (400.0 * first[rule], 1), "a1": (400.0 * first[rule], 1)}
        return {f"b{k}": (150.0 * second[rule], 1) for k in range(8)}

    used = run_client_epochs(tuner, 45, load)
    assert "predicted" in used[10:20] and used[10:20].count("predicted") >= 7  # the first pair's rule
    assert tuner.resets == 1 and tuner.stats()["resets"] == 1
    assert used[21:25] == ["convoy"] * 4  # the eight start on the convoy at once
    assert set(used[21:]) == set(RULES)  # and every rule is tried again on them
    assert tuner.chosen == "convoy" and used[-12:].count("convoy") >= 10


def streams(config: SchedulerConfig, interval_s: float) -> list[float]:
    """Six decoders of batch 1-16 over 24 layers, each an open loop: a token (pass) started every
    ``interval_s``, their phases spread over it (users reading at a set rate); their passes' times."""
    clients = [
        Walker(f"d{i}", rows=r, gap_s=0.0005, layers=24, interval_s=interval_s, start_s=i * interval_s / 6)
        for i, r in enumerate((1, 2, 4, 8, 16, 1))
    ]
    Simulation(config, clients, fixed_s=300e-6, per_row_s=10e-6).run(2.0)
    return [t for c in clients for t in c.pass_times(skip=3)]


@pytest.mark.parametrize("interval_s", [0.1, 0.2])
@pytest.mark.parametrize("wait_rule", ["convoy", "adaptive"])
def test_the_convoy_does_not_wait_for_streams_that_idle_between_their_tokens(wait_rule, interval_s):
    # A stream read at a set rate spends most of its interval idle after its pass. Taken for a
    # decoder on its way round to the first layers, it held the others there up to the hold's
    # end at every token: passes x2.8 as long as not waiting at 100 ms, p95 x4 (and the tuner
    # cannot see it: each stream's requests per second are its rate's, whatever the rule).
    # (At 60 ms the streams waited for behind in their passes still make the leaders' passes long
    # and their turns short: x1.53 of not waiting, adaptive; see ``arrivals.py``'s module doc.)
    alone = streams(SchedulerConfig(policy="opportunistic", wait_rule="none"), interval_s)
    held = streams(SchedulerConfig(policy="opportunistic", wait_rule=wait_rule), interval_s)
    assert len(held) >= 0.9 * len(alone)
    assert statistics.fmean(held) <= 1.1 * statistics.fmean(alone)
    assert p95(held) <= 1.1 * p95(alone)


def test_tuner_leaves_the_convoy_for_a_new_set_of_clients_it_does_not_suit():
    """Starting a new set of clients on the convoy is a start, not a verdict: where not waiting
    serves them 40% more, the tuner's explorations find it and keep it."""
    tuner = WaitTuner(epoch_s=0.25)

    def load(epoch, rule):
        if epoch < 20:  # the first pair: the convoy serves 40% more
            return {f"a{k}": (400.0 * (1.4 if rule == "convoy" else 1.0), 1) for k in range(2)}
        return {f"b{k}": (150.0 * (1.4 if rule == "none" else 1.0), 1) for k in range(8)}

    used = run_client_epochs(tuner, 70, load)
    assert tuner.resets == 1 and tuner.chosen == "none" and used[-12:].count("none") >= 9


def test_tuner_keeps_its_ratings_while_a_client_stays():
    """Clients come and go one at a time, some always at work: no new set of clients, no reset."""
    tuner = WaitTuner(epoch_s=0.25)

    def load(epoch, rule):
        return {"steady": (300.0, 1), f"c{epoch // 4}": (300.0 * (1.3 if rule == "convoy" else 1.0), 1)}

    run_client_epochs(tuner, 40, load)
    assert tuner.resets == 0 and tuner.chosen == "convoy"


def test_a_trial_lasts_as_long_as_the_epoch_before_it_however_slow_its_rule_makes_the_tokens():
    """An epoch lasts five of the slowest decoder's tokens. Taken when the epoch ends, a rule that
    halves the decoders' pace doubled its own trial: in a committed run with client processes a
    "none" trial lasted 778 ms between convoy epochs of ~340, at half their requests/s. An epoch
    lasts no longer than five tokens at the pace when it began, under the rule before it."""
    tuner = WaitTuner(epoch_s=0.1)
    token_s = {"none": 0.16, "predicted": 0.09, "convoy": 0.08}  # the slowest decoder, under each rule
    rate = {"none": 500, "predicted": 900, "convoy": 1000}  # requests/s of each of two clients
    now = 0.0
    tuner.tick(now, 5 * token_s[tuner.rule])
    while now < 12.0:
        now = round(now + 0.002, 6)
        for client in ("a", "b"):
            tuner.handed_out(client, round(0.002 * rate[tuner.rule]), 4, now)
        if tuner.due(now):
            tuner.tick(now, 5 * token_s[tuner.rule])  # the pace as measured under the rule in use
    epochs = [(rule, length_ms) for rule, _, _, length_ms, *_ in tuner.history]
    after_convoy = [epoch for (before, _), epoch in zip(epochs, epochs[1:]) if before == "convoy"]
    assert {"none", "predicted"} <= {rule for rule, _ in after_convoy}  # trials of both
    assert all(length_ms == pytest.approx(1e3 * 5 * token_s["convoy"], abs=5) for _, length_ms in after_convoy)


def test_an_epoch_is_not_held_by_a_pace_measured_on_a_prefill():
    """The slowest decoder's pace when an epoch begins is its prefill's (0.6 s a token here); with
    the length fixed then, the epoch lasted five of those, 3 s (measured with client processes:
    2-4 s epochs just after the clients' start, some of them "none" trials). The pace is read again
    while the epoch lasts: once it is the decoding's (after a second here; five tokens: 0.4 s) the
    epoch ends -- and counts: it is no idle executor's overrun, though it ran past twice its
    length as read at the end."""
    tuner = WaitTuner(epoch_s=0.1)
    tuner.tick(0.0)
    now = 0.0
    while now < 0.1:
        now = round(now + 0.002, 6)
        for client in ("a", "b"):
            tuner.handed_out(client, 2, 4, now)
    tuner.tick(now, min_epoch_s=5 * 0.6)  # the pace of the prefill just done
    begun = now
    while len(tuner.history) < 2 and now < 5.0:
        now = round(now + 0.002, 6)
        for client in ("a", "b"):
            tuner.handed_out(client, 2, 4, now)
        if tuner.due(now):
            tuner.tick(now, min_epoch_s=5 * (0.6 if now - begun < 1.0 else 0.08))  # then decoding
    assert len(tuner.history) == 2 and tuner.history[-1][3] == pytest.approx(1000, abs=60)
    assert tuner.history[-1][4:] == (3000, 400)  # its cap (the prefill's pace), the pace that ended it


def test_an_epoch_that_the_pace_would_end_early_still_outlasts_its_settling():
    """Requests count after the epoch's settling, a quarter of the length expected when it began
    (the last epoch's: 1.5 s here). When the pace read then falls at once (0.2 s, five tokens of
    0.04), ending the epoch there would leave nothing counted after the settling, and the epoch
    would say nothing; it lasts twice its settling, so half of it is measured."""
    tuner = WaitTuner(epoch_s=0.1)
    tuner.tick(0.0)
    now, paces = 0.0, iter([1.5, 1.5])  # two ends read a slow pace, then the pace falls
    pace = next(paces)
    while len(tuner.history) < 3 and now < 10.0:
        now = round(now + 0.002, 6)
        for client in ("a", "b"):
            tuner.handed_out(client, 2, 4, now)
        if tuner.due(now):
            epochs = len(tuner.history)
            tuner.tick(now, min_epoch_s=pace)
            if len(tuner.history) > epochs:
                pace = next(paces, 0.2)
    assert [round(entry[3], -1) for entry in tuner.history] == [100, 1500, 750]


def test_tuner_ignores_epochs_that_say_nothing():
    tuner = WaitTuner(epoch_s=0.2)
    tuner.tick(0.0)
    for i in range(100):  # one client only: nothing to batch with, the epoch does not count
        tuner.handed_out("a", 1, 1, 0.1 + i * 0.001)
    tuner.tick(0.25)
    for i in range(40):  # two clients served early in the next epoch, then the executor idles:
        tuner.handed_out("ab"[i % 2], 1, 1, 0.31 + i * 0.002)
    tuner.tick(10.0)  # its end is seen seconds late (an overrun epoch): it does not count either
    assert tuner.epochs == 0 and tuner.rule == FIRST_TRIALS[0]
    for i in range(40):  # the same served in an epoch whose end is seen on time counts
        tuner.handed_out("ab"[i % 2], 1, 1, 10.06 + i * 0.002)
    tuner.tick(10.21)
    assert tuner.epochs == 1
    with pytest.raises(ValueError, match="epoch_s"):
        WaitTuner(epoch_s=0.0)  # would look on every plan (SchedulerConfig refuses it first)


@pytest.mark.slow
def test_opportunistic_stops_waiting_when_waiting_does_not_pay():
    """Clients on cores of their own, a cheap executor: waiting only adds latency, so the tuner
    settles on no waiting, and the pooled step time is within 10% of the immediate policy's."""

    def clients():
        return [
            Walker(f"c{i}", rows=r, gap_s=0.0005 * (1 + i % 3), layers=8, start_s=i * 3.7e-5)
            for i, r in enumerate((1, 4, 16, 2))
        ]

    results = {}
    for name, config in (("immediate", SchedulerConfig(policy="immediate")), ("opportunistic", SchedulerConfig())):
        walkers = clients()
        # 8 s: the tuner leaves its start rule (the convoy) after two epochs of each rule show
        # it (x1.12 of immediate over 4 s, x1.07 over 8; one epoch sufficed before: x1.09, x1.06)
        sim = Simulation(config, walkers, fixed_s=5e-6, per_row_s=1e-7).run(8.0)
        results[name] = statistics.fmean(t for w in walkers for t in w.token_times(skip=50))
        if name == "opportunistic":
            stats = sim.scheduler.stats()["wait_rule"]
            assert (
                stats["rule"] == "none"
                and stats["trials"]["none"] > stats["trials"]["convoy"] + stats["trials"]["predicted"]
            )
    assert results["opportunistic"] <= 1.1 * results["immediate"]
    assert math.isfinite(results["immediate"])


def test_tuner_is_asked_for_the_decoders_token_times_only_when_an_epoch_may_end(monkeypatch):
    """The scheduler plans on every arrival and hand-out; the epoch's length (five of the slowest
    decoder's tokens) costs a look at every decoder, so it is computed only once the epoch as
    last measured has run out (``WaitTuner.due``): per plan, that look was ~15% of the scheduler's
    time with 8 decoders, and a server's socket thread does all of it."""
    tuner = WaitTuner(epoch_s=0.2)
    assert tuner.due(0.0)  # not started: the first tick starts it
    tuner.tick(0.0)
    assert not tuner.due(0.1) and tuner.due(0.2)
    tuner.tick(0.2, min_epoch_s=0.5)  # ends the epoch; the decoders' tokens make the next one longer
    assert not tuner.due(0.39) and tuner.due(0.41)  # looked at from epoch_s on,
    tuner.tick(0.41, min_epoch_s=0.5)
    assert not tuner.due(0.5) and tuner.due(0.52)  # then every half epoch_s while it lasts

    calls = []
    walkers = [Walker(f"d{i}", rows=1, gap_s=0.0005, start_s=1e-4 * i) for i in range(4)]
    sim = Simulation(SchedulerConfig(), walkers)
    real = pacing.DecodeGuard.longest_token_s
    monkeypatch.setattr(pacing.DecodeGuard, "longest_token_s", lambda self, now: calls.append(now) or real(self, now))
    sim.run(1.0)
    assert 0 < len(calls) < 0.1 * len(sim.batches)


def test_the_choice_starts_from_the_start_rule_and_leaves_it_only_for_a_clearly_better_one():
    """Rules that serve alike keep the tuner on its start rule, whichever it is (not waiting for
    client threads, the convoy for the others); a rule clearly better is chosen from either."""
    for start in ("none", "convoy"):
        tuner = WaitTuner(epoch_s=0.2)
        tuner.start_rule = start
        _, chosen, now = run_epochs(tuner, 30, lambda _, rule: (1000.0, 4))
        assert chosen[len(FIRST_TRIALS) :].count(start) == 30 - len(FIRST_TRIALS), (start, chosen)
        better = "convoy" if start == "none" else "none"
        _, chosen, _ = run_epochs(tuner, 60, lambda _, rule, b=better: (1600.0 if rule == b else 1000.0, 4), now)
        assert chosen[-1] == better, (start, chosen)


def test_one_slow_epoch_compared_on_both_sides_does_not_switch_the_choice():
    """The start rule's first epoch after the first trials ran at half its pace (a convoy forming
    again after two trials while the clients still start; client processes, 2026-12-01): compared
    with the trial before it and the epoch after it, it moved the ratings past the switching
    margin, and the tuner left the convoy for the window at x0.7 of lockstep's tokens/s. A switch
    needs two epochs of each rule to show it; a rule better in every epoch is still chosen."""
    tuner = WaitTuner(epoch_s=0.2)
    tuner.start_rule = "convoy"
    first = len(FIRST_TRIALS)
    one_slow_epoch = lambda epoch, rule: (500.0 if epoch == first else 1000.0, 4)  # noqa: E731
    used, chosen, now = run_epochs(tuner, 30, one_slow_epoch)
    assert used[first] == "convoy" and used[first + 1] != "convoy", used  # compared on both sides
    assert chosen[first:] == ["convoy"] * (30 - first), chosen
    none_better = lambda _, rule: (1600.0 if rule == "none" else 1000.0, 4)  # noqa: E731
    _, chosen, _ = run_epochs(tuner, 30, none_better, now)
    assert chosen[-1] == "none", chosen


def test_until_the_ratings_choose_a_rule_the_choice_follows_the_start_rule():
    """The start rule is where the choice stands until the ratings say otherwise, and the scheduler
    may change it whenever the tuner may choose (the host's load moves; 2026-12-01, the start read
    during the clients' start hung over the whole run). Rules that serve alike leave the choice on
    the start rule of the moment; a rule the ratings chose over it is kept when it changes."""
    tuner = WaitTuner(epoch_s=0.2)
    tuner.start_rule = "none"
    alike = lambda _, rule: (1000.0, 4)  # noqa: E731
    _, chosen, now = run_epochs(tuner, 12, alike)
    assert chosen[-1] == "none"
    tuner.start_rule = "convoy"
    _, chosen, now = run_epochs(tuner, 3, alike, now)
    assert chosen == ["convoy"] * 3, chosen
    predicted_better = lambda _, rule: (1600.0 if rule == "predicted" else 1000.0, 4)  # noqa: E731
    _, chosen, now = run_epochs(tuner, 60, predicted_better, now)
    assert chosen[-1] == "predicted", chosen
    tuner.start_rule = "none"
    _, chosen, _ = run_epochs(tuner, 3, predicted_better, now)
    assert chosen == ["predicted"] * 3, chosen


def test_client_threads_of_the_executors_process_start_on_the_convoy_whatever_the_hosts_room(tiny_checkpoint):
    """The engine tells the scheduler which clients call from threads of its own process: while
    all of them do, the tuner starts on the convoy even where the host's CPUs have room (they take
    turns on one interpreter lock, which the host's reading does not see); a client over a
    transport (a driver's ``submit``) brings in the host's room, which starts from not waiting."""
    import torch

    from symbiosis.executor.executor import BaseExecutor

    with BaseExecutor.from_pretrained(tiny_checkpoint("llama")) as executor:
        scheduler = executor._engine.scheduler
        scheduler.read_host_load(lambda: 0.1, cores=16)  # a host with room: 14 idle cores
        layer_id = "model.layers.0.self_attn.q_proj"
        rows = torch.ones(1, executor.weights.specs[layer_id].in_features)

        later = [1e6]

        def start_rule() -> str:
            later[0] += 1e3  # due: the scheduler sets the start whenever the tuner may choose
            scheduler._tick_tuner(later[0])
            return scheduler._tuner.start_rule

        for client in ("a", "b"):
            executor.register_client(client)
            executor.call(client, layer_id, Op.FORWARD, rows, LatencyClass.DECODE)
        assert start_rule() == "convoy"
        executor.register_client("remote")
        executor.submit("remote", layer_id, Op.FORWARD, rows, LatencyClass.DECODE).result(timeout=10)
        assert start_rule() == "none"
        executor.unregister_client("remote")
        assert start_rule() == "convoy"


def test_the_host_load_reading_covers_the_last_seconds_not_the_last_call(monkeypatch):
    """``HostCpu.busy_share`` is the share over the last ``window_s`` (the scheduler asks every half
    epoch, and a tenth of a second of a small host's ticks is noise), or since it began."""
    from collections import namedtuple

    from symbiosis.executor import host_load

    Times = namedtuple("Times", "user nice system idle iowait irq softirq steal guest guest_nice")
    state = {"now": 0.0, "busy": 0.0, "idle": 0.0}
    monkeypatch.setattr(
        host_load.psutil, "cpu_times", lambda: Times(state["busy"], 0, 0, state["idle"], 0, 0, 0, 0, 0, 0)
    )
    reader = host_load.HostCpu(window_s=2.0, clock=lambda: state["now"])

    def run(seconds: float, share: float) -> None:  # two cores, ``share`` of their time busy
        state["now"] += seconds
        state["busy"] += 2 * seconds * share
        state["idle"] += 2 * seconds * (1 - share)

    run(0.1, 0.9)
    assert reader.busy_share() == pytest.approx(0.9)  # since it began
    for step in range(40):  # 4 s of tenths that read 0.2 and 1.0 in turn
        run(0.1, 0.2 if step % 2 else 1.0)
        assert 0.55 <= reader.busy_share() <= 0.65 or step < 20
    for _ in range(30):
        run(0.1, 0.3)
        reader.busy_share()
    assert reader.busy_share() == pytest.approx(0.3)
    # A pause of the asker (an idle executor asks nothing): an idle minute, then a busy second
    # read every tenth -- the share is the second's, not the minute's.
    run(60.0, 0.0)
    for _ in range(10):
        run(0.1, 1.0)
        share = reader.busy_share()
    assert share == pytest.approx(1.0)
    assert reader.cores >= 1


def test_clients_over_a_transport_start_from_not_waiting_while_the_host_has_idle_cores(tiny_checkpoint):
    """A client that is not a thread of the executor's process brings the convoy start only while
    the host's CPUs are busy (the engine's reader, ``host_load.HostCpu``); with room on them, or
    no reading, as said; the reading shows in the stats."""
    import torch

    from symbiosis.executor.executor import BaseExecutor
    from symbiosis.executor.host_load import HostCpu
    from symbiosis.executor.wait_tuner import IDLE_HOST_BUSY_SHARE

    with BaseExecutor.from_pretrained(tiny_checkpoint("llama")) as executor:
        scheduler = executor._engine.scheduler
        layer_id = "model.layers.0.self_attn.q_proj"
        rows = torch.ones(1, executor.weights.specs[layer_id].in_features)
        executor.register_client("remote")
        executor.submit("remote", layer_id, Op.FORWARD, rows, LatencyClass.DECODE).result(timeout=10)
        busy: list[float | None] = [1.0]
        scheduler.read_host_load(lambda: busy[0])
        later = [1e6]

        def start_rule() -> str:
            later[0] += 1e3
            scheduler._tick_tuner(later[0])
            return scheduler._tuner.start_rule

        assert start_rule() == "convoy"
        busy[0] = IDLE_HOST_BUSY_SHARE - 0.01
        assert start_rule() == "none"
        assert executor.stats()["scheduler"]["wait_rule"]["host_cpu_busy"] == busy[0]
        busy[0] = IDLE_HOST_BUSY_SHARE
        assert start_rule() == "convoy"
        busy[0] = None  # no time passed between readings: nothing known
        assert start_rule() == "convoy"
        # Room is a core idle too, where the reader knows how many there are: 40% of 2 cores idle
        # is under one (client processes taking turns with the executor), 40% of 16 is six.
        busy[0] = 0.6
        scheduler.read_host_load(lambda: busy[0], cores=2)
        assert start_rule() == "convoy"
        scheduler.read_host_load(lambda: busy[0], cores=16)
        assert start_rule() == "none"
        # The engine's own reader: a share of the host's CPU time, which this thread kept busy.
        reader = HostCpu()
        until = time.process_time() + 0.2
        while time.process_time() < until:  # 20 ticks of this process's own CPU time at least
            pass
        share = reader.busy_share()
        assert share is not None and 0.0 < share <= 1.0


def test_a_trial_that_costs_the_sequences_backs_off_though_clients_rate_it_level():
    """Clients of batch 1 and 16. Not waiting lets the small one go x1.2 faster and slows the large
    one x1.2: rated client by client the two rules are level, so its trials never lost and came
    every fifth epoch. Each one costs 16 of the 17 sequences a slow epoch, though (client threads
    of batch 1-16: "none" trials rated level with the convoy while the convoy served x1.2 the
    tokens/s). A trial's cost is judged per sequence (latency rows per request), so its trials
    back off; the ratings, which choose, still weigh each client alike."""
    tuner = WaitTuner(epoch_s=0.25)

    def load(_, rule):
        if rule == "convoy":
            return {"small": (500.0, 1), "large": (500.0, 16)}
        return {"small": (600.0, 1), "large": (500.0 / 1.2, 16)}

    used = run_client_epochs(tuner, 60, load)
    assert tuner.chosen == "convoy"
    assert abs(tuner.ratings["convoy"] - tuner.ratings["none"]) < 0.05  # level, client by client
    later = used[len(FIRST_TRIALS) + 20 :]
    assert later.count("none") <= 2, used  # every 20th epoch at most (every 5th when judged per client)
    assert tuner.stats()["trial_every"]["none"] == EXPLORE_EVERY * RARE_FACTOR


def test_the_tuner_counts_a_clients_sequences_in_its_latency_work_only(monkeypatch):
    """What weighs a client in a trial's cost is its latency rows per request (the sequences it
    decodes); a fine-tuning client's rows are bulk work and weigh one, or its hundreds of rows
    a request would decide every trial."""
    seen: dict[str, set[tuple[int, int | None]]] = {}
    real = WaitTuner.handed_out

    def record(self, client_id, requests, rows, now_s, latency_rows=None):
        seen.setdefault(client_id, set()).add((rows, latency_rows))
        return real(self, client_id, requests, rows, now_s, latency_rows)

    monkeypatch.setattr(WaitTuner, "handed_out", record)
    walkers = [Walker(f"d{i}", rows=4, gap_s=0.0005, start_s=1e-4 * i) for i in range(2)]
    walkers.append(Walker("ft", rows=512, gap_s=0.001, latency_class=F))
    Simulation(SchedulerConfig(), walkers).run(0.2)
    assert seen["d0"] == seen["d1"] == {(4, 4)}
    assert seen["ft"] and all(latency_rows == 0 for _, latency_rows in seen["ft"])


def _paced_beside_a_decoder_on_a_background_lane(flood: list[tuple[int, int]]) -> tuple[Scheduler, float]:
    """A decoder "a" active on the latency lane and a flooding client "f" (``flood``: its requests,
    (request id, rows)) on a background bulk lane: asserts that the flood's products are cut to
    what its allowance can owe, and held while the allowance is spent. Returns the scheduler and
    the time then."""
    from symbiosis.executor.scheduler import CREDIT_CAP_S, Lane

    scheduler = Scheduler(SchedulerConfig(bulk_lane="background"))
    scheduler._guard.backlog_share = 0.05  # as a decoder's slowed tokens would have brought it down
    now, request_id = 0.0, 0
    for layer in range(4):  # "a" decodes (latency lane), so it is an active decoder
        scheduler.add(PendingRequest(request_id, "a", f"l{layer}", Op.FORWARD, 1, D, now))
        scheduler.next_batch(now, Lane.LATENCY)
        request_id += 1
        now += 0.0005
    for flood_id, rows in flood:
        scheduler.add(PendingRequest(flood_id, "f", "big", Op.FORWARD, rows, F, now))
    first = scheduler.next_batch(now, Lane.BULK)
    assert first is not None
    scheduler.batch_done(first, first.rows * 1e-6, now + first.rows * 1e-6)  # 1 us a row, learned
    now += 0.1  # the allowance has filled again
    scheduler.add(PendingRequest(request_id, "a", "l0", Op.FORWARD, 1, D, now))  # still decoding
    scheduler.next_batch(now, Lane.LATENCY)
    batch = scheduler.next_batch(now, Lane.BULK)
    assert batch is not None and batch.rows <= CREDIT_CAP_S / 1e-6 + 1  # cut to what its allowance can owe
    scheduler.batch_done(batch, 4 * CREDIT_CAP_S, now + 4 * CREDIT_CAP_S)  # it took longer: spent
    now += 4 * CREDIT_CAP_S
    held, wakeup = scheduler.next_batch_or_wakeup(now, Lane.BULK)
    assert held is None and now < wakeup < now + 1.0  # held until its allowance fills again
    return scheduler, now


def test_a_flood_on_a_background_bulk_lane_is_paced_while_a_decoder_is_active():
    """With bulk work on runners of its own (``bulk_lane="background"``, ``next_batch(lane=BULK)``)
    the OS keeps bulk products out of the decoders' way, but a flood's client and the server's
    socket thread still take the host's cores at normal priority, so a flood is paced there as on
    a shared lane: cut to products its allowance can owe, and held while the allowance is spent
    and a decoder is active -- a fine-tuning client walking its layers, one request at a time, is
    not. Without an active decoder the flood runs unpaced."""
    from symbiosis.executor.scheduler import Lane

    scheduler, now = _paced_beside_a_decoder_on_a_background_lane([(1000 + i, 16_384) for i in range(3)])
    scheduler.add(PendingRequest(2000, "t", "other", Op.FORWARD, 256, F, now))  # a fine-tuning walk
    walk = scheduler.next_batch(now, Lane.BULK)
    assert walk is not None and [s.request_id for s in walk.slices] == [2000]
    quiet = now + 2.0  # the decoder is gone: the flood runs unpaced, a whole row budget
    unpaced = scheduler.next_batch(quiet, Lane.BULK)
    assert unpaced is not None and unpaced.rows == scheduler.config.row_budget


def _fine_tuning_beside_a_decoder_on_a_background_lane(runners: int, bulk_share: float) -> tuple[Scheduler, float]:
    """A target of 50 ms, decoder "a" active on the latency lane, and a fine-tuning client "t"
    walking its layers (one 256-row request at a time: no flood) on a background bulk lane of
    ``runners`` threads, the target's feedback at ``bulk_share``. Returns the scheduler and the
    time then, a first bulk batch of "t" run and learned (1 us a row)."""
    from symbiosis.executor.scheduler import Lane

    scheduler = Scheduler(SchedulerConfig(bulk_lane="background", decode_slo_ms=50.0))
    scheduler.bulk_runners = runners
    scheduler._guard.bulk_share = bulk_share
    now, request_id = 0.0, 0
    for layer in range(4):
        scheduler.add(PendingRequest(request_id, "a", f"l{layer}", Op.FORWARD, 1, D, now))
        scheduler.next_batch(now, Lane.LATENCY)
        request_id += 1
        now += 0.0005
    scheduler.add(PendingRequest(2000, "t", "big", Op.FORWARD, 256, F, now))
    first = scheduler.next_batch(now, Lane.BULK)
    assert first is not None and first.rows == 256
    scheduler.batch_done(first, 256e-6, now + 256e-6)
    return scheduler, now + 256e-6


def test_with_a_target_fine_tuning_on_a_background_bulk_lane_is_paced_while_a_decoder_is_active():
    """On a background bulk lane the OS keeps bulk products off the decoders' cores, but fine-tuning
    still slows them outside the queue (its clients' own work, the server's thread reading its
    rows), and before, a target had nothing to act on there. With ``decode_slo_ms`` set, bulk
    work is now paced on its own runners as on a shared lane: held while the allowance (the
    target's ``bulk_share`` of every bulk runner) is spent and a decoder is active; with the
    share at 1, two runners both busy are not held; without a target, the same walk is not held."""
    from symbiosis.executor.scheduler import CREDIT_CAP_S, Lane

    scheduler, now = _fine_tuning_beside_a_decoder_on_a_background_lane(runners=2, bulk_share=MIN_BULK_SHARE)
    scheduler.add(PendingRequest(2001, "t", "big", Op.FORWARD, 256, F, now))
    scheduler.add(PendingRequest(4, "a", "l0", Op.FORWARD, 1, D, now))  # still decoding
    scheduler.next_batch(now, Lane.LATENCY)
    scheduler._allowed.spend(2 * CREDIT_CAP_S)  # the products it ran took the allowance
    held, wakeup = scheduler.next_batch_or_wakeup(now, Lane.BULK)
    assert held is None and now < wakeup < now + 1.0
    refill_s = CREDIT_CAP_S / (2 * MIN_BULK_SHARE)  # from -CREDIT_CAP_S at 2 runners' rate (1 runner: twice)
    assert wakeup - now == pytest.approx(refill_s, rel=0.05)
    later = scheduler.next_batch(wakeup + 1e-6, Lane.BULK)
    assert later is not None and [s.request_id for s in later.slices] == [2001]

    # The feedback at its top: two runners' worth of bulk products a second is no more than allowed.
    busy, now = _fine_tuning_beside_a_decoder_on_a_background_lane(runners=2, bulk_share=1.0)
    for request_id in range(3000, 3040):
        busy.add(PendingRequest(request_id, "t", "big", Op.FORWARD, 256, F, now))
        batch = busy.next_batch(now, Lane.BULK)
        assert batch is not None, "held with the share at 1"
        busy.batch_done(batch, 256e-6, now + 256e-6)
        busy.add(PendingRequest(request_id + 100, "a", "l0", Op.FORWARD, 1, D, now))
        busy.next_batch(now, Lane.LATENCY)
        now += 256e-6 / 2  # two runners: each product's time is half a product of wall clock

    # Without a target, the same fine-tuning walk is not paced there (the OS's priority is all).
    untargeted = Scheduler(SchedulerConfig(bulk_lane="background"))
    untargeted._allowed.spend(2 * CREDIT_CAP_S)
    untargeted.add(PendingRequest(0, "a", "l0", Op.FORWARD, 1, D, 0.0))
    untargeted.next_batch(0.0, Lane.LATENCY)
    untargeted.add(PendingRequest(1, "t", "big", Op.FORWARD, 256, F, 0.0))
    assert untargeted.next_batch(0.0, Lane.BULK) is not None


def test_a_decoder_served_at_once_beside_bulk_clients_is_seen_by_the_decode_guard():
    """On a background bulk lane a decoder whose only neighbours are bulk clients is served at once
    (``serves_at_once(lane=LATENCY)``, the engine's fast path); its calls are still recorded, so
    the decode guard knows it decodes and at what pace, and a flood beside it is paced when its
    tokens slow down. (Unrecorded, the guard saw 0-2 tokens of such a bystander in a 6 s window,
    and the flood was never paced.) Its very first call counts too, before it has joined; a client
    with no one else joined records nothing."""
    from symbiosis.executor.scheduler import Lane

    scheduler = Scheduler(SchedulerConfig(bulk_lane="background"))
    for i in range(3):
        scheduler.add(PendingRequest(1000 + i, "f", "big", Op.FORWARD, 16_384, F, 0.0))
    assert scheduler.serves_at_once("a", "l0", Op.FORWARD, 1, D, 0.0, Lane.LATENCY)
    assert scheduler.stats()["decode_guard"]["decoders_tracked"] == 1  # the first call, "a" not yet joined
    scheduler.served_alone("a", 1, D)
    now = 0.001
    for token in range(8):
        for layer in range(4):
            assert scheduler.serves_at_once("a", f"l{layer}", Op.FORWARD, 1, D, now, Lane.LATENCY)
            scheduler.served_alone("a", 1, D)
            now += 0.001 if token < 3 else 0.004  # its tokens become 4x slower (the flood's cores)
    assert scheduler._guard.active(now) == ["a"]
    guard = scheduler.stats()["decode_guard"]
    assert guard["token_samples"] >= 6
    assert guard["token_samples_over_own_target"] >= 3 and guard["backlog_share"] < 0.2

    lone = Scheduler(SchedulerConfig(bulk_lane="background"))
    assert lone.serves_at_once("a", "l0", Op.FORWARD, 1, D, 0.0, Lane.LATENCY)
    assert lone.stats()["decode_guard"]["decoders_tracked"] == 0


def test_one_request_larger_than_a_batch_is_a_backlog_paced_like_a_flood():
    """A client that sends ONE 16,384-row request at a time has more rows queued than a batch holds
    (``row_budget``): a backlog, paced like several requests queued -- before, it evaded the pacing
    (client threads: the bystander's p95 x4.6-5.7 of alone beside it, x1.6-1.7 beside the same
    rows sent 8 at a time). A fine-tuning step of ``row_budget`` rows walking its layers is not
    paced, and without a decoder the large request runs unpaced."""
    from symbiosis.executor.scheduler import Lane

    budget = SchedulerConfig().row_budget
    scheduler, now = _paced_beside_a_decoder_on_a_background_lane([(1000, 4 * budget)])  # one request
    scheduler.add(PendingRequest(2000, "t", "other", Op.FORWARD, budget, F, now))  # a fine-tuning walk
    walk = scheduler.next_batch(now, Lane.BULK)
    assert walk is not None and [s.request_id for s in walk.slices] == [2000] and walk.rows == budget

    lone = Scheduler(SchedulerConfig(bulk_lane="background"))  # the same flood, no decoder: unpaced
    lone.add(PendingRequest(1, "f", "big", Op.FORWARD, 4 * budget, F, 0.0))
    assert [lone.next_batch(0.0, Lane.BULK).rows for _ in range(4)] == [budget] * 4
