"""How busy the host's CPUs are.

The wait tuner's start depends on it (``wait_tuner.IDLE_HOST_START_RULE``): holding requests back
for a convoy saves products, which pays when the CPUs are the bottleneck, and costs latency when
they have room. The scheduler asks when the tuner may choose (once an epoch), so a reading covers
the epoch before it. System-wide, not this process: the clients on the same host (and other
tenants) use the same cores. The benchmarks' "cores busy" read the same seconds
(``host_cpu_busy_s``).
"""

from __future__ import annotations

import psutil

BUSY_FIELDS = ("user", "nice", "system", "irq", "softirq")


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
    (``host_cpu_busy_s``) since the previous call, or since construction for the first; None when
    no time has passed."""

    def __init__(self) -> None:
        self._last = psutil.cpu_times()

    def busy_share(self) -> float | None:
        now = psutil.cpu_times()
        last, self._last = self._last, now
        total = _cpu_s(now) - _cpu_s(last)
        if total <= 0:
            return None
        return min(1.0, max(0.0, (host_cpu_busy_s(now) - host_cpu_busy_s(last)) / total))
