"""Requests of a client beside another one, on every transport: queued ones (lockstep holds them
for the other client) are answered through the server's result sinks (``_ReplySink`` in
``transport/zmq_server.py``), not futures; those no rule holds (``immediate``) are served at once
without the queue (``Scheduler.serves_at_once``). Exact results for every op and row count either
way -- an empty request included, whose result comes back inside ``submit`` before the server has
booked it -- and nothing left in flight."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch

import symbiosis
from symbiosis.transport.schemes import open_transport
from symbiosis.transport.zmq_server import ZmqServer
from symbiosis.vocabulary import LatencyClass, Op

LAYER = "model.layers.0.self_attn.q_proj"


# policy -> whether a call beside a joined peer is served at once. Lockstep holds every request
# for the other joined client (up to 1 ms here): every call takes the queue.
AT_ONCE = {"lockstep": False, "immediate": True}


@pytest.fixture(scope="module", params=list(AT_ONCE))
def executor(request, tiny_checkpoint) -> Iterator[symbiosis.BaseExecutor]:
    # q/k/v have biases.
    with symbiosis.BaseExecutor.from_pretrained(
        tiny_checkpoint("qwen2"), policy=request.param, lockstep_timeout_ms=1.0
    ) as ex:
        yield ex


@pytest.fixture
def sock_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="symb-q-", dir="/tmp")  # short: ipc paths are limited to ~100 chars
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _expected(executor: symbiosis.BaseExecutor, op: Op, rows: torch.Tensor) -> torch.Tensor:
    layer = executor.weights.layers[LAYER]
    if op is Op.FORWARD:
        return rows @ layer.weight.t() + layer.bias
    if op is Op.BACKWARD:
        return rows @ layer.weight
    return rows @ layer.weight.t()


@pytest.mark.parametrize("kind", ["ipc", "shm+ipc", "tcp", "dist+tcp"])
def test_requests_beside_another_client_are_answered_exactly(executor, sock_dir: str, kind: str) -> None:
    bind = "tcp://127.0.0.1:0" if kind.endswith("tcp") else f"ipc://{sock_dir}/executor.sock"
    server = ZmqServer(executor, bind, allow_shm=kind == "shm+ipc").start()
    try:
        assert server._takes_sinks  # a BaseExecutor takes sinks: the path under test
        address = server.address if "+" not in kind else kind.split("+")[0] + "+" + server.address
        # dist: every payload over the gloo pair group, not inline (its rows reach the executor
        # after the server booked the request)
        options = {"inline_threshold": 0} if kind.startswith("dist") else {}
        with open_transport(address, **options) as caller, open_transport(address):  # a peer joined
            start = executor.stats()
            before, alone_before = start["layers"].get(LAYER, {}).get("requests", 0), start["batches_run_by"]["alone"]
            g = torch.Generator().manual_seed(5)
            for op in Op:
                for n in (0, 1, 5):
                    width = op.input_width(executor.weights.specs[LAYER])
                    rows = torch.randn(n, width, generator=g)
                    got = caller.call(LAYER, op, rows, LatencyClass.DECODE)
                    # Computed in another thread and batch than here: the same sums in another order.
                    torch.testing.assert_close(got, _expected(executor, op, rows), rtol=1e-5, atol=1e-6)
                    got.add_(1)  # a tensor of its own, writable
        stats = executor.stats()
        assert stats["inflight_requests"] == 0
        assert stats["layers"][LAYER]["requests"] - before == 2 * len(Op)  # the empty ones never reach it
        # dist: the rows reach the executor after the server booked the request, so it is queued
        # whatever the rule (``ZmqServer`` tries the at-once path only with the rows in hand).
        at_once = AT_ONCE[executor.scheduler_config.policy] and not kind.startswith("dist")
        assert stats["batches_run_by"]["alone"] - alone_before == (2 * len(Op) if at_once else 0)
    finally:
        server.close(drain=False)
