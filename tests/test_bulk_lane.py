"""Bulk work on a background thread (``SchedulerConfig.bulk_lane``): a decode request never waits
behind a bulk product, results stay exact, and ``shared`` keeps the one-product-at-a-time engine."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import symbiosis
from symbiosis.errors import ConfigurationError
from symbiosis.executor import engine as engine_module
from symbiosis.executor.requests import PendingRequest
from symbiosis.executor.scheduler import SPLIT_MIN_ROWS, Lane, Scheduler, SchedulerConfig
from symbiosis.executor.scheduler_config import resolve_bulk_lane
from symbiosis.vocabulary import LatencyClass, Op

LAYER = "model.layers.0.self_attn.q_proj"
BULK_ROWS = 300  # over decode_share_rows (256): bulk whatever its class


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("qwen2")


def _expected(executor, rows):
    layer = executor.weights.layers[LAYER]
    return rows @ layer.weight.t() + layer.bias


class BlockedBulkProduct:
    """Stands in for ``run_batch``: a product of a bulk request (``SPLIT_MIN_ROWS`` rows or more:
    several bulk threads may each run a part of one) stops until ``release`` is set, recording the
    thread that runs it; others run as usual."""

    def __init__(self, monkeypatch):
        self.started, self.release = threading.Event(), threading.Event()
        self.thread_name, self.native_id = None, None
        real = engine_module.run_batch

        def run_batch(layer, op, rows_list):
            if sum(r.shape[0] for r in rows_list) >= SPLIT_MIN_ROWS:
                self.thread_name, self.native_id = threading.current_thread().name, threading.get_native_id()
                self.started.set()
                assert self.release.wait(30), "the test never released the bulk product"
            return real(layer, op, rows_list)

        monkeypatch.setattr(engine_module, "run_batch", run_batch)


def _wait_until_not(engine, flag: str) -> None:
    """Wait until the runner that completed a future has given the engine back: a future's
    result is set just before its runner clears ``_computing`` / ``_bulk_computing``, so a
    thread woken by ``result()`` can see the engine still taken (a loaded host widens that)."""
    deadline = time.monotonic() + 10
    while getattr(engine, flag):
        assert time.monotonic() < deadline, f"the engine kept {flag} set"
        time.sleep(0.001)


def _start_bulk_then_decode(executor, blocked):
    g = torch.Generator().manual_seed(0)
    bulk_rows, decode_rows = torch.randn(BULK_ROWS, 64, generator=g), torch.randn(1, 64, generator=g)
    bulk = executor.submit("trainer", LAYER, Op.FORWARD, bulk_rows, LatencyClass.FINETUNE)
    assert blocked.started.wait(10), "the bulk product never started"
    decode = executor.submit("decoder", LAYER, Op.FORWARD, decode_rows, LatencyClass.DECODE)
    return (bulk, bulk_rows), (decode, decode_rows)


def test_a_decode_request_is_served_while_a_bulk_product_runs(path, monkeypatch):
    blocked = BlockedBulkProduct(monkeypatch)
    with symbiosis.BaseExecutor.from_pretrained(path, policy="immediate", bulk_lane="background") as ex:
        (bulk, bulk_rows), (decode, decode_rows) = _start_bulk_then_decode(ex, blocked)
        try:
            torch.testing.assert_close(decode.result(timeout=10), _expected(ex, decode_rows), rtol=1e-5, atol=1e-6)
            assert not bulk.done()  # still held in its product: the decode request did not wait for it
        finally:
            blocked.release.set()
        torch.testing.assert_close(bulk.result(timeout=10), _expected(ex, bulk_rows), rtol=1e-5, atol=1e-6)
        assert blocked.thread_name.startswith("symbiosis-bulk")
        if hasattr(os, "SCHED_IDLE"):
            assert os.sched_getscheduler(blocked.native_id) == os.SCHED_IDLE
        assert ex.stats()["batches_run_by"]["bulk_thread"] >= 1


def test_shared_bulk_lane_runs_one_product_at_a_time(path, monkeypatch):
    blocked = BlockedBulkProduct(monkeypatch)
    with symbiosis.BaseExecutor.from_pretrained(path, policy="immediate", bulk_lane="shared") as ex:
        (bulk, _), (decode, decode_rows) = _start_bulk_then_decode(ex, blocked)
        try:
            with pytest.raises(TimeoutError):
                decode.result(timeout=0.3)  # behind the bulk product
        finally:
            blocked.release.set()
        torch.testing.assert_close(decode.result(timeout=10), _expected(ex, decode_rows), rtol=1e-5, atol=1e-6)
        bulk.result(timeout=10)
        assert not blocked.thread_name.startswith("symbiosis-bulk")
        assert "bulk_thread" not in ex.stats()["batches_run_by"]


def test_concurrent_bulk_and_latency_requests_are_exact(path):
    """Threads of in-process callers mixing fine-tuning, long prefill and decode requests, forward
    and backward, on a background bulk lane: every result is its own product."""
    with symbiosis.BaseExecutor.from_pretrained(path, bulk_lane="background", row_budget=128) as ex:
        g = torch.Generator().manual_seed(1)
        jobs = [
            (op, cls, torch.randn(n, 64, generator=g))
            for n, cls in ((1, LatencyClass.DECODE), (300, LatencyClass.PREFILL), (40, LatencyClass.FINETUNE))
            for op in (Op.FORWARD, Op.BACKWARD)
            for _ in range(3)
        ]
        results = [None] * len(jobs)

        def run(i):
            op, cls, rows = jobs[i]
            results[i] = ex.call(f"c{i}", LAYER, op, rows, cls, timeout_s=30)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert ex.stats()["batches_run_by"]["bulk_thread"] > 0
        layer = ex.weights.layers[LAYER]
        for (op, _, rows), result in zip(jobs, results):
            expected = rows @ layer.weight.t() + layer.bias if op is Op.FORWARD else rows @ layer.weight
            torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-6)


def test_fine_tuning_paced_to_a_target_beside_a_decoder_is_exact(path, monkeypatch):
    """With ``decode_slo_ms`` on a background bulk lane, fine-tuning work beside an active decoder
    is paced and its rows cut to what the allowance can owe (``Scheduler._paced_on_own_runner``):
    the chunks' products, assembled, are still the request's own product, and so are the
    decoder's. The target's feedback starts at its floor here, as a decoder over the target
    would have brought it, and the allowance's cap is 20 us, so that whether a chunk is cut does
    not hang on how fast this host multiplies (a 2000-row product of this model fits in the real
    cap's 2 ms)."""
    from symbiosis.executor import scheduler as scheduler_module
    from symbiosis.executor.pacing import MIN_BULK_SHARE

    monkeypatch.setattr(scheduler_module, "CREDIT_CAP_S", 2e-5)

    # One bulk thread: a request is not split between idle threads, so a cut is the pacing's.
    config = dict(bulk_lane="background", bulk_threads=1, decode_slo_ms=1.0)
    with symbiosis.BaseExecutor.from_pretrained(path, **config) as ex:
        ex._engine.scheduler._guard.bulk_share = MIN_BULK_SHARE
        g = torch.Generator().manual_seed(3)
        decode_rows = [torch.randn(1, 64, generator=g) for _ in range(400)]
        bulk_rows = [torch.randn(2000, 64, generator=g) for _ in range(3)]
        decoded: list[torch.Tensor] = []
        done = threading.Event()

        def decode():
            for rows in decode_rows:  # one client decoding at its own pace, until the bulk work is done
                decoded.append(ex.call("decoder", LAYER, Op.FORWARD, rows, LatencyClass.DECODE, timeout_s=30))
                if done.is_set():
                    break
                time.sleep(0.0005)

        decoder = threading.Thread(target=decode)
        decoder.start()
        time.sleep(0.05)  # the decoder is active before the fine-tuning work arrives
        tuned = [ex.call("trainer", LAYER, Op.FORWARD, rows, LatencyClass.FINETUNE, timeout_s=60) for rows in bulk_rows]
        done.set()
        decoder.join(timeout=30)
        stats = ex.stats()["scheduler"]
    for rows, result in zip(bulk_rows, tuned):
        torch.testing.assert_close(result, _expected(ex, rows), rtol=1e-5, atol=1e-6)
    for rows, result in zip(decode_rows, decoded):
        torch.testing.assert_close(result, _expected(ex, rows), rtol=1e-5, atol=1e-6)
    assert stats["chunks_cut_for_decode"] > 0, stats  # the pacing's cut happened


def test_unknown_bulk_lane_is_a_configuration_error():
    with pytest.raises(ConfigurationError, match="bulk_lane"):
        SchedulerConfig(bulk_lane="sideways")


# ---- the policy side: a scheduler asked for one lane -------------------------------------------------


def _req(request_id, client, rows, cls, at=0.0, layer="l0"):
    return PendingRequest(request_id, client, layer, Op.FORWARD, rows, cls, at)


def _decoder_then_finetuning() -> tuple[Scheduler, float]:
    """A scheduler that has seen a decoder walk 4 layers for 6 tokens (1-row products of 0.1 ms,
    0.3 ms of its own work between calls) and 64-row fine-tuning products of layer l0, and now
    holds a 1000-row fine-tuning request for l0 while the decoder is active."""
    scheduler = Scheduler(SchedulerConfig(policy="immediate", min_chunk_rows=1))
    now, request_id = 0.0, 100
    for _ in range(6):
        for layer in range(4):
            scheduler.add(_req(request_id, "decoder", 1, LatencyClass.DECODE, now, f"l{layer}"))
            request_id += 1
            batch = scheduler.next_batch(now)
            now += 1e-4
            scheduler.batch_done(batch, 1e-4, now)
            now += 3e-4
        now += 5e-4
    for _ in range(3):
        scheduler.add(_req(request_id, "trainer", 64, LatencyClass.FINETUNE, now))
        request_id += 1
        batch = scheduler.next_batch(now, Lane.BULK)
        scheduler.batch_done(batch, 64e-5, now + 64e-5)
        now += 7e-4
    scheduler.add(_req(1, "trainer", 1000, LatencyClass.FINETUNE, now))
    return scheduler, now


def _slices(batch):
    return [(s.request_id, s.start, s.stop) for s in batch.slices]


def test_one_runner_cuts_bulk_rows_for_a_decoder_but_the_bulk_lane_takes_them_whole():
    shared, now = _decoder_then_finetuning()
    [(request_id, start, stop)] = _slices(shared.next_batch(now))
    assert (request_id, start) == (1, 0) and stop < 1000  # cut to the decoder's delay budget
    background, now = _decoder_then_finetuning()
    assert _slices(background.next_batch(now, Lane.BULK)) == [(1, 0, 1000)]  # the OS keeps it out of the way


def test_each_lane_gets_only_its_own_rows():
    scheduler, now = _decoder_then_finetuning()
    scheduler.add(_req(2, "decoder", 1, LatencyClass.DECODE, now))
    assert scheduler.next_wakeup(now, Lane.LATENCY) == now
    assert _slices(scheduler.next_batch(now, Lane.LATENCY)) == [(2, 0, 1)]  # the bulk rows stay out
    assert scheduler.next_batch(now, Lane.LATENCY) is None
    assert scheduler.next_wakeup(now, Lane.LATENCY) is None  # nothing of its lane pending
    assert _slices(scheduler.next_batch(now, Lane.BULK)) == [(1, 0, 1000)]
    assert scheduler.next_batch(now, Lane.BULK) is None


def test_a_latency_client_beside_bulk_clients_only_is_alone():
    scheduler, now = _decoder_then_finetuning()  # the trainer's 1000 rows are pending
    assert not scheduler.alone("decoder")  # one runner: the trainer's work could share its batch
    assert scheduler.alone("decoder", Lane.LATENCY)  # two runners: bulk work neither shares nor delays it
    assert not scheduler.alone("trainer", Lane.LATENCY)  # the decoder is a latency client
    scheduler.client_joined("newcomer")  # sent nothing yet: it may be a decoder
    assert not scheduler.alone("decoder", Lane.LATENCY)
    scheduler.client_left("newcomer")
    scheduler.add(_req(2, "decoder", 1, LatencyClass.DECODE, now))  # latency work pending (its own)
    assert not scheduler.alone("decoder", Lane.LATENCY)


def test_a_decoder_beside_a_running_bulk_product_takes_the_lone_client_path(path, monkeypatch):
    blocked = BlockedBulkProduct(monkeypatch)
    with symbiosis.BaseExecutor.from_pretrained(path, bulk_lane="background") as ex:
        (bulk, bulk_rows), (decode, _) = _start_bulk_then_decode(ex, blocked)
        try:
            decode.result(timeout=10)  # nothing of the latency lane pending now
            _wait_until_not(ex._engine, "_computing")
            rows = torch.randn(2, 64)
            before = ex.stats()["batches_run_by"]["alone"]
            result = ex._engine.call("decoder", LAYER, Op.FORWARD, rows, LatencyClass.DECODE, timeout_s=10)
            torch.testing.assert_close(result, _expected(ex, rows), rtol=1e-5, atol=1e-6)
            assert ex.stats()["batches_run_by"]["alone"] == before + 1
        finally:
            blocked.release.set()
        torch.testing.assert_close(bulk.result(timeout=10), _expected(ex, bulk_rows), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("device", "own_process", "lane"),
    [("cpu", True, "background"), ("cpu", False, "shared"), ("cuda", True, "shared"), ("cuda", False, "shared")],
)
def test_auto_is_background_only_for_a_cpu_executor_in_its_own_process(device, own_process, lane):
    assert resolve_bulk_lane(SchedulerConfig(), device, own_process).bulk_lane == lane
    chosen = SchedulerConfig(bulk_lane="background")
    assert resolve_bulk_lane(chosen, device, own_process) is chosen  # a choice is kept


def test_an_in_process_executor_keeps_one_runner_by_default(path):
    with symbiosis.BaseExecutor.from_pretrained(path) as ex:
        assert "bulk_thread" not in ex.stats()["batches_run_by"]
        assert ex._engine._bulk_threads == []


@pytest.mark.parametrize("policy", ["lockstep", "opportunistic"])
def test_the_bulk_lane_waits_for_no_one(policy):
    """Whether a waiting policy's wait for other clients pays depends on latency work the bulk
    runner does not see (and no one wakes it when that changes): its work is ready at once."""
    scheduler = Scheduler(SchedulerConfig(policy=policy, wait_rule="budget"))
    scheduler.client_joined("decoder")
    scheduler.add(_req(1, "trainer", 64, LatencyClass.FINETUNE, 0.0))
    assert scheduler.next_batch(0.0) is None  # one runner for both lanes: held for the decoder
    assert scheduler.next_wakeup(0.0, Lane.BULK) == 0.0
    assert _slices(scheduler.next_batch(0.0, Lane.BULK)) == [(1, 0, 64)]


def test_a_clients_next_bulk_request_does_not_jump_its_running_one(path, monkeypatch):
    """A lone fine-tuning client's request while its previous one is in the bulk thread's product:
    not computed at once beside it (on the lone-client path, at normal priority)."""
    blocked = BlockedBulkProduct(monkeypatch)
    with symbiosis.BaseExecutor.from_pretrained(path, policy="immediate", bulk_lane="background") as ex:
        rows = torch.randn(BULK_ROWS, 64)
        first = ex.submit("trainer", LAYER, Op.FORWARD, rows, LatencyClass.FINETUNE)
        assert blocked.started.wait(10)
        try:
            assert ex._engine.try_alone("trainer", LAYER, Op.FORWARD, rows, LatencyClass.FINETUNE) is None
        finally:
            blocked.release.set()
        first.result(timeout=10)
        _wait_until_not(ex._engine, "_bulk_computing")
        # ... and once it is done, the lone client's path is open again.
        result = ex._engine.try_alone("trainer", LAYER, Op.FORWARD, rows, LatencyClass.FINETUNE)
        torch.testing.assert_close(result, _expected(ex, rows), rtol=1e-5, atol=1e-6)


# ---- several bulk threads (``SchedulerConfig.bulk_threads``) --------------------------------------


def test_idle_bulk_threads_split_a_lone_bulk_batch_into_equal_parts():
    rows = 3 * SPLIT_MIN_ROWS
    scheduler = Scheduler(SchedulerConfig(policy="immediate"))
    scheduler.add(_req(1, "trainer", rows, LatencyClass.FINETUNE))
    assert _slices(scheduler.next_batch(0.0, Lane.BULK, share=2)) == [(1, 0, rows // 2)]
    # The thread that comes next, alone now: the rest whole.
    assert _slices(scheduler.next_batch(0.0, Lane.BULK, share=1)) == [(1, rows // 2, rows)]
    scheduler.add(_req(2, "trainer", rows, LatencyClass.FINETUNE))
    # Four idle threads, but rows for three parts of SPLIT_MIN_ROWS.
    assert _slices(scheduler.next_batch(0.0, Lane.BULK, share=4)) == [(2, 0, SPLIT_MIN_ROWS)]


@pytest.mark.parametrize(("rows", "share"), [(4 * SPLIT_MIN_ROWS, 1), (2 * SPLIT_MIN_ROWS - 1, 2)])
def test_a_bulk_batch_is_not_split_for_one_thread_or_into_parts_under_the_floor(rows, share):
    scheduler = Scheduler(SchedulerConfig(policy="immediate"))
    scheduler.add(_req(1, "trainer", rows, LatencyClass.FINETUNE))
    assert _slices(scheduler.next_batch(0.0, Lane.BULK, share=share)) == [(1, 0, rows)]


def test_bulk_work_in_two_groups_goes_whole_to_two_threads():
    scheduler = Scheduler(SchedulerConfig(policy="immediate"))
    scheduler.add(_req(1, "a", 100, LatencyClass.FINETUNE, layer="l0"))
    scheduler.add(_req(2, "b", 100, LatencyClass.FINETUNE, layer="l1"))
    first = _slices(scheduler.next_batch(0.0, Lane.BULK, share=2))
    second = _slices(scheduler.next_batch(0.0, Lane.BULK, share=1))
    assert sorted(first + second) == [(1, 0, 100), (2, 0, 100)]


class MeetingBulkProducts:
    """Stands in for ``run_batch``: each product of ``min_rows`` rows or more records its thread,
    that thread's torch thread count and its rows, then waits until ``parties`` such products are
    running at once (so the test fails, by the barrier's timeout, unless they run side by side)."""

    def __init__(self, monkeypatch, parties: int, min_rows: int = 32):
        self.seen: list[tuple[str, int, int]] = []
        barrier = threading.Barrier(parties, timeout=20)
        real = engine_module.run_batch

        def run_batch(layer, op, rows_list):
            rows = sum(r.shape[0] for r in rows_list)
            if rows >= min_rows:
                self.seen.append((threading.current_thread().name, torch.get_num_threads(), rows))
                barrier.wait()
            return real(layer, op, rows_list)

        monkeypatch.setattr(engine_module, "run_batch", run_batch)


def test_two_bulk_threads_split_a_lone_request_each_on_one_torch_thread(path, monkeypatch):
    meeting = MeetingBulkProducts(monkeypatch, parties=2)
    with symbiosis.BaseExecutor.from_pretrained(path, policy="immediate", bulk_lane="background", bulk_threads=2) as ex:
        assert ex.stats()["bulk_threads"] == 2
        rows = torch.randn(BULK_ROWS, 64, generator=torch.Generator().manual_seed(3))
        result = ex.submit("trainer", LAYER, Op.FORWARD, rows, LatencyClass.FINETUNE).result(timeout=30)
        # The halves' products (150 rows each, one torch thread) against the whole one in this
        # thread: float32 rounding may differ with the kernel's blocking, ~1e-7 relative.
        torch.testing.assert_close(result, _expected(ex, rows), rtol=1e-5, atol=1e-6)
    assert sorted(rows for _, _, rows in meeting.seen) == [BULK_ROWS // 2, BULK_ROWS // 2]
    assert len({name for name, _, _ in meeting.seen}) == 2
    assert [(name[:14], threads) for name, threads, _ in meeting.seen] == [("symbiosis-bulk", 1)] * 2, meeting.seen


def test_two_jobs_bulk_requests_run_side_by_side(path, monkeypatch):
    meeting = MeetingBulkProducts(monkeypatch, parties=2)
    other = "model.layers.1.self_attn.q_proj"
    with symbiosis.BaseExecutor.from_pretrained(path, policy="immediate", bulk_lane="background", bulk_threads=2) as ex:
        g = torch.Generator().manual_seed(4)
        a_rows, b_rows = torch.randn(40, 64, generator=g), torch.randn(40, 64, generator=g)
        a = ex.submit("job-a", LAYER, Op.FORWARD, a_rows, LatencyClass.FINETUNE)
        b = ex.submit("job-b", other, Op.BACKWARD, b_rows, LatencyClass.FINETUNE)
        torch.testing.assert_close(a.result(timeout=30), _expected(ex, a_rows), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b.result(timeout=30), b_rows @ ex.weights.layers[other].weight, rtol=1e-5, atol=1e-6)
    assert sorted(rows for _, _, rows in meeting.seen) == [40, 40]


def test_one_bulk_thread_runs_each_product_on_every_torch_thread(path, monkeypatch):
    meeting = MeetingBulkProducts(monkeypatch, parties=1)
    with symbiosis.BaseExecutor.from_pretrained(path, policy="immediate", bulk_lane="background", bulk_threads=1) as ex:
        rows = torch.randn(BULK_ROWS, 64)
        ex.submit("trainer", LAYER, Op.FORWARD, rows, LatencyClass.FINETUNE).result(timeout=30)
    assert [(threads, n) for _, threads, n in meeting.seen] == [(torch.get_num_threads(), BULK_ROWS)]


def test_bulk_threads_must_be_a_count():
    with pytest.raises(ConfigurationError, match="bulk_threads"):
        SchedulerConfig(bulk_threads=-1)


def test_bulk_threads_leave_other_threads_torch_thread_count_alone(path):
    """A bulk thread's one torch thread is its own: torch hands the count last set in any thread
    to threads that start later, so the engine sets its creator's back."""
    threads = torch.get_num_threads()
    seen = []
    with symbiosis.BaseExecutor.from_pretrained(path, bulk_lane="background", bulk_threads=2):
        later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        later.start()
        later.join()
    assert torch.get_num_threads() == threads and seen == [threads]


@pytest.fixture
def two_torch_threads():
    """This thread (the executor's creator) on two torch threads, whatever earlier tests left."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_lone_jobs_batch_uses_every_bulk_threads_core(path, monkeypatch, two_torch_threads):
    """One fine-tuning job, nothing else of the bulk lane waiting: its batch (too small to split)
    runs on the torch threads of every bulk thread, as with one bulk thread, not on one core."""
    meeting = MeetingBulkProducts(monkeypatch, parties=1)
    with symbiosis.BaseExecutor.from_pretrained(path, policy="immediate", bulk_lane="background", bulk_threads=2) as ex:
        rows = torch.randn(64, 64)
        result = ex.submit("trainer", LAYER, Op.FORWARD, rows, LatencyClass.FINETUNE).result(timeout=30)
        torch.testing.assert_close(result, _expected(ex, rows), rtol=1e-5, atol=1e-6)
    assert [(threads, n) for _, threads, n in meeting.seen] == [(2, 64)]


def test_active_clients_of_a_lane():
    scheduler = Scheduler(SchedulerConfig(policy="immediate"))
    scheduler.add(_req(1, "job-a", 64, LatencyClass.FINETUNE, 0.0))
    scheduler.add(_req(2, "job-b", 64, LatencyClass.FINETUNE, 0.0))
    scheduler.add(_req(3, "decoder", 1, LatencyClass.DECODE, 0.0))
    assert scheduler.active_clients(Lane.BULK, 0.5) == 2 and scheduler.active_clients(Lane.LATENCY, 0.5) == 1
    for _ in range(3):
        scheduler.next_batch(0.5)
    assert scheduler.active_clients(Lane.BULK, 0.9) == 2  # nothing pending, but recent
    assert scheduler.active_clients(Lane.BULK, 5.0) == 0  # gone quiet


def test_bulk_products_start_no_threads_after_startup(path, two_torch_threads):
    """The bulk threads start their OpenMP teams at the most threads they will use: a lone job's
    batch on every bulk thread's core, then jobs side by side, add no thread to the process (the
    soak test holds an executor to its idle thread count)."""

    def thread_count() -> int:
        return len(os.listdir("/proc/self/task"))

    with symbiosis.BaseExecutor.from_pretrained(path, policy="immediate", bulk_lane="background", bulk_threads=2) as ex:
        before = thread_count()
        rows = torch.randn(64, 64)
        for _ in range(3):
            ex.submit("trainer", LAYER, Op.FORWARD, rows, LatencyClass.FINETUNE).result(timeout=30)
        futures = [ex.submit(f"job-{i}", LAYER, Op.FORWARD, rows, LatencyClass.FINETUNE) for i in range(4)]
        for future in futures:
            future.result(timeout=30)
        assert thread_count() <= before  # (a thread of an earlier test may end meanwhile)


def test_bulk_threads_serve_rows_that_require_grad(path):
    """An in-process training client's rows require grad (``FrozenLinearFunction`` passes them as
    they are); a bulk thread runs with autograd on unless told otherwise, so a request split
    between the bulk threads once made its chunks' products require grad, the assembly into one
    output raised, the bulk thread died and the request was never answered (a fine-tuning
    client hung). Products on the executor's own threads never record autograd."""
    with symbiosis.BaseExecutor.from_pretrained(path, policy="immediate", bulk_lane="background") as ex:
        g = torch.Generator().manual_seed(2)
        ex.call("decoder", LAYER, Op.FORWARD, torch.randn(1, 64, generator=g), LatencyClass.DECODE)  # not alone
        for rows in (torch.randn(4 * SPLIT_MIN_ROWS, 64, generator=g, requires_grad=True),) * 3:
            for op in (Op.FORWARD, Op.BACKWARD):
                result = ex.call("trainer", LAYER, op, rows, LatencyClass.FINETUNE, timeout_s=10)
                assert not result.requires_grad
                layer, plain = ex.weights.layers[LAYER], rows.detach()
                expected = plain @ layer.weight.t() + layer.bias if op is Op.FORWARD else plain @ layer.weight
                torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-5)
        assert ex.stats()["batches_run_by"]["bulk_thread"] > 0
