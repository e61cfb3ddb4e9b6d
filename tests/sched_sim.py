"""A discrete-event model of an executor and its clients, to test the scheduler with a fake clock.

The executor runs one batch at a time; a batch of ``n`` rows takes ``fixed_s + per_row_s * n``
(the scheduler is told, as the engine tells it). Clients are closed loops:

- ``Walker``: walks ``layers`` forward requests per pass (a decoder: one pass per token, class
  decode), or a forward pass then a backward pass (a fine-tuning step, class finetune), sending
  each request ``gap_s`` after the previous one's result (its own work per layer) and
  ``pass_gap_s`` more between passes -- or, with ``interval_s``, an open loop: a pass starts
  at most every ``interval_s`` (``pass_times`` is then its per-token latency);
- ``Flood``: keeps ``depth`` requests of ``rows`` rows outstanding on one layer, from time 0.
  With ``host_s_per_row``, each of its results also costs work on the clients' host (copying it,
  making the next request) for that long per row, and a walker whose own work starts while that
  work runs takes ``Simulation.contention`` times longer for it: cores the executor does not
  schedule (clients as processes on one host, measured in issue 11).

Each client records when each of its passes (tokens, steps) ended; ``token_times`` gives the
time between consecutive pass ends, which is what a client measures as its per-token latency.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from symbiosis.executor.requests import Batch, PendingRequest
from symbiosis.executor.scheduler import Scheduler, SchedulerConfig
from symbiosis.vocabulary import LatencyClass, Op


@dataclass
class Walker:
    client_id: str
    rows: int
    gap_s: float
    layers: int = 8
    latency_class: LatencyClass = LatencyClass.DECODE
    pass_gap_s: float = 0.0
    start_s: float = 0.0
    # An open loop: a pass starts at most every ``interval_s`` (a stream read at a set rate), one
    # interval after the last pass started, or at once when that pass took longer (0: closed loop).
    interval_s: float = 0.0
    pass_ends: list[float] = field(default_factory=list)
    pass_starts: list[float] = field(default_factory=list)  # arrival of each pass's first request
    waits: list[float] = field(default_factory=list)  # arrival -> its batch started, per request
    arrivals: list[float] = field(default_factory=list)  # when each of its requests arrived

    def steps(self):
        """(layer_id, op) of every request of one step, in order."""
        forward = [(f"l{i}", Op.FORWARD) for i in range(self.layers)]
        if self.latency_class is LatencyClass.FINETUNE:
            return forward + [(f"l{i}", Op.BACKWARD) for i in reversed(range(self.layers))]
        return forward

    def token_times(self, skip: int = 2) -> list[float]:
        ends = self.pass_ends[skip:]
        return [b - a for a, b in zip(ends, ends[1:])]

    def pass_times(self, skip: int = 2) -> list[float]:
        """From each pass's first request to its end: a client's per-token latency when it idles
        between passes (``pass_gap_s``: an open-loop stream, read at a set rate)."""
        return [end - start for start, end in list(zip(self.pass_starts, self.pass_ends))[skip:]]


@dataclass
class Flood:
    client_id: str
    rows: int
    depth: int
    latency_class: LatencyClass
    layer_id: str = "l3"
    rows_done: int = 0
    host_s_per_row: float = 0.0


@dataclass
class Simulation:
    config: SchedulerConfig
    clients: list
    fixed_s: float = 50e-6
    per_row_s: float = 1e-6
    contention: float = 1.0  # how much slower a walker's own work is while a flood's host work runs
    # What the engine tells the scheduler about its products (``Scheduler.products_share_client_cores``):
    # False for an executor on an accelerator, this model's executor; True on a CPU.
    products_share_client_cores: bool = False
    batches: list[tuple[float, float, Batch]] = field(default_factory=list)  # (start, end, batch)
    owners: dict[int, str] = field(default_factory=dict)  # request id -> client id
    scheduler: Scheduler | None = None

    def duration_s(self, batch: Batch) -> float:
        return self.fixed_s + self.per_row_s * batch.rows

    def run(self, until_s: float) -> Simulation:
        scheduler = self.scheduler = Scheduler(self.config)
        scheduler.products_share_client_cores = self.products_share_client_cores
        ids = itertools.count()
        owner: dict[int, tuple[object, int, PendingRequest]] = {}  # request id -> (client, step index, request)
        rows_left: dict[int, int] = {}
        arrivals: list[tuple[float, int, object, int]] = []  # (time, tiebreak, client, step index)
        tiebreak = itertools.count()
        for client in self.clients:
            if isinstance(client, Walker):
                heapq.heappush(arrivals, (client.start_s, next(tiebreak), client, 0))
            else:
                for _ in range(client.depth):
                    heapq.heappush(arrivals, (0.0, next(tiebreak), client, 0))
        now, busy_until, running = 0.0, None, None
        self._host_busy_until = 0.0
        while now <= until_s:
            while arrivals and arrivals[0][0] <= now:
                at, _, client, step = heapq.heappop(arrivals)
                rid = next(ids)
                if isinstance(client, Walker):
                    layer_id, op = client.steps()[step]
                    if step == 0:
                        client.pass_starts.append(at)
                    client.arrivals.append(at)
                    request = PendingRequest(rid, client.client_id, layer_id, op, client.rows, client.latency_class, at)
                else:
                    request = PendingRequest(
                        rid, client.client_id, client.layer_id, Op.FORWARD, client.rows, client.latency_class, at
                    )
                owner[rid] = (client, step, request)
                self.owners[rid] = client.client_id
                rows_left[rid] = request.rows
                scheduler.add(request)
            if running is not None and busy_until <= now:
                start, batch = running
                scheduler.batch_done(batch, busy_until - start, busy_until)
                self.batches.append((start, busy_until, batch))
                for s in batch.slices:
                    rows_left[s.request_id] -= s.rows
                    if rows_left[s.request_id] == 0:
                        self._completed(owner.pop(s.request_id), busy_until, arrivals, tiebreak)
                running = None
            if running is None:
                batch = scheduler.next_batch(now)
                if batch is not None:
                    for s in batch.slices:
                        client, _, request = owner[s.request_id]
                        if s.start == 0 and isinstance(client, Walker):
                            client.waits.append(now - request.arrival_s)
                    running, busy_until = (now, batch), now + self.duration_s(batch)
                    continue
            events = [busy_until] if running is not None else []
            if arrivals:
                events.append(arrivals[0][0])
            if running is None:
                wakeup = scheduler.next_wakeup(now)
                if wakeup is not None:
                    assert wakeup > now, "next_wakeup said 'now' but next_batch returned None"
                    events.append(wakeup)
            if not events:
                break
            now = min(events)
        return self

    def _completed(self, done, end_s: float, arrivals: list, tiebreak) -> None:
        client, step, request = done
        if isinstance(client, Flood):
            client.rows_done += request.rows
            host_s = client.host_s_per_row * request.rows
            self._host_busy_until = max(self._host_busy_until, end_s) + host_s
            heapq.heappush(arrivals, (end_s + host_s, next(tiebreak), client, 0))
            return
        gap_s = client.gap_s * (self.contention if end_s < self._host_busy_until else 1.0)
        steps = len(client.steps())
        if step + 1 == steps:
            client.pass_ends.append(end_s)
            next_s = end_s + gap_s + client.pass_gap_s
            if client.interval_s:
                next_s = max(next_s, client.pass_starts[-1] + client.interval_s)
            heapq.heappush(arrivals, (next_s, next(tiebreak), client, 0))
        else:
            heapq.heappush(arrivals, (end_s + gap_s, next(tiebreak), client, step + 1))

    def busy_fraction(self, client_id: str, since_s: float = 0.0) -> float:
        """Share of the executor's time (since ``since_s``) spent on ``client_id``'s rows."""
        total = spent = 0.0
        for start, end, batch in self.batches:
            if start < since_s:
                continue
            total += end - start
            mine = sum(s.rows for s in batch.slices if self.owners[s.request_id] == client_id)
            spent += (end - start) * mine / batch.rows if batch.rows else 0.0
        return spent / total if total else 0.0


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]
