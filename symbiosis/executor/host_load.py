"""How busy the host's CPUs are.

The wait tuner's start depends on it (``wait_tuner.IDLE_HOST_START_RULE``): holding requests back
for a convoy saves products, which pays when the CPUs are the bottleneck, and costs latency when
they have room. System-wide, not this process: the clients on the same host (and other tenants)
use the same cores. The benchmarks' "cores busy" read the same seconds (``host_cpu_busy_s``).

A reading covers the last ``WINDOW_S`` seconds (or all the time since the reader began, if
less), whenever it is asked for -- as far as the readings before it go: it starts at the newest
reading at least that old, or, after a pause of the asker (an idle executor does not ask), at the
first one after the pause, so that a host that was idle for an hour does not read idle for the
first seconds of the load that ended the pause. The scheduler asks every half epoch (a tenth of a second or
so), and a share over that alone is noise on a small host: the kernel counts CPU time in ticks
(100 a second a core), and client processes that take turns with the executor leave the cores
idle for a few ticks at a time. Measured (2026-12-01, this 2-core host, 8 decoding client
processes): readings over ~0.1 s went 0.23-0.98, about 0.78 on average, and the tuner's start
flipped between its two rules every few readings -- the choice it made after its first trials
hung on one of them.
"""

from __future__ import annotations

import time
from collections import deque

import psutil

BUSY_FIELDS = ("user", "nice", "system", "irq", "softirq")
#: A reading is the busy share over about this many seconds (the module doc says why).
WINDOW_S = 2.0


def host_cpu_busy_s(times=None) -> float:
    """CPU seconds this host's cores have been busy since boot, summed over the cores: every
    process's (background priority too), not time the hypervisor stole. ``times``: a
    ``psutil.cpu_times()`` reading (read now by default)."""
    times = psutil.cpu_times() if times is None else times
    return sum(getattr(times, name, 0.0) for name in BUSY_FIELDS)


def _cpu_s(times) -> float:
    """All CPU seconds since boot, summed over the cores (Linux counts guest time within user time
    too: not twice, as psutil's own ``cpu_percent``)."""
    return sum(times) - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)


class HostCpu:
    """``busy_share()``: the share of the host's CPU time (all cores) that was busy
    (``host_cpu_busy_s``) over the last ``window_s`` seconds -- or since construction, or since
    the first reading after a pause, if that is shorter (module doc); None when no CPU time has
    passed. ``cores``: how many cores that time is shared
    between (the logical CPUs the kernel counts)."""

    def __init__(self, window_s: float = WINDOW_S, clock=time.monotonic) -> None:
        self.window_s = window_s
        self.cores = psutil.cpu_count() or 1
        self._clock = clock
        # (clock, busy CPU seconds, all CPU seconds), oldest first; the oldest is the one reading
        # at or before the window's start (or the first one).
        self._readings: deque[tuple[float, float, float]] = deque()
        self._read()

    def _read(self) -> tuple[float, float, float]:
        times = psutil.cpu_times()
        reading = (self._clock(), host_cpu_busy_s(times), _cpu_s(times))
        self._readings.append(reading)
        return reading

    def busy_share(self) -> float | None:
        now, busy_s, all_s = self._read()
        readings = self._readings
        while len(readings) > 2 and readings[1][0] <= now - self.window_s:
            readings.popleft()  # the next one still reaches back to the window's start
        if len(readings) > 2 and readings[0][0] < now - 2 * self.window_s:
            readings.popleft()  # a pause: start after it (module doc)
        _, busy_then_s, all_then_s = readings[0]
        total = all_s - all_then_s
        if total <= 0:
            return None
        return min(1.0, max(0.0, (busy_s - busy_then_s) / total))
