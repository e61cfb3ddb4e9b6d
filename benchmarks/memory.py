"""Memory of benchmark processes: a background RSS sampler over many processes, and a process's own RSS."""

from __future__ import annotations

import resource
import threading

import psutil

GIB = float(2**30)
MIB = float(2**20)


def own_memory() -> dict[str, int]:
    """This process's RSS now and its peak so far (``ru_maxrss``: exact, unlike sampling)."""
    return {
        "rss_bytes": psutil.Process().memory_info().rss,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


class RssSampler:
    """Samples the RSS of watched processes every ``interval_s`` on a background thread (psutil).

    ``peak_by_pid``: highest RSS seen per process; ``peak_total``: highest *sum* over the watched
    processes at one sampling instant (what the machine had to hold at once). RSS counts shared
    library pages in every process, so sums slightly overstate; both sides of a comparison
    include them alike.
    """

    def __init__(self, interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self.roles: dict[int, str] = {}
        self.peak_by_pid: dict[int, int] = {}
        self.last_by_pid: dict[int, int] = {}
        self.peak_total = 0
        self.samples = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def watch(self, pid: int, role: str) -> None:
        with self._lock:
            self.roles[pid] = role

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def sample(self) -> None:
        with self._lock:
            pids = list(self.roles)
        total = 0
        for pid in pids:
            try:
                rss = psutil.Process(pid).memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            total += rss
            self.last_by_pid[pid] = rss
            self.peak_by_pid[pid] = max(rss, self.peak_by_pid.get(pid, 0))
        self.peak_total = max(self.peak_total, total)
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> RssSampler:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.sample()
        return self

    def peaks_of(self, role: str) -> list[int]:
        return [self.peak_by_pid.get(pid, 0) for pid, r in self.roles.items() if r == role]
