"""``benchmarks.batching --clients-as processes --profile DIR``: where each process spends a window.

Why. The closed-loop clients of a processes run wait on the executor; whether the executor's
serving thread, its products, the transport or the clients themselves bound a run is a question
of where each process's threads spend the measured window, on the host the run is on (a profile
from a 2-core host, where the products take the cores, says little about a 16-core one).

How. At a window's start one ``py-spy record`` per process (the executor and every client) samples
it for the window's length, every thread, idle ones included, without pausing it
(``--nonblocking``: a paused executor would be a slower executor), into py-spy's raw format (one
``frame;frame;... count`` line per distinct stack, the thread first). ``summarize`` reads such a
file: per thread, the share of its samples spent waiting in a blocking call, and where its samples
end (the innermost frame, with its caller). py-spy is not a dependency: ``pip install py-spy``.
A py-spy that cannot attach (no ptrace permission) leaves its reason in ``NAME.err``.
"""

from __future__ import annotations

import gzip
import math
import re
import shutil
import subprocess
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

RATE_HZ = 100
# py-spy's raw format: "frames count", the first frame the thread ("thread (TID): NAME"), then
# "function (file:line)" frames, outermost first. py-spy marks idleness only in its own statistics,
# not in raw output: a sample counts as waiting when its innermost frame is one of these blocking
# calls (the lane's receives spin for a few microseconds first, then block in the kernel).
_LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")
_FRAME = re.compile(r"^(?P<function>.*?) \((?P<where>[^()]*)\)$")
WAITING = frozenset(
    {
        "wait",
        "poll",
        "select",
        "sleep",
        "recv",
        "recv_into",
        "recvmsg_into",
        "recv_multipart",
        "acquire",
        "join",
        "_recv_bytes",
        "_recv",
        "_worker",
        "_receive_into",
        "_receive_datagram",
        "_receive_stream",
        "_receive_exactly",
    }
)


def py_spy() -> str:
    found = shutil.which("py-spy")
    if found is None:
        raise SystemExit("--profile needs py-spy on PATH: pip install py-spy")
    return found


@dataclass
class WindowProfile:
    """One window's ``py-spy record`` processes, one per named process."""

    folder: Path
    processes: list[subprocess.Popen] = field(default_factory=list)
    error_files: list[Path] = field(default_factory=list)

    @classmethod
    def start(cls, folder: Path, prefix: str, pids: dict[str, int], seconds: float) -> WindowProfile:
        folder.mkdir(parents=True, exist_ok=True)
        profile = cls(folder)
        for name, pid in pids.items():
            command = [
                py_spy(),
                "record",
                "--pid",
                str(pid),
                "--duration",
                str(max(1, math.ceil(seconds))),
                "--rate",
                str(RATE_HZ),
                "--idle",
                "--threads",
                "--nonblocking",
                "--format",
                "raw",
                "--output",
                str(folder / f"{prefix}-{name}.txt"),
            ]
            with open(folder / f"{prefix}-{name}.err", "w") as errors:
                profile.processes.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors))
            profile.error_files.append(folder / f"{prefix}-{name}.err")
        return profile

    def wait(self, timeout_s: float = 30.0) -> None:
        """Until every py-spy has written its file (they end with the window), at most ``timeout_s``
        for all of them together; one still running then is killed."""
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for errors in self.error_files:  # kept only when py-spy said something
            if errors.exists() and errors.stat().st_size == 0:
                errors.unlink()


def _frames(stack: str) -> tuple[str, list[tuple[str, str]]]:
    """(thread, [(function, file:line) outermost first]) of one raw stack."""
    parts = stack.split(";")
    thread = parts[0]
    frames = []
    for part in parts[1:]:
        match = _FRAME.match(part)
        frames.append((match["function"], match["where"]) if match else (part, ""))
    return thread, frames


def _is_waiting(frames: list[tuple[str, str]]) -> bool:
    return not frames or frames[-1][0].rsplit(".", 1)[-1] in WAITING


def _leaf(frames: list[tuple[str, str]]) -> str:
    """The innermost frame and its caller: where the time went, and who asked."""
    names = [function for function, _ in frames[-2:]]
    return " < ".join(reversed(names)) if names else "(no Python frame)"


def _samples(path: Path):
    """(thread, frames, count) of each stack in a raw file (``.gz`` too)."""
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    for line in text.splitlines():
        match = _LINE.match(line)
        if match is not None:
            thread, frames = _frames(match["stack"])
            yield thread, frames, int(match["count"])


# What the executor's serving thread (``ZmqServer``: it receives every lane message, schedules,
# runs latency products and replies) is doing in a sample, by its frames: the first that matches.
SERVING_ACTIVITIES: tuple[tuple[str, object], ...] = (
    ("idle (spinning or polling for the next message)", lambda names: "try_for" in names or names[-1] == "Poller.poll"),
    ("products (run_batch)", lambda names: "run_batch" in names),
    (
        "rows cloned out of the lane buffer (the server, before b38b13b)",
        lambda names: names[-1] == "ZmqServer._queue_routed",
    ),
    ("rows copied or cast for the executor (submit)", lambda names: names[-1] == "ExecutionEngine.submit"),
    ("results back (a device's copy waits for its product)", lambda names: names[-1] == "ExecutionEngine._complete"),
    (
        "replies sent",
        lambda names: any(n in names for n in ("ZmqServer._lane_send", "ExecutorLane.flush", "tensor_payload")),
    ),
    (
        "requests received",
        lambda names: names[-1] == "decode" or any(n in names for n in ("ExecutorLane.receive", "_receive_long")),
    ),
    ("scheduler", lambda names: any(n.startswith("Scheduler.") for n in names)),
    ("other Python (routing, bookkeeping)", lambda names: True),
)


def serving_breakdown(path: Path) -> dict[str, float]:
    """Shares of the serving thread's samples in an executor's raw file, by ``SERVING_ACTIVITIES``."""
    shares = dict.fromkeys((name for name, _ in SERVING_ACTIVITIES), 0)
    total = 0
    for thread, frames, count in _samples(path):
        if "ZmqServer" not in thread:
            continue
        names = [function for function, _ in frames] or [""]
        total += count
        name = next(name for name, matches in SERVING_ACTIVITIES if matches(names))
        shares[name] += count
    return {name: count / total for name, count in shares.items()} if total else {}


def summarize(path: Path, top: int = 8) -> str:
    """Per thread (most samples first): the share of its samples spent waiting in a blocking call,
    and the innermost frames (with their callers) its samples end in, waiting or not."""
    samples: Counter[str] = Counter()
    waiting: Counter[str] = Counter()
    leaves: dict[str, Counter[str]] = defaultdict(Counter)
    for thread, frames, count in _samples(path):
        samples[thread] += count
        waiting[thread] += count if _is_waiting(frames) else 0
        leaves[thread][_leaf(frames)] += count
    lines = [f"== {path.name}"]
    for thread, total in samples.most_common():
        lines.append(f"  {thread}: {total} samples, waiting {waiting[thread] / total:.0%}")
        for leaf, count in leaves[thread].most_common(top):
            lines.append(f"    {count / total:6.1%}  {leaf}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.window_profile",
        description="Where each thread of a profiled process spent a window (py-spy raw files from "
        "`benchmarks.batching --profile DIR`, or .gz of them).",
    )
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE")
    parser.add_argument(
        "--serving",
        action="store_true",
        help="What an executor's serving thread did (SERVING_ACTIVITIES), one column per file.",
    )
    args = parser.parse_args(argv)
    missing = [str(path) for path in args.files if not path.is_file()]
    if missing:  # a glob that matched nothing reaches here as its own pattern
        parser.error(f"no such file: {', '.join(missing)}")
    if not args.serving:
        for path in args.files:
            print(summarize(path))
        return
    columns = [serving_breakdown(path) for path in args.files]
    for index, path in enumerate(args.files):
        print(f"[{index}] {path}")
    print(" ".join(f"{f'[{i}]':>7}" for i in range(len(columns))))
    for activity, _ in SERVING_ACTIVITIES:
        print(" ".join(f"{column.get(activity, 0):7.1%}" for column in columns), activity)


if __name__ == "__main__":
    main()
