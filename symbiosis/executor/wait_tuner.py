"""Which waiting pays here: a small online experiment the opportunistic scheduler runs all the time.

Holding a layer's requests back to batch them with a client on its way saves a product: that pays when the
executor (or the CPU it shares with its clients) is the bottleneck, and costs latency when it is not.
Which holds depends on where the clients run (README): threads take turns on one interpreter lock,
processes on one host share the cores, remote clients share only the executor. So the scheduler tries
three waiting *rules* in turn and keeps the one under which its clients step fastest:

- ``none``: serve at once (the immediate policy): no wait added, no product saved;
- ``predicted``: hold only for clients predicted to arrive within the request's wait budget;
- ``convoy``: hold for every client on its way to the layer (the lockstep idea), up to
  ``lockstep_timeout_ms``: the fewest products, but the smallest clients step at the convoy's pace.

The measurements behind each choice below are dated in docs/performance.md, "Sharing the executor".

*Epochs.* A trial (*epoch*) lasts ``adapt_epoch_ms``, or five of the slowest active decoder's tokens if
longer (a convoy forms over one pass), at its recent pace (the median of its last ``pacing.RECENT_TOKENS``
token times: it forgets slow first tokens). It lasts no longer than five tokens at the pace when it began
(a rule that slows the decoders must not lengthen its own trial, which every client pays); the pace is
read again every half ``adapt_epoch_ms`` (``due``), so that a pace read at the clients' start does not
hold it. Requests count once the previous rule's convoys settle (``SETTLE_FRACTION`` of the expected
length); an epoch lasts at least twice that.

*What is measured*, per client: its requests per second (in a closed loop, 1 / its step time), or, for a
decoder with ``MIN_CLIENT_TOKENS`` tokens or more in both epochs, its tokens' time (``token``): the same
measure for one stepping back to back, and the only measure that moves for a stream read at a set rate,
whose requests per second are the reader's whatever the rule. Stalls (below) are still told by requests
per second, as a rule can change such a stream's tokens several-fold. Epochs are compared *client by
client*, by the mean log speed-up (a geometric mean: a rule that speeds every client up by x rates x); not
by total requests per second, which a rule raises by letting small clients race ahead while the large ones
(most of the tokens) slow down; nor by rows per second, which swing five-fold between prefill and
decoding.

*Not compared*, as it says nothing about the rule: a client's first epoch (its start: allocations, a
prefill, a cold cache); a client with fewer than ``MIN_CLIENT_REQUESTS`` in either epoch (noise); epochs
with different clients at work (one that joins or leaves changes the others' speed through the shared
cores and executor); epochs of different phases (``SAME_PHASE``: a client's request size is its own, not
the rule's, so a jump marks a prefill or its end, which made whichever rule ran first look several times
worse); epochs with fewer than two clients (nothing to batch) or ``MIN_REQUESTS`` requests; and one ended
by a look an epoch late (the executor idled). The epoch after one not counted is compared with nothing.

*Ratings.* Each counted epoch after one of another rule moves the two rules' ratings apart by
``PAIR_WEIGHT`` of the surprise (observed log speed-up minus rated gap: an Elo rating). Only adjacent
epochs are compared: on a shared machine load moves throughput by tens of percent within seconds, more
than the rules differ, so a rule's average would say when it ran. One comparison counts at most
``MAX_SPEEDUP`` (x1.5): no rule changes every client's speed several-fold, clients stalling together do;
from level, one such comparison moves the gap to x1.11, under the switching margin. A swing of
``STALL_SPEEDUP`` (x3) or more is a stall (real effects: x1.9-2.5 in the simulations): a stalled epoch,
compared on both sides, moves the ratings once, judges no trial and counts towards no switch.

*Switching.* The rule in use is ``start_rule`` until another is rated above it by ``SWITCH_MARGIN``
(x1.15: adjacent epochs differ by up to x2 on a shared machine) *and* beat it in two epochs of its own
against two of the other's within the last ``HISTORY`` epochs (else one slow epoch, compared on both
sides, decides); that rule is then kept, whatever the start rule does, until another beats it so. A 6 s
benchmark window (5-15 epochs) is often too short for the ratings to decide: there the start does.

*Exploring.* The first epochs try each rule (``FIRST_TRIALS``): "none" first, as the clients' start is
compared with nothing and not waiting costs it least; the convoy, which gains or loses the most, between
two "none" so that it is compared twice; then "predicted". After that every ``EXPLORE_EVERY``-th epoch
tries the rule least recently tried, to follow the load. A trial costs every client a slow epoch (what a
p95 sees first), so trials back off: every ``EXPLORE_EVERY * 2**level``-th epoch (5, 10, 20:
``RARE_FACTOR`` at most); a trial that lost to the chosen rule by ``LOSES`` (x1.1) raises the level by
one, by ``LOST_BADLY`` (x1.5) to the rare pace; one that did not lose resets it. A rule rated
``CLEARLY_WORSE`` (x1.25) below the chosen one stays rare. A trial's loss is the worse of its comparisons
with the chosen rule's epochs around it, as the epoch after pays for it (a "none" trial scatters the
convoy), and weighs clients by their sequences (latency rows per request), as a trial costs tokens; the
ratings, which choose, weigh clients alike (by sequences, a rule that speeds up only the small clients
rates far below its worth to them). The price: a rule that became better waits up to 20 epochs for a trial
(40 while both others are rare).

*Starting over.* Ratings belong to the clients they were measured on: what waiting paid two clients says
little about eight. When a counted epoch's clients are all new (a benchmark's next group, a new batch of
jobs), the tuner forgets its ratings (``resets``) and starts from ``start_rule``, exploring at the usual
pace without the first trials (two epochs of not waiting cost a short workload most).

*Start rules* (``start_rule``, set by the scheduler whenever the tuner may choose: the load moves):

- ``START_RULE``, the convoy, for client processes and remote clients while the host's CPUs are busy: the
  products it saves pay (client processes on 2 cores: x1.33 of not waiting's tokens/s; tcp:// alike).
- ``IN_PROCESS_START_RULE``, the convoy, while every client is a thread of the executor's process
  (``Scheduler.client_in_process``), whatever the host's room: they share one interpreter lock, which the
  host's CPU reading does not see, and each batch the executor does not run is lock time a client can use
  (its cost: beside fine-tuning threads, which get more of the lock, the decoders' p95 rises).
- ``IDLE_HOST_START_RULE``, not waiting, for the others while ``host_load.HostCpu`` reads (over
  ``host_load.WINDOW_S``) under ``IDLE_HOST_BUSY_SHARE`` busy with ``IDLE_HOST_SPARE_CORES`` idle: where
  the cores are not the bottleneck a request no rule holds is served at once
  (``Scheduler.serves_at_once``) and holding it only adds a wait (16 cores with an H200: not waiting beat
  the convoy by x1.2-1.6). A whole idle core: client processes on 2 cores read ~0.78 busy as they take
  turns with the executor, and the convoy served x1.3 of not waiting there.
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
