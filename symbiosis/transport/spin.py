"""Waiting for a same-host peer: check for a while before sleeping.

Why. A thread that blocks in ``recv`` or ``poll`` sleeps, and on a virtual machine its core may
halt; waking it costs more than the syscall. Measured on this project's 2-core VM (2026-11-25,
a ``symbiosis serve`` process and a client process, 1-row calls to a hidden-512 llama's
``o_proj``): 145 µs a call with both sides sleeping, ~85-95 µs with one side checking its socket
for up to 2 ms before sleeping, 43 µs with both. A decode step waits like that twice per call:
the client for the product, the executor's socket thread for the client's next call (the client
computes attention and norms between calls). A 16-sequence decode step over ``shm+ipc`` took
27.5-28.2 ms sleeping, 24.3-25.1 ms with a 1 ms bound and 21.9-23.7 ms with 2 ms (in-process:
20.4-21.5); the gate/up product of that step takes ~1.4 ms, hence the 2 ms default. (Those are
the first, unconditional version's figures. With the adaptive one below: that step 28.5 and 31.2
ms against 34.9 and 39.5 sleeping, on a busier host; 1-row calls 33-53 µs back to back, and
43-60 µs with the client working or asleep 200 µs between calls -- 172-211 µs sleeping -- though
an earlier hour of the same day gave ~91 µs there with the same code.)

How. Only same-host lanes spin (``lane.py``'s Unix-socket calls, the executor's socket thread
after serving a lane message): they are the waits a decode step makes tens of times per token.
A spin is bounded (``SPIN_S``; a reply that takes longer is waited for asleep, as before, and
then the wake-up is small against the wait), adaptive and polite: each side spins only while
its recent waits have been decode-short (``RecentWaits``: the client while its replies average
under ``SPIN_S / 2``, the executor while its client's work between calls averages under
``SPIN_S / 4``; a training step, a client whose calls queue behind other clients' work, or an
executor whose clients call rarely, sleeps at once and leaves the cores to the others), and each
empty check yields the core (``sched_yield``), so another runnable thread on it runs first.
ZeroMQ waits, tcp lanes and shared-memory segments do not spin.

Backing off from background work. A yield hands the core to *any* runnable task, and the
kernel's fair scheduler (EEVDF) may pick a background one -- a fine-tuning job at ``SCHED_IDLE``
(``threads.enter_background_priority``) -- and take the core back only at a later tick: the
spinner is runnable, not asleep, so no wake-up preempts the background task, and it keeps the
core for 1.5-5 ms. A thread that *sleeps* instead is woken by its reply and preempts a background
task at once. So when yields keep losing the core (``LOSSES_FOR_CALM`` yields of over
``STOLEN_YIELD_S``, each less than ``LOSS_WINDOW_S`` after the last), this process's waits sleep
at once for a spell (the core is busy with someone else's work, so it does
not halt and the wake-up is cheap): ``CALM_S``, doubled up to ``LONGEST_CALM_S`` while the
losses keep coming right after each spell; then spinning is tried again. Measured on this
2-core host (2026-11-27): two processes ping-ponging over a lane socket through ``try_for`` with
300 us of work a side, beside two ``SCHED_IDLE`` busy loops: mean round trip 1.19-1.24 ms (p95
4.9-5.0 ms) yielding regardless, 0.73-0.80 ms (p95 0.70-0.75 ms) with the spells; alone, 0.62
ms either way (a lone loss does not start a spell: with one loss enough, a lone client's round trips over
shm+ipc came out x1.17-1.75 of the old code's in three A/Bs; with three in 100 ms, 7 of 8
ratios 0.69-1.0 and one 1.41 in two). ``python -m benchmarks.yield_loss`` re-measures the
ping-pong.
End to end the effect is within this host's noise: ``symbiosis api`` over shm+ipc beside two
background fine-tuning jobs (alternated pairs), inference p50 inter-token 43.9 vs 49.4 ms and
the jobs +10% steps (a fixed 1 s spell after one loss, four pairs); with the rule above 45.9 vs
48.1 ms, p95 119 vs 112 ms, the jobs' steps the same (three pairs).

``SYMBIOSIS_SPIN_US`` (read once, at import) sets the bound in microseconds; 0 turns spinning
off (a host whose cores are all busy with other work gains nothing from it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

SPIN_VARIABLE = "SYMBIOSIS_SPIN_US"
DEFAULT_SPIN_US = 2000.0


def _spin_seconds() -> float:
    value = os.environ.get(SPIN_VARIABLE, "").strip()
    try:
        micros = float(value) if value else DEFAULT_SPIN_US
    except ValueError:
        micros = DEFAULT_SPIN_US  # a malformed value must not stop a process from starting
    return max(micros, 0.0) * 1e-6


#: How long a same-host wait checks before it sleeps, in seconds (0: never).
SPIN_S = _spin_seconds()
#: A side spins only while its recent waits average at most this: a decode step's (replies in a
#: fraction of a millisecond to ~1.5 ms at hidden 512, the client's work between calls shorter), not a
#: training step's (products of hundreds of rows, and attention's backward between calls, take
#: milliseconds; a spinning peer then takes a core from the other side's second torch thread: a
#: training step over shm+ipc with 2 threads per process went from x1.08-1.20 of monolithic to
#: x1.27-1.33 when both sides spun on any wait under 2 ms).
CLIENT_SPIN_IF_WAITS_UNDER_S = SPIN_S / 2
SERVER_SPIN_IF_GAPS_UNDER_S = SPIN_S / 4
#: A yield that kept the caller off its core longer than this lost it to a task that runs whole
#: time slices (a background job), not to a peer's worker that needed it for a moment.
STOLEN_YIELD_S = 1e-3
#: How long this process's waits sleep at once after such losses: the shortest spell, doubled
#: (up to the longest) each time the core is lost again soon after a spell -- background work that
#: lasts -- and back to the shortest after a while without losses.
CALM_S = 0.25
LONGEST_CALM_S = 4.0
#: Losses start a spell only when ``LOSSES_FOR_CALM`` come less than ``LOSS_WINDOW_S`` apart:
#: background work makes them by the hundred a second, while a lone one (the hypervisor taking
#: this virtual CPU away, a kernel thread) is noise that must not slow a lone client's calls.
LOSSES_FOR_CALM = 3
LOSS_WINDOW_S = 0.1


class CoreLosses:
    """Yields that lost the core, and the calm spell they started (module doc). One per process,
    shared by its threads: a race between them only ever miscounts a loss or moves a spell's end."""

    __slots__ = ("calm_until", "spell_s", "losses", "last_loss_at")

    def __init__(self) -> None:
        self.calm_until = 0.0  # ``_clock`` time until which waits sleep at once
        self.spell_s = CALM_S  # the last spell's length
        self.losses = 0  # losses in a row, each within LOSS_WINDOW_S of the last
        self.last_loss_at = -1e9

    def lost(self, now: float) -> bool:
        """Count a yield that lost the core at ``now``; True if that starts a spell."""
        self.losses = self.losses + 1 if now - self.last_loss_at < LOSS_WINDOW_S else 1
        self.last_loss_at = now
        if self.losses < LOSSES_FOR_CALM:
            return False
        self.losses = 0
        lasting = now - self.calm_until < self.spell_s  # lost again right after the last spell
        self.spell_s = min(2 * self.spell_s, LONGEST_CALM_S) if lasting else CALM_S
        self.calm_until = now + self.spell_s
        return True


_core_losses = CoreLosses()
#: The clock and the yield ``try_for`` uses (tests replace them).
_clock = time.perf_counter
_yield_core = os.sched_yield
#: Weight of the newest wait in ``RecentWaits``' moving average.
WAIT_WEIGHT = 0.25
#: A wait counts as at most this long (the first one, after an idle hour, must not linger).
LONGEST_WAIT_S = 1.0


class RecentWaits:
    """A moving average of one side's recent waits, and the spin they call for: ``spin_s`` while
    the average is at most ``limit_s``, else none (sleep at once)."""

    __slots__ = ("limit_s", "mean_s", "spin_s")

    def __init__(self, limit_s: float, spin_s: float = SPIN_S) -> None:
        self.limit_s = limit_s
        self.spin_s = spin_s
        self.mean_s = 0.0

    def observe(self, seconds: float) -> None:
        self.mean_s += WAIT_WEIGHT * (min(seconds, LONGEST_WAIT_S) - self.mean_s)

    def spin_budget_s(self) -> float:
        return self.spin_s if self.mean_s <= self.limit_s else 0.0


def spin_window_s(waits: RecentWaits, since_last_s: float, timeout_s: float) -> float:
    """How long the executor's socket thread checks before it sleeps: the rest of its spin since
    the last lane call was answered, never past the poll's own timeout (a batch the scheduler
    holds is due then); 0 or less: sleep at once."""
    return min(waits.spin_budget_s() - since_last_s, timeout_s)


def try_for(attempt: Callable[[], T | None], budget_s: float) -> T | None:
    """``attempt()`` until it returns something other than None or ``budget_s`` has passed,
    yielding the core between attempts; None if nothing came (the caller then waits asleep).
    Also None, at once or mid-spin, while background work takes this process's cores (module doc)."""
    if budget_s <= 0:
        return None
    losses = _core_losses
    now = _clock()
    if now < losses.calm_until:
        return None
    deadline = now + budget_s
    while True:
        result = attempt()
        if result is not None:
            return result
        now = _clock()
        if now >= deadline:
            return None
        _yield_core()
        after = _clock()
        if after - now > STOLEN_YIELD_S and losses.lost(after):
            return None
