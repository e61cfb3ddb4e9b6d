"""Which waiting pays here: a small online experiment the opportunistic scheduler runs all the time.

Holding a layer's requests back to batch them with a client that is on its way saves a product;
it pays when the executor (or the CPU it shares with its clients) is the bottleneck, and costs
latency when it is not. Which one holds depends on where the clients run (see README): client
threads in one process take turns on one interpreter lock, client processes on one host share
the cores, remote clients share nothing but the executor. So instead of guessing, the scheduler
tries three waiting *rules* in turn and keeps the one under which its clients step fastest:

- ``none``: serve at once (the immediate policy);
- ``predicted``: hold only for clients predicted to arrive within the request's wait budget;
- ``convoy``: hold for every client on its way to the layer (the lockstep idea, for clients that
  walk the same op and can come), up to ``lockstep_timeout_ms``.

A trial (*epoch*) lasts ``adapt_epoch_ms``, or five of the slowest active decoder's tokens if that
is longer (a rule needs a few passes to show: a convoy forms over one; a token at the decoder's
recent pace, the median of its last ``pacing.RECENT_TOKENS`` token times, which forgets the
clients' slow first tokens within three tokens where their average kept them for five or six
epochs) -- but no longer than five tokens at the pace when it began, under the rule before it.
Taken at its end alone, a rule that slows the decoders lengthened its own trial: in the committed
runs with client processes of batch 1-16 (2026-11-29), three "none" trials lasted 620-780 ms,
about twice the convoy epochs beside them, at 40-60% of their requests/s -- the trial's cost,
which every client pays. Fixed at its start alone, a pace measured just after the clients' start
(their prefills, their warm-up beside each other) set epochs of 2-4 s; so the pace is read again
while the epoch lasts (from ``adapt_epoch_ms`` on, every half of that), and the epoch ends at the
shorter -- though not before twice its settling (below), so that half of it or more is measured.
What an epoch measures is each client's requests per second over the epoch after its settling (for
the previous rule's convoys: a quarter of the length expected when it began, the last epoch's):
for a client in a closed loop, the inverse of its step time. Two epochs are compared *client by
client*: the mean over the clients served in both of the log of each one's speed-up (a geometric
mean), so that a rule that speeds every client up by x rates x. Not the total requests per second:
with clients of different batch sizes, a rule that lets the small ones race ahead raises the total
while the large ones (most of the tokens) slow down -- measured with client processes of batch
1-16, the total rated "none" above the convoy rule that served x1.6 more tokens/s at a lower mean
step time. Not rows per second either: it swings five-fold between a prefill phase and decoding. A
client's first epoch is not compared (it holds the client's start: allocations, a prefill, a cold
cache -- whatever the rule), nor is a client that completed fewer than ``MIN_CLIENT_REQUESTS`` in
either epoch (its rate is noise); and two epochs are compared only if the same clients were at
work in both: a client that joins or leaves changes the others' speed whatever the rule (they
share the cores and the executor), so the comparison would credit the rule with it. Measured
(2026-11-27, 8 client processes of one sequence each on this 2-core host, each warming up alone
while the others still load its model; 96 tokens each): compared across those arrivals, the
warm-up epochs rated the convoy rule below the others and the tuner left it (three runs, 16.4-19.9
tokens/s in all; "predicted" in use at the end of the two whose rule was read), while the convoy
rule fixed served 25.2 with half the executor's CPU (4x fewer batches, so 4x fewer passes over the
weights). Without those comparisons one run of two kept the convoy (24.6 tokens/s); the other
still left it on the noise of the first decoding epochs (20.0). An epoch counts only if two
clients or more were served in it (alone, nothing can be batched) and the look that ended it came
on time (an idle executor says nothing about a rule).

A decoder with ``MIN_CLIENT_TOKENS`` tokens or more in both epochs is compared on its tokens'
time instead (``token``: from the decode guard, a token's time from its first call to the next
token's, or its pass alone for a decoder that idles between tokens longer than its pass takes):
for a decoder stepping back to back the same measure as its requests per second, inverted; for a
stream read at a set rate (an open loop) the only one that moves -- its requests per second are
the reader's rate whatever the rule, so the tuner saw no difference between rules there and kept
its start rule whatever it cost the streams. A stall (below) is still told by the requests per
second: a rule can change a stream's tokens several-fold (below: 15 ms a token not waiting,
64-278 ms held in a convoy), and taken for stalls, such comparisons never counted towards a switch.
What it does on this host is within the noise. Measured (2026-12-07, 8 client threads of batch 1-16
each reading a token every 150 ms, near the host's saturation, alternated runs of this code and the
code before): with 6 s windows the tuner has ~11 epochs, too few to switch (ratings 0.02-0.09
towards "none", under the margin): it kept the convoy in 5 runs of 6 (75-278 ms a token; the code
before in 6 of 6, 64-162 ms), and one run chose "none" early (15 ms); with 20 s windows one run of
two switched to "none" mid-window (130 ms a token, immediate 118), none before (150-204 ms). In
most of these runs the streams were in step, immediate's too (56-188 ms a token against ~14 out of
step): once there, no rule gets them out within a window. Every 200 ms (12 s windows) and closed
loops (8 client threads of batch 1-16): the same rules chosen as before, figures within the noise.

Scores are compared in pairs of *adjacent* epochs only: on a shared machine the load moves
throughput by tens of percent within seconds, more than the rules differ, so a rule's average
over time says more about when it ran than about the rule. Each counted epoch that follows an
epoch of another rule moves the two rules' ratings apart by ``PAIR_WEIGHT`` of the surprise
(observed score difference minus rated difference; an Elo rating), so slow drifts cancel.
Two adjacent epochs are compared only if they served the same kind of work: each client's
rows per request within ``SAME_PHASE`` (x1.5) of its own in the other epoch (averaged over the
clients in both, weighted by requests). A client's request size is its own business (its batch,
prefill or decode), not the rule's -- unlike the mix over all clients, which a rule changes by
letting fast clients run ahead -- so a jump in it marks a change of phase: the clients' start
(prefill: several times the rows of a decode request, at a fraction of its request rate)
followed by decoding made the first trial's rule look several times worse than the next one,
whichever it was. Measured (client processes on this 2-core host, 8 decoders of batch
1-16): the convoy rule, tried first during the prefill, was rated far below "none" and hardly
tried again, although it served x1.6 more tokens/s when fixed.

One comparison counts at most ``MAX_SPEEDUP`` (x1.5) either way. No waiting rule changes every
client's speed several-fold from one epoch to the next; clients that stall together do (waiting for
each other at a start line, for the host, for their own next job), whatever the rule, and the
rule that ran next to that epoch took the whole swing as its credit. Measured (client processes
of batch 1-16 on this 2-core host, 6 s runs): in 2 runs of 3, one comparison with an epoch of
the clients' start (a stall; a mix of prefill and decode) rated "predicted" past the switching
margin -- in one, x1.35 above the convoy, past ``CLEARLY_WORSE`` too, so the convoy was hardly
tried again -- and the tuner kept "predicted" for the run, at x0.85 of the convoy's tokens/s.
Bounded, one such comparison moves two rules' rating gap ``g`` to at most ``(1 - PAIR_WEIGHT) g +
PAIR_WEIGHT log 1.5``: from rules rated level, x1.11, less than the switching margin; under a true
difference of x1.5 or more the gap still grows towards x1.5 (enough to choose the better rule and
to set the other aside as clearly worse). A stalled epoch is compared twice, though, with the
epoch before it and with the one after, and two bounded comparisons against one rule moved the
gap past the switching margin. Measured (client processes of batch 1-16, 2026-11-29 18:00): the
first convoy epoch after the first trials served 138 requests/s between a "predicted" trial at 686
and a "none" one at 1395 (other clients still loading their models), and the tuner left the
convoy for the run, at x0.74 of lockstep's tokens/s. A swing of ``STALL_SPEEDUP`` (x3) or more is
taken for a stall: an epoch takes part in one such comparison at most (the first). A rule's real
effect stays below that in the tuner's simulations (x1.9-2.5 for the largest) and counts, bounded,
on both sides of its trial as before.

A switch needs two epochs of each rule: a rule is chosen over the one in use only when, besides
its rating, it beat that rule in two of its own epochs or more, against two of the other's or more
(counted comparisons, not stalls, within the last ``HISTORY`` epochs). The ratings alone let one
slow epoch decide: it is compared with the epochs on both sides of it. Measured (2026-12-01, client
processes of batch 1-16 on this 2-core host, 6 s windows): the convoy's first epoch after the first
trials (200 ms: the convoy forming again after a "predicted" trial, the clients still starting) ran
at 725 requests/s between a "predicted" epoch at 1387 and a "none" one at 1555; the two bounded
comparisons moved "none" past the margin, and the tuner kept it for the window at 268 tokens/s
against lockstep's 361 (2 runs of 6 that hour). The price: leaving a start rule that does not suit
takes one trial more (the simulator's clients on cores of their own, a cheap executor: x1.12 of
immediate's step time over 4 s instead of x1.09, x1.07 over 8 s instead of x1.06).

Ratings belong to the clients they were measured on. When a counted epoch's clients are all new
(none took part in a counted epoch since the ratings began: a benchmark's next group of client
processes, a new batch of jobs after the last one left), the tuner starts over (``resets`` in its
stats) from ``start_rule``, exploring the others at the usual pace (not the first trials again:
two epochs of not waiting cost a short workload most): what waiting paid for two clients of one
sequence says little about eight. Measured
(2026-11-29, this 2-core host, one ``serve`` process for groups of 2 then 8 one-sequence client
processes of the ~105M llama): the ratings of the 2-client group (predicted x1.29 over the convoy)
kept the 8-client group on "predicted" -- rated clearly better, so the convoy was retried only
every 20th epoch -- at 7.7 rows a batch and 42 tokens/s, against 12.7 rows and 53 tokens/s for a
server whose tuner had chosen the convoy (one HF process per adapter: 44).

Where the tuner starts (``start_rule``, set by the scheduler) depends on where the clients run.
Client processes and remote clients start on ``START_RULE``, the convoy, while the host's CPUs are
busy (below for a host with room): there they gain from it (client processes of batch 1-16 on 2
cores: x1.33 of the tokens/s of not waiting, at x0.92 of lockstep's mean latency; the same over
tcp://; with the executor on an H200, x1.35 -- before a request no rule holds skipped the queue,
which reversed it there). Clients that are all threads of the executor's own process
(``Scheduler.client_in_process``) start on ``IN_PROCESS_START_RULE``, the convoy too, whatever
the host's room: they take turns on one interpreter lock, which a reading of the host's CPUs
does not see -- every batch the executor's Python does not run is lock time a client can use,
however many cores sit idle. Measured on this 2-core host, 8 client threads of batch 1-16
(``python -m benchmarks.batching --scenarios inference``, 2026-12-01, eight sets of 2-4 repeats:
quiet hours, and beside a busy loop of another process on one core or on both): the convoy fixed
served x1.10-1.54 of immediate's tokens/s in every set, at x0.96-1.08 of lockstep's mean latency
(x1.18 in one set, beside one busy loop), while not waiting ran x0.97-1.40 of lockstep's latency.
Before (2026-11-23, and three runs of 2026-11-30 on a busier host) not waiting had kept the mean
latency below lockstep's, x0.87-0.96, with every rule's tokens/s within the noise -- there the
convoy ran at lockstep's latency (x1.0) and matched immediate's tokens/s, so the convoy is the
start that met the tokens/s target in every set, and the nearer of the two to lockstep's latency
in most. The convoy costs the smallest clients: a client of one sequence steps at the convoy's pace
(248 ms beside 213 ms not waiting, quiet hour) while the 8- and 16-sequence ones, most of the
tokens, step x1.2-1.3 faster. The tuner still tries the other rules there and takes one when it is
rated better by the switching margin, as anywhere; its epochs (five of the slowest decoder's
tokens, ~1.2-1.7 s for these threads) are too long for the ratings to decide within a 6 s window,
so there the start decides. Beside fine-tuning threads, convoys of decoders leave them more of
the lock too, at a cost in the decoders' p95: 44%, 40% and 31% of their solo tokens/s kept under
the convoy start (2026-11-30 morning, 2026-12-01 twice) against 17% under not waiting
(2026-11-30 evening), at a decoders' p95 x1.66, x1.51 and x1.74 of alone against x1.47 (all
short of the 85% and 1.2 targets; docs/performance.md); with ``--decode-slo-ms`` the decoders'
p95 came x1.10-1.27 of the target under the convoy start, x1.09 under not waiting.

Other clients start from not waiting while the host's CPUs have room
(``IDLE_HOST_START_RULE``: the scheduler reads ``host_load.HostCpu`` whenever the tuner may
choose, a reading covers the last ``host_load.WINDOW_S`` seconds, and room is a share of all CPU
time busy below ``IDLE_HOST_BUSY_SHARE`` that leaves ``IDLE_HOST_SPARE_CORES`` idle on average).
Why a whole core: on this 2-core host, 8 decoding client processes kept 1.5-1.6 cores busy under
not waiting -- a share of ~0.78, near the 0.75 line, because the processes take turns with the
executor and leave the cores idle a few ticks at a time, not because a core is free to take more
products -- and the convoy served x1.3 of its tokens/s there (2026-12-01, quiet hours, llama
and qwen2).
A convoy saves products, which pays when the cores are the bottleneck (the 2-core host above, busy
throughout); where they are not, a request that no rule holds is served at once, without the queue
(``Scheduler.serves_at_once``), and holding it only adds a wait. Measured (2026-11-30, a 16-core
host with an H200, client processes of batch 1-16, executor on the GPU, single runs, 5-9 of the
16 cores busy): not waiting served 1446-1602 tokens/s at 20-24 ms mean, lockstep 1020-1248 at
30-37 ms, the convoy fixed 925 at 41 ms; "none" epochs ran x1.3-1.4 the requests/s of the convoy
epochs beside them. Started on the convoy, the tuner reached "none" after ~15 epochs (3 s of the
6 s window), and opportunistic served x0.83-0.94 of immediate's tokens/s.

The first epochs try each rule (``FIRST_TRIALS``): "none" first, as the clients' start is compared
with nothing (see above) and not waiting costs that start the least; then convoy, and none again,
so that convoy, which gains or loses the most, is compared twice; then predicted. The rule in use
then is ``start_rule`` -- as the scheduler sets it at the time, not as it was once: the host's
load moves, and the first trials end during the clients' start, whose reading is the least typical
(2026-12-01, 8 client processes on this 2-core host: the start read "none" at that moment in 2 runs
of 2, and the tuner kept it for the whole window at x0.75-0.87 of lockstep's tokens/s, though it
rated the convoy above it, by less than the margin) -- until another rule is rated better than
the one in use by ``SWITCH_MARGIN`` (x1.15: on a shared machine adjacent epochs differ by up to
x2, and a switch needs two or more comparisons pointing the same way at ``PAIR_WEIGHT`` 0.25,
and two epochs of each rule: above),
which is then kept whatever the start rule does, until a rule is rated better than it by the
margin again; every
``EXPLORE_EVERY``-th epoch tries the rule least recently tried, so the choice follows a change of
load or clients. A rule rated clearly worse than the one in use (by more than ``CLEARLY_WORSE``,
x1.25) is tried only every ``EXPLORE_EVERY * RARE_FACTOR``-th epoch: a trial of a bad rule costs
every client a slow epoch, which is what a p95 latency sees first. And each rule's trials back off
on their own results: a rule is tried at every ``EXPLORE_EVERY * 2**level``-th epoch only (5, 10,
20: the rare pace at most), and a trial that lost to the chosen rule by ``LOSES`` (x1.1) or more
raises its rule's level by one; one that lost by ``LOST_BADLY`` (x1.5, the most one comparison
counts) sets the rare pace at once; one that did not lose brings it back to every fifth epoch. A
trial's loss is the worse of its comparisons with the chosen rule's epochs before and after it (a
comparison that swung as a stall, ``STALL_SPEEDUP``, is not one of them), not their mean: the
epoch after a trial pays for it -- a "none" trial scatters the convoy, whose next epoch ran at
~0.6 of its pace while the clients met again (client processes over tcp://, 2026-12-01) -- so
the comparison with it made the trial look as much better as the one before made it look worse,
and a trial of a rule that served x0.75 of the convoy was taken for one that did not lose and
retried every fifth epoch. The price: a drift in load makes one of the two comparisons look worse
than the rule is, so a rule's trials back off more often than they should -- they only come
rarer (a rule that became better still gets its trial within 20 epochs), while the ratings, which
choose, still take the two comparisons alike. And a trial's loss is counted per *sequence*: each
client's log speed-up weighs its latency rows per request (the sequences it decodes; a client whose
work is bulk weighs one), since what a trial costs is tokens. Client by client, a rule that lets
the small clients race ahead while the large ones slow down rates level with the convoy: client
threads of batch 1-16 (2026-12-01, 20 s windows) rated "none" level with the convoy in two runs of
three (ratings within x1.03; x1.2 in the third) while the convoy fixed served x1.2 its tokens/s, so
its trials did not lose and came every 5th or 10th epoch in those two. The ratings, which choose,
still weigh each client alike: weighed by sequences, a rule that speeds up the small clients and
leaves the largest as it is (the slowest, which no rule holds) rates far below what it is worth to
the others, and the simulator's clients on cores of their own
(``test_opportunistic_stops_waiting_when_waiting_does_not_pay``) left the convoy for "none" ~5
epochs later (x1.26 of immediate's step time over 8 s instead of x1.07). Measured (client threads
of batch 1-16, ``--scenarios inference --policies opportunistic lockstep immediate --window-s 20``,
five rounds alternating with the code before, 2026-12-01 06:37-06:52): opportunistic x0.99-1.12 of
lockstep's mean latency (median x1.008) against x1.01-1.15 (x1.050) judged client by client,
tokens/s alike (median 151 and 150); "none" backed off to every 20th epoch by the window's end in
four runs of five, every 10th in the fifth (before: every 5th in two, 10th in two, 20th in one),
and ~1 trial fewer a 20 s window. Within this host's noise, in the direction of fewer trials. The
ratings alone keep a losing rule in the trials too long:
moved a quarter of the way at a time, a rule x1.25 slower sits near the ``CLEARLY_WORSE`` line and
was tried every fifth epoch (or tenth, beside the other rule's trials) for the whole run, each
trial a slow epoch for every client. Measured (2026-11-30, client processes of batch 1-16 on this
2-core host, epochs of ~1 s on a slow day): a "predicted" trial ran at x0.41-0.46 of the convoy
epochs beside it, in the middle of a 6 s window -- a tenth of the window's tokens -- while its
rating was still x1.2 below the convoy's. (Partly the executor's stalls then: its smaller batches
brought row counts whose matmul forms were timed on first use. With those timed before serving,
``BaseExecutor.warm_up``, its trials ran at x0.78-0.87, and "none"'s at x0.8, every fifth epoch,
within ``CLEARLY_WORSE`` of the convoy by its rating.) With the backoff, in 20 s windows of
the same clients: 2-3 trials a window instead of 5, and the clients' p95 7-9% lower in three
interleaved pairs of runs. The cost of backing off: a rule that became better gets its next
trial within 20 epochs (40 when both other rules are at the rare pace: they take turns), as
before for a rule rated clearly worse, and is chosen a few trials after it (its rating moves a
quarter of the way per comparison): within 50 epochs in the simulator, at whatever epoch the
change comes.
"""

from __future__ import annotations

import math

RULES: tuple[str, ...] = ("none", "predicted", "convoy")
FIRST_TRIALS: tuple[str, ...] = ("none", "convoy", "none", "predicted")
EXPLORE_EVERY = 5
RARE_LEVEL = 2  # a rule's trials back off to every EXPLORE_EVERY * 2**level epochs, at most this level
RARE_FACTOR = 2**RARE_LEVEL
CLEARLY_WORSE = math.log(1.25)
SWITCH_MARGIN = math.log(1.15)
PAIR_WEIGHT = 0.25
START_RULE = "convoy"
IN_PROCESS_START_RULE = "convoy"  # whatever the host's room (module doc)
IDLE_HOST_START_RULE = "none"
IDLE_HOST_BUSY_SHARE = 0.75  # of all the host's CPU time, over the last seconds (host_load.WINDOW_S)
IDLE_HOST_SPARE_CORES = 1.0  # idle cores, on average over the same seconds
SETTLE_FRACTION = 0.25
MIN_REQUESTS = 8
MIN_CLIENT_REQUESTS = 3
MIN_CLIENT_TOKENS = 2  # a decoder's tokens in each of two epochs for its token time to compare them
SAME_PHASE = math.log(1.5)
MAX_SPEEDUP = math.log(1.5)
STALL_SPEEDUP = math.log(3.0)
LOSES = math.log(1.1)
LOST_BADLY = MAX_SPEEDUP
HISTORY = 40


# Per client, what an epoch measured: its requests, the log of its rows per request, the log of its
# requests per second, its sequences (latency rows per request, at least 1: its weight in what
# a trial cost, ``_speedup_per_sequence``), its decoded tokens and minus the log of their mean time
# (0.0 when none: ``_log_speedup``). During a prefill those rows are prompt tokens, but an epoch of
# prefill is not compared with one of decoding (``_same_phase``).
_Epoch = tuple[int, float, float, float, int, float]


class WaitTuner:
    """Runs the trials and says which waiting rule is in force (see module doc)."""

    def __init__(self, epoch_s: float, start_s: float | None = None) -> None:
        if not epoch_s > 0:
            raise ValueError(f"WaitTuner epoch_s must be positive, got {epoch_s!r}")
        self.epoch_s = epoch_s
        self.rule = FIRST_TRIALS[0]
        self.start_rule = START_RULE  # where the choice starts (module doc); the scheduler may change it
        self.ratings: dict[str, float] = {}  # relative, from adjacent epochs; only rules tried
        self.chosen: str | None = None  # the rule used between trials
        # Whether ``chosen`` was chosen over the start rule by the ratings; while not, it follows
        # the start rule, which the scheduler may change whenever the tuner may choose.
        self._chosen_on_ratings = False
        self.epochs = 0  # epochs that counted
        self.resets = 0  # times the tuner started over for a new set of clients
        self._since_reset = 0  # epochs that counted since then (the first trials, exploration)
        self._population: set[str] = set()  # clients of the counted epochs since then
        self.trials = {rule: 0 for rule in RULES}
        # the last epochs: (rule, requests/s, rows/s, its length, its cap -- five tokens at the pace
        # when it began -- and five tokens at the pace read last; the last three in ms)
        self.history: list[tuple[str, int, int, int, int, int]] = []
        self._last_tried = {rule: -1 for rule in RULES}
        # rule -> how far its trials back off (module doc): tried at every EXPLORE_EVERY * 2**level-th
        # epoch only. And the trial last begun: its rule, that rule's level then, and what it lost
        # in its comparisons so far (with the epoch before it, then with the one after it).
        self._backoff = {rule: 0 for rule in RULES}
        self._on_trial: tuple[str, int, list[float]] | None = None
        # (rule, {client: what it measured}) of the last counted epoch
        self._previous: tuple[str, dict[str, _Epoch]] | None = None
        self._previous_stalled = False  # the last epoch's comparison, counted, swung past STALL_SPEEDUP
        # (winner, loser) -> (the winner's epochs, the loser's epochs) of the counted comparisons in
        # which that rule beat the other, the two latest of each: a switch needs two of each within
        # the last HISTORY epochs (module doc), not one epoch compared on both sides.
        self._shown: dict[tuple[str, str], tuple[set[int], set[int]]] = {}
        self._settled: set[str] = set()  # clients seen in a counted epoch before the last one
        self._per_client: dict[str, list[int]] = {}  # client -> [requests, rows, latency rows] this epoch
        self._tokens: dict[str, list[float]] = {}  # decoder -> [tokens, their time] this epoch (``token``)
        # The epoch: its start (None: not started), the most it may last (five tokens at the pace
        # before it), when the clients' requests start to count, and when tick next reads the pace.
        self._start_s: float | None = None
        self._cap_s, self._settle_s, self._check_s = epoch_s, 0.0, 0.0
        if start_s is not None:
            self._begin(start_s, 0.0, None)

    def handed_out(
        self, client_id: str, requests: int, rows: int, now_s: float, latency_rows: int | None = None
    ) -> None:
        """``requests`` requests (``rows`` rows, ``latency_rows`` of them latency work: all when
        None) of ``client_id`` were completed at ``now_s``."""
        if self._start_s is None:
            self._begin(now_s, 0.0, None)
        if now_s >= self._start_s + self._settle_s:
            latency_rows = rows if latency_rows is None else latency_rows
            counts = self._per_client.get(client_id)
            if counts is None:
                self._per_client[client_id] = [requests, rows, latency_rows]
            else:
                counts[0] += requests
                counts[1] += rows
                counts[2] += latency_rows

    def token(self, client_id: str, token_s: float, now_s: float) -> None:
        """A token of decoder ``client_id`` ended at ``now_s``, having taken ``token_s`` (its pass, or
        from its start to the next token's: ``pacing.DecodeGuard``). Counted like its requests,
        after the epoch's settling; the rules are compared on it where a decoder has tokens in
        both epochs (``_log_speedup``)."""
        if self._start_s is not None and now_s >= self._start_s + self._settle_s:
            counts = self._tokens.get(client_id)
            if counts is None:
                self._tokens[client_id] = [1, token_s]
            else:
                counts[0] += 1
                counts[1] += token_s

    def due(self, now_s: float) -> bool:
        """Whether ``tick`` may end the epoch now: the scheduler asks this on every plan, and
        ``tick``'s ``min_epoch_s`` costs a look at every decoder, so it is computed only then
        (from ``adapt_epoch_ms`` on, every half of that while the epoch lasts)."""
        return self._start_s is None or now_s >= self._check_s

    def tick(self, now_s: float, min_epoch_s: float = 0.0) -> None:
        """End the epoch if it is over, score it, and pick the next rule. ``min_epoch_s``: five of
        the slowest decoder's tokens at their pace now. The epoch lasts that long, but no longer
        than five tokens at the pace when it began (under the rule before it: a rule that slows
        the decoders does not lengthen its own trial, and a pace measured on a prefill does not
        hold the epoch after it), and at least ``epoch_s`` and twice its settling (see module
        doc). The first epoch, begun before any pace was read, lasts ``epoch_s``: it holds the
        clients' start, which no comparison uses."""
        if self._start_s is None:
            self._begin(now_s, min_epoch_s, None)
            return
        if not self.due(now_s):
            return
        elapsed_s = now_s - self._start_s
        # At least twice the settling: half of what is counted is settled, whatever the pace.
        length_s = max(self.epoch_s, 2.0 * self._settle_s, min(self._cap_s, min_epoch_s))
        if elapsed_s < length_s:
            self._check_s = self._start_s + min(length_s, elapsed_s + self.epoch_s / 2)
            return
        scored_s = elapsed_s - self._settle_s
        requests = sum(counts[0] for counts in self._per_client.values())
        # Not counted if this look came more than an epoch late: the executor was idle (it plans,
        # and so looks, on every arrival), and an idle executor says nothing about a rule. (A gap
        # that ends at a look within the epoch is not seen here: at most about one epoch's worth.)
        on_time = now_s - self._check_s <= length_s
        if on_time and len(self._per_client) >= 2 and requests >= MIN_REQUESTS:
            rows = sum(counts[1] for counts in self._per_client.values())
            if self._population.isdisjoint(self._per_client):
                self._start_over()
            self._population.update(self._per_client)
            self._rate(
                {
                    c: (n, math.log(max(r, 1) / n), math.log(n / scored_s), max(1.0, lr / n), *self._token_speed(c))
                    for c, (n, r, lr) in self._per_client.items()
                }
            )
            self.history.append(
                (
                    self.rule,
                    round(requests / scored_s),
                    round(rows / scored_s),
                    round(1e3 * elapsed_s),
                    round(1e3 * self._cap_s),
                    round(1e3 * min_epoch_s),
                )
            )
            del self.history[:-HISTORY]
            self.trials[self.rule] += 1
            self._last_tried[self.rule] = self.epochs
            self.epochs += 1
            self._since_reset += 1
            self.rule = self._next_rule()
        else:
            self._previous = None  # what follows an epoch that said nothing is not compared with it
        self._begin(now_s, min_epoch_s, elapsed_s)

    def _token_speed(self, client_id: str) -> tuple[int, float]:
        """(tokens, minus the log of their mean time) of ``client_id`` this epoch; (0, 0.0) if none."""
        tokens, total_s = self._tokens.get(client_id, (0, 0.0))
        return (int(tokens), -math.log(total_s / tokens)) if tokens and total_s > 0 else (0, 0.0)

    def _begin(self, now_s: float, min_epoch_s: float, last_s: float | None) -> None:
        """Start an epoch at ``now_s``; ``last_s``: how long the one before lasted. Requests count
        after the settling of the previous rule's convoys: a quarter of the length expected (the
        last epoch's, as it is the pace now; at most the cap)."""
        self._start_s, self._per_client, self._tokens = now_s, {}, {}
        self._cap_s = max(self.epoch_s, min_epoch_s)
        expected_s = self._cap_s if last_s is None else min(self._cap_s, max(self.epoch_s, last_s))
        self._settle_s = SETTLE_FRACTION * expected_s
        self._check_s = now_s + self.epoch_s

    def _start_over(self) -> None:
        """Forget the ratings (they were measured on other clients). The first time, the first
        trials come next; after that the new clients start on ``start_rule`` and the others are
        explored at the usual pace: a workload's first trials cost it two epochs of not waiting,
        and a new group is as often a short one (a benchmark's next group of processes, a batch
        of jobs) as a long one."""
        self._previous, self._settled = None, set()
        self._shown = {}
        self._last_tried = {rule: -1 for rule in RULES}
        self._backoff = {rule: 0 for rule in RULES}
        self._on_trial = None
        if self._population:
            self.resets += 1
            self.ratings, self.chosen = {self.start_rule: 0.0}, self.start_rule
            self._chosen_on_ratings = False
            self._since_reset = len(FIRST_TRIALS) + 1  # past the first trials; explores at 2 * EXPLORE_EVERY
        else:
            self.ratings, self.chosen = {}, None
            self._since_reset = 0
        self._population = set()

    def _rate(self, clients: dict[str, _Epoch]) -> None:
        """Rate the epoch just ended from ``clients`` (per client, what it measured: ``_Epoch``)."""
        rule = self.rule
        self.ratings.setdefault(rule, 0.0 if not self.ratings else max(self.ratings.values()))
        stalled = False
        if self._previous is not None and self._previous[0] != rule:
            other, before = self._previous
            compared = [
                c
                for c in before.keys() & clients.keys() & self._settled
                if min(before[c][0], clients[c][0]) >= MIN_CLIENT_REQUESTS
            ]
            if compared and _same_clients(before, clients) and _same_phase(before, clients, compared):
                speedup = sum(_log_speedup(before[c], clients[c]) for c in compared) / len(compared)
                # A stall is told by the clients' requests per second, not their tokens' time: a rule
                # can change an open loop's tokens several-fold (module doc), not its rate.
                rate_swing = sum(clients[c][2] - before[c][2] for c in compared) / len(compared)
                # One swing of a stall per epoch at most (module doc): a stalled epoch is compared
                # with the epochs on both sides of it, and it moves the ratings once.
                swing_of_a_stall = abs(rate_swing) >= STALL_SPEEDUP
                if not (swing_of_a_stall and self._previous_stalled):
                    stalled = swing_of_a_stall
                    if not swing_of_a_stall:  # a stall says nothing about the rule (module doc)
                        self._judge_trial(rule, other, _speedup_per_sequence(before, clients, compared))
                        self._note_shown(rule, other, speedup)
                    speedup = max(-MAX_SPEEDUP, min(MAX_SPEEDUP, speedup))
                    surprise = speedup - (self.ratings[rule] - self.ratings[other])
                    self.ratings[rule] += PAIR_WEIGHT * surprise / 2
                    self.ratings[other] -= PAIR_WEIGHT * surprise / 2
        self._previous_stalled = stalled
        if self._previous is not None:
            self._settled = set(self._previous[1])
        self._previous = (rule, clients)

    def _note_shown(self, rule: str, other: str, speedup: float) -> None:
        """Which of the two rules the comparison of this epoch (``rule``'s) with the one before
        (``other``'s) showed faster, and in which epochs (see ``_shown``)."""
        if speedup == 0.0:
            return
        this, before = self.epochs, self.epochs - 1  # the epoch before was counted: it is compared
        winner, loser = ((rule, this), (other, before)) if speedup > 0 else ((other, before), (rule, this))
        for epochs, epoch in zip(self._shown.setdefault((winner[0], loser[0]), (set(), set())), (winner[1], loser[1])):
            epochs.add(epoch)
            if len(epochs) > 2:
                epochs.remove(min(epochs))  # the two latest are all a switch asks about

    def _shown_on_two_epochs_each(self, winner: str, loser: str) -> bool:
        """Whether ``winner`` beat ``loser`` in two epochs of its own, against two of the loser's,
        within the last HISTORY epochs (see ``_shown``)."""
        won, lost = self._shown.get((winner, loser), ((), ()))
        recent = self.epochs - HISTORY
        return sum(e >= recent for e in won) >= 2 and sum(e >= recent for e in lost) >= 2

    def _judge_trial(self, rule: str, other: str, speedup: float) -> None:
        """A comparison of ``rule``'s epoch with the one before (``other``'s), whose clients went
        ``speedup`` (a log) faster: if it compares the trial last begun with the chosen rule, the
        trial's loss so far -- the worse of its comparisons (the chosen rule's epoch after a trial
        pays for it; module doc) -- sets how far that rule's trials back off, from its level before the
        trial (module doc). Any other comparison (the chosen rule's first epoch after a switch,
        with the rule chosen before) judges no trial."""
        if self._on_trial is None:
            return
        trial, before, losses = self._on_trial
        if rule == trial and other == self.chosen:
            losses.append(-speedup)
        elif other == trial and rule == self.chosen:
            losses.append(speedup)
        else:
            return
        lost = max(losses)
        if lost >= LOST_BADLY:
            self._backoff[trial] = RARE_LEVEL
        elif lost >= LOSES:
            self._backoff[trial] = min(RARE_LEVEL, before + 1)
        else:
            self._backoff[trial] = 0

    def _next_rule(self) -> str:
        if self._since_reset < len(FIRST_TRIALS):
            # a trial too: the last one's comparison with the first epoch of the chosen rule judges it
            first = FIRST_TRIALS[self._since_reset]
            self._on_trial = (first, self._backoff[first], [])
            return first
        top = max(self.ratings, key=self.ratings.__getitem__)
        if self.chosen is None or not self._chosen_on_ratings:  # the start rule, now
            self.chosen = self.start_rule if self.start_rule in self.ratings else top
        if self.ratings[top] > self.ratings[self.chosen] + SWITCH_MARGIN and self._shown_on_two_epochs_each(
            top, self.chosen
        ):
            self.chosen = top
            self._backoff[top] = 0
            self._chosen_on_ratings = top != self.start_rule
        best = self.chosen
        if self._since_reset % EXPLORE_EVERY == 0:
            others = [
                rule
                for rule in RULES
                if rule != best and self._since_reset % (EXPLORE_EVERY * 2 ** self._trial_level(rule, best)) == 0
            ]
            if others:
                trial = min(others, key=self._last_tried.__getitem__)
                self._on_trial = (trial, self._backoff[trial], [])
                return trial
        return best

    def _trial_level(self, rule: str, best: str) -> int:
        """How far ``rule``'s trials back off now: by its own trials' results, and to the rare pace
        when its rating puts it clearly below ``best``'s (a rule not rated yet is not)."""
        if self.ratings.get(rule, math.inf) < self.ratings[best] - CLEARLY_WORSE:
            return RARE_LEVEL
        return self._backoff[rule]

    def stats(self) -> dict:
        return {
            "rule": self.rule,
            "chosen": self.chosen,
            "start_rule": self.start_rule,
            "epochs": self.epochs,
            "resets": self.resets,
            "trials": dict(self.trials),
            "ratings": {rule: round(rating, 4) for rule, rating in self.ratings.items()},
            # each rule but the chosen one is tried at every this-many-th epoch (by its trials'
            # results and its rating; module doc)
            "trial_every": {
                rule: EXPLORE_EVERY * 2 ** self._trial_level(rule, self.chosen) for rule in RULES if rule != self.chosen
            }
            if self.chosen is not None
            else {},
            "history": [list(entry) for entry in self.history],
        }


def _same_clients(before: dict[str, _Epoch], now: dict[str, _Epoch]) -> bool:
    """Whether the same clients were at work in both epochs (each completing at least
    ``MIN_CLIENT_REQUESTS``; see module doc): a client that joins or leaves changes the others'
    speed too, whatever the rule, when they share cores or the executor."""

    def at_work(epoch: dict[str, _Epoch]) -> set[str]:
        return {c for c, (requests, *_) in epoch.items() if requests >= MIN_CLIENT_REQUESTS}

    return at_work(before) == at_work(now)


def _same_phase(before: dict[str, _Epoch], now: dict[str, _Epoch], clients: list[str]) -> bool:
    """Whether ``clients`` (served in both epochs) asked for rows alike (see module doc): each
    one's log rows per request moved by at most ``SAME_PHASE`` on average, weighted by its
    requests now."""
    total = sum(now[c][0] for c in clients)
    if not total:
        return False  # no client in both: nothing says the work was alike
    change = sum(now[c][0] * abs(now[c][1] - before[c][1]) for c in clients) / total
    return change <= SAME_PHASE


def _speedup_per_sequence(before: dict[str, _Epoch], now: dict[str, _Epoch], clients: list[str]) -> float:
    """How much faster ``clients``' sequences went now than before (a log): the mean of each
    client's log speed-up, weighted by its sequences -- its latency rows per request, the mean of
    the two epochs' -- what a trial costs (see module doc)."""
    weights = {c: (before[c][3] + now[c][3]) / 2 for c in clients}
    return sum(weights[c] * _log_speedup(before[c], now[c]) for c in clients) / sum(weights.values())


def _log_speedup(before: _Epoch, now: _Epoch) -> float:
    """How much faster one client went now than before (a log): by its tokens' time where it decoded
    ``MIN_CLIENT_TOKENS`` or more in both epochs, else by its requests per second (module doc)."""
    if min(before[4], now[4]) >= MIN_CLIENT_TOKENS:
        return now[5] - before[5]
    return now[2] - before[2]
