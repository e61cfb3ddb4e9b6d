"""Prometheus metrics of the API server, under the names vLLM dashboards already chart.

Each metric is vLLM's name with a ``symbiosis:`` prefix instead of ``vllm:``. The engine reports
through :class:`~symbiosis.serving.engine.EngineHooks`; this class implements those hooks.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from symbiosis.serving.engine import EngineHooks

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


class ServingMetrics(EngineHooks):
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("symbiosis:num_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("symbiosis:num_requests_waiting", "Requests waiting to be admitted", registry=r)
        self.cache_bytes = Gauge("symbiosis:kv_cache_bytes", "Bytes of the running batch's KV cache", registry=r)
        self.adapters_loaded = Gauge("symbiosis:lora_adapters_loaded", "LoRA adapters held in memory", registry=r)
        self.ttft = Histogram(
            "symbiosis:time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "symbiosis:inter_token_latency_seconds",
            "Time between two tokens of a sequence",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "symbiosis:e2e_request_latency_seconds", "Arrival to last token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.generation_tokens = Counter("symbiosis:generation_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("symbiosis:prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.finished_requests = Counter(
            "symbiosis:request_success", "Sequences finished, by reason", ["finished_reason"], registry=r
        )
        self.model_name = model_name
        self.sequences_in_flight = 0  # running + waiting at the engine's last report (read on shutdown)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- EngineHooks ------------------------------------------------------------------------------

    def queue_changed(self, running: int, waiting: int, cache_bytes: int, adapters_loaded: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.sequences_in_flight = running + waiting
        self.cache_bytes.set(cache_bytes)
        self.adapters_loaded.set(adapters_loaded)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def finished(self, seconds: float, prompt_tokens: int, completion_tokens: int, reason: str) -> None:
        self.e2e.observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.finished_requests.labels(reason).inc()
