"""Starting the API server's engine process (``engine_process.py``) before this process imports
what it serves with.

Both processes import torch, transformers and the serving modules (~2.5 s each on this 2-core
host) before the engine process can build anything. Started from ``RemoteEngine``, the engine
process began its imports only once the HTTP process had finished its own; started first thing
by ``symbiosis api`` (``spawn_engine_process``, light: no torch here), the two run side by side
and ``RemoteEngine`` adopts the process. The engine process connects to the two socket addresses
at once; ZeroMQ keeps retrying until ``RemoteEngine`` binds them, and the process waits for its
first message (its options), exiting if this process is gone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass


@dataclass
class SpawnedEngine:
    """An engine process started and not yet adopted by a ``RemoteEngine``."""

    folder: str  # mode 0700: only this user can open the sockets in it
    commands: str  # ipc:// address, parent -> child
    events: str  # ipc:// address, child -> parent
    process: subprocess.Popen

    def discard(self) -> None:
        """Stop it (it was never told what to serve, so it holds nothing) and remove its folder."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def spawn_engine_process() -> SpawnedEngine:
    folder = tempfile.mkdtemp(prefix="symbiosis-api-engine-")
    commands, events = f"ipc://{folder}/commands", f"ipc://{folder}/events"
    process = subprocess.Popen(
        [sys.executable, "-m", "symbiosis.serving.engine_process", commands, events, str(os.getpid())],
        stdin=subprocess.DEVNULL,
    )
    return SpawnedEngine(folder, commands, events, process)
