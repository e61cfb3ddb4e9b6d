"""A spinning wait beside background work: the yields that lose the core, and the calm spells.

Two processes ping-pong one byte over a Unix ``SOCK_SEQPACKET`` pair, each busy ``--work-us``
between messages (a decode step's attention and norms) and waiting through
``symbiosis.transport.spin.try_for`` (then asleep), as same-host lanes do. Beside them run
``--hogs`` busy loops at the background CPU class (``threads.enter_background_priority``:
``SCHED_IDLE`` on Linux), as fine-tuning jobs run. Two variants, alternated block by block:
``spells`` (the code as it is) and ``yield-always`` (losses never start a calm spell:
``spin.STOLEN_YIELD_S`` set to infinity), each with and without the hogs.

Reports the round trip's median, mean, p95 and p99 per variant and setting (medians over blocks).
What it shows (``transport/spin.py``): a yield can hand the core to a background task until a
later scheduler tick, 1.5-5 ms; without the hogs both variants should match.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.results import command_line, machine_info, print_summary, write_json
from symbiosis.threads import enter_background_priority
from symbiosis.transport import spin

MODULE = "benchmarks.yield_loss"
VARIANTS = ("spells", "yield-always")
_SPIN_BUDGET_S = 0.002


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _receive(sock: socket.socket, buffer: bytearray) -> int:
    def attempt() -> int | None:
        try:
            return sock.recv_into(buffer, 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None

    got = spin.try_for(attempt, _SPIN_BUDGET_S)
    return got if got is not None else sock.recv_into(buffer)


def _fork(target) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            target()
        finally:
            os._exit(0)
    return pid


def round_trips(variant: str, hogs: int, work_s: float, calls: int, warmup: int) -> list[float]:
    """Seconds per round trip of ``calls`` ping-pongs (after ``warmup``) in a fresh pair of processes."""
    spin.STOLEN_YIELD_S = 1e-3 if variant == "spells" else float("inf")
    spin._core_losses = spin.CoreLosses()
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    def hog() -> None:
        enter_background_priority()
        while True:
            pass

    def peer() -> None:
        mine.close()  # else the parent's close would not end this loop
        buffer = bytearray(64)
        while _receive(theirs, buffer):
            _busy(work_s)
            theirs.send(b"x")

    children = [_fork(hog) for _ in range(hogs)]
    children.append(_fork(peer))
    buffer, times = bytearray(64), []
    try:
        for _ in range(warmup + calls):
            started = time.perf_counter()
            mine.send(b"x")
            _receive(mine, buffer)
            _busy(work_s)
            times.append(time.perf_counter() - started)
    finally:
        mine.close()  # the peer reads 0 bytes and exits
        for pid in children[:-1]:
            os.kill(pid, 9)
        for pid in children:
            os.waitpid(pid, 0)
    return times[warmup:]


def _figures(times: Sequence[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "median_us": 1e6 * statistics.median(ordered),
        "mean_us": 1e6 * statistics.fmean(ordered),
        "p95_us": 1e6 * ordered[int(0.95 * (len(ordered) - 1))],
        "p99_us": 1e6 * ordered[int(0.99 * (len(ordered) - 1))],
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hogs", type=int, default=2, help="Background busy loops beside the pair (default 2).")
    parser.add_argument("--work-us", type=float, default=300.0, help="Work per side between messages (µs).")
    parser.add_argument("--calls", type=int, default=3000, help="Timed round trips per block.")
    parser.add_argument("--blocks", type=int, default=2, help="Blocks per variant and setting, alternated.")
    parser.add_argument("--output", type=Path, default=None, help="Folder for yield_loss.json.")
    args = parser.parse_args(argv)
    if not hasattr(os, "fork"):
        sys.exit("this benchmark forks: it needs a POSIX system")
    started = time.time()
    settings = {"with_hogs": args.hogs, "alone": 0}
    blocks: dict[str, list[dict]] = {f"{v}/{s}": [] for s in settings for v in VARIANTS}
    for block in range(args.blocks):
        order = VARIANTS if block % 2 == 0 else VARIANTS[::-1]
        for setting, hogs in settings.items():
            for variant in order:
                times = round_trips(variant, hogs, args.work_us * 1e-6, args.calls, warmup=200)
                blocks[f"{variant}/{setting}"].append(_figures(times))
    summary = {
        key: {figure: statistics.median(b[figure] for b in runs) for figure in runs[0]} for key, runs in blocks.items()
    }
    result = {
        "benchmark": "yield_loss",
        "command": command_line(argv, MODULE),
        "machine": machine_info(),
        "config": vars(args) | {"output": str(args.output)},
        "wall_s": time.time() - started,
        "summary": summary,
        "blocks": blocks,
    }
    if args.output is not None:
        args.output.mkdir(parents=True, exist_ok=True)
        write_json(args.output / "yield_loss.json", result)
    print_summary(summary)


if __name__ == "__main__":
    main()
