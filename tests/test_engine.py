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
