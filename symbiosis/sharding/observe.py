"""Figures of a sharded executor, summed over its ranks (``ShardedExecutor.stats``/``health``)."""

from __future__ import annotations

from collections.abc import Iterable


def merge_layers(per_shard: Iterable[dict]) -> dict:
    """Per-layer counters (``ExecutionEngine.stats()["layers"]``) summed over shards; the means
    weighted by what they are means of."""
    totals: dict[str, dict[str, float]] = {}
    for layers in per_shard:
        for layer_id, c in layers.items():
            t = totals.setdefault(
                layer_id, dict.fromkeys(("requests", "rows", "batches", "errors", "batch_rows", "wait", "latency"), 0.0)
            )
            t["requests"] += c["requests"]
            t["rows"] += c["rows"]
            t["batches"] += c["batches"]
            t["errors"] += c["errors"]
            t["batch_rows"] += c["mean_rows_per_batch"] * c["batches"]
            t["wait"] += c["mean_queue_wait_ms"] * c["requests"]
            t["latency"] += c["mean_latency_ms"] * c["requests"]
    return {
        layer_id: {
            "requests": int(t["requests"]),
            "rows": int(t["rows"]),
            "batches": int(t["batches"]),
            "mean_rows_per_batch": t["batch_rows"] / t["batches"] if t["batches"] else 0.0,
            "errors": int(t["errors"]),
            "mean_queue_wait_ms": t["wait"] / t["requests"] if t["requests"] else 0.0,
            "mean_latency_ms": t["latency"] / t["requests"] if t["requests"] else 0.0,
        }
        for layer_id, t in totals.items()
    }


def health_of(shards: list[dict], strategy: str, device: str) -> dict:
    """``/health`` of a sharded executor from every rank's stats: status ``ok`` only when all are up."""
    listed = [s["shard"] | {"inflight_requests": s.get("inflight_requests")} for s in shards]
    return {
        "status": "ok" if all(s["up"] for s in listed) else "unavailable",
        "strategy": strategy,
        "world_size": len(listed),
        "device": device,
        "shards": listed,
    }
