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
    yielding the core between attempts; None if nothing came (the caller then waits asleep)."""
    if budget_s <= 0:
        return None
    deadline = time.perf_counter() + budget_s
    while True:
        result = attempt()
        if result is not None:
            return result
        if time.perf_counter() >= deadline:
            return None
        os.sched_yield()
