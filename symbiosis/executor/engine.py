"""Mechanism: receive requests, ask the scheduler what to run, run it, complete the futures.

One compute thread owns the matrix products; callers (in-process client threads or a transport
server) only enqueue. The scheduler decides *what* and *when* (pure policy, see
``scheduler.py``); this module does the bookkeeping around it: casting at the boundary, gathering
row slices, reassembling chunked requests, and failing a batch without failing the executor.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from symbiosis.errors import ExecutorUnavailableError, ProtocolError, ShapeError, SymbiosisError, UnknownLayerError
from symbiosis.executor.requests import Batch, PendingRequest
from symbiosis.executor.runner import run_batch
from symbiosis.executor.scheduler import Scheduler
from symbiosis.executor.weights import BaseModelWeights
from symbiosis.vocabulary import LatencyClass, Op

ALLOWED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class _Inflight:
    """A request between submit and completion (the only per-request state the executor has)."""

    rows: torch.Tensor  # input rows, already in the executor's dtype and device
    future: Future
    out_dtype: torch.dtype
    out_device: torch.device
    submitted_s: float
    output: torch.Tensor | None = None  # only for requests served in several chunks
    rows_done: int = 0
    started: bool = False  # its first rows reached a matrix product


@dataclass
class LayerCounters:
    requests: int = 0
    rows: int = 0
    batches: int = 0
    batch_rows: int = 0
    errors: int = 0
    latency_s: float = 0.0
    queue_wait_s: float = 0.0

    def as_dict(self) -> dict:
        return {
            "requests": self.requests,
            "rows": self.rows,
            "batches": self.batches,
            "mean_rows_per_batch": self.batch_rows / self.batches if self.batches else 0.0,
            "errors": self.errors,
            "mean_queue_wait_ms": 1e3 * self.queue_wait_s / self.requests if self.requests else 0.0,
            "mean_latency_ms": 1e3 * self.latency_s / self.requests if self.requests else 0.0,
        }


class ExecutionEngine:
    """Thread-safe front (``submit``) and one compute thread around a ``Scheduler``."""

    def __init__(self, weights: BaseModelWeights, scheduler: Scheduler, clock: Callable[[], float] = time.monotonic):
        self.weights = weights
        self.scheduler = scheduler
        self._clock = clock
        self._cond = threading.Condition()
        self._inflight: dict[int, _Inflight] = {}
        self._owner: dict[int, str] = {}
        self._ids = itertools.count()
        self._per_layer: defaultdict[str, LayerCounters] = defaultdict(LayerCounters)
        self._accepting = True
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="symbiosis-executor", daemon=True)
        self._thread.start()
        first = next(iter(weights.layers.values()), None)
        self.device = first.weight.device if first else torch.device("cpu")
        self.dtype = first.weight.dtype if first else torch.float32

    # ---- front ---------------------------------------------------------------------------------

    def validate(self, layer_id: str, op: Op, rows: torch.Tensor) -> None:
        spec = self.weights.specs.get(layer_id)
        if spec is None:
            raise UnknownLayerError(f"unknown base layer {layer_id!r} (the executor serves {len(self.weights.specs)} layers)")
        if not isinstance(op, Op):
            raise ProtocolError(f"unknown op {op!r}; expected one of {[o.value for o in Op]}")
        if rows.dim() != 2 or rows.shape[1] != op.input_width(spec):
            raise ShapeError(
                f"{op.value} of {layer_id!r} takes rows of width {op.input_width(spec)}, got shape {tuple(rows.shape)}"
            )
        if rows.dtype not in ALLOWED_DTYPES:
            raise ProtocolError(f"dtype {rows.dtype} is not allowed; use one of {[str(d) for d in ALLOWED_DTYPES]}")

    def submit(self, client_id: str, layer_id: str, op: Op, rows: torch.Tensor, latency_class: LatencyClass) -> Future:
        self.validate(layer_id, op, rows)
        future: Future = Future()
        spec = self.weights.specs[layer_id]
        if rows.shape[0] == 0:
            future.set_result(rows.new_empty((0, op.output_width(spec))))
            return future
        # Cast in the caller's thread so the compute thread only multiplies.
        local = rows.to(device=self.device, dtype=self.dtype)
        with self._cond:
            if not self._accepting:
                raise ExecutorUnavailableError("the executor is shutting down and accepts no new requests")
            request_id = next(self._ids)
            now = self._clock()
            self._inflight[request_id] = _Inflight(local, future, rows.dtype, rows.device, now)
            self._owner[request_id] = client_id
            self.scheduler.add(PendingRequest(request_id, client_id, layer_id, op, rows.shape[0], latency_class, now))
            counters = self._per_layer[layer_id]
            counters.requests += 1
            counters.rows += rows.shape[0]
            self._cond.notify()
        return future

    def client_joined(self, client_id: str) -> None:
        with self._cond:
            self.scheduler.client_joined(client_id)
            self._cond.notify()

    def client_left(self, client_id: str) -> None:
        with self._cond:
            dropped = self.scheduler.client_left(client_id)
            for request_id in dropped:
                inflight = self._inflight.pop(request_id, None)
                self._owner.pop(request_id, None)
                if inflight is not None:
                    inflight.future.set_exception(ExecutorUnavailableError(f"client {client_id!r} left"))
            self._cond.notify()

    def close(self, drain: bool = True, timeout_s: float = 30.0) -> None:
        """Refuse new requests; with ``drain`` finish those in flight, else fail them."""
        with self._cond:
            self._accepting = False
            if not drain:
                self._fail_all(ExecutorUnavailableError("the executor was closed"))
            self._cond.notify()
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._inflight and time.monotonic() < deadline:
                self._cond.wait(0.05)
            self._running = False
            self._fail_all(ExecutorUnavailableError("the executor was closed"))
            self._cond.notify()
        self._thread.join(timeout=5)

    def stats(self) -> dict:
        with self._cond:
            return {
                "layers": {k: v.as_dict() for k, v in self._per_layer.items()},
                "inflight_requests": len(self._inflight),
                "scheduler": self.scheduler.stats(),
            }

    # ---- compute thread ------------------------------------------------------------------------

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self._inflight):
            self.scheduler.client_left(self._owner[request_id])
        for inflight in self._inflight.values():
            if not inflight.future.done():
                inflight.future.set_exception(error)
        self._inflight.clear()
        self._owner.clear()

    def _next(self) -> Batch | None:
        with self._cond:
            while self._running:
                now = self._clock()
                batch = self.scheduler.next_batch(now)
                if batch is not None:
                    return batch
                wakeup = self.scheduler.next_wakeup(now)
                self._cond.wait(None if wakeup is None else max(0.0, wakeup - now))
            return None

    def _loop(self) -> None:
        while (batch := self._next()) is not None:
            self._run(batch)  # a method, so the batch's tensors die with its frame

    def _run(self, batch: Batch) -> None:
        with self._cond:  # requests may have been dropped (client left) since scheduling
            parts = [(s, self._inflight[s.request_id]) for s in batch.slices if s.request_id in self._inflight]
            now = self._clock()
            counters = self._per_layer[batch.layer_id]
            for _, inflight in parts:
                if not inflight.started:
                    inflight.started = True
                    counters.queue_wait_s += now - inflight.submitted_s
        if not parts:
            return
        layer = self.weights.layers[batch.layer_id]
        try:
            outputs = run_batch(layer, batch.op, [inflight.rows[s.start : s.stop] for s, inflight in parts])
        except Exception as exc:  # a failed product fails its batch, never the executor
            self._fail_batch(batch.layer_id, parts, exc)
            return
        self._complete(batch, parts, outputs)

    def _fail_batch(self, layer_id: str, parts, exc: Exception) -> None:
        error = exc if isinstance(exc, SymbiosisError) else SymbiosisError(f"executor failed on {layer_id}: {exc!r}")
        with self._cond:
            self._per_layer[layer_id].errors += 1
            for s, inflight in parts:
                if self._inflight.pop(s.request_id, None) is not None:
                    self._owner.pop(s.request_id, None)
                    inflight.future.set_exception(error)
            self._cond.notify_all()

    def _complete(self, batch: Batch, parts, outputs: list[torch.Tensor]) -> None:
        finished: list[tuple[_Inflight, torch.Tensor]] = []
        now = self._clock()
        with self._cond:
            counters = self._per_layer[batch.layer_id]
            counters.batches += 1
            counters.batch_rows += sum(s.rows for s, _ in parts)
            for (s, inflight), out in zip(parts, outputs):
                total = inflight.rows.shape[0]
                if s.start == 0 and s.stop == total:
                    # A slice of a shared batch output would pin the whole batch in memory and
                    # be a view to autograd; give each request its own tensor.
                    result = out if len(parts) == 1 else out.clone()
                else:  # served in chunks: assemble into one buffer
                    if inflight.output is None:
                        inflight.output = out.new_empty((total, out.shape[1]))
                    inflight.output[s.start : s.stop] = out
                    inflight.rows_done += s.rows
                    if inflight.rows_done < total:
                        continue
                    result = inflight.output
                self._inflight.pop(s.request_id, None)
                self._owner.pop(s.request_id, None)
                counters.latency_s += now - inflight.submitted_s
                finished.append((inflight, result))
            if not self._inflight:
                self._cond.notify_all()
        for inflight, result in finished:
            inflight.future.set_result(result.to(device=inflight.out_device, dtype=inflight.out_dtype))
