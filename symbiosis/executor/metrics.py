"""Prometheus ``/metrics``, a ``/health`` endpoint and ``/stats`` (JSON) for a running executor.

A custom collector reads ``executor.stats()`` at scrape time, so the executor's hot path keeps
plain counters and pays nothing for observability. Served by the standard library's HTTP
server on a background thread; binds loopback unless told otherwise.

Why not ``prometheus_client.start_http_server``: like ``ThreadingHTTPServer`` it starts one thread
per connection with no read timeout, so clients that open connections and never finish a request
pile up threads without bound. Here at most ``max_handlers`` connections are served at once, their
reads and writes time out after ``request_timeout_s``, and further connections are closed at once.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from symbiosis.errors import BindError
from symbiosis.vocabulary import module_list_of

log = logging.getLogger(__name__)


def per_label(layers: dict[str, dict]) -> dict[str, dict]:
    """Per-layer counters (``executor.stats()["layers"]``) by metric label: a layer's id, except that
    the members of a module list -- an MoE's experts, ``experts.gate_up_proj.3`` -- count under the
    list's name (``experts.gate_up_proj``): a label per expert would make a 128-expert model's
    scrape ~86,000 series. ``/stats`` keeps each layer."""
    totals: dict[str, dict] = {}
    for layer, counters in layers.items():
        label = module_list_of(layer) or layer
        total = totals.setdefault(label, dict.fromkeys(("requests", "rows", "batches", "errors"), 0))
        for key in ("requests", "rows", "batches", "errors"):
            total[key] += counters[key]
        # the means, weighted as they were taken: rows per batch, times per request
        total["batch_rows"] = total.get("batch_rows", 0.0) + counters["mean_rows_per_batch"] * counters["batches"]
        for key in ("mean_latency_ms", "mean_queue_wait_ms"):
            total[key] = total.get(key, 0.0) + counters[key] * counters["requests"]
    for total in totals.values():
        total["mean_rows_per_batch"] = total.pop("batch_rows") / total["batches"] if total["batches"] else 0.0
        for key in ("mean_latency_ms", "mean_queue_wait_ms"):
            total[key] = total[key] / total["requests"] if total["requests"] else 0.0
    return totals


class ExecutorCollector:
    """Turns ``executor.stats()`` into Prometheus metric families."""

    def __init__(self, executor):
        self.executor = executor

    def collect(self):
        stats = self.executor.stats()
        requests = CounterMetricFamily("symbiosis_requests", "Requests served, per base layer", labels=["layer"])
        rows = CounterMetricFamily("symbiosis_rows", "Rows (tokens) served, per base layer", labels=["layer"])
        batches = CounterMetricFamily("symbiosis_batches", "Matrix products run, per base layer", labels=["layer"])
        errors = CounterMetricFamily("symbiosis_errors", "Failed batches, per base layer", labels=["layer"])
        rows_per_batch = GaugeMetricFamily("symbiosis_mean_rows_per_batch", "Mean rows per batch", labels=["layer"])
        latency = GaugeMetricFamily(
            "symbiosis_mean_latency_ms", "Mean time from submit to result (ms)", labels=["layer"]
        )
        queue_wait = GaugeMetricFamily(
            "symbiosis_mean_queue_wait_ms", "Mean time from submit to first product (ms)", labels=["layer"]
        )
        for layer, counters in per_label(stats["layers"]).items():
            requests.add_metric([layer], counters["requests"])
            rows.add_metric([layer], counters["rows"])
            batches.add_metric([layer], counters["batches"])
            errors.add_metric([layer], counters["errors"])
            rows_per_batch.add_metric([layer], counters["mean_rows_per_batch"])
            latency.add_metric([layer], counters["mean_latency_ms"])
            queue_wait.add_metric([layer], counters["mean_queue_wait_ms"])
        yield from (requests, rows, batches, errors, rows_per_batch, latency, queue_wait)
        yield GaugeMetricFamily(
            "symbiosis_inflight_requests", "Requests not yet answered", value=stats["inflight_requests"]
        )
        yield GaugeMetricFamily(
            "symbiosis_weights_bytes", "Bytes of base-layer weights held", value=stats["weights_bytes"]
        )
        yield GaugeMetricFamily(
            "symbiosis_joined_clients", "Clients connected", value=stats["scheduler"]["joined_clients"]
        )
        yield from scheduler_metrics(stats["scheduler"])
        if "shards" in stats:  # a sharded executor (symbiosis/sharding): one series per rank
            up = GaugeMetricFamily("symbiosis_shard_up", "1 while the shard answers, else 0", labels=["shard"])
            held = GaugeMetricFamily(
                "symbiosis_shard_weights_bytes", "Bytes of base-layer weights the shard keeps", labels=["shard"]
            )
            inflight = GaugeMetricFamily(
                "symbiosis_shard_inflight_requests", "Requests not yet answered, per shard", labels=["shard"]
            )
            for shard in stats["shards"]:
                label = [str(shard["shard"]["rank"])]
                up.add_metric(label, 1.0 if shard["shard"]["up"] else 0.0)
                held.add_metric(label, shard.get("weights_bytes", 0))
                inflight.add_metric(label, shard.get("inflight_requests", 0))
            yield from (up, held, inflight)


def scheduler_metrics(scheduler: dict):
    """What the scheduler decides, from its ``stats()``: which waiting rule is in force (the
    opportunistic policy tries three and keeps the best, ``wait_tuner.py``), why batches were
    released, what waits, and how the decode guard paces bulk work. A sharded executor reports the
    scheduler of the rank that serves the clients (the other ranks batch what it relays to them).
    Keys a stats dict lacks are skipped."""
    rule = scheduler.get("wait_rule") or {}
    if "rule" in rule:
        in_force = GaugeMetricFamily(
            "symbiosis_wait_rule", "1 for the waiting rule in force now (a trial or the chosen one)", labels=["rule"]
        )
        rules = set(rule.get("trials", {})) | {rule["rule"]}
        for name in sorted(rules):
            in_force.add_metric([name], 1.0 if name == rule["rule"] else 0.0)
        yield in_force
    if rule.get("trials"):
        chosen = GaugeMetricFamily(
            "symbiosis_wait_rule_chosen",
            "1 for the rule the adaptive tuner uses between its trials (all 0 during its first trials)",
            labels=["rule"],
        )
        trials = CounterMetricFamily(
            "symbiosis_wait_rule_epochs", "Tuner epochs counted under each rule", labels=["rule"]
        )
        for name, count in sorted(rule["trials"].items()):
            chosen.add_metric([name], 1.0 if name == rule.get("chosen") else 0.0)
            trials.add_metric([name], count)
        yield from (chosen, trials)
        yield CounterMetricFamily(
            "symbiosis_wait_rule_resets", "Times the tuner started over for a new set of clients", value=rule["resets"]
        )
    if "ready_reasons" in scheduler:
        reasons = CounterMetricFamily(
            "symbiosis_batches_ready", "Batches released, by why their group was ready", labels=["reason"]
        )
        for reason, count in sorted(scheduler["ready_reasons"].items()):
            reasons.add_metric([reason], count)
        yield reasons
    if "pending_requests" in scheduler:
        pending = GaugeMetricFamily(
            "symbiosis_pending_requests", "Requests waiting, by latency class", labels=["latency_class"]
        )
        pending_rows = GaugeMetricFamily(
            "symbiosis_pending_rows", "Rows waiting, by latency class", labels=["latency_class"]
        )
        for cls, count in sorted(scheduler["pending_requests"].items()):
            pending.add_metric([cls], count)
            pending_rows.add_metric([cls], scheduler.get("pending_rows", {}).get(cls, 0))
        yield from (pending, pending_rows)
    if "chunks_cut_for_decode" in scheduler:
        yield CounterMetricFamily(
            "symbiosis_chunks_cut_for_decode",
            "Bulk products cut short so that a decoder does not wait behind them",
            value=scheduler["chunks_cut_for_decode"],
        )
    if "bulk_batches_in_free_time" in scheduler:
        yield CounterMetricFamily(
            "symbiosis_bulk_batches_in_free_time",
            "Bulk products run, with their paced share spent, in the time before the decoders' next calls were due",
            value=scheduler["bulk_batches_in_free_time"],
        )
    guard = scheduler.get("decode_guard")
    if guard:
        yield GaugeMetricFamily("symbiosis_decoders_tracked", "Clients seen decoding", value=guard["decoders_tracked"])
        yield GaugeMetricFamily(
            "symbiosis_bulk_share_ratio",
            "Share of time bulk work may use while clients decode (paced by --decode-slo-ms; 1 without)",
            value=guard["bulk_share"],
        )
        yield GaugeMetricFamily(
            "symbiosis_backlog_share_ratio",
            "Share of time a client with a backlog (a flood) may use while others decode",
            value=guard["backlog_share"],
        )
        yield CounterMetricFamily(
            "symbiosis_decode_tokens", "Decoded tokens timed by the decode guard", value=guard["token_samples"]
        )
        yield CounterMetricFamily(
            "symbiosis_decode_tokens_over_slo",
            "Timed tokens over --decode-slo-ms (0 without a target)",
            value=guard["token_samples_over_slo"],
        )


def _peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _BoundedHTTPServer(ThreadingHTTPServer):
    """A ``ThreadingHTTPServer`` with at most ``max_handlers`` handler threads alive at once.

    A connection that arrives while all are busy is closed unanswered: a scraper retries at its
    next interval, and the accept loop never blocks (so ``shutdown`` stays prompt).
    """

    # socketserver's default backlog of 5 makes the kernel drop the connections of a burst (their
    # SYNs are retried a second later); a deeper one lets them be accepted, and shed, at once.
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_handlers: int):
        self._slots = threading.BoundedSemaphore(max_handlers)
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts the handler thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        # A peer that timed out or went away is routine for a metrics port; no traceback on stderr.
        log.debug("metrics request from %s failed: %r", client_address, sys.exc_info()[1])


class MetricsServer:
    """``GET /metrics`` (Prometheus text format) and ``GET /health`` (JSON) on ``host:port``.

    At most ``max_handlers`` connections are served at once (one thread each); every read and write
    of a connection times out after ``request_timeout_s``, so a client that sends nothing more
    holds its thread that long at most.
    """

    def __init__(
        self, executor, port: int, host: str = "127.0.0.1", *, max_handlers: int = 8, request_timeout_s: float = 5.0
    ):
        registry = CollectorRegistry()
        registry.register(ExecutorCollector(executor))

        class Handler(BaseHTTPRequestHandler):
            timeout = request_timeout_s  # socket timeout of each read and write (StreamRequestHandler)

            def do_GET(self):  # http.server's naming
                if self.path.startswith("/metrics"):
                    body, ctype, status = generate_latest(registry), CONTENT_TYPE_LATEST, 200
                elif self.path.startswith("/stats"):
                    # The whole stats() as JSON, for tools that start an executor process
                    # (symbiosis/executor/process.py), plus this process's peak RSS.
                    payload = dict(executor.stats(), peak_rss_bytes=_peak_rss_bytes())
                    body, ctype, status = json.dumps(payload, default=str).encode(), "application/json", 200
                elif self.path.startswith("/health"):
                    payload = executor.health()  # a sharded executor reports every shard
                    status = 200 if payload["status"] == "ok" else 503
                    body, ctype = json.dumps(payload, default=str).encode(), "application/json"
                else:
                    body, ctype, status = b"not found; try /metrics, /health or /stats\n", "text/plain", 404
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # scrapes are not news
                pass

        try:
            self._server = _BoundedHTTPServer((host, port), Handler, max_handlers)
        except (OSError, OverflowError) as exc:  # the port is taken, not ours to take, or no port (socket's Overflow)
            raise BindError(f"cannot serve metrics at {host}:{port}: {getattr(exc, 'strerror', None) or exc}") from None
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="symbiosis-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
