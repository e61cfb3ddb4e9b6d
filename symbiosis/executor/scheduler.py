"""Batching policy of the base executor: which rows of which requests to multiply next, and when.

Pure policy: the scheduler takes request descriptions (``PendingRequest``) and a
clock value passed in by the caller, and returns decisions (``Batch``). It does no I/O, no math,
no threading and never reads a clock, so it is tested with plain floats.

Requests are grouped by ``(layer_id, op)``: only rows for the same base layer and the same product
can share one GEMM. Three policies decide when a group is *ready* (paper §3.6-3.7):

- ``immediate`` ("no-lockstep"): at once. Lowest latency, smallest batches.
- ``lockstep``: when every joined client has a request in the group (the way HF/vLLM keep one batch
  through all layers), or after ``lockstep_timeout_ms`` so that a stalled client cannot freeze others.
- ``opportunistic`` (default): wait a little to collect more rows, with a budget that grows with
  the request's size and latency class (see ``SchedulerConfig.wait_budget_s``), and stop waiting
  as soon as waiting cannot help (the group already fills ``row_budget``, or every joined client
  is already in it). With ``predict_arrivals`` (default) it waits only for clients that are *on
  their way* to the group's layer; see "Predicted arrivals" below.

Predicted arrivals. Clients walk the base layers of an op in a fixed order, one request at a
time; ``arrivals.ArrivalPredictor`` learns that order and each client's pace (``gap`` per layer)
from arrivals, and predicts when a client behind a group's layer in the same pass reaches it. The
group is held only while some client is expected no
later than the group's budget deadline, and at most until the latest such expectation plus one
``gap`` of slack (a client that falls behind its prediction stops being waited for). Clients that
are ahead (already at or past the layer), idle between passes, in another op (a fine-tuning
client in backward while the group is forward), or without a measured pace are not waited for:
the group is served at once. Waiting for them cannot grow the batch within the budget, only delay
it. The budget deadline remains the bound in every case.

Among ready groups, and among requests inside a batch, requests that waited ``aging_ms`` go first
(oldest first); otherwise decode before prefill before fine-tuning, then oldest arrival. A batch
holds at most ``row_budget`` rows; the request that does not fit is split by rows and continued in
the next batch. This is FlexLLM's token-level fine-tuning idea (a fine-tuning sequence is cut into
token windows that ride along with inference) done at the executor, where it is free: base layers
are row-independent, so any row chunking gives the same result. It bounds how much other work a
decode request can find in front of it.

Cost per call is O(groups with pending work) plus O(log n) per request handed out (opportunistic
with predictions: O(groups x clients)); requests are never scanned as a whole, except by ``client_left`` (rare) for the leaving client's own requests.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from typing import Literal

from symbiosis.executor.arrivals import ArrivalPredictor
from symbiosis.executor.requests import Batch, PendingRequest, RowSlice
from symbiosis.vocabulary import LatencyClass, Op

Policy = Literal["immediate", "lockstep", "opportunistic"]
POLICIES: tuple[str, ...] = ("immediate", "lockstep", "opportunistic")

# Latency classes in the order a batch serves them (decode first).
_CLASS_ORDER: tuple[LatencyClass, ...] = tuple(sorted(LatencyClass, key=lambda c: c.priority))


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class SchedulerConfig:
    """How the base executor batches requests. Each field's ``metadata["help"]`` is the CLI help text."""

    policy: Policy = field(
        default="opportunistic",
        metadata=_help(
            "Batching policy: 'immediate' (serve at once, no lockstep), 'lockstep' (wait for every "
            "joined client at each layer) or 'opportunistic' (wait briefly, by request size and class)."
        ),
    )
    max_wait_ms: float = field(
        default=5.0,
        metadata=_help("Opportunistic: cap on how long any request may be held back to grow a batch (ms)."),
    )
    row_budget: int = field(
        default=4096,
        metadata=_help("Most rows in one batch; larger requests are split into row chunks across batches."),
    )
    lockstep_timeout_ms: float = field(
        default=50.0,
        metadata=_help("Lockstep: serve a layer anyway once its oldest request waited this long (ms)."),
    )
    aging_ms: float = field(
        default=20.0,
        metadata=_help(
            "A request that waited this long is served before any class priority, oldest first (ms); "
            "prevents fine-tuning from starving under a steady stream of decode requests. A fine-tuning "
            "step makes ~2 requests per base layer, so this bounds its queueing per step."
        ),
    )
    decode_base_wait_ms: float = field(
        default=3.0,
        metadata=_help("Opportunistic: wait budget of a decode request before its per-row growth (ms)."),
    )
    prefill_base_wait_ms: float = field(
        default=4.0,
        metadata=_help("Opportunistic: wait budget of a prefill request before its per-row growth (ms)."),
    )
    finetune_base_wait_ms: float = field(
        default=5.0,
        metadata=_help("Opportunistic: wait budget of a fine-tuning request before its per-row growth (ms)."),
    )
    wait_per_row_ms: float = field(
        default=0.002,
        metadata=_help(
            "Opportunistic: how much the wait budget grows per row of the request (ms/row); "
            "0.002 adds 0.5 ms for 256 rows, 4 ms for 2048 rows."
        ),
    )

    predict_arrivals: bool = field(
        default=True,
        metadata=_help(
            "Opportunistic: hold a layer's requests only while another client is on its way to that "
            "layer (behind it in the same pass and expected within the wait budget, learned from the "
            "order and pace of each client's requests); off: always hold for the whole wait budget."
        ),
    )

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"SchedulerConfig.policy must be one of {POLICIES}, got {self.policy!r}")
        if isinstance(self.row_budget, bool) or not isinstance(self.row_budget, int) or self.row_budget < 1:
            raise ValueError(f"SchedulerConfig.row_budget must be an integer >= 1, got {self.row_budget!r}")
        if not isinstance(self.predict_arrivals, bool):
            raise ValueError(f"SchedulerConfig.predict_arrivals must be a bool, got {self.predict_arrivals!r}")
        for name in (
            "max_wait_ms",
            "lockstep_timeout_ms",
            "aging_ms",
            "decode_base_wait_ms",
            "prefill_base_wait_ms",
            "finetune_base_wait_ms",
            "wait_per_row_ms",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"SchedulerConfig.{name} must be a finite number >= 0, got {value!r}")
        if not self.decode_base_wait_ms <= self.prefill_base_wait_ms <= self.finetune_base_wait_ms:
            raise ValueError(
                "SchedulerConfig base waits must satisfy decode <= prefill <= finetune (a small, urgent "
                f"request should wait least), got decode={self.decode_base_wait_ms}, "
                f"prefill={self.prefill_base_wait_ms}, finetune={self.finetune_base_wait_ms}"
            )

    @classmethod
    def help_texts(cls) -> dict[str, str]:
        """Field name -> help text, for a CLI that exposes these options."""
        return {f.name: f.metadata["help"] for f in fields(cls)}

    def base_wait_ms(self, latency_class: LatencyClass) -> float:
        return {
            LatencyClass.DECODE: self.decode_base_wait_ms,
            LatencyClass.PREFILL: self.prefill_base_wait_ms,
            LatencyClass.FINETUNE: self.finetune_base_wait_ms,
        }[latency_class]

    def wait_budget_s(self, rows: int, latency_class: LatencyClass) -> float:
        """How long the opportunistic policy may hold a request back to grow its batch (seconds).

        ``wait_ms = min(max_wait_ms, base_wait_ms[class] + wait_per_row_ms * rows)``

        Why: a request's natural time in the system (client-side attention and adapters, the GEMM
        itself, the network) grows with its rows and is longer for prefill and fine-tuning steps
        than for one decode token. Waiting costs a small decode request a large fraction of its
        latency and a large prefill or fine-tuning request a small one (paper §3.7), so the budget
        grows with both; ``max_wait_ms`` is the provider's cap on the worst penalty per layer.
        """
        wait_ms = self.base_wait_ms(latency_class) + self.wait_per_row_ms * rows
        return min(self.max_wait_ms, wait_ms) / 1000.0


class _Entry:
    """A pending request and how many of its rows have been handed out."""

    __slots__ = ("request", "seq", "next_row", "split", "done")

    def __init__(self, request: PendingRequest, seq: int) -> None:
        self.request = request
        self.seq = seq  # insertion order: the tie-breaker that makes every decision deterministic
        self.next_row = 0
        self.split = False  # some rows handed out, the rest still pending
        self.done = False

    @property
    def remaining(self) -> int:
        return self.request.rows - self.next_row


class _Group:
    """Pending requests for one ``(layer_id, op)``: one queue per latency class, sorted by arrival."""

    __slots__ = ("layer_id", "op", "queues", "deadlines", "client_counts", "pending_rows", "started")

    def __init__(self, layer_id: str, op: Op) -> None:
        self.layer_id = layer_id
        self.op = op
        self.queues: dict[LatencyClass, deque[_Entry]] = {c: deque() for c in _CLASS_ORDER}
        # Min-heap of (ready_s, seq, entry); entries of finished or dropped requests are skipped lazily.
        self.deadlines: list[tuple[float, int, _Entry]] = []
        self.client_counts: dict[str, int] = {}
        self.pending_rows = 0
        self.started = 0  # pending requests with some rows already handed out

    def insert(self, entry: _Entry, ready_s: float) -> None:
        queue = self.queues[entry.request.latency_class]
        position = len(queue)
        # Arrivals come almost always in order; walk back only for a late-added earlier arrival.
        while position > 0 and queue[position - 1].request.arrival_s > entry.request.arrival_s:
            position -= 1
        queue.insert(position, entry)
        heapq.heappush(self.deadlines, (ready_s, entry.seq, entry))
        client = entry.request.client_id
        self.client_counts[client] = self.client_counts.get(client, 0) + 1
        self.pending_rows += entry.request.rows

    def forget(self, entry: _Entry) -> None:
        """Bookkeeping once ``entry`` left its queue (finished or dropped)."""
        entry.done = True
        self.pending_rows -= entry.remaining
        if entry.split:
            self.started -= 1
        client = entry.request.client_id
        left = self.client_counts[client] - 1
        if left:
            self.client_counts[client] = left
        else:
            del self.client_counts[client]

    def earliest_ready_s(self) -> float:
        while self.deadlines[0][2].done:
            heapq.heappop(self.deadlines)
        return self.deadlines[0][0]

    def heads(self) -> list[_Entry]:
        return [q[0] for q in self.queues.values() if q]

    def is_empty(self) -> bool:
        return not self.client_counts


class Scheduler:
    """Decides which batch the base executor runs next; see the module docstring for the policy.

    The executor loop calls ``add`` for each arriving request, then ``next_batch(clock())`` until it
    returns None, then sleeps until ``next_wakeup`` or a new arrival. Every request is completed by
    handing out its rows ``[0, rows)`` in increasing, contiguous, non-overlapping slices; a request
    with 0 rows is handed out once as the empty slice ``[0, 0)``.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._row_budget = config.row_budget
        self._aging_s = config.aging_ms / 1000.0
        self._lockstep_timeout_s = config.lockstep_timeout_ms / 1000.0
        self._groups: dict[tuple[str, Op], _Group] = {}  # only groups with pending requests
        self._entries: dict[int, _Entry] = {}  # request_id -> pending entry
        self._by_client: dict[str, dict[int, None]] = {}  # client -> its pending request ids, in add order
        self._clients: set[str] = set()  # joined clients, explicitly or by sending a request
        self._seq = 0
        self._pending_rows = 0
        self._batches = 0
        self._rows_served = 0
        self._completed = {c.value: 0 for c in _CLASS_ORDER}
        self._dropped = 0
        self._max_first_wait_s = {c.value: 0.0 for c in _CLASS_ORDER}
        self._sum_first_wait_s = {c.value: 0.0 for c in _CLASS_ORDER}
        self._ready_reasons = {"deadline": 0, "started": 0, "full": 0, "all_clients": 0, "none_coming": 0, "overdue": 0}
        self._predict = config.policy == "opportunistic" and config.predict_arrivals
        self._arrivals = ArrivalPredictor()  # fed always; consulted by opportunistic with predictions

    # ----------------------------------------------------------------------------- clients

    def client_joined(self, client_id: str) -> None:
        self._clients.add(client_id)

    def client_left(self, client_id: str) -> list[int]:
        """Forget the client and drop its pending requests (partly served ones too); returns their ids."""
        self._clients.discard(client_id)
        self._arrivals.forget(client_id)
        dropped = list(self._by_client.pop(client_id, {}))
        for request_id in dropped:
            entry = self._entries.pop(request_id)
            key = (entry.request.layer_id, entry.request.op)
            group = self._groups[key]
            group.queues[entry.request.latency_class].remove(entry)
            self._pending_rows -= entry.remaining
            group.forget(entry)
            if group.is_empty():
                del self._groups[key]
        self._dropped += len(dropped)
        return dropped

    # ----------------------------------------------------------------------------- requests

    def add(self, request: PendingRequest) -> None:
        if request.rows < 0:
            raise ValueError(f"request {request.request_id} has rows={request.rows}; rows must be >= 0")
        if request.request_id in self._entries:
            raise ValueError(f"request id {request.request_id} is already pending; ids must be unique")
        self._clients.add(request.client_id)
        entry = _Entry(request, self._seq)
        self._seq += 1
        key = (request.layer_id, request.op)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(request.layer_id, request.op)
        group.insert(entry, self._ready_s(request))
        self._arrivals.arrived(request)
        self._entries[request.request_id] = entry
        self._by_client.setdefault(request.client_id, {})[request.request_id] = None
        self._pending_rows += request.rows

    def _ready_s(self, request: PendingRequest) -> float:
        """When waiting for more rows stops being worth it for this request alone."""
        policy = self.config.policy
        if policy == "immediate":
            return request.arrival_s
        if policy == "lockstep":
            return request.arrival_s + self._lockstep_timeout_s
        return request.arrival_s + self.config.wait_budget_s(request.rows, request.latency_class)

    # ----------------------------------------------------------------------------- readiness

    def _ready_now_reason(self, group: _Group) -> str | None:
        """Why ``group`` is ready regardless of the clock, or None."""
        if group.started:
            return "started"  # its service has begun; holding the rest back gains nothing
        policy = self.config.policy
        if policy != "immediate" and len(group.client_counts) >= len(self._clients):
            return "all_clients"  # no other joined client can add to this group
        if policy == "opportunistic" and group.pending_rows >= self._row_budget:
            return "full"
        return None

    def _hold_until_s(self, group: _Group, now_s: float) -> tuple[float, str]:
        """Until when ``group`` may wait without new arrivals, and what ends the wait then."""
        deadline_s = group.earliest_ready_s()
        if not self._predict:
            return deadline_s, "deadline"
        latest_s = -math.inf
        for expected_s, gap_s in self._arrivals.expected(group.layer_id, group.op, group.client_counts, now_s):
            give_up_s = expected_s + gap_s  # one hop of slack for jitter in its pace
            if expected_s <= deadline_s:  # one that arrives later cannot be waited for anyway
                latest_s = max(latest_s, give_up_s)
        if latest_s == -math.inf:
            return -math.inf, "none_coming"
        if latest_s < deadline_s:
            return latest_s, "overdue"
        return deadline_s, "deadline"

    def _ready_reason(self, group: _Group, now_s: float) -> str | None:
        reason = self._ready_now_reason(group)
        if reason is None:
            hold_until_s, why = self._hold_until_s(group, now_s)
            if hold_until_s <= now_s:
                reason = why
        return reason

    def next_wakeup(self, now_s: float) -> float | None:
        """Earliest time (never before ``now_s``) at which ``next_batch`` may return a batch without
        new arrivals; None when nothing is pending."""
        if not self._groups:
            return None
        wakeup = math.inf
        for group in self._groups.values():
            if self._ready_now_reason(group) is not None:
                return now_s
            wakeup = min(wakeup, self._hold_until_s(group, now_s)[0])
        return max(now_s, wakeup)

    # ----------------------------------------------------------------------------- batching

    def _pick(self, group: _Group, aged_before_s: float) -> _Entry | None:
        """The next request to serve in ``group``: aged ones oldest first, else by class, then arrival."""
        oldest: _Entry | None = None
        for entry in group.heads():
            if entry.request.arrival_s <= aged_before_s and (
                oldest is None or (entry.request.arrival_s, entry.seq) < (oldest.request.arrival_s, oldest.seq)
            ):
                oldest = entry
        if oldest is not None:
            return oldest
        for queue in group.queues.values():  # in _CLASS_ORDER
            if queue:
                return queue[0]
        return None

    def _group_rank(self, group: _Group, aged_before_s: float) -> tuple:
        heads = group.heads()
        oldest = min(heads, key=lambda e: (e.request.arrival_s, e.seq))
        if oldest.request.arrival_s <= aged_before_s:
            return (0, 0, oldest.request.arrival_s, oldest.seq)
        first = next(q[0] for q in group.queues.values() if q)  # highest class present
        return (1, first.request.latency_class.priority, first.request.arrival_s, first.seq)

    def next_batch(self, now_s: float) -> Batch | None:
        """The batch to run now, or None if every group with pending work should keep waiting."""
        aged_before_s = now_s - self._aging_s
        best: tuple | None = None
        best_key: tuple[str, Op] | None = None
        best_reason = ""
        for key, group in self._groups.items():
            reason = self._ready_reason(group, now_s)
            if reason is None:
                continue
            rank = self._group_rank(group, aged_before_s)
            if best is None or rank < best:
                best, best_key, best_reason = rank, key, reason
        if best_key is None:
            return None
        self._ready_reasons[best_reason] += 1
        return self._fill(best_key, now_s, aged_before_s)

    def _fill(self, key: tuple[str, Op], now_s: float, aged_before_s: float) -> Batch:
        group = self._groups[key]
        slices: list[RowSlice] = []
        rows = 0
        while True:
            entry = self._pick(group, aged_before_s)
            if entry is None:
                break
            room = self._row_budget - rows
            if room == 0 and entry.remaining > 0:
                break
            request = entry.request
            take = min(entry.remaining, room)
            if entry.next_row == 0:
                waited = now_s - request.arrival_s
                cls = request.latency_class.value
                self._max_first_wait_s[cls] = max(self._max_first_wait_s[cls], waited)
                self._sum_first_wait_s[cls] += waited
            slices.append(RowSlice(request.request_id, entry.next_row, entry.next_row + take))
            rows += take
            self._pending_rows -= take
            if take == entry.remaining:
                group.queues[request.latency_class].popleft()
                entry.next_row += take
                group.pending_rows -= take
                self._finish(group, entry, now_s)
            else:  # split: the rest is continued in a later batch
                if not entry.split:
                    entry.split = True
                    group.started += 1
                entry.next_row += take
                group.pending_rows -= take
                break
        if group.is_empty():
            del self._groups[key]
        self._batches += 1
        self._rows_served += rows
        return Batch(layer_id=group.layer_id, op=group.op, slices=tuple(slices))

    def _finish(self, group: _Group, entry: _Entry, now_s: float) -> None:
        request = entry.request
        self._arrivals.handed_out(request, now_s)  # its client's pace is measured from here
        group.forget(entry)
        del self._entries[request.request_id]
        client_requests = self._by_client[request.client_id]
        del client_requests[request.request_id]
        if not client_requests:
            del self._by_client[request.client_id]
        self._completed[request.latency_class.value] += 1

    # ----------------------------------------------------------------------------- introspection

    def pending_rows(self) -> int:
        """Rows not yet handed out, over all pending requests."""
        return self._pending_rows

    def alone(self, client_id: str) -> bool:
        """Nothing is pending and no other client has joined: no policy could batch a request of
        ``client_id`` with anything, so the engine may serve it at once without queueing it."""
        return not self._entries and (not self._clients or self._clients == {client_id})

    def served_alone(self, client_id: str, rows: int, latency_class: LatencyClass) -> None:
        """Account for a request the engine served at once (see ``alone``) as a batch of its own."""
        self._clients.add(client_id)
        self._batches += 1
        self._rows_served += rows
        self._completed[latency_class.value] += 1

    def stats(self) -> dict:
        pending_requests = {c.value: 0 for c in _CLASS_ORDER}
        pending_rows = {c.value: 0 for c in _CLASS_ORDER}
        for group in self._groups.values():
            for cls, queue in group.queues.items():
                pending_requests[cls.value] += len(queue)
                pending_rows[cls.value] += sum(e.remaining for e in queue)
        return {
            "policy": self.config.policy,
            "config": asdict(self.config),
            "joined_clients": len(self._clients),
            "pending_groups": len(self._groups),
            "pending_requests": pending_requests,
            "pending_rows": pending_rows,
            "completed_requests": dict(self._completed),
            "dropped_requests": self._dropped,
            "batches": self._batches,
            "rows_served": self._rows_served,
            "mean_batch_rows": self._rows_served / self._batches if self._batches else 0.0,
            "max_first_wait_ms": {c: s * 1000.0 for c, s in self._max_first_wait_s.items()},
            "mean_first_wait_ms": {
                c: 1000.0 * s / self._completed[c] if self._completed[c] else 0.0 for c, s in self._sum_first_wait_s.items()
            },
            "ready_reasons": dict(self._ready_reasons),
        }
