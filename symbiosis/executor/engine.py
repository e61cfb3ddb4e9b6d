"""Mechanism: receive requests, ask the scheduler what to run, run it, complete the futures.

The scheduler decides *what* and *when* (pure policy, see ``scheduler.py``); this module does the
bookkeeping around it: casting at the boundary, gathering row slices, reassembling chunked
requests, and failing a batch without failing the executor.

Who runs a product (flat combining). At most one batch of latency work is computed at a time,
by whichever thread finds it ready first:

- ``call`` (in-process clients) enqueues its request and, in the same critical section, asks the
  scheduler for a ready batch and runs it *in the caller's own thread* — its own rows and any
  rows other clients queued meanwhile. While the caller's request is held back (the policy waits
  for more rows) or another thread is computing, the caller waits and then tries again. A lone
  client therefore pays no thread hand-off, and concurrent clients still share one product. A
  finished product wakes only the callers whose requests it finished and one more waiting caller
  (to run the next batch), not every waiting thread: under a flood of small chunks, waking all of
  them made each chunk a fight for the interpreter lock that a decoding bystander lost.
- A transport server's socket thread is a *driver* (``attach_driver``): after reading a burst of
  requests it calls ``run_ready``, which runs every batch that is ready now in that thread, and
  it polls its sockets no longer than until the scheduler's next wake-up; ``wake`` callbacks tell
  it when work arrives from elsewhere. So a remote request, too, is received, multiplied and
  answered by one thread.
- ``submit`` (tools, servers) enqueues and returns a future, or fills the caller's ``ResultSink``;
  the engine's own compute thread runs what no waiting caller and no driver is there to run.

Bulk work (fine-tuning, long prompts: the scheduler's bulk lane) has threads of its own when
``SchedulerConfig.bulk_lane`` says ``background`` (``symbiosis serve``'s default on a CPU): they run
bulk batches beside the latency runners above, at the OS's background CPU priority (SCHED_IDLE),
so a decode request never waits behind a bulk product -- the OS takes the core back for latency
work the moment it wakes -- and bulk work gets the CPU time latency work leaves (a flood is still
paced: ``Scheduler.next_batch``; a bulk thread waits for the scheduler's wake-up then). The latency
runners then take latency work only. Measured (co-serving phase of ``benchmarks/serving.py``: a
serving client over shm beside 2 fine-tuning jobs): p95 inter-token latency x1.09-1.48 of
inference alone (median x1.23, 14 runs) against x2.5-3.0 with one runner for both lanes. With
``shared`` (the default on an accelerator, whose products share one stream anyway, and
in-process: the bulk threads' OpenMP teams would be more teams in the clients' process, see
below) the latency runners run bulk batches too, paced and cut into chunks by the scheduler.

There is one bulk thread per torch thread of the executor (``SchedulerConfig.bulk_threads``),
each multiplying on one core: different jobs' batches side by side, and a lone batch's rows split
between the idle threads (``Scheduler.next_batch``'s ``share``). One product on every core does
less on a CPU: its threads meet at every step of it, and a sleeping one is woken each time.
Measured (2026-11-28, this 2-core host, the ~105M llama's forward and input-gradient products of
its layers): 64-row products 300 tokens/s on 2 threads, 425 as two 1-thread streams side by side,
365 as one 64-row batch split in two 32-row halves (128 rows: 350, 475, 430); 8 fine-tuning
client processes 261-270 against 233-244 tokens/s with one bulk thread (interleaved runs; see
docs/performance.md). Only batches
of twice ``SPLIT_MIN_ROWS`` or more are split (see there: a split costs when the other cores have
other work). One core each holds only while other bulk work waits or other jobs share the lane
(``_bulk_threads_for``): a lone job's batch gets the threads no bulk product uses, so that on a
many-core host a fine-tuning job beside decoders is not held to one core. The bulk threads start
their OpenMP teams at once, so that a server's thread count does not grow at the first bulk
product.

Running products in the callers' threads also keeps a second OpenMP team out of the process: the
compute thread of an in-process executor never multiplies while a client waits, so it never
creates the idle worker team that made every torch op of its neighbours slower (libgomp sleeps
and wakes its workers with syscalls once more threads exist than cores).
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import torch

from symbiosis.errors import (
    ExecutorTimeoutError,
    ExecutorUnavailableError,
    ProtocolError,
    ShapeError,
    SymbiosisError,
    UnknownLayerError,
)
from symbiosis.executor import expert_rows as experts
from symbiosis.executor.host_load import HostCpu
from symbiosis.executor.requests import Batch, PendingRequest, RowSlice
from symbiosis.executor.runner import aligned, apply_op, out_fits_product, run_batch
from symbiosis.executor.scheduler import Lane, Scheduler
from symbiosis.executor.weights import BaseModelWeights
from symbiosis.protocol import check_expert_rows
from symbiosis.threads import enter_background_priority, with_torch_threads
from symbiosis.vocabulary import LatencyClass, LayerSpec, Op, module_lists

ALLOWED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A driver (server socket thread) returns to its sockets after running products this long, even
# with more ready: a latency-sensitive request may be waiting unread behind a run of bulk chunks.
DRIVER_SLICE_S = 0.0005
#: A product served alone (``_run_alone``) or a queued batch of latency work only is timed for the
#: cost model once in this many: a CPU clock is a system call on a VM, and two per product were ~5%
#: of a lone 1-row round trip and ~10% of the queued path's time in the engine (issue 11). Queued
#: batches with bulk rows are always timed: their durations also charge the bulk lane's credits.
LATENCY_TIMING_EVERY = 4


class ResultSink(Protocol):
    """Where ``ExecutionEngine.submit`` puts a request's result instead of a new ``Future`` (the
    methods of a ``Future`` the engine uses). A transport server passes one that answers the
    request at once: without a ``Future`` per request, its done-callback and the per-request copy,
    a queued 1-row round trip took x0.85-0.88 of the time (``benchmarks/roundtrip.py``, ``+joined``).

    ``takes_views``: the result may be a view of the batch's shared output, which the sink copies
    out (a reply) before anyone could modify it, so the engine skips the per-request copy it makes
    for other callers (a view of a shared output would pin the whole batch and be a view to
    autograd). ``set_result``/``set_exception`` are called once, outside the engine's lock, in the
    thread that ran the batch (or that dropped the request)."""

    takes_views: bool

    def done(self) -> bool: ...

    def set_result(self, result: torch.Tensor) -> None: ...

    def set_exception(self, error: BaseException) -> None: ...


@dataclass
class _Admitted:
    """A request between submit and completion (the only per-request state the executor has)."""

    rows: torch.Tensor  # input rows, already in the executor's dtype and device
    future: Future | ResultSink
    out_dtype: torch.dtype
    out_device: torch.device
    submitted_s: float
    cast_back: bool = True  # the result goes back to ``out_dtype``/``out_device`` (the rows were cast)
    takes_views: bool = False  # see ``ResultSink``
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
    """Thread-safe front (``call`` / ``submit``) around a ``Scheduler``; see the module docstring."""

    def __init__(self, weights: BaseModelWeights, scheduler: Scheduler, clock: Callable[[], float] = time.monotonic):
        self.weights = weights
        self.scheduler = scheduler
        # An MoE's experts tensors, by name: the layer ids of their experts (``expert_rows.py``).
        self._module_lists = {
            name: tuple(m.layer_id for m in members) for name, members in module_lists(weights.specs.values()).items()
        }
        host_cpu = HostCpu()
        scheduler.read_host_load(host_cpu.busy_share, host_cpu.cores)  # the wait tuner's start depends on it
        self._clock = clock
        self._lock = threading.Lock()
        # Two conditions on one lock, so that a thread is woken only when it has something to do
        # (a needless wake-up costs a futex call and a GIL hand-over per request): callers inside
        # ``call`` wait on ``_cond``; the compute thread waits on ``_compute_cv``.
        self._cond = threading.Condition(self._lock)
        self._compute_cv = threading.Condition(self._lock)
        self._inflight: dict[int, _Admitted] = {}
        self._owner: dict[int, str] = {}
        self._ids = itertools.count()
        self._per_layer: defaultdict[str, LayerCounters] = defaultdict(LayerCounters)
        self._accepting = True
        self._running = True
        self._computing = False  # some thread is running a batch (at most one at a time)
        self._callers_waiting = 0  # threads inside ``call``: while any waits, they run the batches
        # Each waiting caller's own condition (on the same lock), by its request id, oldest first: a
        # finished product wakes only the callers it finished and one caller to run the next batch,
        # not every waiting thread (each needless wake-up is a GIL hand-over and a re-plan).
        self._caller_cvs: dict[int, threading.Condition] = {}
        self._thread_cvs = threading.local()  # each calling thread's condition (``_caller_cv``)
        self._drivers: list[Callable[[], None]] = []  # wake callbacks of attached drivers
        # Clients that used ``call``, told to the scheduler once (``client_in_process``): kept here
        # too, so that every call checks it without taking the lock.
        self._in_process_callers: set[str] = set()
        # Which threads ran products (observability; in-process and driven servers should leave
        # the compute thread idle, see the module doc). "alone": the lone-client fast path.
        self._callers_blocked = 0  # waiting callers that wait for the product in progress to end
        self._batches_run_by = {"alone": 0, "caller": 0, "driver": 0, "compute_thread": 0}
        self.device, self.dtype = weights.device, weights.dtype
        # What a product costs, for the scheduler's cost model: on a CPU, the computing thread's CPU
        # time, so that waiting for the interpreter lock or for a core (other clients' work on the
        # same cores) is not taken for the product's cost; elsewhere, the clock.
        cpu = self.device.type == "cpu" and clock is time.monotonic
        self._product_clock = time.thread_time if cpu else clock
        self._on_cpu = self.device.type == "cpu"
        scheduler.products_share_client_cores = self._on_cpu  # (the decoders' free time: scheduler.py)
        # The lone-client path, whose every call is a few µs of Python on top of a tiny product
        # (a decode row), keeps what it can from one call to the next: which ``out`` suits which
        # rows (the lane slots of ``transport/lane_routes.py`` pass the same tensors every time).
        # Weak references: a remembered tensor may lie in a shared-memory segment that must close.
        self._alone_out_fits: dict[tuple[str, Op], tuple[object, weakref.ref, weakref.ref, bool]] = {}
        # Products that may go untimed (``LATENCY_TIMING_EVERY``), counted by the thread that
        # holds ``_computing``, so one at a time.
        self._latency_products = 0
        bulk_thread = scheduler.config.bulk_lane == "background"  # "auto": see resolve_bulk_lane
        # Bulk work (fine-tuning, long prompts) on its own thread at the OS's background priority
        # (``_bulk_loop``); the other runners then take latency work only.
        self._latency_lane: Lane | None = Lane.LATENCY if bulk_thread else None
        self._bulk_computing = 0  # bulk threads running a batch now
        self._bulk_cv = threading.Condition(self._lock)
        self._bulk_threads: list[threading.Thread] = []
        if bulk_thread:
            self._batches_run_by["bulk_thread"] = 0
            threads = torch.get_num_threads()
            count = scheduler.config.bulk_threads or threads
            scheduler.bulk_runners = count
            self._bulk_cores = threads  # the most torch threads a bulk product runs on
            self._bulk_cores_busy = 0  # torch threads of the bulk products running now
            started = threading.Semaphore(0)
            for index in range(count):
                thread = threading.Thread(
                    target=with_torch_threads(self._bulk_loop),
                    args=(count > 1, started),
                    name=f"symbiosis-bulk-{index}",
                    daemon=True,
                )
                thread.start()
                self._bulk_threads.append(thread)
            for _ in range(count):
                started.acquire(timeout=10)
            # torch keeps the count last set in any thread as the one threads that start later
            # take at their first parallel op: this thread's own again, not a bulk thread's 1.
            torch.set_num_threads(threads)
        self._thread = threading.Thread(target=with_torch_threads(self._loop), name="symbiosis-executor", daemon=True)
        self._thread.start()

    # ---- front ---------------------------------------------------------------------------------

    def validate(self, layer_id: str, op: Op, rows: torch.Tensor, expert_rows: Sequence[int] = ()) -> None:
        if expert_rows or layer_id in self._module_lists:
            members = self._module_lists.get(layer_id)
            experts.check_takes(layer_id, members, expert_rows)
            self.validate(members[0], op, rows)  # (its width and dtype: every member's)
            check_expert_rows(layer_id, expert_rows, rows.shape[0])
            return
        spec = self.weights.specs.get(layer_id)
        if spec is None:
            raise UnknownLayerError(
                f"unknown base layer {layer_id!r} (the executor serves {len(self.weights.specs)} layers)"
            )
        if not isinstance(op, Op):
            raise ProtocolError(f"unknown op {op!r}; expected one of {[o.value for o in Op]}")
        if rows.dim() != 2 or rows.shape[1] != op.input_width(spec):
            raise ShapeError(
                f"{op.value} of {layer_id!r} takes rows of width {op.input_width(spec)}, got shape {tuple(rows.shape)}"
            )
        if rows.dtype not in ALLOWED_DTYPES:
            raise ProtocolError(f"dtype {rows.dtype} is not allowed; use one of {[str(d) for d in ALLOWED_DTYPES]}")

    def submit(
        self,
        client_id: str,
        layer_id: str,
        op: Op,
        rows: torch.Tensor,
        latency_class: LatencyClass,
        *,
        wake: bool = True,
        sink: ResultSink | None = None,
        borrowed: bool = False,
        expert_rows: Sequence[int] = (),
    ) -> Future | ResultSink:
        """Enqueue a request; a waiting caller, a driver or the compute thread runs it. A driver
        that will call ``run_ready`` itself next passes ``wake=False`` (no one else is woken).
        The result goes to ``sink`` when given (returned), else to a new ``Future``.
        ``expert_rows``: ``layer_id`` is an experts tensor, each expert's rows one part
        (``expert_rows.py``); every part is queued now, and answered together.

        ``borrowed``: ``rows`` are the caller's only until this returns (a server's receive
        buffer, which its next message overwrites), so the engine keeps a copy -- one copy: the
        cast to its device or dtype when there is one. A server that cloned them itself and the
        cast then copied again spent 9-13% of its serving thread on the two (py-spy, 16-core H200
        host, decoders beside fine-tuning, docs/benchmarks/batching_h200)."""
        self.validate(layer_id, op, rows, expert_rows)
        future: Future | ResultSink = Future() if sink is None else sink
        if rows.shape[0] == 0:
            future.set_result(rows.new_empty((0, op.output_width(self._spec(layer_id)))))
            return future
        # Cast here: the computing thread only multiplies.
        cast = not self._is_local(rows)
        if cast:
            local = rows.to(device=self.device, dtype=self.dtype)
        else:
            local = rows.clone() if borrowed else rows
        with self._lock:  # the condition's own lock: ``with self._cond`` adds two Python calls
            if expert_rows:
                self._enqueue_parts(client_id, layer_id, op, local, rows, latency_class, future, cast, expert_rows)
            else:
                self._enqueue(client_id, layer_id, op, local, rows, latency_class, future, cast)
            if wake:
                self._wake_others()
        return future

    def _enqueue_parts(
        self, client_id, layer_id, op, local, rows, latency_class, target, cast: bool, expert_rows
    ) -> list[int]:
        """Enqueue each expert's rows of an expert-rows request as a request of that expert's
        layer (holding ``_cond``), answered together to ``target`` (``expert_rows.JoinedResult``);
        their request ids."""
        parts = experts.parts_of(self._module_lists[layer_id], expert_rows)
        with torch.inference_mode(False):  # (the runners' threads write into it)
            output = rows.new_empty((rows.shape[0], op.output_width(self._spec(layer_id))))
        joined = experts.JoinedResult(target, output, len(parts))
        return [
            self._enqueue(
                client_id,
                member,
                op,
                local[start:stop],
                rows[start:stop],
                latency_class,
                joined.part(start, stop),
                cast,
            )
            for member, start, stop in parts
        ]

    def _spec(self, layer_id: str) -> LayerSpec:
        """The spec of a layer, or of an experts tensor's experts."""
        members = self._module_lists.get(layer_id)
        return self.weights.specs[layer_id if members is None else members[0]]

    def attach_driver(self, wake: Callable[[], None]) -> None:
        """A thread that will call ``run_ready`` whenever ``wake()`` is called (from any thread) and
        by the wake-up time ``run_ready`` returns; while any is attached the compute thread rests."""
        with self._cond:
            self._drivers.append(wake)

    def detach_driver(self, wake: Callable[[], None]) -> None:
        with self._cond:
            if wake in self._drivers:
                self._drivers.remove(wake)
            self._compute_cv.notify()  # the compute thread may have work again

    def run_ready(self) -> float | None:
        """Run, in this thread, every batch that is ready now; return the scheduler's next wake-up
        (a monotonic time; None: nothing is held). Returns early while another thread computes
        (that thread wakes the drivers when it is done), and once it has run products for
        ``DRIVER_SLICE_S`` with more still ready: it then returns the current time, so that the
        driver reads its sockets (a decode request may be waiting there behind a run of bulk
        chunks) and calls again at once."""
        with self._cond:
            started = now = self._clock()
            while self._running and not self._computing:
                batch, wakeup = self.scheduler.next_batch_or_wakeup(now, self._latency_lane)
                if batch is None:
                    return wakeup
                self._run_locked(batch, "driver")
                now = self._clock()
                if now - started >= DRIVER_SLICE_S:
                    return now
            return None

    def _wake_others(self) -> None:
        """Work arrived or is left (holding ``_cond``): wake whoever runs batches now — one waiting
        caller if any, else the drivers if any, else the compute thread."""
        if self._callers_waiting:
            self._wake_a_runner()
        elif self._drivers:
            for wake in self._drivers:
                wake()
        else:
            self._compute_cv.notify()

    def _wake_a_runner(self) -> None:
        """Wake one waiting caller whose own request is still pending (holding ``_cond``): it runs
        the next ready batch, or sleeps until the scheduler's next wake-up. The one with the most
        rows left: a client sending bulk work runs the products, and a decoding client is woken
        for its own result rather than to compute someone else's chunk first."""
        best, best_rows = None, -1
        for request_id, cv in self._caller_cvs.items():
            inflight = self._inflight.get(request_id)
            if inflight is not None and inflight.rows.shape[0] - inflight.rows_done > best_rows:
                best, best_rows = cv, inflight.rows.shape[0] - inflight.rows_done
        if best is not None:
            best.notify()

    def call(
        self,
        client_id: str,
        layer_id: str,
        op: Op,
        rows: torch.Tensor,
        latency_class: LatencyClass,
        timeout_s: float,
        expert_rows: Sequence[int] = (),
    ) -> torch.Tensor:
        """Run a request and return its result, computing ready batches in this thread (see module doc)."""
        if expert_rows or layer_id in self._module_lists:
            return self._call_expert_rows(client_id, layer_id, op, rows, latency_class, timeout_s, expert_rows)
        self.validate(layer_id, op, rows)
        if rows.shape[0] == 0:
            return rows.new_empty((0, op.output_width(self.weights.specs[layer_id])))
        if client_id not in self._in_process_callers:
            self._note_in_process_caller(client_id)
        result = self.try_alone(client_id, layer_id, op, rows, latency_class)
        if result is not None:
            return result
        local = rows if self._is_local(rows) else rows.to(device=self.device, dtype=self.dtype)
        future: Future = Future()
        deadline = self._clock() + timeout_s
        cv = self._caller_cv()
        with self._cond:
            request_id = self._enqueue(client_id, layer_id, op, local, rows, latency_class, future, local is not rows)
            self._wait_locked(future, [request_id], cv, deadline, f"{op.value} of {layer_id!r}", timeout_s)
        return future.result()

    def _note_in_process_caller(self, client_id: str) -> None:
        """A client calling from this process (the wait tuner's start depends on it); asked by the
        caller first, as every in-process call does."""
        with self._lock:
            self.scheduler.client_in_process(client_id)
            self._in_process_callers.add(client_id)

    def _wait_locked(self, future, request_ids: list[int], cv, deadline: float, what: str, timeout_s: float) -> None:
        """Wait (holding ``_cond``) until ``future`` is done, running ready batches in this thread
        meanwhile (see module doc): the requests ``request_ids`` (an expert-rows request's parts:
        several) are this caller's; past ``deadline`` each is failed."""
        for request_id in request_ids:
            self._caller_cvs[request_id] = cv
        self._callers_waiting += 1
        try:
            while not future.done():
                if not self._running:
                    raise ExecutorUnavailableError("the executor was closed")
                now = self._clock()
                if now >= deadline:
                    for request_id in request_ids:
                        self._drop(request_id, ExecutorTimeoutError(f"{what} took longer than {timeout_s} s"))
                    break
                batch, wakeup = None, None  # another thread computes: it notifies when done
                blocked = self._computing
                if not blocked:
                    batch, wakeup = self.scheduler.next_batch_or_wakeup(now, self._latency_lane)
                if batch is not None:
                    self._run_locked(batch, "caller")
                    continue
                self._callers_blocked += blocked
                try:
                    cv.wait(max(0.0, min(deadline, wakeup if wakeup is not None else deadline) - now))
                finally:
                    self._callers_blocked -= blocked
        finally:
            self._callers_waiting -= 1
            for request_id in request_ids:
                del self._caller_cvs[request_id]
            if self._callers_waiting == 0 and self._work_for_latency_runners():
                self._wake_others()  # what is left is the drivers' or the compute thread's again
            elif self._inflight and not self._computing:
                self._wake_a_runner()  # this caller may have been the one woken to run the next batch

    def _call_expert_rows(self, client_id, layer_id, op, rows, latency_class, timeout_s, expert_rows) -> torch.Tensor:
        """``call`` with ``expert_rows`` (``submit``): alone when it can be, else every expert's
        rows queued at once as parts (each batched with other clients' rows for its expert) and
        waited for together: one wait, where a call per part waited its turn part after part."""
        if rows.shape[0] == 0:  # (else ``try_alone`` validates)
            self.validate(layer_id, op, rows, expert_rows)
            return rows.new_empty((0, op.output_width(self._spec(layer_id))))
        if client_id not in self._in_process_callers:
            self._note_in_process_caller(client_id)
        result = self.try_alone(client_id, layer_id, op, rows, latency_class, expert_rows=expert_rows)
        if result is not None:
            return result
        local = rows if self._is_local(rows) else rows.to(device=self.device, dtype=self.dtype)
        future: Future = Future()
        deadline = self._clock() + timeout_s
        cv = self._caller_cv()
        with self._cond:
            ids = self._enqueue_parts(
                client_id, layer_id, op, local, rows, latency_class, future, local is not rows, expert_rows
            )
            self._wait_locked(future, ids, cv, deadline, f"{op.value} of {layer_id!r}", timeout_s)
        return future.result()

    def _is_local(self, rows: torch.Tensor) -> bool:
        """Whether ``rows`` are already in the executor's dtype and on its device: the usual case,
        told apart without a no-op ``to`` (a microsecond or two on every request that pays it)."""
        return rows.dtype is self.dtype and (rows.is_cpu if self._on_cpu else rows.device == self.device)

    def _caller_cv(self) -> threading.Condition:
        """This thread's own condition on the engine's lock, made at its first queued call and
        kept: a thread waits in one ``call`` at a time, and a new ``Condition`` per call was ~5%
        of the queued path's time (``benchmarks/roundtrip.py``, ``inproc+queued``)."""
        cv = getattr(self._thread_cvs, "cv", None)
        if cv is None:
            cv = self._thread_cvs.cv = threading.Condition(self._lock)
        return cv

    def try_alone(
        self,
        client_id: str,
        layer_id: str,
        op: Op,
        rows: torch.Tensor,
        latency_class: LatencyClass,
        out: torch.Tensor | None = None,
        align: bool = False,
        expert_rows: Sequence[int] = (),
    ) -> torch.Tensor | None:
        """For a driver: the result of a valid, non-empty request computed at once in this thread
        when nothing could share its batch (``client_id`` alone, or nothing pending and no rule in
        force holding it for another client: ``Scheduler.serves_at_once``); None (nothing done)
        otherwise.

        ``align``: the rows may lie at any address (a transport's bytes); they are copied to an
        aligned tensor first when they do not (``runner.aligned``). An in-process caller's rows,
        alone, are multiplied where they lie, as the monolithic model would; queued work is
        aligned as a batch is (``run_batch``).

        ``out``: where the driver will send the result from (a shared-memory reply region); the
        product is written straight into it when the rows are in the executor's dtype (and
        ``out`` suits ``apply_op``), and the result is then ``out`` itself.

        ``expert_rows``: see ``submit``; validated here (a driver validated only what the wire
        protocol checks). Alone as its first expert's request would be, every expert's product
        is then computed in turn."""
        parts = None
        if expert_rows or layer_id in self._module_lists:
            self.validate(layer_id, op, rows, expert_rows)
            parts = experts.parts_of(self._module_lists[layer_id], expert_rows)
            if not parts:
                return None  # (no rows: ``submit`` answers at once)
            layer_id, out = parts[0][0], None
        lane = self._latency_lane
        if lane is not None and self.scheduler.lane_of(latency_class, rows.shape[0]) is not Lane.LATENCY:
            lane = None  # bulk work is alone only with no one else there
        with self._lock:  # the condition's own lock: ``with self._cond`` adds two Python calls
            alone = (
                self._running
                and self._accepting
                and not self._computing
                and not (lane is None and self._bulk_computing)  # a client's next bulk request waits its turn
                and self.scheduler.serves_at_once(
                    client_id, layer_id, op, rows.shape[0], latency_class, self._clock(), lane
                )
            )
            if not alone:
                return None
            self._computing = True
        try:
            if self._is_local(rows):
                local = aligned(rows) if align else rows  # the usual case: no no-op ``to`` there and back
            else:
                out = None  # the product is cast back to the rows' dtype anyway
                local = rows.to(device=self.device, dtype=self.dtype)
        except BaseException:  # a failed copy (memory) must not leave the engine taken for good
            with self._lock:
                self._computing_done()
            raise
        if parts is not None:
            return self._run_alone_parts(client_id, op, local, rows, latency_class, parts, align)
        return self._run_alone(client_id, layer_id, op, local, rows, latency_class, out)

    def _run_alone(self, client_id, layer_id, op, local, rows, latency_class, out=None) -> torch.Tensor:
        """The lone-client fast path of ``call`` (``_computing`` already taken): no scheduler
        round, no future — the product (into ``out`` when given and suitable, see ``apply_op``),
        the counters, and the result in the caller's dtype."""
        layer = self.weights.layers[layer_id]
        out_fits = None
        if out is not None:
            known = self._alone_out_fits.get((layer_id, op))
            if known is not None and known[0] is layer and known[1]() is out and known[2]() is local:
                out_fits = known[3]
            else:
                out_fits = out_fits_product(layer, op, local, out)
                self._alone_out_fits[(layer_id, op)] = (layer, weakref.ref(out), weakref.ref(local), out_fits)
        timed = self._times_latency_product()
        started = self._clock()
        cpu_started = self._product_clock() if timed else 0.0
        try:
            if torch.is_grad_enabled():  # see ``_compute``
                with torch.no_grad():
                    result = apply_op(layer, op, local, out, out_fits)
            else:
                result = apply_op(layer, op, local, out, out_fits)
        finally:
            cost = self._product_clock() - cpu_started if timed else None
            with self._lock:
                self._served_alone(client_id, layer_id, op, local.shape[0], latency_class, cost, started)
                self._computing_done(queue_changed=False)
        if local is rows and result.dtype is rows.dtype:
            return result
        return result.to(device=rows.device, dtype=rows.dtype)

    def _run_alone_parts(self, client_id, op, local, rows, latency_class, parts, align: bool) -> torch.Tensor:
        """``_run_alone`` of an expert-rows request: each expert's product in turn, into one result.
        ``align``: each expert's rows aligned as a batch's are (``run_batch``), so that the products
        are the bits the queued path gives (a slice of aligned rows need not be aligned)."""
        timed = self._times_latency_product()
        started = self._clock()
        output = local.new_empty((local.shape[0], op.output_width(self.weights.specs[parts[0][0]])))
        costs: list[float | None] = []
        try:
            with torch.no_grad():  # (see ``_compute``)
                for member, start, stop in parts:
                    cpu_started = self._product_clock() if timed else 0.0
                    part = aligned(local[start:stop]) if align else local[start:stop]
                    output[start:stop] = apply_op(self.weights.layers[member], op, part)
                    costs.append(self._product_clock() - cpu_started if timed else None)
        finally:
            with self._lock:
                for (member, start, stop), cost in zip(parts, costs):  # (those computed)
                    self._served_alone(client_id, member, op, stop - start, latency_class, cost, started)
                self._computing_done(queue_changed=False)
        if local is rows and output.dtype is rows.dtype:
            return output
        return output.to(device=rows.device, dtype=rows.dtype)

    def _served_alone(self, client_id, layer_id, op, rows: int, latency_class, cost, started: float) -> None:
        """The counters of a product served alone (holding the lock), and the scheduler told."""
        counters = self._per_layer[layer_id]
        counters.requests += 1
        counters.rows += rows
        counters.batches += 1
        counters.batch_rows += rows
        counters.latency_s += self._clock() - started
        self.scheduler.served_alone(client_id, rows, latency_class, layer_id, op, cost)
        self._batches_run_by["alone"] += 1

    def _enqueue(self, client_id, layer_id, op, local, rows, latency_class, future, cast: bool) -> int:
        """Record the request and hand it to the scheduler (holding ``_cond``). ``cast``: whether
        ``local`` is ``rows`` cast to the executor's device or dtype (its result is cast back)."""
        if not self._accepting:
            raise ExecutorUnavailableError("the executor is shutting down and accepts no new requests")
        request_id = next(self._ids)
        now = self._clock()
        self._inflight[request_id] = _Admitted(
            local,
            future,
            rows.dtype,
            rows.device,
            now,
            cast,
            getattr(future, "takes_views", False),
        )
        self._owner[request_id] = client_id
        self.scheduler.add(PendingRequest(request_id, client_id, layer_id, op, rows.shape[0], latency_class, now))
        if self._bulk_threads and self.scheduler.lane_of(latency_class, rows.shape[0]) is Lane.BULK:
            self._bulk_cv.notify()
        counters = self._per_layer[layer_id]
        counters.requests += 1
        counters.rows += rows.shape[0]
        return request_id

    def _drop(self, request_id: int, error: Exception) -> None:
        """Fail one request (its caller timed out) holding ``_cond``. It stays scheduled — the
        scheduler removes requests only per client, and the other requests of its client must
        stay — and its result is discarded when its batch completes."""
        inflight = self._inflight.get(request_id)
        if inflight is not None and not inflight.future.done():
            inflight.future.set_exception(error)

    def client_joined(self, client_id: str) -> None:
        with self._cond:
            self.scheduler.client_joined(client_id)
            self._notify_everyone()

    def client_left(self, client_id: str) -> None:
        with self._cond:
            self._in_process_callers.discard(client_id)
            dropped = self.scheduler.client_left(client_id)
            for request_id in dropped:
                inflight = self._inflight.pop(request_id, None)
                self._owner.pop(request_id, None)
                if inflight is not None:
                    inflight.future.set_exception(ExecutorUnavailableError(f"client {client_id!r} left"))
            self._notify_everyone()

    def close(self, drain: bool = True, timeout_s: float = 30.0) -> None:
        """Refuse new requests; with ``drain`` finish those in flight (up to ``timeout_s``), else
        fail them at once."""
        with self._cond:
            self._accepting = False
            if not drain:
                self._fail_all(ExecutorUnavailableError("the executor was closed"))
            self._notify_everyone()
            deadline = time.monotonic() + timeout_s
            while self._inflight and time.monotonic() < deadline:
                self._cond.wait(0.05)
            self._running = False
            self._fail_all(ExecutorUnavailableError("the executor was closed"))
            self._notify_everyone()
        self._thread.join(timeout=5)
        for thread in self._bulk_threads:
            thread.join(timeout=5)

    def _notify_everyone(self) -> None:
        """Membership or lifecycle changed (holding ``_cond``): everyone re-checks."""
        self._cond.notify_all()
        for cv in self._caller_cvs.values():
            cv.notify()
        self._compute_cv.notify()
        self._bulk_cv.notify()
        for wake in self._drivers:
            wake()

    def oldest_wait_s(self) -> float:
        """How long the oldest request in flight has waited (0 when none): what ``/health`` reads.
        O(requests in flight), for a monitor's occasional look."""
        with self._cond:
            oldest = min((inflight.submitted_s for inflight in self._inflight.values()), default=None)
            return 0.0 if oldest is None else max(0.0, self._clock() - oldest)

    @property
    def accepting(self) -> bool:
        return self._accepting

    def stats(self) -> dict:
        with self._cond:
            return {
                "layers": {k: v.as_dict() for k, v in self._per_layer.items()},
                "inflight_requests": len(self._inflight),
                "batches_run_by": dict(self._batches_run_by),
                "bulk_threads": len(self._bulk_threads),
                "scheduler": self.scheduler.stats(),
            }

    # ---- computing -----------------------------------------------------------------------------

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self._inflight):
            self.scheduler.client_left(self._owner[request_id])
        for inflight in self._inflight.values():
            if not inflight.future.done():
                inflight.future.set_exception(error)
        self._inflight.clear()
        self._owner.clear()

    def _loop(self) -> None:
        """The compute thread: runs what is ready while no caller is waiting to run it."""
        torch.set_grad_enabled(False)  # (thread-local) base products never record autograd
        with self._cond:
            while self._running:
                now = self._clock()
                if self._callers_waiting == 0 and not self._drivers and not self._computing:
                    batch, wakeup = self.scheduler.next_batch_or_wakeup(now, self._latency_lane)
                    if batch is not None:
                        self._run_locked(batch, "compute_thread")
                        continue
                else:
                    wakeup = None  # callers or drivers run the batches; they notify when they stop
                self._compute_cv.wait(None if wakeup is None else max(0.0, wakeup - now))

    def _bulk_loop(self, one_thread: bool, started: threading.Semaphore) -> None:
        """A bulk thread: runs bulk batches (fine-tuning, long prompts) as they become ready, at
        the OS's background priority, so that a latency product never waits behind one: on a
        core the latency runners want, the OS stops this thread at once (SCHED_IDLE).
        ``one_thread``: one of several bulk threads (see ``_bulk_threads_for``). Releases
        ``started`` once its thread count is set."""
        enter_background_priority()
        torch.set_grad_enabled(False)  # (thread-local) see ``_compute``
        # OpenMP starts this thread's team now, at the most threads it will use (the executor's:
        # see ``_bulk_threads_for``), so that a server's thread count never grows at a later
        # product (see the module doc).
        torch.get_num_threads()  # torch's first use in a thread takes the count last set anywhere,
        threads = self._bulk_cores  # which another bulk thread may just have set to 1
        torch.set_num_threads(threads)
        warm = torch.ones(128, 128)
        torch.mm(warm, warm)
        if one_thread:
            threads = 1
            torch.set_num_threads(1)  # this thread's own count (OpenMP and MKL keep one per thread)
        started.release()
        with self._cond:
            while self._running:
                now = self._clock()
                idle = len(self._bulk_threads) - self._bulk_computing  # this one included
                batch, wakeup = self.scheduler.next_batch_or_wakeup(now, Lane.BULK, share=idle)
                if batch is not None:
                    more = self.scheduler.has_pending(Lane.BULK)
                    if idle > 1 and more:
                        self._bulk_cv.notify()  # rows left (a part of this batch's, or another group)
                    if one_thread:
                        wanted = self._bulk_threads_for(now, more)
                        if wanted != threads:
                            threads = wanted
                            torch.set_num_threads(wanted)
                    self._bulk_cores_busy += threads
                    try:
                        self._run_locked(batch, "bulk_thread")
                    finally:
                        self._bulk_cores_busy -= threads
                else:  # none is pending, or a flood is paced until ``wakeup`` (``Scheduler.next_batch``)
                    self._bulk_cv.wait(None if wakeup is None else max(0.0, wakeup - now))

    def _bulk_threads_for(self, now: float, more: bool) -> int:
        """The torch threads of the batch a bulk thread just took (holding ``_cond``): one when
        other bulk work is waiting (the other bulk threads take it, one core each), else the
        executor's threads shared between the bulk clients, within those no running bulk product
        uses: a lone fine-tuning job beside decoders gets every core the decoders leave (as with
        one bulk thread), two jobs on two cores one each."""
        if more:
            return 1
        cores = self._bulk_cores
        fair = cores // max(1, self.scheduler.active_clients(Lane.BULK, now))
        return max(1, min(fair, cores - self._bulk_cores_busy))

    def _run_locked(self, batch: Batch, runner: str) -> None:
        """Run ``batch`` with ``_cond`` held on entry and exit, released around the product."""
        parts = [(s, self._inflight[s.request_id]) for s in batch.slices if s.request_id in self._inflight]
        if not parts:  # requests dropped (client left) since scheduling
            return
        now = self._clock()
        counters = self._per_layer[batch.layer_id]
        for _, inflight in parts:
            if not inflight.started:
                inflight.started = True
                counters.queue_wait_s += now - inflight.submitted_s
        bulk = runner == "bulk_thread"
        if bulk:
            self._bulk_computing += 1
        else:
            self._computing = True
        self._batches_run_by[runner] += 1
        timed = not batch.latency_only or self._times_latency_product()
        self._cond.release()
        ok, duration, finished = False, None, []
        try:
            ok, duration, finished = self._compute(batch, parts, timed)
        finally:
            self._cond.acquire()
            if ok:
                self.scheduler.batch_done(batch, duration, self._clock())  # the cost model learns from it
            if bulk:  # the latency runners' work is not changed by it: only its callers learn
                self._bulk_computing -= 1
                self._notify_callers_of(finished)
            else:
                self._computing_done(finished, runner == "caller")

    def _computing_done(self, finished: list[int] = (), by_caller: bool = False, queue_changed: bool = True) -> None:
        """A product finished (holding ``_cond``): the callers of the requests it ``finished`` learn
        their results; unless a caller ran it (it goes on running batches, or wakes a runner as it
        leaves), one waiting caller gets its turn to compute; without callers, whoever runs what
        is left is woken. Not after a product served alone (``queue_changed=False``) unless a
        caller waits for the product to end: the others wait for a time their last plan gave,
        which a product outside the queue did not move; woken, one plans for nothing. Beside a
        flood held by its pacing, that was a flood thread woken after each of a decoder's
        products, planning under the interpreter lock the decoder needs."""
        self._computing = False
        self._notify_callers_of(finished)
        if by_caller:
            return
        if self._callers_waiting:
            if queue_changed or self._callers_blocked:
                self._wake_a_runner()
        elif self._work_for_latency_runners():
            self._wake_others()

    def _notify_callers_of(self, finished: list[int]) -> None:
        """Wake the waiting callers whose requests are ``finished`` (holding ``_cond``)."""
        for request_id in finished:
            cv = self._caller_cvs.get(request_id)
            if cv is not None:
                cv.notify()

    def _work_for_latency_runners(self) -> bool:
        """Requests are in flight that the callers, drivers or compute thread may have to run
        (holding ``_cond``): with a bulk thread, only latency work counts -- bulk work is always
        in flight while a job trains, and waking every driver after each decode product for it
        cost a wake-up, a poll and two plans."""
        if not self._inflight:
            return False
        return self._latency_lane is None or self.scheduler.has_pending(self._latency_lane)

    def _times_latency_product(self) -> bool:
        """Whether the product about to run (served alone, or a queued batch of latency work only)
        is timed for the cost model: one in ``LATENCY_TIMING_EVERY`` (the caller holds ``_computing``)."""
        self._latency_products += 1
        return self._latency_products % LATENCY_TIMING_EVERY == 1

    def _compute(self, batch: Batch, parts, timed: bool = True) -> tuple[bool, float | None, list[int]]:
        """The product and completing its requests' futures (called without ``_cond`` held):
        whether it succeeded, its duration in seconds (when ``timed``), and the ids of the
        requests it ended."""
        if torch.is_grad_enabled():
            # A caller's thread outside autograd's own ``forward`` (``call`` used directly): its
            # rows may require grad. Base products never record autograd: the client's
            # ``FrozenLinearFunction`` does, and a chunk's product that required grad made the
            # assembly of a split request raise in a bulk thread, which died with the request
            # unanswered (the executor's own threads turn autograd off when they start).
            with torch.no_grad():
                return self._compute(batch, parts, timed)
        layer = self.weights.layers[batch.layer_id]
        started = self._product_clock() if timed else 0.0
        try:
            outputs = run_batch(layer, batch.op, [_rows_of(s, inflight.rows) for s, inflight in parts])
        except Exception as exc:  # a failed product fails its batch, never the executor
            return False, None, self._fail_batch(batch.layer_id, parts, exc)
        duration = self._product_clock() - started if timed else None
        try:
            return True, duration, self._complete(batch, parts, outputs)
        except Exception as exc:  # nor does a failure handing its results out (the runner lives on)
            return False, None, self._fail_batch(batch.layer_id, parts, exc)

    def _fail_batch(self, layer_id: str, parts, exc: Exception) -> list[int]:
        error = exc if isinstance(exc, SymbiosisError) else SymbiosisError(f"executor failed on {layer_id}: {exc!r}")
        failed = []
        with self._cond:
            self._per_layer[layer_id].errors += 1
            for s, inflight in parts:
                if self._inflight.pop(s.request_id, None) is not None:
                    self._owner.pop(s.request_id, None)
                    failed.append(s.request_id)
                    if not inflight.future.done():
                        inflight.future.set_exception(error)
        return failed

    def _complete(self, batch: Batch, parts, outputs: list[torch.Tensor]) -> list[int]:
        finished: list[tuple[_Admitted, torch.Tensor]] = []
        finished_ids: list[int] = []
        # The copies first, without the lock (a bulk batch's are megabytes, and every runner and
        # arriving request needs the lock). Two bulk threads may each be copying a chunk of one
        # request: their rows do not overlap, and the buffer is made once, under the lock.
        results: list[torch.Tensor | None] = []
        for (s, inflight), out in zip(parts, outputs):
            if s.start == 0 and s.stop == inflight.rows.shape[0]:
                # A slice of a shared batch output would pin the whole batch in memory and
                # be a view to autograd; give each request its own tensor (unless its sink
                # copies it out at once).
                results.append(out if len(parts) == 1 or inflight.takes_views else out.clone())
            else:  # served in chunks: assemble into one buffer
                if inflight.output is None:
                    with self._lock:
                        if inflight.output is None:
                            inflight.output = out.new_empty((inflight.rows.shape[0], out.shape[1]))
                inflight.output[s.start : s.stop] = out
                results.append(None)
        now = self._clock()
        with self._cond:
            counters = self._per_layer[batch.layer_id]
            counters.batches += 1
            counters.batch_rows += sum(s.rows for s, _ in parts)
            for (s, inflight), result in zip(parts, results):
                if result is None:  # a chunk: done once all of its request's rows are
                    inflight.rows_done += s.rows
                    if inflight.rows_done < inflight.rows.shape[0]:
                        continue
                    result = inflight.output
                self._inflight.pop(s.request_id, None)
                self._owner.pop(s.request_id, None)
                counters.latency_s += now - inflight.submitted_s
                finished.append((inflight, result))
                finished_ids.append(s.request_id)
        for inflight, result in finished:
            if not inflight.future.done():  # a caller that timed out has its error already
                try:
                    if inflight.cast_back:
                        result = result.to(device=inflight.out_device, dtype=inflight.out_dtype)
                except Exception as exc:  # (memory) this request fails; the others get theirs
                    inflight.future.set_exception(SymbiosisError(f"executor failed on {batch.layer_id}: {exc!r}"))
                    continue
                inflight.future.set_result(result)
        return finished_ids


def _rows_of(part: RowSlice, rows: torch.Tensor) -> torch.Tensor:
    """The rows of ``part`` of a request whose rows are ``rows``: the tensor itself when the part
    is all of it (a decode request, nearly always), without a slice -- a view costs the serving
    thread a couple of microseconds per request, as much as a 1-row product's bookkeeping."""
    return rows if part.start == 0 and part.stop == rows.shape[0] else rows[part.start : part.stop]
