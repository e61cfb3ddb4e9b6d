"""Start ``symbiosis serve`` in a child process and know when, where and what it serves.

This is the one way the demo, the benchmarks and the tests start an executor process. Readiness
is the JSON file ``symbiosis serve --ready-file PATH`` writes once every address is bound (see
``write_ready_file``): addresses, pid, checkpoint fingerprint, metrics URL. Nothing parses the
human log line.

The child's output goes through a pipe that a daemon thread drains (a full pipe would block the
child) into a bounded tail, which error messages quote, and optionally into a log file.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from symbiosis.errors import ConfigurationError, SymbiosisError


class ExecutorProcessError(SymbiosisError):
    """The executor process exited or did not become ready in time; the message quotes its output."""


@dataclass(frozen=True)
class ReadyInfo:
    """What ``serve --ready-file`` writes once it serves (its JSON, field for field)."""

    addresses: list[str]
    pid: int
    fingerprint: str
    model_type: str
    metrics_url: str | None = None

    @classmethod
    def read(cls, path: Path) -> ReadyInfo:
        data = json.loads(Path(path).read_text())
        return cls(
            addresses=list(data["addresses"]),
            pid=int(data["pid"]),
            fingerprint=str(data["fingerprint"]),
            model_type=str(data["model_type"]),
            metrics_url=data.get("metrics_url"),
        )


def write_ready_file(path: Path, info: ReadyInfo) -> None:
    """Write ``info`` to ``path`` atomically (a reader never sees half a file): a temporary file in
    the same folder, then a rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(info.__dict__, f)
    os.replace(tmp, path)


class _OutputDrain:
    """Reads a child's output on a daemon thread: keeps the last lines, copies to ``log`` if given."""

    def __init__(self, stream: IO[str], log: IO[str] | None, tail_lines: int = 60) -> None:
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._log = log
        self._thread = threading.Thread(target=self._run, args=(stream,), name="executor-output", daemon=True)
        self._thread.start()

    def _run(self, stream: IO[str]) -> None:
        for line in stream:
            self.tail.append(line)
            if self._log is not None:
                self._log.write(line)
                self._log.flush()

    def text(self) -> str:
        return "".join(self.tail)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


# Children not closed yet: stopped when this interpreter exits, so an owner that ends on an
# uncaught exception (or forgets ``close``) leaves no executor running with nobody to serve.
_OPEN: weakref.WeakSet[ExecutorProcess] = weakref.WeakSet()
EXIT_CLOSE_TIMEOUT_S = 10.0


@atexit.register
def _close_open_processes() -> None:
    for process in list(_OPEN):
        process.close(timeout_s=EXIT_CLOSE_TIMEOUT_S)


class ExecutorProcess:
    """``symbiosis serve MODEL_DIR --bind ADDRESS ...`` in a child process.

    ``extra_args``: more ``serve`` flags (``--policy``, ``--max-wait-ms``, ...). ``threads``: torch
    intra-op threads of the child (``OMP_NUM_THREADS``/``MKL_NUM_THREADS``), None for torch's
    default. ``env``: variables added to this process's environment for the child.
    ``metrics``: also serve ``/metrics``, ``/health`` and ``/stats`` on a free loopback port, which
    ``stats()`` reads. ``wait``: block until ready here (else call ``wait_ready`` later, e.g. to
    overlap the load with other work).
    """

    def __init__(
        self,
        model_dir: str | Path,
        binds: Sequence[str],
        *,
        extra_args: Sequence[str] = (),
        threads: int | None = None,
        env: Mapping[str, str] | None = None,
        metrics: bool = False,
        log_path: Path | None = None,
        timeout_s: float = 180.0,
        wait: bool = True,
    ) -> None:
        if not binds:
            raise ConfigurationError("an executor process needs at least one address to bind")
        self._folder = tempfile.mkdtemp(prefix="symbiosis-executor-")
        self.ready_file = Path(self._folder) / "ready.json"
        command = [sys.executable, "-m", "symbiosis", "serve", str(model_dir)]
        for address in binds:
            command += ["--bind", address]
        command += ["--ready-file", str(self.ready_file)]
        if metrics:
            command += ["--metrics-port", "0"]
        command += list(extra_args)
        child_env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        if threads is not None:
            child_env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        child_env.update(env or {})
        self._log = open(log_path, "a") if log_path is not None else None  # noqa: SIM115 (closed in close())
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=child_env,
        )
        _OPEN.add(self)
        self._output = _OutputDrain(self.process.stdout, self._log)
        self._ready: ReadyInfo | None = None
        self._timeout_s = timeout_s
        if wait:
            self.wait_ready()

    # ---- readiness --------------------------------------------------------------------------------

    def wait_ready(self, timeout_s: float | None = None) -> ReadyInfo:
        """Block until the ready file exists; raise ``ExecutorProcessError`` (quoting the child's
        output) if the child exits first or ``timeout_s`` passes, and stop the child then."""
        if self._ready is not None:
            return self._ready
        deadline = time.monotonic() + (self._timeout_s if timeout_s is None else timeout_s)
        while not self.ready_file.exists():
            code = self.process.poll()
            if code is not None:
                self._output.join(2.0)
                self.close()
                raise ExecutorProcessError(f"the executor process exited with code {code}:\n{self._output.text()}")
            if time.monotonic() > deadline:
                self.close()
                raise ExecutorProcessError(
                    f"the executor process was not ready in time; its output:\n{self._output.text()}"
                )
            time.sleep(0.02)
        self._ready = ReadyInfo.read(self.ready_file)
        return self._ready

    @property
    def info(self) -> ReadyInfo:
        return self.wait_ready()

    @property
    def addresses(self) -> list[str]:
        return self.info.addresses

    @property
    def address(self) -> str:
        """The first bound address (with ports resolved: ``tcp://127.0.0.1:0`` becomes the real port)."""
        return self.info.addresses[0]

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        """The last lines the child printed."""
        return self._output.text()

    # ---- what it serves -----------------------------------------------------------------------------

    def stats(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """The executor's ``stats()`` (plus ``peak_rss_bytes``), read from its ``/stats`` endpoint;
        needs ``metrics=True``."""
        url = self.info.metrics_url
        if url is None:
            raise ExecutorProcessError("stats() needs an executor process started with metrics=True")
        with urllib.request.urlopen(f"{url}/stats", timeout=timeout_s) as response:
            return json.loads(response.read())

    # ---- ending it ----------------------------------------------------------------------------------

    def signal(self, sig: int) -> None:
        """Send ``sig`` (e.g. ``signal.SIGKILL`` for a crash test) if the child still runs."""
        if self.process.poll() is None:
            self.process.send_signal(sig)

    def wait(self, timeout_s: float | None = None) -> int:
        """Wait for the child to exit (``subprocess.TimeoutExpired`` after ``timeout_s``); its exit code."""
        code = self.process.wait(timeout=timeout_s)
        self._output.join(2.0)  # so that output() has its last lines
        return code

    def close(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (``serve`` drains its in-flight requests and exits), SIGKILL after ``timeout_s``;
        always reaps the child. Returns its exit code. Children still open when the interpreter
        exits are closed then (``EXIT_CLOSE_TIMEOUT_S``)."""
        _OPEN.discard(self)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._output.join(2.0)
        if self._log is not None and not self._log.closed:
            self._log.close()
        for leftover in (self.ready_file, Path(self._folder)):
            try:
                leftover.unlink() if leftover.is_file() else leftover.rmdir()
            except OSError:
                pass
        return self.process.returncode

    def __enter__(self) -> ExecutorProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
