"""How busy the host's CPUs are: the share of all CPU time not idle since the last reading.

The wait tuner's start depends on it (``wait_tuner.IDLE_HOST_START_RULE``): holding requests back
for a convoy saves products, which pays when the CPUs are the bottleneck, and costs latency when
they have room. The scheduler asks when the tuner may choose (once an epoch), so a reading covers
the epoch before it. System-wide, not this process: the clients on the same host (and other
tenants) use the same cores.
"""

from __future__ import annotations

import psutil


class HostCpu:
    """``busy_share()``: the share of the host's CPU time (all cores) that was not idle since the
    previous call, or since construction for the first; None when no time has passed."""

    def __init__(self) -> None:
        self._last = psutil.cpu_times()

    def busy_share(self) -> float | None:
        now = psutil.cpu_times()
        last, self._last = self._last, now
        total = _total(now) - _total(last)
        if total <= 0:
            return None
        idle = _idle(now) - _idle(last)
        return min(1.0, max(0.0, 1.0 - idle / total))


def _total(times) -> float:
    # Linux counts guest time within user time too: not twice (as psutil's own cpu_percent).
    return sum(times) - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)


def _idle(times) -> float:
    return times.idle + getattr(times, "iowait", 0.0)
