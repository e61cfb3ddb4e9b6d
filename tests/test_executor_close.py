"""``BaseExecutor.close(drain=False)`` fails what is in flight at once instead of draining it."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import symbiosis
from symbiosis.errors import ExecutorUnavailableError
from symbiosis.transport.schemes import open_transport
from symbiosis.vocabulary import LatencyClass, Op


@pytest.mark.parametrize("where", ["inproc", "tcp"])
@pytest.mark.slow
def test_close_without_drain_does_not_wait_for_held_requests(tiny_checkpoint, where):
    # lockstep with two joined clients holds a lone request for a minute: only a drain would wait
    ex = symbiosis.BaseExecutor.from_pretrained(tiny_checkpoint("llama"), policy="lockstep", lockstep_timeout_ms=60_000)
    errors: list[BaseException] = []
    if where == "tcp":
        server = ex.serve("tcp://127.0.0.1:0")
        caller = open_transport(server.address, connect_timeout_s=1.0)
        other = open_transport(server.address, connect_timeout_s=1.0)
        call = lambda: caller.call("lm_head", Op.FORWARD, torch.randn(1, 64), LatencyClass.DECODE)  # noqa: E731
    else:
        ex.register_client("other")
        call = lambda: ex.call("me", "lm_head", Op.FORWARD, torch.randn(1, 64), LatencyClass.DECODE)  # noqa: E731

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 15
    while not ex.stats()["inflight_requests"]:  # the call is held: only a drain would wait for it
        assert time.monotonic() < deadline
        time.sleep(0.005)
    started = time.monotonic()
    ex.close(drain=False)
    assert time.monotonic() - started < 2.0
    thread.join(timeout=15)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], ExecutorUnavailableError)
    if where == "tcp":
        caller.close()
        other.close()
