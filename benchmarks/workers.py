"""Benchmark child processes that speak JSON lines: ``Worker`` (parent side) and ``serve_worker`` (child side).

Scenarios that compare processes (one executor + K clients vs K monolithic jobs) run every
process from this interpreter with the same environment, and talk to workers in JSON lines on
stdin/stdout: a worker prints one ``EVENT_PREFIX {"event": "ready", ...}`` line once loaded, then
runs once per ``go`` line it reads (printing ``{"event": "done", ...}``) until ``exit``. Other
stdout lines (library chatter) are ignored. An executor child is not a worker: it is started with
``symbiosis.executor.process.ExecutorProcess`` (readiness from ``serve --ready-file``).
"""

from __future__ import annotations

import collections
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from benchmarks.memory import own_memory
from benchmarks.results import jsonable, repo_root
from symbiosis.heap import skip_exit_collection

EVENT_PREFIX = "@@bench "


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
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def loopback_binds(folder: Path) -> list[str]:
    """A free loopback tcp port and an ipc socket in ``folder`` (the executor serves both)."""
    return ["tcp://127.0.0.1:0", f"ipc://{Path(folder) / 'executor.sock'}"]


class _LineReader:
    """Reads a child's stdout on a daemon thread (so a full pipe never blocks the child)."""

    def __init__(self, stream) -> None:
        self.events: queue.Queue[dict | None] = queue.Queue()
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self._thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self._thread.start()

    def _run(self, stream) -> None:
        for line in stream:
            self.tail.append(line)
            if line.startswith(EVENT_PREFIX):
                self.events.put(json.loads(line[len(EVENT_PREFIX) :]))
        self.events.put(None)  # EOF

    def next_event(self, timeout_s: float, what: str) -> dict:
        try:
            event = self.events.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"{what}: no answer in {timeout_s:.0f}s; last output:\n{''.join(self.tail)}") from None
        if event is None:
            raise RuntimeError(f"{what}: process exited; last output:\n{''.join(self.tail)}")
        if event.get("event") == "error":
            raise RuntimeError(f"{what} failed: {event.get('error')}")
        return event


class Worker:
    """A benchmark worker child (``python -m MODULE worker SPEC_JSON``); see the protocol above."""

    def __init__(
        self, module: str, spec: Mapping[str, Any], *, threads: int = 1, env: Mapping[str, str] | None = None
    ) -> None:
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
    print(EVENT_PREFIX + json.dumps(jsonable({"event": event, **fields}), allow_nan=False), flush=True)


def serve_worker(setup: Callable[[], Callable[[], dict]]) -> None:
    """Worker side: ``setup()`` loads and returns ``run_once``; answer ``go`` lines until ``exit``.

    ``ready`` and every ``done`` carry the process's peak RSS so far (``ru_maxrss``, exact, unlike
    sampling) next to whatever ``run_once`` returns.
    """
    try:
        run_once = setup()
        emit_event("ready", pid=os.getpid(), **own_memory())
        for line in sys.stdin:
            command = line.strip()
            if command == "exit":
                skip_exit_collection()  # ~1 s of every worker's exit otherwise (symbiosis/heap.py)
                break
            if command == "go":
                emit_event("done", **run_once(), **own_memory())
    except Exception:
        emit_event("error", error=traceback.format_exc()[-3000:])
        raise SystemExit(1) from None
