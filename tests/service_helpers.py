"""Start executor and client processes for the service tests (real processes, real sockets)."""

from __future__ import annotations

import socket
from pathlib import Path

import torch

from symbiosis.executor.process import ExecutorProcess


def loopback_address(kind: str, tmp_path: Path) -> str:
    """An address on this host to serve and reach an executor at: ``tcp`` (a free port), ``ipc``
    (a socket in ``tmp_path``), or ``shm+ipc`` (that socket, with shared-memory payloads)."""
    if kind == "tcp":
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    if kind == "ipc":
        return f"ipc://{tmp_path}/executor.sock"
    return f"shm+ipc://{tmp_path}/executor.sock"


def start_executor(path: Path, address: str, *extra: str, timeout_s: float = 120.0) -> ExecutorProcess:
    """``symbiosis serve`` in its own process, ready when this returns (its ready file exists)."""
    return ExecutorProcess(path, [address], extra_args=extra, timeout_s=timeout_s)


def stop(process: ExecutorProcess) -> None:
    process.close()


def compare_client(path: str, address: str, method: str, arch: str, result_queue, together=None) -> None:
    """Runs in a client process: split (remote executor) vs monolithic; reports the worst error.

    ``together``: a ``multiprocessing.Barrier`` of every client of the test. Each client then
    computes only once all are connected and disconnects only once all are done, so no client is
    ever alone with the executor (which would serve it on the lone-client path, not the batched
    one the test may be about), however the processes' start-up times fall."""
    torch.set_num_threads(1)
    from tests.reference import close_client, loss_and_grads, make_pair

    try:
        reference, split = make_pair(path, address, method, arch)
        ids = torch.randint(3, 200, (2, 7), generator=torch.Generator().manual_seed(2))
        ref_logits, ref_loss, ref_grads = loss_and_grads(reference, ids)
        if together is not None:
            together.wait(timeout=180)
        logits, loss, grads = loss_and_grads(split, ids)
        if together is not None:
            together.wait(timeout=180)
        errors = [float((logits - ref_logits).abs().max()), float((loss - ref_loss).abs())]
        errors += [float((grads[name] - g).abs().max() / (g.abs().max() + 1e-12)) for name, g in ref_grads.items()]
        ok = set(grads) == set(ref_grads) and len(ref_grads) > 0
        close_client(split)
        result_queue.put((method, ok, max(errors)))
    except Exception as exc:  # reported to the test process
        if together is not None:
            together.abort()  # the others must not wait for this one
        result_queue.put((method, False, repr(exc)))
