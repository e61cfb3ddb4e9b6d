"""Observability: executor.stats(), Prometheus /metrics and /health."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
import torch

import symbiosis
from symbiosis.executor.metrics import MetricsServer, per_label, scheduler_metrics
from symbiosis.executor.requests import PendingRequest
from symbiosis.executor.scheduler import Scheduler, SchedulerConfig
from symbiosis.vocabulary import LatencyClass, Op


def test_stats_and_endpoints(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    with symbiosis.BaseExecutor.from_pretrained(path, policy="immediate", row_budget=64) as ex:
        layer = "model.layers.0.self_attn.q_proj"
        ex.run(layer, "forward", torch.randn(3, 64))
        ex.run(layer, "backward", torch.randn(2, 64))
        stats = ex.stats()
        counters = stats["layers"][layer]
        assert counters["requests"] == 2 and counters["rows"] == 5 and counters["batches"] == 2
        assert counters["mean_rows_per_batch"] == 2.5 and counters["errors"] == 0
        assert counters["mean_queue_wait_ms"] >= 0 and counters["mean_latency_ms"] >= counters["mean_queue_wait_ms"]
        assert stats["config"]["policy"] == "immediate" and stats["config"]["row_budget"] == 64
        metrics = MetricsServer(ex, port=0)
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics", timeout=5).read().decode()
            assert f'symbiosis_requests_total{{layer="{layer}"}} 2.0' in text
            assert f'symbiosis_rows_total{{layer="{layer}"}} 5.0' in text
            assert "symbiosis_weights_bytes" in text
            health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/health", timeout=5).read())
            assert health["status"] == "ok"
        finally:
            metrics.close()


def test_an_moes_experts_count_under_their_tensors_label_and_means_keep_their_weights():
    def layer(requests, rows, batches, latency_ms, queue_ms):
        means = {"mean_rows_per_batch": rows / batches, "mean_latency_ms": latency_ms, "mean_queue_wait_ms": queue_ms}
        return {"requests": requests, "rows": rows, "batches": batches, "errors": 0, **means}

    labels = per_label({
        "m.layers.0.mlp.experts.gate_up_proj.0": layer(1, 2, 1, 10.0, 1.0),
        "m.layers.0.mlp.experts.gate_up_proj.7": layer(3, 6, 2, 2.0, 1.0),
        "m.layers.0.self_attn.q_proj": layer(4, 8, 4, 1.0, 0.5),
    })  # fmt: skip
    assert sorted(labels) == ["m.layers.0.mlp.experts.gate_up_proj", "m.layers.0.self_attn.q_proj"]
    experts = labels["m.layers.0.mlp.experts.gate_up_proj"]
    assert (experts["requests"], experts["rows"], experts["batches"]) == (4, 8, 3)
    assert experts["mean_rows_per_batch"] == pytest.approx(8 / 3)
    assert experts["mean_latency_ms"] == pytest.approx((10.0 + 3 * 2.0) / 4) and experts["mean_queue_wait_ms"] == 1.0
    assert labels["m.layers.0.self_attn.q_proj"]["mean_rows_per_batch"] == 2.0


def test_metrics_say_what_the_scheduler_decides(tiny_checkpoint):
    """Which waiting rule is in force (the opportunistic policy's tuner tries three), why batches
    were released, what waits, and how the decode guard paces bulk work: from ``stats()``."""
    path = tiny_checkpoint("llama")
    layer = "model.layers.0.self_attn.q_proj"
    for policy in ("opportunistic", "lockstep"):
        with symbiosis.BaseExecutor.from_pretrained(path, policy=policy) as ex:
            for _ in range(3):
                ex.run(layer, "forward", torch.randn(2, 64))
            scheduler = ex.stats()["scheduler"]
            metrics = MetricsServer(ex, port=0)
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics", timeout=5).read().decode()
            finally:
                metrics.close()
        lines = set(text.splitlines())
        rule = scheduler["wait_rule"]["rule"]
        assert f'symbiosis_wait_rule{{rule="{rule}"}} 1.0' in lines
        if policy == "opportunistic":
            assert rule == "none"  # the tuner's first trial: not waiting
            for name in ("none", "predicted", "convoy"):
                assert f'symbiosis_wait_rule_chosen{{rule="{name}"}} 0.0' in lines  # no choice before the trials
                assert f'symbiosis_wait_rule_epochs_total{{rule="{name}"}} 0.0' in lines
            assert "symbiosis_wait_rule_resets_total 0.0" in lines
        else:
            assert rule == "lockstep" and not any(line.startswith("symbiosis_wait_rule_chosen") for line in lines)
        for reason, count in scheduler["ready_reasons"].items():
            assert f'symbiosis_batches_ready_total{{reason="{reason}"}} {float(count)}' in lines
        # The lone caller's products ran at once, past the scheduler's queue: counted all the same.
        assert sum(scheduler["ready_reasons"].values()) == scheduler["batches"] == 3
        assert 'symbiosis_pending_requests{latency_class="decode"} 0.0' in lines
        assert 'symbiosis_pending_rows{latency_class="finetune"} 0.0' in lines
        assert "symbiosis_chunks_cut_for_decode_total 0.0" in lines
        assert "symbiosis_bulk_batches_in_free_time_total 0.0" in lines
        assert "symbiosis_bulk_share_ratio 1.0" in lines and "symbiosis_backlog_share_ratio 1.0" in lines
        assert "symbiosis_decode_tokens_over_slo_total 0.0" in lines
        assert f"symbiosis_decoders_tracked {float(scheduler['decode_guard']['decoders_tracked'])}" in lines


def test_scheduler_metrics_count_what_was_served():
    scheduler = Scheduler(SchedulerConfig(policy="opportunistic"))
    scheduler.client_joined("a")
    scheduler.client_joined("b")
    scheduler.add(PendingRequest(1, "a", "l0", Op.FORWARD, 3, LatencyClass.DECODE, 0.0))
    scheduler.add(PendingRequest(2, "b", "l0", Op.FORWARD, 5, LatencyClass.FINETUNE, 0.0))
    scheduler.add(PendingRequest(3, "b", "l1", Op.FORWARD, 7, LatencyClass.FINETUNE, 0.0))
    batch = scheduler.next_batch(0.0)
    assert batch is not None
    samples = {
        (family.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in scheduler_metrics(scheduler.stats())
        for sample in family.samples
    }
    stats = scheduler.stats()
    released = {reason: count for reason, count in stats["ready_reasons"].items() if count}
    assert sum(released.values()) == 1  # one batch released, for the reason the scheduler gives
    for reason, count in released.items():
        assert samples[("symbiosis_batches_ready", (("reason", reason),))] == count
    waiting = stats["pending_requests"]
    assert sum(waiting.values()) >= 1  # the other layer's request still waits
    for cls, count in waiting.items():
        assert samples[("symbiosis_pending_requests", (("latency_class", cls),))] == count
        assert samples[("symbiosis_pending_rows", (("latency_class", cls),))] == stats["pending_rows"][cls]
    assert samples[("symbiosis_wait_rule", (("rule", "none"),))] == 1.0


def test_health_says_when_the_executor_stops_serving(tiny_checkpoint, monkeypatch):
    """Before, a single executor's /health said "ok" whatever happened: a product that never
    ended, a server whose socket thread stopped, a closing executor. Each now answers 503 with
    its status and reason, so a monitor restarts it as it would a dead one."""
    import threading

    import symbiosis.executor.executor as executor_module

    monkeypatch.setattr(executor_module, "HEALTH_STALL_S", 0.3)
    layer = "model.layers.0.self_attn.q_proj"
    release = threading.Event()
    with symbiosis.BaseExecutor.from_pretrained(tiny_checkpoint("llama"), policy="immediate") as ex:
        compute = ex._engine._compute

        def never_ending_until_released(*args, **kwargs):
            release.wait(30)
            return compute(*args, **kwargs)

        monkeypatch.setattr(ex._engine, "_compute", never_ending_until_released)
        metrics = MetricsServer(ex, port=0)
        url = f"http://127.0.0.1:{metrics.port}/health"
        try:
            assert ex.health()["status"] == "ok"
            ex.register_client("a")
            ex.register_client("b")  # two clients: the request is queued, not served alone in this thread
            stuck = ex.submit("a", layer, Op.FORWARD, torch.randn(2, 64), LatencyClass.DECODE)
            deadline = time.monotonic() + 10
            while ex.health()["status"] == "ok":
                assert time.monotonic() < deadline, ex.health()
                time.sleep(0.02)
            with pytest.raises(urllib.error.HTTPError) as answered:
                urllib.request.urlopen(url, timeout=5)
            health = json.loads(answered.value.read())
            assert answered.value.code == 503 and health["status"] == "stalled" and "waited" in health["reason"]
            release.set()
            stuck.result(timeout=10)
            assert ex.health()["status"] == "ok"

            server = ex.serve("tcp://127.0.0.1:0")
            assert ex.health()["status"] == "ok"
            server.close()  # its socket thread stops; the executor still lists it
            health = ex.health()
            assert health["status"] == "unavailable" and server.address in health["reason"]
        finally:
            release.set()
            metrics.close()
    assert ex.health()["status"] == "stopping"
