"""The executor's engine: batching is exact, chunking is exact, nothing is kept between calls."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

import symbiosis
from symbiosis.errors import ProtocolError, ShapeError, UnknownLayerError
from symbiosis.vocabulary import LatencyClass, Op


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("qwen2")  # has biases on q/k/v


def _expected(executor, layer_id, op, rows):
    layer = executor.weights.layers[layer_id]
    if op == "forward":
        return rows @ layer.weight.t() + (layer.bias if layer.bias is not None else 0)
    if op == "backward":
        return rows @ layer.weight
    return rows @ layer.weight.t()


@pytest.mark.parametrize("policy", ["immediate", "lockstep", "opportunistic"])
@pytest.mark.parametrize("row_budget", [3, 4096])
def test_concurrent_requests_are_exact_under_every_policy(path, policy, row_budget):
    layer_id = "model.layers.0.self_attn.q_proj"
    with symbiosis.BaseExecutor.from_pretrained(
        path, policy=policy, row_budget=row_budget, lockstep_timeout_ms=5
    ) as ex:
        g = torch.Generator().manual_seed(0)
        jobs = [(op, torch.randn(n, 64, generator=g)) for n in (0, 1, 5, 17) for op in ("forward", "backward", "noise")]
        results = [None] * len(jobs)

        def run(i):
            op, rows = jobs[i]
            results[i] = ex.submit(f"c{i}", layer_id, Op(op), rows, LatencyClass.PREFILL).result(timeout=30)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for (op, rows), result in zip(jobs, results):
            assert result.shape == rows.shape
            # Close, not equal: a batched GEMM (other row count, rows at another offset, bias fused
            # by addmm) may sum the 64 products in another order. Outputs are ~N(0, 0.16) here
            # (weights std 0.02), so reordering moves them by ~sqrt(64)·eps·0.16 ≈ 1.5e-7;
            # atol=1e-6 and rtol=1e-5 allow that with margin, a wrong or misplaced row is off by ~0.2.
            torch.testing.assert_close(result, _expected(ex, layer_id, op, rows), rtol=1e-5, atol=1e-6)
        if row_budget == 3:
            assert ex.stats()["layers"][layer_id]["batches"] >= sum(rows.shape[0] for _, rows in jobs) // 3


def test_latency_products_are_timed_one_in_four_and_bulk_products_always(path):
    """A CPU clock is a system call: queued latency-only batches are timed for the cost model once
    in ``LATENCY_TIMING_EVERY``; bulk batches always (their time charges the bulk lane's credits)."""
    from symbiosis.executor.engine import LATENCY_TIMING_EVERY

    layer_id = "model.layers.0.self_attn.q_proj"
    with symbiosis.BaseExecutor.from_pretrained(path, policy="lockstep", lockstep_timeout_ms=0) as ex:
        engine = ex._engine
        reported = []
        batch_done = engine.scheduler.batch_done
        engine.scheduler.batch_done = lambda batch, duration_s, now_s: (
            reported.append((batch.latency_only, duration_s)),
            batch_done(batch, duration_s, now_s),
        )
        engine.attach_driver(lambda: None)  # this thread runs the batches (``run_ready``)
        for client in ("a", "b"):  # another client joined: lockstep queues every request
            engine.client_joined(client)
        rows = torch.randn(1, 64)
        classes = [LatencyClass.DECODE] * (2 * LATENCY_TIMING_EVERY) + [LatencyClass.FINETUNE] * 3
        for latency_class in classes:
            future = engine.submit("a", layer_id, Op.FORWARD, rows, latency_class, wake=False)
            engine.run_ready()
            torch.testing.assert_close(future.result(timeout=10), _expected(ex, layer_id, "forward", rows))
        assert ex.stats()["batches_run_by"]["driver"] == len(classes)
        assert [latency_only for latency_only, _ in reported] == [c is LatencyClass.DECODE for c in classes]
        timed = [duration_s is not None for _, duration_s in reported]
        assert timed == ([True] + [False] * (LATENCY_TIMING_EVERY - 1)) * 2 + [True] * 3


def test_threads_that_call_again_and_again_wait_on_their_own_condition_and_get_exact_results(path):
    """A calling thread keeps one condition for all its queued calls (``_caller_cv``): three
    threads calling 40 times each under lockstep (each call queued and woken by another thread's
    product, or running it) all finish, each result exact, each thread on one condition."""
    layer_id = "model.layers.0.self_attn.q_proj"
    with symbiosis.BaseExecutor.from_pretrained(path, policy="lockstep", lockstep_timeout_ms=2) as ex:
        engine = ex._engine
        conditions: dict[str, set[int]] = {}
        make = engine._caller_cv

        def recorded():
            cv = make()
            conditions.setdefault(threading.current_thread().name, set()).add(id(cv))
            return cv

        engine._caller_cv = recorded
        errors = []

        def client(name: str, seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            try:
                for _ in range(40):
                    rows = torch.randn(1 + seed, 64, generator=g)
                    result = ex.call(name, layer_id, Op.FORWARD, rows, LatencyClass.DECODE, 30.0)
                    torch.testing.assert_close(result, _expected(ex, layer_id, "forward", rows), rtol=1e-5, atol=1e-6)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=client, args=(f"c{i}", i), name=f"c{i}") for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not errors and not any(t.is_alive() for t in threads)
        assert conditions and all(len(ids) == 1 for ids in conditions.values())
        assert ex.stats()["batches_run_by"]["caller"] > 0


def test_executor_keeps_no_tensor_after_a_call(path):
    with symbiosis.BaseExecutor.from_pretrained(path) as ex:
        rows = torch.randn(4, 64)
        out = ex.run("model.layers.0.mlp.gate_proj", "forward", rows)
        ref_in, ref_out = weakref.ref(rows), weakref.ref(out)
        del rows, out
        gc.collect()
        assert ref_in() is None and ref_out() is None
        assert ex.stats()["inflight_requests"] == 0


def test_bad_requests_get_typed_errors(path):
    with symbiosis.BaseExecutor.from_pretrained(path) as ex:
        with pytest.raises(UnknownLayerError):
            ex.run("model.nope", "forward", torch.zeros(1, 64))
        with pytest.raises(ShapeError, match="width 64"):
            ex.run("model.layers.0.self_attn.q_proj", "forward", torch.zeros(1, 63))
        with pytest.raises(ShapeError):
            ex.run("model.layers.0.self_attn.q_proj", "forward", torch.zeros(64))
        with pytest.raises(ProtocolError, match="dtype"):
            ex.run("model.layers.0.self_attn.q_proj", "forward", torch.zeros(1, 64, dtype=torch.int64))
        # still serving
        assert ex.run("model.layers.0.self_attn.q_proj", "forward", torch.zeros(2, 64)).shape == (2, 64)


def test_closed_executor_refuses_new_work(path):
    ex = symbiosis.BaseExecutor.from_pretrained(path)
    ex.close()
    with pytest.raises(symbiosis.ExecutorUnavailableError):
        ex.run("model.layers.0.self_attn.q_proj", "forward", torch.zeros(1, 64))


def test_lockstep_waits_for_every_joined_client(path):
    """Two joined clients: the first request is held until the second arrives (or the timeout)."""
    layer_id = "model.layers.0.self_attn.q_proj"
    with symbiosis.BaseExecutor.from_pretrained(path, policy="lockstep", lockstep_timeout_ms=10_000) as ex:
        ex.register_client("a")
        ex.register_client("b")
        first = ex.submit("a", layer_id, Op.FORWARD, torch.ones(1, 64), LatencyClass.DECODE)
        with pytest.raises(TimeoutError):
            first.result(timeout=0.2)
        second = ex.submit("b", layer_id, Op.FORWARD, torch.ones(2, 64), LatencyClass.DECODE)
        assert first.result(timeout=5).shape == (1, 64) and second.result(timeout=5).shape == (2, 64)
        assert ex.stats()["layers"][layer_id]["batches"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_borrowed_rows_are_copied_before_submit_returns(path, dtype):
    """``submit(..., borrowed=True)``: the caller's buffer may be overwritten once it returns (a
    server's receive buffer); the product still sees the rows as they were -- kept as a clone, or
    as the cast to the executor's dtype, which is a copy already."""
    layer_id = "model.layers.0.self_attn.q_proj"
    with symbiosis.BaseExecutor.from_pretrained(path, dtype=dtype, policy="lockstep", lockstep_timeout_ms=10_000) as ex:
        ex.register_client("a")
        ex.register_client("b")
        buffer = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
        sent = buffer.clone()
        held = ex.submit("a", layer_id, Op.FORWARD, buffer, LatencyClass.DECODE, borrowed=True)  # waits for "b"
        buffer.fill_(1e3)  # the next message lands in the same buffer
        other = ex.submit("b", layer_id, Op.FORWARD, torch.ones(1, 64), LatencyClass.DECODE)
        result, _ = held.result(timeout=5), other.result(timeout=5)
        assert result.dtype == torch.float32  # cast back to the rows' dtype
        expected = _expected(ex, layer_id, "forward", sent.to(dtype)).float()
        torch.testing.assert_close(result, expected, rtol=2e-2 if dtype is torch.bfloat16 else 1e-5, atol=1e-3)


class _Sink:
    """A ``ResultSink`` (``executor/engine.py``) that records what it was given."""

    def __init__(self, takes_views: bool) -> None:
        self.takes_views = takes_views
        self.results: list[torch.Tensor] = []
        self.errors: list[BaseException] = []
        self.filled = threading.Event()

    def done(self) -> bool:
        return self.filled.is_set()

    def set_result(self, result: torch.Tensor) -> None:
        self.results.append(result)
        self.filled.set()

    def set_exception(self, error: BaseException) -> None:
        self.errors.append(error)
        self.filled.set()


def test_a_sink_gets_its_result_once_and_a_view_only_if_it_takes_views(path):
    """``submit(..., sink=)``: the result goes to the sink, not a new future; a sink that copies
    its result out at once (a transport's reply) gets its rows of the shared batch output, any
    other its own tensor (a view would pin the batch and be a view to autograd)."""
    layer_id = "model.layers.0.self_attn.q_proj"
    with symbiosis.BaseExecutor.from_pretrained(path, policy="lockstep", lockstep_timeout_ms=10_000) as ex:
        ex.register_client("a")
        ex.register_client("b")
        g = torch.Generator().manual_seed(3)
        rows_a, rows_b = torch.randn(2, 64, generator=g), torch.randn(3, 64, generator=g)
        viewer, owner = _Sink(takes_views=True), _Sink(takes_views=False)
        assert ex.submit("a", layer_id, Op.FORWARD, rows_a, LatencyClass.DECODE, sink=viewer) is viewer
        ex.submit("b", layer_id, Op.FORWARD, rows_b, LatencyClass.DECODE, sink=owner)
        assert viewer.filled.wait(5) and owner.filled.wait(5)
        assert ex.stats()["layers"][layer_id]["batches"] == 1  # one product for both
        assert len(viewer.results) == len(owner.results) == 1 and not viewer.errors and not owner.errors
        torch.testing.assert_close(viewer.results[0], _expected(ex, layer_id, "forward", rows_a), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(owner.results[0], _expected(ex, layer_id, "forward", rows_b), rtol=1e-5, atol=1e-6)
        batch_numel = (2 + 3) * 64
        assert viewer.results[0].untyped_storage().nbytes() == batch_numel * 4  # the batch's output
        assert owner.results[0].untyped_storage().nbytes() == 3 * 64 * 4  # a copy of its own rows


def test_a_leaving_clients_sink_gets_the_error(path):
    layer_id = "model.layers.0.self_attn.q_proj"
    with symbiosis.BaseExecutor.from_pretrained(path, policy="lockstep", lockstep_timeout_ms=10_000) as ex:
        ex.register_client("a")
        ex.register_client("b")
        sink = _Sink(takes_views=True)
        ex.submit("a", layer_id, Op.FORWARD, torch.ones(1, 64), LatencyClass.DECODE, sink=sink)
        ex.unregister_client("a")
        assert sink.filled.wait(5) and not sink.results
        assert [type(e) for e in sink.errors] == [symbiosis.ExecutorUnavailableError]
        assert ex.stats()["inflight_requests"] == 0


def test_leaving_client_drops_its_pending_work(path):
    layer_id = "model.layers.0.self_attn.q_proj"
    with symbiosis.BaseExecutor.from_pretrained(path, policy="lockstep", lockstep_timeout_ms=10_000) as ex:
        ex.register_client("a")
        ex.register_client("b")
        pending = ex.submit("a", layer_id, Op.FORWARD, torch.ones(1, 64), LatencyClass.DECODE)
        ex.unregister_client("a")
        with pytest.raises(symbiosis.ExecutorUnavailableError):
            pending.result(timeout=5)
        assert ex.stats()["inflight_requests"] == 0


@pytest.mark.parametrize(
    "options, at_once",
    [
        ({"policy": "immediate"}, True),
        ({"policy": "opportunistic", "wait_rule": "none"}, True),
        ({"policy": "lockstep", "lockstep_timeout_ms": 1.0}, False),  # holds every call for the other client
    ],
    ids=["immediate", "none", "lockstep"],
)
def test_a_request_no_rule_would_hold_is_served_at_once_beside_an_active_client_and_exactly(path, options, at_once):
    """Two clients calling one after the other, nothing pending at each call: where the rule in
    force would hold the request for no one, the engine serves it in the caller's thread without
    the queue (``Scheduler.serves_at_once``; which rules allow it: tests/test_scheduler_at_once.py),
    with the same result as the queue gives."""
    from symbiosis.executor.engine import ExecutionEngine
    from symbiosis.executor.scheduler import Scheduler, SchedulerConfig

    layer_id = "model.layers.0.self_attn.q_proj"
    with symbiosis.BaseExecutor.from_pretrained(path) as ex:
        engine = ExecutionEngine(ex.weights, Scheduler(SchedulerConfig(**options)))
        try:
            engine.client_joined("a")
            engine.client_joined("b")
            rows = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
            results = [engine.call(c, layer_id, Op.FORWARD, rows, LatencyClass.DECODE, 5.0) for c in ("b", "a", "b")]
            paths = dict(engine.stats()["batches_run_by"])
        finally:
            engine.close()
    for result in results:
        torch.testing.assert_close(result, _expected(ex, layer_id, "forward", rows), rtol=1e-5, atol=1e-6)
    assert (paths["alone"], paths["caller"]) == ((3, 0) if at_once else (0, 3))


def test_an_executor_on_a_cpu_tells_its_scheduler_that_its_products_take_the_clients_cores(path):
    """On a CPU the decoders' free time is not free (their own work needs the cores a bulk
    product takes), so with a target the scheduler counts it at the feedback's share; an executor
    on an accelerator leaves it whole (``Scheduler.products_share_client_cores``; tests/test_cuda.py)."""
    with symbiosis.BaseExecutor.from_pretrained(path) as ex:
        assert ex._engine.scheduler.products_share_client_cores


def test_a_product_served_alone_wakes_only_a_caller_that_waits_for_it_to_end(path):
    """A product served alone (``try_alone``) leaves the queue as it was, so a caller waiting for a
    time its last plan gave has nothing new to plan for; only one that found the engine computing
    and waits for the product to end is woken. (Beside a flood held by its pacing, a flood thread
    woken after each of a decoder's products, to plan for nothing, doubled the decoder's token
    time in process.) A product from the queue wakes a waiting caller as before."""
    with symbiosis.BaseExecutor.from_pretrained(path) as ex:
        engine = ex._engine
        woken = []
        engine._wake_a_runner = lambda: woken.append(True)
        with engine._cond:
            engine._callers_waiting = 1  # one caller waits for the time its plan gave
            try:
                engine._computing = True
                engine._computing_done(queue_changed=False)
                assert woken == []
                engine._callers_blocked = 1  # ... and one for the product to end
                engine._computing = True
                engine._computing_done(queue_changed=False)
                assert woken == [True]
                engine._callers_blocked = 0
                engine._computing = True
                engine._computing_done()  # from the queue
                assert woken == [True, True]
            finally:
                engine._callers_waiting = engine._callers_blocked = 0
