"""Batching policy of the base executor: which rows of which requests to multiply next, and when.

Pure policy: the scheduler takes request descriptions (``PendingRequest``), product durations the
engine measured (``batch_done``) and a clock value passed in by the caller, and returns decisions
(``Batch``). It does no I/O, no math, no threading and never reads a clock, so it is tested with
plain floats.

**Groups and readiness.** Requests are grouped by ``(layer_id, op)``: only rows for the same base
layer and the same product can share one GEMM. The policy decides when a group is *ready*:

- ``immediate`` ("no-lockstep"): at once.
- ``lockstep``: when every joined client has a request in the group (the way HF/vLLM keep one
  batch through all layers), or after ``lockstep_timeout_ms`` so that a stalled client cannot
  freeze others.
- ``opportunistic`` (default): wait only where waiting pays. Which waiting pays differs between
  client threads, client processes and remote clients, so with ``wait_rule="adaptive"`` (default)
  the scheduler keeps trying three rules and uses the best (``wait_tuner.py``): no waiting,
  waiting for clients *predicted* to arrive within the request's wait budget, and waiting for a
  *convoy* of every client on its way to the layer. ``wait_rule`` may also fix one of them, or
  ``budget`` (hold every request for its whole wait budget: the paper's rule). Whichever rule, a
  group stops waiting once waiting cannot help (it fills ``row_budget``, or every joined client is in it).

Arrivals (``arrivals.py``): clients walk the base layers of an op in a fixed order, one request
at a time; the predictor learns that order and each client's pace from arrivals. A client behind
a group's layer in the same pass, or one that repeats its op (a decoder) and will come round
again, is *on its way*. The predicted rule waits for one until its expected arrival plus one gap
of its pace, if that is within the request's wait budget (clients without a measured pace are
not waited for). The convoy rule waits, up to ``lockstep_timeout_ms``, for every client on its way
that is not idle, however far: every group waits for the same clients, so they meet and then
walk together, as in lockstep. Neither waits for clients in another op (fine-tuning in backward
while the group is forward).

**Sharing between clients: two lanes.** A decode or prefill request of at most
``decode_share_rows`` rows is *latency* work; fine-tuning, and anything larger (a long prompt, or
a client that labels big work ``decode``), is *bulk* work. Latency work goes first. Within a lane,
the batch is led by the client with the smallest virtual start tag (start-time fair queueing on
rows): each slice handed out charges its client ``rows + REQUEST_CHARGE_ROWS``, and a client that
becomes busy again starts at the lane's virtual time, so a client's own backlog only ever delays
the client itself: another client's request waits for at most the product running when it
arrives. Bulk work is not starved behind a stream of latency work: it is owed its fair share of
executor time (bulk clients / active clients): each product led by latency work adds
``share / (1 - share)`` of its duration to what bulk is owed, each product led by bulk work takes
its own duration off, and bulk leads ahead of waiting latency work while it is owed. Within one
client's own queue, its most urgent class goes first, except that a request that waited
``aging_ms`` goes first (oldest first), so a client's own decode stream cannot starve its own
fine-tuning.

**Two runners.** An engine with a background bulk lane (``SchedulerConfig.bulk_lane``, see
``engine.py``) runs the lanes in two threads at once and asks ``next_batch`` for one lane's
batches: latency batches carry no bulk rows, and bulk batches are neither held, nor owed shares,
nor cut to the decoders' delay budget (the OS's priorities keep bulk products out of their way;
and whether waiting for another client pays depends on latency work the bulk runner does not
see), so what follows about owed shares and chunks applies to the shared lane, where one runner
serves both -- except pacing: a flood, and with a target all bulk work, slows decoders outside
the queue too (its clients' own work, the server's socket thread reading its rows, the cores'
memory bandwidth), which no CPU priority of the executor's reaches, so they are paced on their own
runners as well, their products cut to what the allowance can owe (``CREDIT_CAP_S``); a target's
allowance there fills ``bulk_runners`` times as fast (a share of 1 leaves every runner busy).

**Chunks and a decode target.** A batch holds at most ``row_budget`` rows; while a client is
decoding, the bulk rows of a batch are further cut to what the learned cost model says fits in
the decoders' delay budget (``pacing.py``: ``decode_slowdown`` times their own time per call, or
with ``decode_slo_ms`` the per-call slack of the target), never below ``min_chunk_rows``, and
with a target, a batch that bulk work leads (not a flood's, nor a chunk sized to the decoders'
free time alone, below) not below the rows whose time equals its product's fixed part
(``CostModel.break_even_rows``; at most twice the largest product measured). The per-call
budget is a worst case -- only the calls that come while a chunk runs wait for it -- and a chunk
cut below that spends more of the executor on the fixed part than on rows; with a target the
feedback then holds the share down for products that mostly did nothing. Where each call's wait
is a chunk's remaining time and the feedback sets how often one comes, twice the fixed part is
the chunk that moves the most rows for the same delay. Measured in the simulator (a product of
100 us + 2 us a row, a target of 1.2x; opportunistic): streams 5 ms apart beside fine-tuning,
p95 x1.07 -> x1.02 of the target and fine-tuning kept 40% -> 47%; on a CPU's terms (free time at
the feedback's share) 17% -> 37%; on this host's products (hidden 512) the fixed part is worth
~20 rows, about ``min_chunk_rows``. Not without a target: there nothing would make up for the
longer waits (2 decoders beside a fine-tuning walker in the simulator: chunks of 50 rows instead
of 16, the decoders' p95 +28%). The rest of a cut request is continued in a later batch.
This is FlexLLM's token-level fine-tuning (a fine-tuning sequence cut into windows that ride along
with inference) done at the executor, where it is free: base layers are row-independent, so any
row chunking gives the same result. With a target, the share bulk work is owed, and the most of
the wall clock it may use while decoders are active (a second credit), are ``bulk_share``: a
share that feedback from the decoders' measured token times keeps as large as the target allows
(never below ``MIN_BULK_SHARE``), so fine-tuning gets everything the target leaves. The target
never shortens the decoders' holds for each other (see ``_hold_until_s``). Without a target, a
client with a backlog (a flood: several requests queued, or one with more rows left than a batch
holds) is paced the same way, on its own share (``backlog_share``) and against each decoder's own
pace (``1 + decode_slowdown`` times its fastest token), since it slows decoders outside the queue
too (the server's socket thread, the host's cores); its rows riding along in a batch led by a
decoder spend the same allowance, and wait while it is spent.

**The decoders' free time.** On the shared lane, a bulk batch that leads while decoders are active
may run until the first of their next calls is due (``ArrivalPredictor.next_call_s``: one gap of
its own after a decoder's last request was handed out, or its turn after a pass; or the end of a
hold of latency work already queued), where that is longer than the delay budget: its product
delays none of them, so only what it runs past that time spends the allowance, and with the
allowance spent it may still lead with a chunk that fits in that time. With a target, on an
executor whose products take the cores the clients' own work needs (a CPU, with its clients
threads or processes on the same host: ``products_share_client_cores``, which the engine sets from
its device), the free time counts at ``bulk_share``: there free time is not free, and only the
feedback sees that (client threads on this 2-core host, unscaled: the p95 x1.12-1.18 of the
target against x1.04-1.07 before). On an accelerator it counts whole. A flood is never let into
free time (its work slows decoders outside the queue). Measured in the simulator, whose executor
is the only shared resource (a target of 1.2x the decoders' p95 alone; immediate /
opportunistic; fine-tuning's share of its solo rate): before free time counted at all, 6 streams
stepping together every 30 ms beside 2 fine-tuning walkers kept 10% / 17%, the same streams 5 ms
apart 12% / 3%, 3 decoders back to back (``coserving`` in the tests) 28% / 53%; with free time
at ``bulk_share``, 62% / 77%, 20% / 17%, 46% / 58%; counted whole, 62% / 83%, 38% / 40%, 82% /
79%. The p95 against the target, scaled -> whole: x1.00 / x1.03 -> x0.99 / x1.04, x1.02 / x1.04
-> x1.03 / x1.07, x1.00 / x1.00 -> x1.01 / x1.01 (2026-12-07; the feedback aims the p95 at the
target itself).

Cost per call: O(groups + pending requests); opportunistic with predictions: O(groups x clients);
a plan in which bulk work may lead while decoders are active adds O(decoders) (``_free_until_s``).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict

from symbiosis.executor.arrivals import ArrivalPredictor
from symbiosis.executor.pacing import MIN_BULK_SHARE, CostModel, DecodeGuard, TimeCredit
from symbiosis.executor.requests import Batch, PendingRequest, RowSlice
from symbiosis.executor.scheduler_config import POLICIES, Policy, SchedulerConfig
from symbiosis.executor.wait_tuner import (
    IDLE_HOST_BUSY_SHARE,
    IDLE_HOST_SPARE_CORES,
    IDLE_HOST_START_RULE,
    IN_PROCESS_START_RULE,
    START_RULE,
    WaitTuner,
)
from symbiosis.vocabulary import LatencyClass, Op

__all__ = ["POLICIES", "Lane", "Policy", "Scheduler", "SchedulerConfig", "REQUEST_CHARGE_ROWS"]

# Latency classes in the order a client's own queue serves them (decode first).
_CLASS_ORDER: tuple[LatencyClass, ...] = tuple(sorted(LatencyClass, key=lambda c: c.priority))
# What a slice costs in fair queueing besides its rows: a product's fixed part, so that a stream
# of 1-row requests is not free next to a client that sends few large ones.
REQUEST_CHARGE_ROWS = 8
# A trial of a waiting rule lasts at least this many tokens of the slowest active decoder.
EPOCH_TOKENS = 5
# Most executor time bulk work may take in one go on credit (its guarantee or its allowance).
CREDIT_CAP_S = 0.002
# The furthest ahead bulk work counts the decoders' free time (``Scheduler._free_until_s``): with
# no decoder due, a chunk is cut by ``row_budget`` alone.
FREE_TIME_CAP_S = 1.0
# Bulk work is never owed more than this share of the time while latency work waits.
MAX_OWED_SHARE = 0.95
# What a product is taken to last before any has been measured (sharing time needs some unit).
NOMINAL_PRODUCT_S = 1e-4
# A client counts as active (for the bulk lane's fair share) this long after its last request.
ACTIVE_CLIENT_S = 1.0
# Bulk threads split a lone bulk batch between them (``next_batch``'s ``share``) into parts of no
# fewer rows than this. A split pays only when the other cores would idle: with other work for
# them (another job's next request, the clients' own work) each part's product does less per row
# than the whole. Measured (2026-11-28, 2 cores, ~105M llama, 64-row fine-tuning requests): 2
# client processes 209 tokens/s with 64-row batches split in halves, 231-236 without; 4 and 8 the
# same either way; one lone 64-row batch's products x1.22 faster split. Per row, 1-thread
# products of 128 rows are within ~5% of larger ones, so a split costs little from there up.
SPLIT_MIN_ROWS = 128


class Lane(enum.IntEnum):
    """The two lanes of work, in the order a single runner serves them (see the module doc)."""

    LATENCY = 0
    BULK = 1


LATENCY, BULK = Lane.LATENCY, Lane.BULK


class _Entry:
    """A pending request and how many of its rows have been handed out."""

    __slots__ = ("request", "seq", "next_row", "done", "client", "group", "budget_deadline_s", "lane")

    def __init__(
        self,
        request: PendingRequest,
        seq: int,
        client: _Client,
        group: _Group,
        budget_deadline_s: float,
        lane: Lane,
    ):
        self.request = request
        # Its lane (``Scheduler.lane_of``), fixed by its class and size: asked of every entry on
        # every plan and fill, where working it out again cost the serving thread more than it did.
        self.lane = lane
        self.seq = seq  # insertion order: the tie-breaker that makes every decision deterministic
        self.next_row = 0
        self.done = False
        self.client = client
        self.group = group
        self.budget_deadline_s = budget_deadline_s  # arrival + its opportunistic wait budget

    @property
    def remaining(self) -> int:
        return self.request.rows - self.next_row


class _Client:
    """A client's pending requests (in add order), its virtual start tag (rows), its last arrival."""

    __slots__ = ("client_id", "entries", "tag", "last_arrival_s", "last_lane")

    def __init__(self, client_id: str) -> None:
        self.client_id = client_id
        self.entries: list[_Entry] = []
        self.tag = 0.0
        self.last_arrival_s = -math.inf
        self.last_lane = LATENCY  # the lane of its last request: a bulk client stays one between requests

    def active(self, now_s: float, within_s: float = ACTIVE_CLIENT_S) -> bool:
        """It has a request pending, or sent one in the last ``within_s``."""
        return bool(self.entries) or now_s - self.last_arrival_s <= within_s


class _Group:
    """Pending requests for one ``(layer_id, op)``, in arrival order."""

    __slots__ = ("layer_id", "op", "entries", "client_counts", "pending_rows", "started", "budget_deadline_s")

    def __init__(self, layer_id: str, op: Op) -> None:
        self.layer_id = layer_id
        self.op = op
        self.entries: list[_Entry] = []
        self.client_counts: dict[str, int] = {}
        self.pending_rows = 0
        self.started = 0  # pending requests with some rows already handed out
        self.budget_deadline_s = math.inf

    @property
    def key(self) -> tuple[str, Op]:
        return (self.layer_id, self.op)

    def insert(self, entry: _Entry) -> None:
        position = len(self.entries)
        # Arrivals come almost always in order; walk back only for a late-added earlier arrival.
        while position > 0 and self.entries[position - 1].request.arrival_s > entry.request.arrival_s:
            position -= 1
        self.entries.insert(position, entry)
        client = entry.request.client_id
        self.client_counts[client] = self.client_counts.get(client, 0) + 1
        self.pending_rows += entry.request.rows
        self.budget_deadline_s = min(self.budget_deadline_s, entry.budget_deadline_s)

    def remove(self, entry: _Entry) -> None:
        """Bookkeeping once ``entry`` is finished or dropped."""
        entry.done = True
        self.entries.remove(entry)
        self.pending_rows -= entry.remaining
        if entry.next_row > 0 and entry.remaining > 0:
            self.started -= 1
        client = entry.request.client_id
        left = self.client_counts[client] - 1
        if left:
            self.client_counts[client] = left
        else:
            del self.client_counts[client]
        if not self.entries:  # the usual case on the queued path: a batch took the group's one request
            self.budget_deadline_s = math.inf
        elif entry.budget_deadline_s <= self.budget_deadline_s:
            self.budget_deadline_s = min(e.budget_deadline_s for e in self.entries)

    def oldest_arrival_s(self) -> float:
        return self.entries[0].request.arrival_s


class Scheduler:
    """Decides which batch the base executor runs next; see the module docstring for the policy.

    The executor loop calls ``add`` for each arriving request, then ``next_batch(clock())`` until it
    returns None, then sleeps until ``next_wakeup`` or a new arrival; it reports each product's
    duration with ``batch_done``. Every request is completed by handing out its rows ``[0, rows)``
    in increasing, contiguous, non-overlapping slices; a request with 0 rows is handed out once as
    the empty slice ``[0, 0)``.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._row_budget = config.row_budget
        self._min_chunk_rows = min(config.min_chunk_rows, config.row_budget)
        self._last_delay_budget_s: float | None = None  # the decode guard's, at the last batch with bulk rows (stats)
        # Threads that run bulk batches at once: 1 (the shared lane's runner) unless an engine
        # with a background bulk lane says how many; a target's allowance fills that many times
        # as fast, so that a share of 1 paces nothing there either.
        self.bulk_runners = 1
        # Whether a product takes cores the clients' own work needs (an executor on a CPU, its
        # clients threads or processes on the same host): then the decoders' free time is not
        # free, and with a target it counts at ``bulk_share`` (``_bulk_may_lead``). The engine
        # says so from its device; the default is an executor on an accelerator, whose products
        # take only its own time (the simulator's model).
        self.products_share_client_cores = False
        self._aging_s = config.aging_ms / 1000.0
        self._lockstep_timeout_s = config.lockstep_timeout_ms / 1000.0
        self._groups: dict[tuple[str, Op], _Group] = {}  # only groups with pending requests
        self._entries: dict[int, _Entry] = {}  # request_id -> pending entry
        self._client_state: dict[str, _Client] = {}  # every client that sent a request and has not left
        self._clients: set[str] = set()  # joined clients, explicitly or by sending a request
        self._virtual = [0.0, 0.0]  # per lane, fair queueing's virtual time: the start tag of its last lead
        self._seq = 0
        self._pending_rows = 0
        self._batches = 0
        self._rows_served = 0
        self._completed = {c.value: 0 for c in _CLASS_ORDER}
        self._dropped = 0
        self._chunks_cut = 0  # bulk slices cut short by the decoders' delay budget
        self._free_time_batches = 0  # bulk batches led in the decoders' free time with the allowance spent
        self._max_first_wait_s = {c.value: 0.0 for c in _CLASS_ORDER}
        self._sum_first_wait_s = {c.value: 0.0 for c in _CLASS_ORDER}
        self._ready_reasons = {
            "deadline": 0,
            "started": 0,
            "full": 0,
            "all_clients": 0,
            "none_coming": 0,
            "overdue": 0,
            "not_waiting": 0,
            "alone": 0,  # served at once by the engine: no other client's request could join it
        }
        opportunistic = config.policy == "opportunistic"
        self._tuner = (
            WaitTuner(config.adapt_epoch_ms / 1000.0) if opportunistic and config.wait_rule == "adaptive" else None
        )
        self._fixed_rule = config.wait_rule if opportunistic else config.policy
        self._in_process: set[str] = set()  # clients that are threads of this process (``client_in_process``)
        # How busy the host's CPUs are (``read_host_load``; a share of all their time, or None):
        # the engine gives a reader; without one, the start does not depend on it.
        self._host_busy: Callable[[], float | None] | None = None
        self._host_cores: int | None = None  # how many cores that share is of (None: not known)
        self._host_busy_share: float | None = None  # the last reading (stats)
        self._arrivals = ArrivalPredictor()  # fed always; consulted by the opportunistic rules
        self._cost = CostModel()
        slo_s = None if config.decode_slo_ms is None else config.decode_slo_ms / 1000.0
        self._guard = DecodeGuard(slo_s, config.decode_slowdown)
        # The convoy rule's view during one plan, filled as it is asked (``_convoy_waits_for``):
        # whether a group is served now whatever the convoy does.
        self._convoy_served_now: dict[_Group, bool] = {}
        # Bulk's guaranteed share: executor time it is owed (seconds, within +-CREDIT_CAP_S); each
        # product led by latency work adds share / (1 - share) of its duration, each led by bulk
        # work subtracts its duration. Bulk leads ahead of waiting latency work while it is owed.
        self._owed_s = 0.0
        self._allowed = TimeCredit(CREDIT_CAP_S, start_s=CREDIT_CAP_S)  # with a target: bulk's most
        # (key, lane, estimated duration, the decoders' free time it started in)
        self._last_fill: tuple[tuple[str, Op], int, float, float] | None = None
        # The decoders' free time when bulk work was last let lead (``_bulk_may_lead``; None in a
        # plan that did not ask), and whether only that time was allowed it (the allowance spent).
        self._free_s: float | None = None
        self._free_only = False
        self._lane_batches = [0, 0]
        self._owed_share = 0.5

    # ----------------------------------------------------------------------------- clients

    def client_joined(self, client_id: str) -> None:
        self._clients.add(client_id)

    def client_in_process(self, client_id: str) -> None:
        """``client_id`` calls from a thread of the executor's own process (the engine's ``call``),
        not over a transport: while every joined client does, the wait tuner starts on
        ``wait_tuner.IN_PROCESS_START_RULE`` whatever the host's room (they take turns on one
        interpreter lock, which the host's reading does not see; see its module doc)."""
        self._in_process.add(client_id)

    def read_host_load(self, busy_share: Callable[[], float | None], cores: int | None = None) -> None:
        """Where to read how busy the host's CPUs are (``host_load.HostCpu.busy_share``: the share
        of all CPU time not idle over the last seconds), and how many ``cores`` share that time.
        While the host has room -- it reads below ``wait_tuner.IDLE_HOST_BUSY_SHARE`` and leaves
        ``wait_tuner.IDLE_HOST_SPARE_CORES`` idle, when ``cores`` is known -- clients that are not
        threads of this process start from not waiting (``wait_tuner.IDLE_HOST_START_RULE``;
        see its module doc)."""
        self._host_busy = busy_share
        self._host_cores = cores

    def client_left(self, client_id: str) -> list[int]:
        """Forget the client and drop its pending requests (partly served ones too); returns their ids."""
        self._clients.discard(client_id)
        self._in_process.discard(client_id)
        self._arrivals.forget(client_id)
        self._guard.forget(client_id)
        state = self._client_state.pop(client_id, None)
        dropped = [] if state is None else [e.request.request_id for e in state.entries]
        for request_id in dropped:
            entry = self._entries.pop(request_id)
            group = entry.group
            self._pending_rows -= entry.remaining
            group.remove(entry)
            if not group.entries:
                del self._groups[group.key]
        self._dropped += len(dropped)
        return dropped

    # ----------------------------------------------------------------------------- requests

    def add(self, request: PendingRequest) -> None:
        if request.rows < 0:
            raise ValueError(f"request {request.request_id} has rows={request.rows}; rows must be >= 0")
        if request.request_id in self._entries:
            raise ValueError(f"request id {request.request_id} is already pending; ids must be unique")
        self._clients.add(request.client_id)
        client = self._client_state.get(request.client_id)
        if client is None:
            client = self._client_state[request.client_id] = _Client(request.client_id)
        lane = self.lane_of(request.latency_class, request.rows)
        if not client.entries:  # busy again: it starts at its lane's virtual time, never earlier
            client.tag = max(client.tag, self._virtual[lane])
        key = (request.layer_id, request.op)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(request.layer_id, request.op)
        budget_deadline_s = request.arrival_s + self.config.wait_budget_s(request.rows, request.latency_class)
        entry = _Entry(request, self._seq, client, group, budget_deadline_s, lane)
        self._seq += 1
        group.insert(entry)
        client.entries.append(entry)
        self._entries[request.request_id] = entry
        self._pending_rows += request.rows
        self._note_arrival(client, request, lane)

    def _note_arrival(self, client: _Client, request: PendingRequest, lane: Lane) -> None:
        """What an arrival teaches: the client's last arrival and lane, its place and pace
        (arrival predictor), whether it is a decoder (decode guard). For a queued request and for
        one served at once alike (``serves_at_once``)."""
        client.last_arrival_s = max(client.last_arrival_s, request.arrival_s)
        client.last_lane = lane
        latency = lane == LATENCY
        position = self._arrivals.arrived(request, latency)
        # A decoder is a client decoding decode-sized requests: one that labels bulk work "decode"
        # gets no decoder's protection for it (nor does its pace count as a decoder's).
        is_decode = latency and request.latency_class is LatencyClass.DECODE
        token_s = self._guard.arrived(
            request.client_id, request.op, is_decode, position, request.arrival_s, is_latency=latency
        )
        if token_s is not None and self._tuner is not None:  # what the tuner compares decoders on
            self._tuner.token(request.client_id, token_s, request.arrival_s)

    def _note_hand_out(self, request: PendingRequest, lane: Lane, now_s: float) -> None:
        """``request``'s last rows were handed out at ``now_s`` (queued or served at once): its
        client's next step starts now (arrival predictor, decode guard), and the wait tuner counts it."""
        self._arrivals.handed_out(request, now_s)  # its client's pace is measured from here
        self._guard.handed_out(request.client_id, now_s)
        if self._tuner is not None:
            latency_rows = request.rows if lane == LATENCY else 0  # what weighs the client in a trial's cost
            self._tuner.handed_out(request.client_id, 1, request.rows, now_s, latency_rows)

    def batch_done(self, batch: Batch, duration_s: float | None, now_s: float) -> None:
        """The engine ran ``batch`` in ``duration_s`` (ending at ``now_s``): learn the product's cost,
        and correct the lanes' credits by what it took more or less than its estimate (charged when
        it was filled). ``duration_s`` None: not timed (a latency-only batch the engine sampled
        out): the estimate stands."""
        key = (batch.layer_id, batch.op)
        if duration_s is None:
            if self._last_fill is not None and self._last_fill[0] == key:
                self._last_fill = None
            return
        self._cost.observe(key, batch.rows, duration_s)
        if self._last_fill is not None and self._last_fill[0] == key:
            _, lane, estimate_s, free_s = self._last_fill
            self._charge(lane, duration_s - estimate_s, max(0.0, duration_s - free_s) - max(0.0, estimate_s - free_s))
            self._last_fill = None

    def _charge(self, lane: int, duration_s: float, paced_s: float) -> None:
        """Account ``duration_s`` of executor time to a batch led by ``lane`` (see ``_owed_s``), of
        which ``paced_s`` spends a bulk batch's allowance (what ran past the decoders' free time)."""
        if lane == BULK:
            self._owed_s -= duration_s
            self._allowed.spend(paced_s)
        else:
            self._owed_s += duration_s * self._owed_share / (1.0 - self._owed_share)
        self._owed_s = min(CREDIT_CAP_S, max(-CREDIT_CAP_S, self._owed_s))

    def lane_of(self, latency_class: LatencyClass, rows: int) -> Lane:
        """Latency work: a decode or prefill request of a decode-sized share; everything else is
        bulk. By the request's whole size: the end of a large request is bulk too."""
        small = rows <= self.config.decode_share_rows
        return LATENCY if small and latency_class is not LatencyClass.FINETUNE else BULK

    def active_clients(self, lane: Lane, now_s: float) -> int:
        """Clients of ``lane`` now: whose last request was of that lane, and that have one pending
        or sent one in the last ``ACTIVE_CLIENT_S``."""
        return sum(1 for c in self._client_state.values() if c.last_lane == lane and c.active(now_s))

    def has_pending(self, lane: Lane) -> bool:
        """Whether rows of ``lane``'s work are waiting to be handed out."""
        return any(e.lane == lane for e in self._entries.values())

    # ----------------------------------------------------------------------------- readiness

    def _tick_tuner(self, now_s: float) -> None:
        """End the wait tuner's epoch if it is due (it then rates the rule it ran, picks the next)."""
        if self._tuner is not None and self._tuner.due(now_s):
            self._tuner.start_rule = self._start_rule()
            self._tuner.tick(now_s, EPOCH_TOKENS * self._guard.longest_token_s(now_s))

    def _start_rule(self) -> str:
        """Where the wait tuner starts (``wait_tuner`` module doc): the in-process start while every
        client is a thread of this process; else not waiting while the host's CPUs have room (read
        whenever the tuner may choose, every half epoch; each reading covers the last
        ``host_load.WINDOW_S``), and the convoy while they do not."""
        self._host_busy_share = self._host_busy() if self._host_busy is not None else None
        if self._clients and self._clients <= self._in_process:  # O(clients): once an epoch
            return IN_PROCESS_START_RULE
        if self._host_has_room(self._host_busy_share):
            return IDLE_HOST_START_RULE
        return START_RULE

    def _host_has_room(self, busy_share: float | None) -> bool:
        """Whether the host's CPUs leave room for not waiting: under ``IDLE_HOST_BUSY_SHARE`` busy
        and, when the core count is known, ``IDLE_HOST_SPARE_CORES`` idle (``wait_tuner`` doc)."""
        if busy_share is None or busy_share >= IDLE_HOST_BUSY_SHARE:
            return False
        return self._host_cores is None or (1.0 - busy_share) * self._host_cores >= IDLE_HOST_SPARE_CORES

    def _rule(self) -> str:
        """The waiting rule in force: the policy's, or the opportunistic one tried or chosen now."""
        return self._tuner.rule if self._tuner is not None else self._fixed_rule

    def _ready_now_reason(self, group: _Group, rule: str) -> str | None:
        """Why ``group`` is ready regardless of the clock, or None."""
        if group.started:
            return "started"  # its service has begun; holding the rest back gains nothing
        if rule == "none":
            return "not_waiting"
        if rule != "immediate" and len(group.client_counts) >= len(self._clients):
            return "all_clients"  # no other joined client can add to this group
        if rule not in ("immediate", "lockstep") and group.pending_rows >= self._row_budget:
            return "full"
        return None

    def _hold_until_s(self, group: _Group, now_s: float, rule: str) -> tuple[float, str]:
        """Until when ``group`` may wait without new arrivals, and what ends the wait then."""
        if rule == "immediate":
            return group.oldest_arrival_s(), "deadline"
        if rule == "lockstep":
            return group.oldest_arrival_s() + self._lockstep_timeout_s, "deadline"
        if rule == "budget":
            return group.budget_deadline_s, "deadline"
        convoy = rule == "convoy"
        deadline_s = group.oldest_arrival_s() + self._lockstep_timeout_s if convoy else group.budget_deadline_s
        # No cap from ``decode_slo_ms`` here: the target paces and cuts bulk work, not the decoders'
        # holds for each other. Cutting holds to the decoders' slack (the target's share of a call
        # less their time per call, which a convoy's holds are part of) broke the convoys that made
        # them fast, and capping only while a decoder missed the target broke them just when speed
        # mattered: 6 client processes beside 2 fine-tuning jobs, p95 x1.46 and x1.54 of a
        # 1.2x-alone target with that cap, x0.96 and x1.09 without (alternated runs, 2026-11-29);
        # alone, 6 client threads ran 12-19 rows a batch with a cap against 30-32 without.
        if convoy:  # (latency work never waits for bulk work: see _walkers)
            if self._convoy_waits_for(group, now_s):
                return deadline_s, "deadline"
            return -math.inf, "none_coming"
        latency_only = self._has_latency_work(group)  # latency work never waits for bulk work
        return self._predicted_hold_until_s(
            group.layer_id, group.op, group.client_counts, now_s, deadline_s, latency_only
        )

    def _predicted_hold_until_s(
        self, layer_id: str, op: Op, present: dict[str, int], now_s: float, deadline_s: float, latency_only: bool
    ) -> tuple[float, str]:
        """The predicted rule's hold of a group for ``(layer_id, op)`` whose clients are
        ``present``: until the last client expected by ``deadline_s`` is due, plus one gap."""
        latest_s = -math.inf
        for expected_s, gap_s in self._arrivals.expected(layer_id, op, present, now_s, True, latency_only):
            if expected_s <= deadline_s:  # one that arrives later cannot be waited for anyway
                latest_s = max(latest_s, expected_s + gap_s)  # one gap of slack for jitter in its pace
        if latest_s == -math.inf:
            return -math.inf, "none_coming"
        if latest_s < deadline_s:
            return latest_s, "overdue"
        return deadline_s, "deadline"

    def _has_latency_work(self, group: _Group) -> bool:
        return self._has_work_of(group, LATENCY)

    def _has_work_of(self, group: _Group, lane: Lane) -> bool:
        return any(e.lane == lane for e in group.entries)

    def _convoy_waits_for(self, group: _Group, now_s: float) -> bool:
        """Convoy rule: whether a client on its way to ``group``'s layer can come: it is computing
        its next layer's input (nothing pending), or its pending request is in a group that is
        served now (ready whatever the rule, or with nobody to wait for: the convoy behind). One
        pending in a group that is itself held cannot come before that group is served, and
        waiting for it is how a ring of groups would wait for each other. So the clients furthest
        behind are never held, the ones ahead wait, and the convoy closes up."""
        for client_id in self._walkers(group, now_s):
            client = self._client_state.get(client_id)
            if client is None or not client.entries:
                return True  # moving
            if self._served_now(client.entries[0].group, now_s):
                return True  # will be served now
        return False

    def _walkers(self, group: _Group, now_s: float) -> Iterator[str]:
        """The clients on their way to ``group``'s layer (``ArrivalPredictor.walking``), found as
        they are asked for: the first that can come (or, for ``_served_now``, the first at all)
        ends the look. Asked only for the groups a plan holds and the groups their walkers are
        in. Found for every group at every plan (and a plan for the wakeup too), the convoy's
        scheduler time was 650 µs a batch against lockstep's 445 (client threads, 2026-12-01);
        547 and 421 with the walkers listed once per plan; found lazily, 320 against 348 for
        that listing in the simulator (``tests/sched_sim.py``, 8 walkers of batch 1-16 on 43
        layers, the scheduler's entry points timed, medians of 7; lockstep 253-264 there)."""
        return self._arrivals.walking(
            group.layer_id,
            group.op,
            group.client_counts,
            now_s,
            self._lockstep_timeout_s,
            self._has_latency_work(group),
        )

    def _served_now(self, group: _Group, now_s: float) -> bool:
        """Whether ``group`` is served now whatever the convoy does: ready regardless of the clock,
        or with nobody to wait for (``_convoy_waits_for``); once per plan."""
        served = self._convoy_served_now.get(group)
        if served is None:
            served = (
                self._ready_now_reason(group, "convoy") is not None or next(self._walkers(group, now_s), None) is None
            )
            self._convoy_served_now[group] = served
        return served

    def _own_rank(self, entry: _Entry, aged_before_s: float) -> tuple:
        """Order within one client's queue: aged requests oldest first, then by class, then arrival."""
        request = entry.request
        if request.arrival_s <= aged_before_s:
            return (0, 0, request.arrival_s, entry.seq)
        return (1, request.latency_class.priority, request.arrival_s, entry.seq)

    def _plan(self, now_s: float, only: Lane | None = None) -> tuple[_Entry | None, str, float]:
        """The request that leads the next batch (None: nothing now), why its group is ready, and
        otherwise the earliest time something may become ready without new arrivals. With
        ``only``, only that lane's work is considered, and of bulk work only a flood is paced (see
        ``next_batch``)."""
        self._tick_tuner(now_s)
        rule = self._rule()
        ready: dict[_Group, str] = {}
        wakeup_s = math.inf
        latency_hold_s = math.inf  # the end of the earliest hold of latency work (``_free_until_s``)
        self._free_s, self._free_only = None, False  # set by ``_bulk_may_lead``, read by ``_fill``
        if rule == "convoy" and only is not BULK:  # a new view for this plan (see _convoy_waits_for)
            self._convoy_served_now = {}
        for group in self._groups.values():
            if only is not None and not self._has_work_of(group, only):
                continue
            if only is BULK:  # its own runner: bulk work waits for no one (whether others come
                ready[group] = "not_waiting"  # depends on latency work this runner cannot see)
                continue
            reason = self._ready_now_reason(group, rule)
            if reason is None:
                hold_until_s, why = self._hold_until_s(group, now_s, rule)
                if hold_until_s <= now_s:
                    reason = why
                else:
                    wakeup_s = min(wakeup_s, hold_until_s)
                    if hold_until_s < latency_hold_s and self._has_latency_work(group):
                        latency_hold_s = hold_until_s
            if reason is not None:
                ready[group] = reason
        if not ready:
            return None, "", wakeup_s
        aged_before_s = now_s - self._aging_s
        best: list[tuple | None] = [None, None]  # per lane: (rank, lead entry)
        for client in self._client_state.values():
            candidates = [e for e in client.entries if e.group in ready and (only is None or e.lane == only)]
            if not candidates:
                continue
            head = candidates[0]
            if only is BULK and self._paced_on_own_runner(head) and self._allowance_spent(head, now_s):
                # The OS keeps bulk products out of the decoders' way, but a flood (and with a
                # target, any bulk work) still slows them outside the queue: paced there too.
                wakeup_s = min(wakeup_s, self._allowed.positive_at_s(now_s, self._allowance_rate()))
                continue
            if len(candidates) == 1:  # the usual case: one request per client (a walk)
                entry = head
            else:
                entry = min(candidates, key=lambda e: self._own_rank(e, aged_before_s))
            lane = entry.lane
            rank = (client.tag, entry.request.arrival_s, entry.seq)
            if best[lane] is None or rank < best[lane][0]:
                best[lane] = (rank, entry)
        latency, bulk = (b[1] if b else None for b in best)
        if bulk is not None and only is None:
            bulk, allowed_at_s = self._bulk_may_lead(bulk, now_s, latency is not None, latency_hold_s)
            wakeup_s = min(wakeup_s, allowed_at_s)
        lead = bulk if bulk is not None else latency
        if lead is None:
            return None, "", wakeup_s
        return lead, ready[lead.group], now_s

    def _bulk_may_lead(
        self, entry: _Entry, now_s: float, latency_waiting: bool, latency_hold_s: float = math.inf
    ) -> tuple[_Entry | None, float]:
        """Whether bulk work (``entry``) leads the next batch: ahead of waiting latency work only
        while owed its share; with a target and decoders active, only within its allowance, or
        in a chunk that ends before the decoders' next call is due (``_free_s``). Also when it
        may (if not now)."""
        active = [c for c in self._client_state.values() if c.active(now_s)]
        bulk_clients = sum(1 for c in active if c.last_lane == BULK)
        targeted = self._guard.slo_s is not None
        share = self._guard.bulk_share if targeted else bulk_clients / max(1, len(active))
        self._owed_share = min(MAX_OWED_SHARE, max(MIN_BULK_SHARE, share))
        flood = self._is_flood(entry)
        if not flood:  # (a flood is not let into free time: its work slows decoders outside the queue)
            free_until_s = now_s if latency_waiting else self._free_until_s(now_s, entry.client, latency_hold_s)
            # With a target, where the clients' own work shares the executor's cores, free time
            # is not free, and only the feedback sees that: it counts at the share the feedback
            # sets. Elsewhere it is whole (module doc).
            scaled = targeted and self.products_share_client_cores
            self._free_s = (free_until_s - now_s) * (self._guard.bulk_share if scaled else 1.0)
        spent = self._allowance_spent(entry, now_s)  # (this also fills the allowance up to now)
        # Paced while decoders are active: all bulk work to a target's share; without a target, a
        # client with a backlog (a flood) to the share that keeps decoders near their own pace.
        if spent and (targeted or flood):
            fits = None if flood else self._cost.rows_within(entry.group.key, self._free_s)
            if fits is not None and fits >= self._min_chunk_rows:
                self._free_only = True  # a chunk in the decoders' free time: it delays none of them
                return entry, now_s
            return None, self._allowed.positive_at_s(now_s, self._allowance_rate())
        if latency_waiting and self._owed_s <= 0:
            return None, math.inf  # latency work leads; its completion re-plans
        return entry, now_s

    def _free_until_s(self, now_s: float, exclude: _Client, latency_hold_s: float) -> float:
        """Until when the runner is expected to have no latency work to run (at most
        ``FREE_TIME_CAP_S`` ahead): the earliest of the active decoders' (but ``exclude``'s) next
        calls (``ArrivalPredictor.next_call_s``) and ``latency_hold_s``, the end of a hold of
        latency work already queued. ``now_s`` when a decoder's next call is overdue or cannot be
        foreseen."""
        until_s = min(latency_hold_s, now_s + FREE_TIME_CAP_S)
        for client_id in self._guard.active(now_s):
            if client_id == exclude.client_id:
                continue
            client = self._client_state.get(client_id)
            if client is not None and client.entries:
                continue  # queued: its group's hold is in ``latency_hold_s``
            due_s = self._arrivals.next_call_s(client_id, Op.FORWARD)
            if due_s is None or due_s <= now_s:
                return now_s
            until_s = min(until_s, due_s)
        return until_s

    def _allowance_rate(self) -> float:
        """The executor time per second of wall clock that paced bulk work may use while decoders
        are active: a share of one runner, or with a target on a background lane, of every bulk
        runner (a flood's ``backlog_share`` keeps one runner's, as it was measured)."""
        if self._guard.slo_s is None:
            return self._guard.backlog_share
        return self._guard.bulk_share * self.bulk_runners  # 1 but on a background lane

    def _paced_on_own_runner(self, entry: _Entry) -> bool:
        """Whether ``entry``'s bulk work is paced on a background bulk lane while decoders are
        active: a flood always; with a target (``decode_slo_ms``), any bulk work. Measured (issue
        11, clients as processes on this 2-core host, 6 decoders beside 2 fine-tuning clients, a
        target of 1.2x the decoders' p95 alone, four alternated rounds of 2 repeats): unpaced
        there, the decoders' p95 beside fine-tuning was 114 ms (median) and fine-tuning ran 406
        tokens/s; paced, 100 ms and 293 tokens/s; a shared lane paced to the same target kept
        9-10% of fine-tuning's solo rate, the paced background lane 14-24%."""
        return self._guard.slo_s is not None or self._is_flood(entry)

    def _is_flood(self, entry: _Entry) -> bool:
        """``entry``'s client has a backlog -- several requests queued, or more rows of one left
        than a batch holds (``row_budget``): a flood, not a client walking its layers. The second:
        a client sending one 16,384-row request at a time evaded the pacing that held the same
        rows sent 8 at a time -- client threads: the bystander's p95 x4.6-5.7 of alone beside it while
        it moved ~250k rows/s; x1.6-1.8 and ~11k rows/s once paced. A fine-tuning step of up to
        ``row_budget`` rows a layer (4096: batch 8 x 512 tokens) is not a backlog."""
        return len(entry.client.entries) > 1 or entry.remaining > self.config.row_budget

    def _allowance_spent(self, entry: _Entry, now_s: float) -> bool:
        """Decoders other than ``entry``'s client are active and paced bulk work has no time left
        (the allowance filled up to ``now_s`` first)."""
        decoding = self._decoders_active(now_s, entry.client.client_id)
        self._allowed.refill(now_s, self._allowance_rate(), filling=decoding)
        return decoding and self._allowed.credit_s <= 0

    def _decoders_active(self, now_s: float, other_than: str) -> bool:
        return any(c != other_than for c in self._guard.active(now_s))

    def _delay_budget_s(self, now_s: float, exclude: str | None = None, backlog: bool = False) -> float | None:
        """The decode guard's budget (``pacing.DecodeGuard.delay_budget_s``). A product for a client
        with a ``backlog`` (a flood: ``_is_flood``) is measured against the decoders'
        own pace (lower envelope, token-time floor), which a starved decoder cannot inflate; other
        bulk work (a fine-tuning client walking its layers, one request at a time) against their
        pace as seen, as it always was: cutting that to the decoders' fastest pace left fine-tuning
        10% of its solo rate beside 6 decoders (40% before), for p95 x1.6 instead of x1.8."""
        calls = self._arrivals.pass_length(Op.FORWARD)
        gap_of = self._arrivals.own_gap_s if backlog else self._arrivals.gap_s
        return self._guard.delay_budget_s(now_s, lambda c: gap_of(c, Op.FORWARD), calls, exclude, backlog)

    def next_wakeup(self, now_s: float, lane: Lane | None = None) -> float | None:
        """Earliest time (never before ``now_s``) at which ``next_batch`` (for ``lane``) may return a
        batch without new arrivals; None when nothing is pending."""
        if not self._groups:
            return None
        lead, _, wakeup_s = self._plan(now_s, lane)
        if lead is not None:
            return now_s
        return None if wakeup_s == math.inf else max(now_s, wakeup_s)

    def next_batch_or_wakeup(
        self, now_s: float, lane: Lane | None = None, share: int = 1
    ) -> tuple[Batch | None, float | None]:
        """``next_batch(now_s, lane, share)``, and when that is None, ``next_wakeup(now_s, lane)`` --
        from one plan. A runner asks both in turn whenever it looks for work (at every arrival),
        and the plan is most of what either costs: with client threads, whose every call waits
        for the interpreter lock the scheduler holds meanwhile, the second plan was 8% (lockstep)
        to 15% (convoy) of the scheduler's time (2026-12-01)."""
        if not self._groups:
            return None, None
        lead, reason, wakeup_s = self._plan(now_s, lane)
        if lead is not None:
            self._ready_reasons[reason] += 1
            return self._fill(lead, now_s, lane, share), None
        return None, None if wakeup_s == math.inf else max(now_s, wakeup_s)

    # ----------------------------------------------------------------------------- batching

    def next_batch(self, now_s: float, lane: Lane | None = None, share: int = 1) -> Batch | None:
        """The batch to run now, or None if every group with pending work should keep waiting.

        ``lane``: for an engine that runs the two lanes in two threads at once (bulk work at the
        OS's background priority, which preempts it for latency work): only that lane's rows, and
        bulk work neither paced nor cut into chunks for the decoders -- the OS keeps it out of
        their way -- but for a flood, which is paced as on a shared lane (the module doc). None:
        one runner serves both, as the module doc says.

        ``share`` (bulk lane only): how many idle bulk threads, this one included, could take bulk
        work now. When the bulk work is all in one group, the batch takes an equal part of its
        rows (one of ``share``, or fewer parts of ``SPLIT_MIN_ROWS`` rows or more), leaving the
        rest to the others: each thread then multiplies its part on one core, rather than one
        product on every core (see ``engine.py``); with bulk work in several groups each thread
        takes a group whole."""
        return self.next_batch_or_wakeup(now_s, lane, share)[0]

    def _split_limit(self, lead: _Entry, share: int) -> int:
        """The most rows a bulk thread takes of ``lead``'s group when ``share`` threads are idle
        (see ``next_batch``)."""
        if share <= 1:
            return self._row_budget
        group = lead.group
        for other in self._groups.values():
            if other is not group and any(e.lane == BULK for e in other.entries):
                return self._row_budget  # another group for another thread: no need to cut this one
        rows = sum(e.remaining for e in group.entries if e.lane == BULK)
        parts = min(share, rows // SPLIT_MIN_ROWS)
        return self._row_budget if parts <= 1 else min(self._row_budget, -(-rows // parts))

    def _fill(self, lead: _Entry, now_s: float, only: Lane | None = None, share: int = 1) -> Batch:
        group = lead.group
        aged_before_s = now_s - self._aging_s
        bulk_limit: int | None = None  # at the first bulk entry: a batch of latency rows never needs it
        if only is BULK:
            # Its own threads: the OS, not the chunk size, protects decoders; the rows are cut only
            # to give idle bulk threads a part each -- and paced work's to what its allowance
            # can owe (``CREDIT_CAP_S``), so that a long product does not outrun its share.
            bulk_limit = self._split_limit(lead, share)
            if self._paced_on_own_runner(lead) and self._decoders_active(now_s, lead.client.client_id):
                fits = self._cost.rows_within(group.key, CREDIT_CAP_S)
                if fits is not None:
                    bulk_limit = min(bulk_limit, max(self._min_chunk_rows, fits))
        others = (
            sorted(
                (e for e in group.entries if e is not lead and (only is None or e.lane == only)),
                key=lambda e: (
                    e.lane,
                    e.client.tag,
                    self._own_rank(e, aged_before_s),
                ),
            )
            if len(group.entries) > 1
            else ()
        )
        lane = lead.lane
        if lane == BULK:
            self._guard.bulk_ran(now_s)
        self._virtual[lane] = max(self._virtual[lane], lead.client.tag)
        self._lane_batches[lane] += 1
        slices: list[RowSlice] = []
        rows = flood_rows = bulk_rows = 0
        for entry in [lead, *others]:
            remaining = entry.remaining
            room = self._row_budget - rows
            if entry.lane == LATENCY:
                take = min(remaining, room)
            else:
                # Without a target, a flood's rows riding along in a decoder's batch are paced like
                # its own batches: they wait while its allowance is spent, else they spend it.
                flood_riding = lane == LATENCY and self._guard.slo_s is None and self._is_flood(entry)
                if flood_riding and self._allowance_spent(entry, now_s):
                    continue
                if bulk_limit is None:
                    bulk_limit = self._bulk_limit(lead, now_s)
                take = min(remaining, room, max(0, bulk_limit - rows))
                if entry is lead:  # the lead always progresses
                    take = max(take, min(remaining, room, self._min_chunk_rows))
                if take < min(remaining, room):
                    self._chunks_cut += 1 if take > 0 else 0
                if flood_riding:
                    flood_rows += take
                bulk_rows += take
            if take == 0 and remaining > 0:
                continue
            self._hand_out(entry, take, now_s)
            slices.append(RowSlice(entry.request.request_id, entry.next_row - take, entry.next_row))
            rows += take
        if not group.entries:
            del self._groups[group.key]
        estimate_s = self._cost.duration_s(group.key, rows)
        if estimate_s is None:
            estimate_s = NOMINAL_PRODUCT_S
        free_s = self._free_s if lane == BULK and self._free_s is not None else 0.0
        if lane == BULK and self._free_only:  # counted here, not in the plan: a plan may only ask when
            self._free_time_batches += 1  # (``next_wakeup``)
        self._charge(lane, estimate_s, max(0.0, estimate_s - free_s))  # an estimate: batch_done corrects it
        if flood_rows:  # a flood's rows riding along spend its allowance (their share of the estimate)
            self._allowed.spend(estimate_s * flood_rows / rows)
        self._last_fill = (group.key, lane, estimate_s, free_s)
        self._batches += 1
        self._rows_served += rows
        return Batch(group.layer_id, group.op, tuple(slices), bulk_rows == 0)

    def _bulk_limit(self, lead: _Entry, now_s: float) -> int:
        """The most bulk rows a batch led by ``lead`` may carry: the rows its product can run in the
        decode guard's delay budget, else the row budget. Not fewer than a minimal chunk, and with a
        target, in a batch that bulk work leads (not a flood's, nor a chunk sized to the decoders'
        free time alone), not fewer than the rows that cost its product's fixed part (module doc).
        Only asked for batches that carry bulk rows: the budget costs more than a decode row's product."""
        flood = self._is_flood(lead)
        budget_s = self._last_delay_budget_s = self._delay_budget_s(now_s, backlog=flood)
        if budget_s is None:
            return self._row_budget
        least = self._min_chunk_rows
        if lead.lane == BULK and self._free_s is not None:  # it leads: the decoders' free time is its own
            budget_s = self._free_s if self._free_only else max(budget_s, self._free_s)
        if lead.lane == BULK and self._guard.slo_s is not None and not self._free_only and not flood:
            least = max(least, self._cost.break_even_rows(lead.group.key))  # (module doc: chunks and a target)
        fits = self._cost.rows_within(lead.group.key, budget_s)
        return self._row_budget if fits is None else min(self._row_budget, max(least, fits))

    def _hand_out(self, entry: _Entry, take: int, now_s: float) -> None:
        request = entry.request
        group = entry.group
        if entry.next_row == 0:
            waited = now_s - request.arrival_s
            cls = request.latency_class.value
            self._max_first_wait_s[cls] = max(self._max_first_wait_s[cls], waited)
            self._sum_first_wait_s[cls] += waited
            if take < request.rows:
                group.started += 1
        entry.client.tag += take + REQUEST_CHARGE_ROWS
        entry.next_row += take
        group.pending_rows -= take
        self._pending_rows -= take
        if entry.remaining == 0:
            if request.rows > 0 and entry.next_row > take:  # a split request's last slice
                group.started -= 1
            self._finish(entry, now_s)

    def _finish(self, entry: _Entry, now_s: float) -> None:
        request = entry.request
        self._note_hand_out(request, entry.lane, now_s)
        entry.group.remove(entry)
        entry.client.entries.remove(entry)
        del self._entries[request.request_id]
        self._completed[request.latency_class] += 1  # a StrEnum: its own hash, without ``.value``

    # ----------------------------------------------------------------------------- introspection

    def pending_rows(self) -> int:
        """Rows not yet handed out, over all pending requests."""
        return self._pending_rows

    def alone(self, client_id: str, lane: Lane | None = None) -> bool:
        """Nothing is pending and no other client has joined: no policy could batch a request of
        ``client_id`` with anything, so the engine may serve it at once without queueing it.

        ``lane=LATENCY``, for a latency request on an engine that runs the lanes apart (see
        ``next_batch``): bulk work neither shares its batch nor delays it, so it is alone when no
        latency work is pending and every other client is a bulk client (its last request was
        bulk; a client that joined and sent nothing yet is not)."""
        if lane is not Lane.LATENCY:
            return not self._entries and (not self._clients or self._clients == {client_id})
        for other in self._clients:
            if other != client_id:
                state = self._client_state.get(other)
                if state is None or state.last_lane == LATENCY:
                    return False
        return not self.has_pending(LATENCY)

    def serves_at_once(
        self,
        client_id: str,
        layer_id: str,
        op: Op,
        rows: int,
        latency_class: LatencyClass,
        now_s: float,
        lane: Lane | None = None,
    ) -> bool:
        """Whether the engine may serve this request at once, in the caller's thread, without
        queueing it: ``alone``, or latency work with nothing pending that the rule in force would
        not hold for anyone (``_holds_for_someone``). The engine reports it with ``served_alone``.

        Queued, such a request would be handed out at once as a batch of its own anyway, but
        through every step of the queue's bookkeeping (add, plan, fill, finish, a future): with
        another, active client connected, a 1-row call over ipc cost x2 what it costs alone
        (``benchmarks/roundtrip.py``, ``ipc+joined``). Bulk work keeps the queue: served whole, a
        large request would make a decoder that wakes meanwhile wait for all of it, where the
        queue cuts it into chunks. So does a request whose client has one pending (order).

        The request's arrival and hand-out are recorded as the queue records them (arrival
        predictor, decode guard, wait tuner), so that the same decisions follow -- also for a
        latency request alone on its lane beside bulk clients: unrecorded, a decoder beside a
        flood was invisible to the decode guard, which then never paced the flood (client
        processes: 0-2 token samples in a 6 s window beside a flood labelled finetune). Not for a
        client with no one else joined: no one's work is paced for it."""
        if self.alone(client_id, lane):
            if lane is LATENCY and len(self._clients) > (client_id in self._clients):  # someone else joined
                self._note_served_at_once(client_id, layer_id, op, rows, latency_class, now_s)
            return True
        if self.lane_of(latency_class, rows) is not LATENCY:
            return False
        if self.has_pending(LATENCY) if lane is LATENCY else self._entries and not self._only_held_floods(now_s):
            return False
        self._tick_tuner(now_s)
        if self._holds_for_someone(client_id, layer_id, op, rows, latency_class, now_s):
            return False
        self._note_served_at_once(client_id, layer_id, op, rows, latency_class, now_s)
        return True

    def _note_served_at_once(
        self, client_id: str, layer_id: str, op: Op, rows: int, latency_class: LatencyClass, now_s: float
    ) -> None:
        """Record a latency request served at once as the queue records one it hands out at once."""
        client = self._client_state.get(client_id)
        if client is None:
            client = self._client_state[client_id] = _Client(client_id)
        request = PendingRequest(-1, client_id, layer_id, op, rows, latency_class, now_s)
        self._note_arrival(client, request, LATENCY)
        self._note_hand_out(request, LATENCY, now_s)

    def _only_held_floods(self, now_s: float) -> bool:
        """Whether all that is pending is floods the queue holds now (each client a flood, no target,
        its allowance spent): none of it would lead a batch or ride along in a decoder's, so a
        latency request is served as it would be with nothing pending. Without this, a decoder
        beside a paced flood took the queue's path for every call (in-process: 0.7 ms a call
        against 0.3 alone), though the flood had 5% of the time."""
        if self._guard.slo_s is not None:
            return False
        for client in self._client_state.values():
            entries = client.entries
            if entries and not (
                self._is_flood(entries[0]) and entries[0].lane == BULK and self._allowance_spent(entries[0], now_s)
            ):
                return False
        return True

    def _holds_for_someone(
        self, client_id: str, layer_id: str, op: Op, rows: int, latency_class: LatencyClass, now_s: float
    ) -> bool:
        """Whether the rule in force would hold this latency request, the only one pending (or the
        only latency one, on the latency lane), for another client -- what ``_plan`` would decide
        for its group: ``immediate`` and ``none`` hold for no one; ``convoy`` for a client walking
        towards the layer; ``predicted`` for one expected within the request's wait budget;
        ``lockstep`` and ``budget`` for every client (by definition, idle or not). On a layer not
        yet placed in the walk (the first pass) the queue decides."""
        rule = self._rule()
        if rule in ("immediate", "none"):
            return False
        if rule in ("lockstep", "budget") or not self._arrivals.placed(layer_id, op):
            return True
        present = {client_id: 1}
        if rule == "convoy":
            # ``_convoy_waits_for``: with nothing pending, every walker is moving, so it waits for any.
            walkers = self._arrivals.walking(layer_id, op, present, now_s, self._lockstep_timeout_s, True)
            return next(walkers, None) is not None
        deadline_s = now_s + self.config.wait_budget_s(rows, latency_class)
        return self._predicted_hold_until_s(layer_id, op, present, now_s, deadline_s, True)[0] > now_s

    def served_alone(
        self,
        client_id: str,
        rows: int,
        latency_class: LatencyClass,
        layer_id: str | None = None,
        op: Op | None = None,
        duration_s: float | None = None,
    ) -> None:
        """Account for a request the engine served at once (see ``alone``) as a batch of its own."""
        self._clients.add(client_id)
        state = self._client_state.get(client_id)
        if state is not None:  # what it sends now, for the other clients' ``alone``
            state.last_lane = self.lane_of(latency_class, rows)
        self._batches += 1
        self._rows_served += rows
        self._completed[latency_class] += 1
        self._ready_reasons["alone"] += 1
        if layer_id is not None and op is not None and duration_s is not None:
            self._cost.observe((layer_id, op), rows, duration_s)

    def stats(self) -> dict:
        pending_requests = {c.value: 0 for c in _CLASS_ORDER}
        pending_rows = {c.value: 0 for c in _CLASS_ORDER}
        for entry in self._entries.values():
            pending_requests[entry.request.latency_class.value] += 1
            pending_rows[entry.request.latency_class.value] += entry.remaining
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
                c: 1000.0 * s / self._completed[c] if self._completed[c] else 0.0
                for c, s in self._sum_first_wait_s.items()
            },
            "ready_reasons": dict(self._ready_reasons),
            "wait_rule": (
                {**self._tuner.stats(), "host_cpu_busy": self._host_busy_share}
                if self._tuner is not None
                else {"rule": self._fixed_rule}
            ),
            "decode_guard": self._guard.stats(),
            "chunks_cut_for_decode": self._chunks_cut,
            "bulk_batches_in_free_time": self._free_time_batches,
            "last_delay_budget_ms": None if self._last_delay_budget_s is None else 1e3 * self._last_delay_budget_s,
            "batches_led_by_lane": {"latency": self._lane_batches[LATENCY], "bulk": self._lane_batches[BULK]},
        }
