"""How long products take, who is decoding, and how much a product may delay them (pure bookkeeping).

Two pieces the scheduler asks before it cuts a chunk of bulk rows (fine-tuning, prefill, or a
request labelled decode that is larger than a decode-sized share):

- ``CostModel`` learns ``duration = fixed + per_row * rows`` for each ``(layer, op)`` from the
  durations the engine reports (decayed least squares), and answers the inverse: how many rows
  fit in a time budget. This is FlexLLM's latency estimate ``f(c, s)``, learned online instead of
  profiled in advance, so it follows the machine's load.
- ``DecodeGuard`` follows the clients that are decoding (their last request was a forward
  request of class ``decode``): their pace per layer call (from ``ArrivalPredictor``), the time of
  each token (arrival of one pass's first layer to the next; the pass alone for a decoder that
  idles between passes longer than its pass takes, a stream read at a set rate:
  ``DecodeGuard._token_time_s``), and from those the *delay budget*:
  how long one product may delay one of their layer calls. A pass during which the decoder paused
  (quiet between two calls for ``PAUSE_S`` or two of its tokens, whichever is longer: its own next
  job, a start line) is no token: counted, one pause of a few seconds raised a decoder's token
  time (an EWMA) by a second, and the wait tuner's epochs (five of the slowest decoder's tokens)
  with it, so that one trial rule could hold for most of a benchmark window. Seen once (8 client
  processes that wait for each other at the benchmark's start line): 7 epochs in 8 s, "not
  waiting" for 6901 of the window's 7970 batches, 397 tokens/s against 503-540 in the runs beside
  it. Not a shorter gap: a decoder starved of CPU by bulk work goes quiet between calls too, and
  its slow tokens are what the target's feedback must see.

  - With a per-token target (``decode_slo_ms``): a decoder walking ``n`` layer calls per token,
    each taking ``gap`` of its own, meets the target if no call waits more than
    ``slo / n - gap``; that is the budget (the smallest over active decoders). What the budget
    cannot see (several decoders queueing at once, CPU shared with the fine-tuning clients'
    own work) is closed by feedback on ``bulk_share``, the fraction of time fine-tuning may use
    while decoders are active: every decoded token over the target multiplies it by
    ``MISS_FACTOR``, every token within it by ``HIT_FACTOR``, chosen so that the share settles
    where 1 token in 20 misses (the target is met at p95: ``HIT_FACTOR ** 19 * MISS_FACTOR == 1``).
    It never goes below ``MIN_BULK_SHARE``, so fine-tuning always progresses.
  - Without a target: ``decode_slowdown`` times the decoder's time per call: its pace as the
    executor sees it, or, for a product serving a client with a backlog (``backlog``: several
    requests queued, a flood), its *own* pace: the lower envelope of its pace samples
    (``ArrivalPredictor.own_gap_s``) or its token-time floor over its calls per token if less
    (``floor_token_s``: its fastest token, raised only by tokens no bulk batch overlapped).
    Not its plain pace for a flood: one client's bulk work also takes the *cores* a
    decoder in another process needs for its own share of every token, so a starved decoder
    looks slow, and a budget from its pace would allow the long products that starve it.
    Measured (issue 11, clients as processes on this 2-core machine, a bystander decoding beside
    a client flooding 16,384-row requests): p95 per-token x40-55 of its time alone with the plain
    pace (its calls queued 0.15 ms in the executor; the "pace" the server saw was 34 ms a call),
    x6-8 with this budget for a client with a backlog (``backlog``; fine-tuning walks keep the
    pace as seen: cutting them too left fine-tuning 10% of its solo rate beside 6 decoders, 40%
    without). What is left is not in the queue: the bystander's requests waited ~0.07 ms there
    while its tokens took twice as long (waiting unread while the server's socket thread read the
    flood's requests and ran its chunks, the flood's CPU on the host, the shared path per call).
    So a flood is also *paced* without a target:
    ``backlog_share``, the most of the wall clock it may use while decoders are active, follows
    the same feedback as ``bulk_share`` against each decoder's own target, ``1 + slowdown``
    times its token-time floor, halving at a miss (``FLOOD_MISS_FACTOR``) so that a flood that
    starts beside a decoder is brought down within a few of its tokens. Measured (same setting,
    ``benchmarks.batching --clients-as processes``, four runs): bystander p95 x2.2-2.8 of alone,
    was x7.7-10.9, the flood at ~1/4-1/5 of its rows/s; threads x2.4-3.3, was x4.3-4.6.

  No active decoder: no budget (bulk rows go in chunks of ``row_budget``).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from symbiosis.vocabulary import Op

# Weight of a slower token sample in a decoder's token-time floor (a faster one replaces it), for
# tokens no bulk work overlapped: a decoder that really slowed down (a longer context) is followed
# within ~20 such tokens; tokens slowed by bulk work never raise it.
FLOOR_RISE_WEIGHT = 0.1
# Decay of the cost fit per observed product: the last ~20 products of a layer dominate.
COST_DECAY = 0.95
# A decoder counts as active while its last event is this recent, or two of its tokens' time.
ACTIVE_HORIZON_S = 0.05
# A decoder quiet between two calls for this long (or two of its tokens' time, if longer) paused:
# the pass around it is no token sample (module doc).
PAUSE_S = 0.5
TOKEN_EWMA_WEIGHT = 0.2
# A decoder's recent pace (``longest_token_s``, which sizes the wait tuner's epochs) is the median
# of its last this many token times: it forgets a slow start within three tokens, where the EWMA
# above kept the clients' first tokens (several times the steady ones) for five or six epochs.
RECENT_TOKENS = 5
MIN_BULK_SHARE = 0.05
MISS_FACTOR = 0.8
HIT_FACTOR = MISS_FACTOR ** (-1.0 / 19.0)  # 19 hits undo one miss: the share settles at 5% misses (p95)
# The same feedback on a flood's share (no target): it halves at a miss, so a flood that starts
# beside a decoder is brought down within a few tokens (each a miss the decoder's p95 counts).
FLOOD_MISS_FACTOR = 0.5
FLOOD_HIT_FACTOR = FLOOD_MISS_FACTOR ** (-1.0 / 19.0)


class _Fit:
    """Exponentially weighted sums for a least-squares line ``duration = a + b * rows``."""

    __slots__ = ("w", "x", "y", "xx", "xy", "most_rows")

    def __init__(self) -> None:
        self.w = self.x = self.y = self.xx = self.xy = 0.0
        self.most_rows = 0.0  # the largest product measured (``CostModel.break_even_rows``)

    def add(self, rows: float, duration_s: float) -> None:
        self.most_rows = max(self.most_rows, rows)
        d = COST_DECAY
        self.w = d * self.w + 1.0
        self.x = d * self.x + rows
        self.y = d * self.y + duration_s
        self.xx = d * self.xx + rows * rows
        self.xy = d * self.xy + rows * duration_s

    def line(self) -> tuple[float, float]:
        """``(fixed_s, per_row_s)``; through the origin when the rows seen do not vary enough."""
        spread = self.w * self.xx - self.x * self.x
        if spread > 1e-9 * max(1.0, self.w * self.xx):
            per_row = (self.w * self.xy - self.x * self.y) / spread
            fixed = (self.y - per_row * self.x) / self.w
            if per_row > 0 and fixed >= 0:
                return fixed, per_row
        return 0.0, (self.y / self.x if self.x > 0 else 0.0)


class CostModel:
    """Learned product durations per ``(layer_id, op)``."""

    def __init__(self) -> None:
        self._fits: dict[tuple[str, Op], _Fit] = {}

    def observe(self, key: tuple[str, Op], rows: int, duration_s: float) -> None:
        if rows > 0 and duration_s >= 0 and math.isfinite(duration_s):
            fit = self._fits.get(key)
            if fit is None:
                fit = self._fits[key] = _Fit()
            fit.add(float(rows), duration_s)

    def line(self, key: tuple[str, Op]) -> tuple[float, float] | None:
        """``(fixed_s, per_row_s)`` of ``key``; for a layer never measured, the most expensive per-row
        cost of those that were (a conservative guess); None before any measurement."""
        fit = self._fits.get(key)
        if fit is not None:
            return fit.line()
        if not self._fits:
            return None
        return max((f.line() for f in self._fits.values()), key=lambda line: line[1])

    def rows_within(self, key: tuple[str, Op], budget_s: float) -> int | None:
        """Most rows a product of ``key`` can take and still end within ``budget_s``; None if unknown."""
        line = self.line(key)
        if line is None or line[1] <= 0:
            return None
        fixed_s, per_row_s = line
        return max(0, int((budget_s - fixed_s) / per_row_s))

    def break_even_rows(self, key: tuple[str, Op]) -> int:
        """Rows whose share of a product of ``key`` takes as long as its fixed part: a chunk of
        fewer rows spends more of the executor's time on the fixed part than on rows. At most twice
        the largest product of ``key`` measured: where a product's time hardly grows with its rows,
        as on a GPU, a noisy fit put it anywhere from 0 to ~10,000 rows, and the line says nothing
        far beyond the rows it saw (twice, not once: chunks may grow that way, where capped at the
        largest seen they stayed at the first ones' size -- in the simulator, streams 5 ms apart
        beside fine-tuning kept 40% of it instead of 47%). 0 for a layer not measured."""
        fit = self._fits.get(key)
        if fit is None:
            return 0
        fixed_s, per_row_s = fit.line()
        if per_row_s <= 0:
            return 0
        return int(min(2.0 * fit.most_rows, fixed_s / per_row_s))

    def duration_s(self, key: tuple[str, Op], rows: int) -> float | None:
        line = self.line(key)
        return None if line is None else line[0] + line[1] * rows


class TimeCredit:
    """A token bucket of executor time (seconds): it fills at some rate (a share of the wall clock)
    while ``refill`` is told to, up to ``cap_s``, and products spend it; it may go below zero by
    at most ``cap_s`` (a product longer than the credit it started with)."""

    def __init__(self, cap_s: float, start_s: float = 0.0) -> None:
        self.cap_s = cap_s
        self.credit_s = start_s
        self._last_s: float | None = None

    def refill(self, now_s: float, rate: float, filling: bool = True) -> None:
        if self._last_s is not None and filling and now_s > self._last_s:
            self.credit_s = min(self.cap_s, self.credit_s + rate * (now_s - self._last_s))
        self._last_s = now_s

    def spend(self, seconds: float) -> None:
        """Spend ``seconds`` (negative: a refund, when a product took less than estimated)."""
        self.credit_s = min(self.cap_s, max(-self.cap_s, self.credit_s - seconds))

    def positive_at_s(self, now_s: float, rate: float) -> float:
        """When the credit will be above zero again, filling at ``rate``."""
        if self.credit_s > 0:
            return now_s
        return now_s + (1e-9 - self.credit_s) / rate if rate > 0 else math.inf


class _Decoder:
    __slots__ = (
        "last_event_s",
        "pass_start_s",
        "pass_position",
        "handed_out_s",
        "period_s",
        "token_s",
        "token_dev_s",
        "floor_token_s",
        "recent_token_s",
        "decoding",
        "pending",
        "paused",
    )

    def __init__(self) -> None:
        self.last_event_s = -math.inf
        self.pass_start_s: float | None = None
        self.pass_position = -1
        self.handed_out_s: float | None = None  # when its last request was handed out
        self.period_s: float | None = None  # EWMA of the time from one token's start to the next
        self.token_s: float | None = None  # EWMA of its token times (``DecodeGuard.arrived``)
        self.token_dev_s = 0.0
        self.floor_token_s: float | None = None  # lower envelope of its token times (module doc)
        self.recent_token_s: deque[float] = deque(maxlen=RECENT_TOKENS)  # its last periods
        self.decoding = False  # its last forward request was class decode
        self.pending = False  # that request waits in the queue (then it is active however long it waits)
        self.paused = False  # it paused during the pass in progress (``pause_s``): no token sample

    def horizon_s(self) -> float:
        """How long it may go without an event and still count as active (see ``active``): two
        periods, so that a stream idling between its tokens stays active through its idle time."""
        return max(ACTIVE_HORIZON_S, 2.0 * (self.period_s or 0.0))

    def pause_s(self) -> float:
        """A gap between a hand-out and its next call longer than this is a pause, not a slow
        token: ``horizon_s`` but at least ``PAUSE_S`` (a decoder starved of CPU by bulk work also
        goes quiet between calls, and its slow tokens are what the target's feedback must see)."""
        return max(PAUSE_S, self.horizon_s())


class DecodeGuard:
    """Who is decoding now, at what pace, and how long a product may delay them (see module doc)."""

    def __init__(self, slo_s: float | None, slowdown: float) -> None:
        self.slo_s = slo_s
        self.slowdown = slowdown
        self.bulk_share = 1.0
        self.backlog_share = 1.0  # without a target: the most of the time a flood may use (module doc)
        self.backlog_misses = 0  # token samples over (1 + slowdown) x the decoder's floor, without a target
        self.tokens_seen = 0
        self.slo_misses = 0  # token samples whose rough p95 was over the target
        self._decoders: dict[str, _Decoder] = {}
        self._bulk_ran_s = -math.inf  # when a batch led by bulk work last started

    # ---- events ---------------------------------------------------------------------------------

    def arrived(
        self, client_id: str, op: Op, is_decode: bool, position: int, arrival_s: float, is_latency: bool | None = None
    ) -> float | None:
        """A forward or backward request arrived. ``is_decode``: decode-sized decode work (it makes
        its client a decoder); ``is_latency`` (default: ``is_decode``): latency work of any class. A
        decoder's prefill-sized prefill pass keeps it decoding: a serving client admits new sequences
        between its decode passes, and its running sequences wait for that pass too. Returns the
        time of the decoder's token this arrival ended (``_token_time_s``), if it ended one that counts."""
        if is_latency is None:
            is_latency = is_decode
        decoder = self._decoders.get(client_id)
        if op is Op.BACKWARD:  # (a product without its bias, Op.NOISE, is a forward step: arrivals._WALK)
            if decoder is not None:
                decoder.decoding = False  # in backward: a fine-tuning client, not a decoder
            return None
        if decoder is None:
            if not is_decode:
                return None
            decoder = self._decoders[client_id] = _Decoder()
        token_s = None
        if not decoder.pending and arrival_s - decoder.last_event_s > decoder.pause_s():
            decoder.paused = True  # it stopped: waiting for its own next job, not for us
        decoder.last_event_s = arrival_s
        if position <= decoder.pass_position or decoder.pass_start_s is None:  # a new pass (token) starts
            if is_latency and decoder.decoding and decoder.pass_start_s is not None and not decoder.paused:
                clean = self._bulk_ran_s < decoder.pass_start_s  # no bulk batch started during this token
                period_s = arrival_s - decoder.pass_start_s
                token_s = self._token_time_s(decoder, period_s, arrival_s)
                self._token(decoder, token_s, period_s, clean)
            decoder.pass_start_s = arrival_s
            decoder.paused = False
        decoder.pass_position = position
        decoder.decoding = is_latency
        decoder.pending = True
        return token_s

    def handed_out(self, client_id: str, now_s: float) -> None:
        decoder = self._decoders.get(client_id)
        if decoder is not None:
            decoder.last_event_s = decoder.handed_out_s = now_s
            decoder.pending = False

    @staticmethod
    def _token_time_s(decoder: _Decoder, period_s: float, next_pass_s: float) -> float:
        """A decoder's time for the token that just ended: from its first call to the next token's
        first call (``period_s``), its own work between the two passes included -- unless it idled
        there longer than the pass took (a stream read at a set rate, an open loop: the user's
        pace, not ours), then the pass alone. Measured (issue 11, 6 client processes each
        stepping every 200 ms, steps of ~20 ms alone): every period was a token of ~200 ms, over
        any target of 1.2x the steps' p95, so the target's feedback held fine-tuning at its floor
        (10% of its solo rate kept, the decoders' p95 at x0.8 of the target)."""
        handed_out_s = decoder.handed_out_s
        if handed_out_s is None or decoder.pass_start_s is None or handed_out_s < decoder.pass_start_s:
            return period_s
        pass_s = handed_out_s - decoder.pass_start_s
        return pass_s if next_pass_s - handed_out_s > pass_s else period_s

    def forget(self, client_id: str) -> None:
        self._decoders.pop(client_id, None)

    def bulk_ran(self, now_s: float) -> None:
        """A batch led by bulk work started: tokens in progress are not samples of a decoder's own pace."""
        self._bulk_ran_s = now_s

    def _token(self, decoder: _Decoder, token_s: float, period_s: float, clean: bool) -> None:
        """One token sample: ``token_s`` its time (``_token_time_s``), ``period_s`` the time from
        its start to the next token's."""
        old_period_s = decoder.period_s
        decoder.period_s = (
            period_s if old_period_s is None else old_period_s + TOKEN_EWMA_WEIGHT * (period_s - old_period_s)
        )
        if decoder.token_s is None:
            decoder.token_s = token_s
        else:
            deviation = abs(token_s - decoder.token_s)
            decoder.token_s += TOKEN_EWMA_WEIGHT * (token_s - decoder.token_s)
            decoder.token_dev_s += TOKEN_EWMA_WEIGHT * (deviation - decoder.token_dev_s)
        decoder.recent_token_s.append(period_s)  # epochs long enough for each decoder's tokens
        self.tokens_seen += 1
        floor = decoder.floor_token_s
        if self.slo_s is None and floor is not None:
            self._follow_own_target(token_s, (1.0 + self.slowdown) * floor)
        if floor is None or token_s < floor:
            decoder.floor_token_s = token_s
        elif clean:  # rises only with tokens no bulk work touched: contention must not raise the bar
            decoder.floor_token_s = floor + FLOOR_RISE_WEIGHT * (token_s - floor)
        if self.slo_s is None:
            return
        if token_s > self.slo_s:
            self.slo_misses += 1
            self.bulk_share = max(MIN_BULK_SHARE, self.bulk_share * MISS_FACTOR)
        else:
            self.bulk_share = min(1.0, self.bulk_share * HIT_FACTOR)

    def _follow_own_target(self, token_s: float, own_target_s: float) -> None:
        """Without a target: the same feedback as ``bulk_share``, on ``backlog_share``, against
        the decoder's own target (``1 + slowdown`` times its token-time floor)."""
        if token_s > own_target_s:
            self.backlog_misses += 1
            self.backlog_share = max(MIN_BULK_SHARE, self.backlog_share * FLOOD_MISS_FACTOR)
        else:
            self.backlog_share = min(1.0, self.backlog_share * FLOOD_HIT_FACTOR)

    # ---- questions ------------------------------------------------------------------------------

    def active(self, now_s: float) -> list[str]:
        """Clients decoding now: their last forward request was decode, and it is still waiting, or
        it was served recently (within ``ACTIVE_HORIZON_S`` or two of their tokens)."""
        return [
            client_id
            for client_id, d in self._decoders.items()
            if d.decoding and (d.pending or now_s - d.last_event_s <= d.horizon_s())
        ]

    def longest_token_s(self, now_s: float) -> float:
        """The longest recent token time (median of the last ``RECENT_TOKENS``) among active
        decoders; 0 if none is known."""
        return max(
            (
                statistics.median(d.recent_token_s)
                for c in self.active(now_s)
                if (d := self._decoders[c]).recent_token_s
            ),
            default=0.0,
        )

    def delay_budget_s(
        self, now_s: float, gap_of, calls_per_token: int, exclude: str | None = None, backlog: bool = False
    ) -> float | None:
        """How long one product may delay an active decoder's layer call (seconds); None when no
        decoder (other than ``exclude``) is active or none has a measured pace yet.
        ``gap_of(client_id)``: the client's own time per layer call (or None). ``backlog``: the
        product serves a client with a backlog (a flood, not a fine-tuning walk:
        ``Scheduler._is_flood``): without a target, the decoder's pace is then taken no slower
        than its token-time floor per call (see the module doc)."""
        budget = math.inf
        for client_id in self.active(now_s):
            if client_id == exclude:
                continue
            gap_s = gap_of(client_id)
            if gap_s is None:
                continue
            if self.slo_s is None:
                floor_s = self._decoders[client_id].floor_token_s
                if backlog and floor_s is not None and calls_per_token > 0:
                    # Its time per call when nothing slowed it: a starved decoder's pace would
                    # otherwise allow the long products that starve it (see the module doc).
                    gap_s = min(gap_s, floor_s / calls_per_token)
                budget = min(budget, self.slowdown * gap_s)
            else:
                budget = min(budget, self.slo_s / max(1, calls_per_token) - gap_s)
        return None if budget == math.inf else max(0.0, budget)

    def stats(self) -> dict:
        tokens = [d.token_s for d in self._decoders.values() if d.token_s is not None]
        floors = [d.floor_token_s for d in self._decoders.values() if d.floor_token_s is not None]
        return {
            "decode_slo_ms": None if self.slo_s is None else 1e3 * self.slo_s,
            "decoders_tracked": len(self._decoders),
            "bulk_share": self.bulk_share,
            "backlog_share": self.backlog_share,
            "token_samples_over_own_target": self.backlog_misses,
            "token_samples": self.tokens_seen,
            "token_samples_over_slo": self.slo_misses,
            "token_ms_ewma_max": 1e3 * max(tokens) if tokens else None,
            "token_ms_floor_min": 1e3 * min(floors) if floors else None,
        }
