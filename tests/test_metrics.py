"""Observability: executor.stats(), Prometheus /metrics and /health."""

from __future__ import annotations

import json
import urllib.request

import torch

import symbiosis
from symbiosis.executor.metrics import MetricsServer


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
