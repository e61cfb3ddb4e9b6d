"""Start executor and client processes for the service tests (real processes, real sockets)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch


def start_executor(path: Path, address: str, *extra: str, timeout_s: float = 60.0) -> subprocess.Popen:
    """``symbiosis serve`` in its own process; returns once it prints that it is serving."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        [sys.executable, "-m", "symbiosis", "serve", str(path), "--bind", address, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + timeout_s
    lines = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            break
        lines.append(line)
        if line.startswith("serving"):
            return process
    process.kill()
    raise RuntimeError("executor did not start:\n" + "".join(lines))


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def compare_client(path: str, address: str, method: str, arch: str, result_queue) -> None:
    """Runs in a client process: split (remote executor) vs monolithic; reports the worst error."""
    torch.set_num_threads(1)
    from tests.reference import close_client, loss_and_grads, make_pair

    try:
        reference, split = make_pair(path, address, method, arch)
        ids = torch.randint(3, 200, (2, 7), generator=torch.Generator().manual_seed(2))
        ref_logits, ref_loss, ref_grads = loss_and_grads(reference, ids)
        logits, loss, grads = loss_and_grads(split, ids)
        errors = [float((logits - ref_logits).abs().max()), float((loss - ref_loss).abs())]
        errors += [float((grads[name] - g).abs().max() / (g.abs().max() + 1e-12)) for name, g in ref_grads.items()]
        ok = set(grads) == set(ref_grads) and len(ref_grads) > 0
        close_client(split)
        result_queue.put((method, ok, max(errors)))
    except Exception as exc:  # reported to the test process
        result_queue.put((method, False, repr(exc)))
