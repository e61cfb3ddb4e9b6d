"""What every benchmark script shares: arguments, checkpoints, timing, machine facts, JSON and plots.

Conventions, so that two numbers in one result file can be compared:

* Things that are compared are measured in the same process, interleaved round by round
  (``time_interleaved`` rotates the order every round), after a warm-up, and reported as medians
  with p95 next to them. The machines these run on are shared and noisy; a median of interleaved
  samples survives that, a mean of back-to-back blocks does not.
* Every result names its baseline and carries the ratio to it, plus a hardware ceiling
  (``matmul_ceiling_gflops``: plain ``torch.matmul`` on a square product) where FLOPs matter.
* ``--quick`` means: the ``tiny`` preset and few iterations, so the script finishes in seconds; it
  exists for smoke tests (``tests/test_benchmarks_quick.py``), its numbers mean little.
* Checkpoints are random-weight ``symbiosis.modelzoo`` models, made once and cached under
  ``--cache`` (default ``$SYMBIOSIS_BENCH_CACHE`` or ``~/.cache/symbiosis/bench``); ``--model DIR``
  uses an existing checkpoint folder instead.
* A result is one JSON file (``<benchmark>.json``) plus one PNG (``<benchmark>.png``) in
  ``--output``; the JSON records the command line, the machine and the wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DEFAULT_PRESET = "small"
QUICK_PRESET = "tiny"


# ---- arguments -----------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    env = os.environ.get("SYMBIOSIS_BENCH_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "symbiosis" / "bench"


def add_common_arguments(parser: argparse.ArgumentParser, *, default_repeats: int, quick_repeats: int) -> None:
    """The flags every benchmark takes (``--quick --output --cache --preset --repeats --model --threads``)."""
    parser.add_argument(
        "--quick", action="store_true", help=f"Smoke-test mode: the {QUICK_PRESET!r} preset and few iterations."
    )
    parser.add_argument(
        "--output", type=Path, default=Path("bench-results"), help="Folder for the JSON result and PNG plot."
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="Folder where benchmark checkpoints are made once and kept (default: $SYMBIOSIS_BENCH_CACHE or ~/.cache/symbiosis/bench).",
    )
    parser.add_argument(
        "--preset",
        choices=("tiny", "small", "base"),
        default=None,
        help=f"Model size (default {DEFAULT_PRESET!r}, or {QUICK_PRESET!r} with --quick).",
    )
    parser.add_argument(
        "--arch", default="llama", help="Architecture of the random-weight checkpoint (default: %(default)s)."
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"Measured repetitions, medians taken over them (default {default_repeats}, {quick_repeats} with --quick).",
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="Use this existing checkpoint folder instead of making one."
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads(N) before measuring (default: torch's choice)."
    )
    parser.set_defaults(_default_repeats=default_repeats, _quick_repeats=quick_repeats)


def resolve_common(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on ``--quick`` and apply ``--threads``."""
    if args.preset is None:
        args.preset = QUICK_PRESET if args.quick else DEFAULT_PRESET
    if args.repeats is None:
        args.repeats = args._quick_repeats if args.quick else args._default_repeats
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    if args.cache is None:
        args.cache = default_cache_dir()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    quiet_libraries()
    return args


def checkpoint_path(args: argparse.Namespace, seed: int = 0) -> Path:
    """``--model`` if given, else a cached random-weight checkpoint of ``--arch``/``--preset``."""
    if args.model is not None:
        return Path(args.model)
    from symbiosis.modelzoo import make_model

    return make_model(args.arch, args.preset, Path(args.cache) / f"{args.arch}-{args.preset}-seed{seed}", seed=seed)


# ---- timing --------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(samples_s: Sequence[float]) -> dict[str, float]:
    """Median, p95, mean and min of time samples, in milliseconds, and their count."""
    if not samples_s:
        return {"median_ms": math.nan, "p95_ms": math.nan, "mean_ms": math.nan, "min_ms": math.nan, "n": 0}
    return {
        "median_ms": 1e3 * statistics.median(samples_s),
        "p95_ms": 1e3 * percentile(samples_s, 95),
        "mean_ms": 1e3 * statistics.fmean(samples_s),
        "min_ms": 1e3 * min(samples_s),
        "n": len(samples_s),
    }


def median_or_nan(values: Sequence[float]) -> float:
    finite = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator and not math.isnan(denominator) else math.nan


def time_interleaved(
    candidates: Mapping[str, Callable[[], Any]], *, warmup: int, repeats: int
) -> dict[str, list[float]]:
    """Time each candidate ``repeats`` times, one sample of each per round, in rotating order.

    Every candidate first runs ``warmup`` untimed calls. Interleaving puts the candidates under the
    same background load (other processes, thermal state), so their ratio is meaningful even when
    the absolute times drift.
    """
    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            candidates[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            candidates[name]()
            samples[name].append(time.perf_counter() - start)
    return samples


def square_matmul(size: int = 1024, dtype: torch.dtype = torch.float32) -> tuple[Callable[[], Any], float]:
    """A plain ``torch.matmul`` of two ``size``² matrices and its GFLOP: the hardware-ceiling probe.

    Time it among the candidates (``time_interleaved``) so the ceiling is measured under the same
    background load as the numbers it is compared with.
    """
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    return (lambda: torch.matmul(a, b)), 2.0 * size**3 / 1e9


def matmul_ceiling_gflops(size: int = 1024, repeats: int = 10, dtype: torch.dtype = torch.float32) -> float:
    """Hardware ceiling on its own: GFLOP/s of the best of ``repeats`` square matmuls."""
    probe, gflop = square_matmul(size, dtype)
    samples = time_interleaved({"matmul": probe}, warmup=1, repeats=repeats)["matmul"]
    return gflop / min(samples)


# ---- machine facts and results -------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: CPU count and affinity, torch threads, library versions, load."""
    import peft
    import transformers

    try:
        usable_cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable_cpus = os.cpu_count()
    try:
        load_average = list(os.getloadavg())
    except OSError:
        load_average = None
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus,
        "load_average_1_5_15min": load_average,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda_available": torch.cuda.is_available(),
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }


def _jsonable(value: Any) -> Any:
    """NaN/inf become null (strict JSON); tuples become lists; paths and dtypes become strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (Path, torch.dtype, torch.device)):
        return str(value)
    return value


def write_json(path: Path, result: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(result), indent=2, allow_nan=False) + "\n")
    return path


def command_line(argv: Sequence[str] | None, module: str) -> str:
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python", "-m", module, *args])


# ---- plots ---------------------------------------------------------------------------------------


@dataclass
class Panel:
    """One subplot: grouped bars (``kind="bar"``) or lines (``kind="line"``) over ``labels``.

    ``series`` maps a legend name to one value per label (None/NaN draws nothing).
    """

    title: str
    ylabel: str
    labels: list[str]
    series: dict[str, list[float | None]] = field(default_factory=dict)
    kind: str = "bar"
    log_y: bool = False


def _short_number(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def plot_panels(path: Path, title: str, panels: Sequence[Panel], *, columns: int = 2) -> Path:
    """Write a PNG with one subplot per panel (matplotlib, headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 3.8 * rows), squeeze=False)
    for axis, panel in zip(axes.flat, panels):
        positions = list(range(len(panel.labels)))
        names = list(panel.series)
        if panel.kind == "bar":
            width = 0.8 / max(1, len(names))
            for index, name in enumerate(names):
                values = [math.nan if v is None else v for v in panel.series[name]]
                offsets = [p + (index - (len(names) - 1) / 2) * width for p in positions]
                bars = axis.bar(offsets, values, width=width, label=name)
                axis.bar_label(bars, fmt=_short_number, fontsize=7)
        elif panel.kind == "line":
            for name in names:
                values = [math.nan if v is None else v for v in panel.series[name]]
                axis.plot(positions, values, marker="o", label=name)
        else:
            raise ValueError(f"unknown panel kind {panel.kind!r}; use 'bar' or 'line'")
        axis.set_xticks(positions, panel.labels, fontsize=8)
        axis.set_title(panel.title, fontsize=10)
        axis.set_ylabel(panel.ylabel)
        if panel.log_y:
            axis.set_yscale("log")
        if len(names) > 1:
            axis.legend(fontsize=8)
        axis.grid(axis="y", alpha=0.3)
    for axis in list(axes.flat)[len(panels) :]:
        axis.set_visible(False)
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def quiet_libraries() -> None:
    """No progress bars or deprecation chatter from transformers/peft in benchmark output."""
    import warnings

    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)


def print_summary(summary: Mapping[str, Any]) -> None:
    print(json.dumps(_jsonable(summary), indent=2, allow_nan=False), flush=True)


# ---- processes and memory (the multi-process benchmarks) ----------------------------------------
#
# Scenarios that compare processes (one executor + K clients vs K monolithic jobs) run every
# process from this interpreter with the same environment, and talk to workers in JSON lines on
# stdin/stdout: a worker prints one ``EVENT_PREFIX {"event": "ready", ...}`` line once loaded, then
# runs once per ``go`` line it reads (printing ``{"event": "done", ...}``) until ``exit``. Other
# stdout lines (library chatter) are ignored.

EVENT_PREFIX = "@@bench "


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def process_env(threads: int) -> dict[str, str]:
    """Environment of a benchmark child: unbuffered, ``threads`` torch threads, this repo importable."""
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo_root()), os.environ.get("PYTHONPATH", "")) if p)
    return env


def stop_process(process, timeout_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``; always reaps the child."""
    import subprocess

    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class _LineReader:
    """Reads a child's stdout on a daemon thread (so a full pipe never blocks the child)."""

    def __init__(self, stream) -> None:
        import collections
        import queue
        import threading

        self.events: queue.Queue[dict | None] = queue.Queue()
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self._thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self._thread.start()

    def _run(self, stream) -> None:
        for line in stream:
            self.tail.append(line)
            if line.startswith(EVENT_PREFIX):
                self.events.put(json.loads(line[len(EVENT_PREFIX) :]))
            elif line.startswith("serving"):
                self.events.put({"event": "serving", "line": line.strip()})
        self.events.put(None)  # EOF

    def next_event(self, timeout_s: float, what: str) -> dict:
        import queue

        try:
            event = self.events.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"{what}: no answer in {timeout_s:.0f}s; last output:\n{''.join(self.tail)}") from None
        if event is None:
            raise RuntimeError(f"{what}: process exited; last output:\n{''.join(self.tail)}")
        if event.get("event") == "error":
            raise RuntimeError(f"{what} failed: {event.get('error')}")
        return event


class ServerProcess:
    """A serving child process (``command``); ``addresses`` parsed from the line it prints when ready.

    The line has the shape ``symbiosis serve`` prints: ``serving … at ADDR[ and ADDR…] with policy …``.
    """

    def __init__(
        self, command: Sequence[str], *, threads: int = 1, timeout_s: float = 180.0, wait: bool = True
    ) -> None:
        import subprocess

        self.process = subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=process_env(threads),
        )
        self.pid = self.process.pid
        self._reader = _LineReader(self.process.stdout)
        self._addresses: list[str] | None = None
        if wait:
            self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float = 180.0) -> list[str]:
        """Block until the server prints its ``serving`` line (``wait=False`` lets the caller overlap the load)."""
        if self._addresses is None:
            try:
                line = self._reader.next_event(timeout_s, "server")["line"]
            except BaseException:
                stop_process(self.process)
                raise
            self._addresses = line.rsplit(" with policy", 1)[0].rsplit(" at ", 1)[1].split(" and ")
        return self._addresses

    @property
    def addresses(self) -> list[str]:
        return self.wait_ready()

    def close(self) -> None:
        stop_process(self.process)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def executor_process(
    path: Path, binds: Sequence[str], *, threads: int = 1, extra: Sequence[str] = (), wait: bool = True
) -> ServerProcess:
    """``symbiosis serve MODEL --bind …`` in a child process with ``threads`` torch threads."""
    command = [
        sys.executable,
        "-m",
        "symbiosis",
        "serve",
        str(path),
        *[a for b in binds for a in ("--bind", b)],
        *extra,
    ]
    return ServerProcess(command, threads=threads, wait=wait)


def loopback_binds(folder: Path) -> list[str]:
    """A free loopback tcp port and an ipc socket in ``folder`` (the executor serves both)."""
    return ["tcp://127.0.0.1:0", f"ipc://{Path(folder) / 'executor.sock'}"]


class Worker:
    """A benchmark worker child (``python -m MODULE worker SPEC_JSON``); see the protocol above."""

    def __init__(
        self, module: str, spec: Mapping[str, Any], *, threads: int = 1, env: Mapping[str, str] | None = None
    ) -> None:
        import subprocess
        import tempfile

        self.spec = dict(spec)
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(
            [sys.executable, "-m", module, "worker", json.dumps(self.spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env={**process_env(threads), **(env or {})},
        )
        self.pid = self.process.pid
        self._reader = _LineReader(self.process.stdout)
        self.ready: dict | None = None

    def wait_ready(self, timeout_s: float = 300.0) -> dict:
        if self.ready is None:
            self.ready = self._event(timeout_s, "ready")
        return self.ready

    def go(self) -> None:
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def wait_done(self, timeout_s: float = 600.0) -> dict:
        return self._event(timeout_s, "done")

    def _event(self, timeout_s: float, expected: str) -> dict:
        try:
            event = self._reader.next_event(timeout_s, f"worker {self.spec.get('role', '')} (pid {self.pid})")
        except RuntimeError as exc:
            self._stderr.seek(0)
            raise RuntimeError(f"{exc}\nstderr tail:\n{self._stderr.read()[-3000:]}") from None
        if event.get("event") != expected:
            raise RuntimeError(f"worker pid {self.pid}: expected {expected!r}, got {event}")
        return event

    def request_exit(self) -> None:
        """Ask the worker to finish (closing many: ask all first, then ``close`` each)."""
        if self.process.poll() is None and not self.process.stdin.closed:
            try:
                self.process.stdin.write("exit\n")
                self.process.stdin.close()
            except OSError:  # already gone
                pass

    def close(self) -> None:
        self.request_exit()
        try:
            self.process.wait(timeout=15)
        except Exception:
            pass
        stop_process(self.process)
        self._stderr.close()


def emit_event(event: str, **fields: Any) -> None:
    """Worker side: one protocol line on stdout."""
    print(EVENT_PREFIX + json.dumps(_jsonable({"event": event, **fields}), allow_nan=False), flush=True)


def serve_worker(setup: Callable[[], Callable[[], dict]]) -> None:
    """Worker side: ``setup()`` loads and returns ``run_once``; answer ``go`` lines until ``exit``.

    ``ready`` and every ``done`` carry the process's peak RSS so far (``ru_maxrss``, exact, unlike
    sampling) next to whatever ``run_once`` returns.
    """
    import traceback

    try:
        run_once = setup()
        emit_event("ready", pid=os.getpid(), **own_memory())
        for line in sys.stdin:
            command = line.strip()
            if command == "exit":
                break
            if command == "go":
                emit_event("done", **run_once(), **own_memory())
    except Exception:
        emit_event("error", error=traceback.format_exc()[-3000:])
        raise SystemExit(1)


def own_memory() -> dict[str, int]:
    import resource

    import psutil

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
        import threading

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
        import psutil

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


GIB = float(2**30)
MIB = float(2**20)
