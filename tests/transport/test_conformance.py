"""One conformance suite for every ZeroMQ-based transport: tcp, ipc, shared memory (shm), and
torch.distributed payloads over gloo (dist). tcp, ipc and shm clients send their calls over a
lane (``lane.py``) when they can; ``tcp-zmq`` and ``shm-zmq`` have lanes off, so the ZeroMQ way
of the same requests (inline and shared-memory payloads) is held to the same suite.

Each test runs against a ``ZmqServer`` serving a ``FakeExecutorService`` (real torch math), in a
thread of this process unless it says otherwise, and compares results with the fake's own math
on the same weights. Results must match that math up to summation order only
(``assert_same_product``: MKL may sum in another order for the server's copy of the rows), and
must be tensors of their own: not views, writable, modifiable in place under autograd.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
import zmq

from symbiosis import protocol as P
from symbiosis.errors import (
    ExecutorTimeoutError,
    ExecutorUnavailableError,
    ModelMismatchError,
    ProtocolError,
    ShapeError,
    UnknownLayerError,
)
from symbiosis.transport.base import Transport
from symbiosis.transport.schemes import open_transport
from symbiosis.transport.zmq import ZmqServer, ZmqTransport
from symbiosis.transport.zmq_context import new_context
from symbiosis.vocabulary import LatencyClass, Op

from .fakes import (
    FakeExecutorService,
    assert_same_product,
    call_and_wait,
    declare_dist_payload,
    declare_dist_payload_and_hang,
    same_product,
    serve_in_process,
)

KINDS = ["tcp", "ipc", "shm", "dist", "tcp-zmq", "shm-zmq"]
SPAWN = multiprocessing.get_context("spawn")


def bind_address(kind: str, sock_dir: str) -> str:
    return "tcp://127.0.0.1:0" if kind.startswith("tcp") else f"ipc://{sock_dir}/executor.sock"


def client_address(kind: str, server_address: str) -> str:
    scheme = kind.removesuffix("-zmq")
    return f"{scheme}+{server_address}" if scheme in ("shm", "dist") else server_address


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def server(fake: FakeExecutorService, kind: str, sock_dir: str) -> Iterator[ZmqServer]:
    srv = ZmqServer(fake, bind_address(kind, sock_dir)).start()
    yield srv
    srv.close(drain=False)


@pytest.fixture
def open_client(server: ZmqServer, kind: str) -> Iterator[Callable[..., ZmqTransport]]:
    clients: list[ZmqTransport] = []

    def _open(**kwargs: object) -> ZmqTransport:
        if kind in (
            "dist",
            "shm",
            "shm-zmq",
        ):  # every payload over the pair group / a segment (small ones would ride inline)
            kwargs.setdefault("inline_threshold", 0)
        if kind.endswith("-zmq"):
            kwargs.setdefault("lane", False)
        transport = open_transport(client_address(kind, server.address), **kwargs)
        clients.append(transport)
        return transport

    yield _open
    for transport in clients:
        transport.close()


class RawPeer:
    """A bare DEALER socket, for sending what no well-behaved client would."""

    def __init__(self, address: str) -> None:
        self.ctx = new_context(linger_ms=0)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self) -> tuple[P.Message, list[bytes]]:
        """Next message that is not a heartbeat."""
        while True:
            assert self.sock.poll(5000), "server did not answer"
            header, *payload = self.sock.recv_multipart()
            msg = P.decode(header)
            if not isinstance(msg, (P.Ping, P.Pong)):
                return msg, payload

    def hello(self) -> P.Welcome:
        self.send(P.encode(P.Hello(P.PROTOCOL_VERSION, "raw-peer", 1)))
        welcome, _ = self.recv()
        assert isinstance(welcome, P.Welcome)
        return welcome

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def request(rid: int, layer_id: str, shape: list[int], dtype: str = "float32", **kw: object) -> bytes:
    return P.encode(P.Request(P.PROTOCOL_VERSION, "raw-peer", rid, layer_id, "forward", dtype, shape, "prefill", **kw))


def input_width(fake: FakeExecutorService, layer_id: str, op: Op) -> int:
    return op.input_width(fake.layer_specs()[layer_id])


# ---- results ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", list(Op))
def test_results_match_direct_math(open_client, fake: FakeExecutorService, op: Op, dtype: torch.dtype) -> None:
    transport = open_client()
    assert isinstance(transport, Transport)
    assert transport.fingerprint == fake.fingerprint
    assert transport.layer_specs() == fake.layer_specs()
    for layer_id in ("q", "o"):
        for n in (0, 1, 37):
            rows = torch.randn(n, input_width(fake, layer_id, op)).to(dtype)
            before = rows.clone()
            got = transport.call(layer_id, op, rows, LatencyClass.PREFILL)
            expected = fake.compute(layer_id, op, rows)
            assert got.dtype == dtype and got.shape == expected.shape
            assert_same_product(got, expected, (layer_id, n))
            assert torch.equal(rows, before)  # the transport never writes into the caller's rows


def test_non_contiguous_rows(open_client, fake: FakeExecutorService) -> None:
    rows = torch.randn(16, 10).T  # [10, 16], not contiguous
    got = open_client().call("q", Op.FORWARD, rows, LatencyClass.DECODE)
    assert_same_product(got, fake.compute("q", Op.FORWARD, rows.contiguous()))


class _RemoteForward(torch.autograd.Function):
    """A base layer's forward as a VirtLayer does it: the transport's result *is* the output."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, transport: Transport, layer_id: str) -> torch.Tensor:
        ctx.transport, ctx.layer_id = transport, layer_id
        return transport.call(layer_id, Op.FORWARD, rows.detach(), LatencyClass.FINETUNE)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.transport.call(ctx.layer_id, Op.BACKWARD, grad.contiguous(), LatencyClass.FINETUNE), None, None


@pytest.mark.parametrize(
    ("layer_id", "n", "dtype"),
    [("q", 5, "float32"), ("q", 5, "bfloat16"), ("wide", 4096, "float32")],  # 4 MiB: the zero-copy paths
)
def test_results_are_tensors_of_their_own(
    open_client, fake: FakeExecutorService, layer_id: str, n: int, dtype: str
) -> None:
    """A result is not a view (of a receive buffer, a frame, a shared-memory segment), is
    writable, keeps its values across the next call, and when a custom autograd Function returns
    it (as VirtLayers do) it can be modified in place: peft's ``result += adapter(x)`` and
    Falcon's in-place adds once failed with "Output 0 of View is a view and is being modified
    inplace" on remote transports."""
    transport = open_client()
    rows = torch.randn(n, input_width(fake, layer_id, Op.FORWARD)).to(getattr(torch, dtype))
    expected = fake.compute(layer_id, Op.FORWARD, rows)

    got = transport.call(layer_id, Op.FORWARD, rows, LatencyClass.PREFILL)
    assert not got._is_view() and got._base is None
    assert_same_product(got, expected)
    got.mul_(-2.0)  # writable (scaling by -2 is exact): the write lands
    assert_same_product(got, expected * -2.0)
    kept = got.clone()
    again = transport.call(layer_id, Op.FORWARD, rows, LatencyClass.PREFILL)
    assert torch.equal(got, kept)  # the next result does not reuse (or overwrite) this one's memory
    assert_same_product(again, expected)

    x = rows.clone().requires_grad_()
    out = _RemoteForward.apply(x, transport, layer_id)
    assert not out._is_view()
    out.add_(1.0)  # raises for a view created inside a custom Function
    out.sum().backward()
    assert_same_product(out.detach(), expected + 1.0)
    ones = torch.ones(n, fake.layer_specs()[layer_id].out_features, dtype=rows.dtype)
    assert_same_product(x.grad, fake.compute(layer_id, Op.BACKWARD, ones))


@pytest.mark.slow
def test_64mb_round_trip(open_client, fake: FakeExecutorService) -> None:
    rows = torch.randn(65536, 256)  # 64 MiB of float32, and 64 MiB back
    got = open_client().call("wide", Op.FORWARD, rows, LatencyClass.PREFILL)
    assert_same_product(got, fake.compute("wide", Op.FORWARD, rows))


def test_eight_clients_concurrently(open_client, fake: FakeExecutorService) -> None:
    transports = [open_client() for _ in range(8)]
    shared = open_client()  # and four threads sharing one transport
    failures: list[str] = []

    def work(index: int, transport: ZmqTransport) -> None:
        generator = torch.Generator().manual_seed(index)
        for step in range(15):
            layer_id, op = [("q", Op.FORWARD), ("o", Op.BACKWARD), ("q", Op.NOISE), ("o", Op.FORWARD)][
                (index + step) % 4
            ]
            n = int(torch.randint(0, 50, (1,), generator=generator))
            rows = torch.randn(n, input_width(fake, layer_id, op), generator=generator)
            got = transport.call(layer_id, op, rows, LatencyClass.DECODE)
            if not same_product(got, fake.compute(layer_id, op, rows)):
                failures.append(f"client {index} step {step}")

    threads = [threading.Thread(target=work, args=(i, t)) for i, t in enumerate(transports)]
    threads += [threading.Thread(target=work, args=(100 + i, shared)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    assert failures == []
    submits = [e for e in fake.events if e[0] == "submit"]
    # Each call reaches the executor once: a client that takes a live executor for gone fails its
    # connection and resends its calls in flight (shm clients did, when the broker's per-user cap
    # closed one of their concurrent segment asks).
    assert len(submits) == 12 * 15


# ---- errors ----------------------------------------------------------------------------------


def test_typed_errors_come_back(open_client, server: ZmqServer) -> None:
    transport = open_client()
    with pytest.raises(UnknownLayerError, match="nope"):
        transport.call("nope", Op.FORWARD, torch.randn(2, 16), LatencyClass.PREFILL)
    with pytest.raises(ShapeError):
        transport.call("q", Op.FORWARD, torch.randn(2, 17), LatencyClass.PREFILL)
    with pytest.raises(ShapeError):
        transport.call("q", Op.BACKWARD, torch.randn(2, 16), LatencyClass.PREFILL)  # backward takes width out=24
    with pytest.raises(ShapeError):
        transport.call("q", Op.FORWARD, torch.randn(2, 2, 16), LatencyClass.PREFILL)
    with pytest.raises(ProtocolError, match="float64"):
        transport.call("q", Op.FORWARD, torch.randn(2, 16, dtype=torch.float64), LatencyClass.PREFILL)
    assert server.stats()["q"]["errors"] == 4 and server.stats()["<invalid>"]["errors"] == 1
    assert transport.call("q", Op.FORWARD, torch.randn(2, 16), LatencyClass.PREFILL).shape == (2, 24)


def test_hostile_peer_gets_typed_errors_and_server_stays_healthy(
    open_client, server: ZmqServer, fake: FakeExecutorService, kind: str
) -> None:
    good = open_client()
    stop = threading.Event()
    good_results: list[bool] = []

    def keep_calling() -> None:
        while not stop.is_set():
            rows = torch.randn(5, 16)
            good_results.append(
                same_product(good.call("q", Op.FORWARD, rows, LatencyClass.DECODE), fake.compute("q", Op.FORWARD, rows))
            )

    caller = threading.Thread(target=keep_calling)
    caller.start()
    raw = RawPeer(server.address)
    try:
        raw.send(request(7, "q", [1, 16], shm_name=None), bytes(64))  # before Hello: no session
        reply, _ = raw.recv()
        assert isinstance(reply, P.Reply) and (reply.request_id, reply.error_code) == (7, "unavailable")
        raw.hello()
        cases: list[tuple[list[bytes], int, tuple[str, ...]]] = [
            ([b"\xc1 not msgpack at all"], 0, ("protocol",)),
            ([pickle.dumps({"request_id": 3, "evil": os.system})], 0, ("protocol",)),
            ([request(11, "q", [10**12, 16]), bytes(64)], 11, ("protocol", "shape")),  # huge shape, tiny payload
            ([request(12, "q", [2, 16]), pickle.dumps(torch.randn(2, 16))], 12, ("shape",)),  # pickle as payload
            ([request(13, "q", [2, 16])], 13, ("protocol",)),  # no payload frame
            ([request(14, "q", [-1, 16]), b""], 14, ("shape",)),
            ([request(15, "q", [2, 16], dtype="int64"), bytes(256)], 15, ("protocol",)),
            (
                [
                    request(16, "q", [2, 16], shm_name="symb_not_mine_x"),
                ],
                16,
                ("protocol",),
            ),
            ([request(17, "q", [2, 16], shm_name="999")], 17, ("protocol",)),  # no segment with that id
            ([request(18, "q", [2, 16], shm_name="../../etc/passwd")], 18, ("protocol",)),
            ([P.encode(P.Welcome(1, 19, "x", [], P.Limits(), 1.0, "t", True))], 19, ("protocol",)),
            ([b'{"request_id": 20}'], 0, ("protocol",)),
            ([request(22, "q", [2, 16], dist_tag=22, dist_nbytes=128)], 22, ("protocol",)),  # no dist session
            ([request(23, "q", [2, 16], dist_tag=23, dist_nbytes=128), bytes(128)], 23, ("protocol",)),
            ([request(24, "q", [2, 16], dist_tag=24, shm_name="symb_x")], 24, ("protocol",)),
        ]
        for frames, rid, codes in cases:
            raw.send(*frames)
            reply, _ = raw.recv()
            assert isinstance(reply, P.Reply) and not reply.ok, frames[0][:40]
            assert reply.request_id == rid and reply.error_code in codes, (reply, frames[0][:40])
        raw.send(request(21, "q", [2, 16]), torch.ones(2, 16).numpy().tobytes())  # still serves this peer
        reply, payload = raw.recv()
        assert reply.ok and reply.shape == [2, 24]
        assert_same_product(
            P.tensor_from_payload(bytearray(payload[0]), "float32", [2, 24]),
            fake.compute("q", Op.FORWARD, torch.ones(2, 16)),
        )
    finally:
        raw.close()
        time.sleep(0.2)
        stop.set()
        caller.join(timeout=30)
    assert good_results and all(good_results)
    assert server.stats()["<invalid>"]["errors"] >= 4


def test_fingerprint_mismatch_at_connect(open_client, fake: FakeExecutorService) -> None:
    with pytest.raises(ModelMismatchError, match="other-model"):
        open_client(expected_fingerprint="other-model")
    assert open_client(expected_fingerprint=fake.fingerprint).fingerprint == fake.fingerprint


def test_no_executor_raises_unavailable(kind: str, sock_dir: str) -> None:
    address = "tcp://127.0.0.1:1" if kind.startswith("tcp") else f"ipc://{sock_dir}/nobody.sock"
    start = time.monotonic()
    with pytest.raises(ExecutorUnavailableError):
        open_transport(client_address(kind, address), connect_timeout_s=0.5)
    # ~0.5 s; the bound leaves room for a stalled process on a loaded CI host while staying under
    # the default connect_timeout_s (10 s), so a connect timeout that is not applied still fails.
    assert time.monotonic() - start < 8


def test_timeout_raises_executor_timeout(open_client, fake: FakeExecutorService) -> None:
    transport = open_client(timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(ExecutorTimeoutError):
        transport.call("slow", Op.FORWARD, torch.randn(3, 16), LatencyClass.DECODE)
    # ~0.5 s; the upper bound leaves room for a loaded CI host and is far under the default
    # timeout_s (60 s), so a timeout that is not applied still fails.
    assert 0.4 < time.monotonic() - start < 10
    rows = torch.randn(3, 16)  # the connection is still good
    assert_same_product(transport.call("q", Op.FORWARD, rows, LatencyClass.DECODE), fake.compute("q", Op.FORWARD, rows))


# ---- lifecycle -------------------------------------------------------------------------------


def test_reconnects_after_server_restart(open_client, server: ZmqServer, fake: FakeExecutorService) -> None:
    transport = open_client(connect_timeout_s=5)
    rows = torch.randn(4, 16)
    assert_same_product(
        transport.call("q", Op.FORWARD, rows, LatencyClass.PREFILL), fake.compute("q", Op.FORWARD, rows)
    )
    server.close()
    assert ("unregister", transport.client_id, 0) in fake.events
    restarted = ZmqServer(fake, server.address).start()
    try:
        got = transport.call("q", Op.FORWARD, rows, LatencyClass.PREFILL)
        assert_same_product(got, fake.compute("q", Op.FORWARD, rows))
        assert [e for e in fake.events if e[:2] == ("register", transport.client_id)] == [
            ("register", transport.client_id)
        ] * 2
    finally:
        transport.close()
        restarted.close()


@pytest.mark.slow
def test_close_drains_in_flight_then_refuses(kind: str, sock_dir: str) -> None:
    service = FakeExecutorService(threaded=True, delay_s=0.5)
    server = ZmqServer(service, bind_address(kind, sock_dir)).start()
    transport = open_transport(client_address(kind, server.address), connect_timeout_s=0.5, timeout_s=5)
    rows = torch.randn(3, 16)
    results: list[torch.Tensor] = []
    caller = threading.Thread(
        target=lambda: results.append(transport.call("q", Op.FORWARD, rows, LatencyClass.PREFILL))
    )
    caller.start()
    assert service.wait_for(lambda events: any(e[0] == "submit" for e in events), 5)
    server.close(drain=True)
    caller.join(timeout=5)
    assert len(results) == 1
    assert_same_product(results[0], service.compute("q", Op.FORWARD, rows))
    with pytest.raises(ExecutorUnavailableError):
        transport.call("q", Op.FORWARD, rows, LatencyClass.PREFILL)
    transport.close()
    with pytest.raises(ExecutorUnavailableError):
        transport.call("q", Op.FORWARD, rows, LatencyClass.PREFILL)
    service.close()


def segment_label(server: ZmqServer, client_id: str) -> str:
    """The memfd name of ``client_id``'s shared-memory segments (server internals, on purpose: the
    executor names each session's segments apart, so a test can count one session's mappings)."""
    for _ in range(100):
        try:
            labels = [s.channel_state["shm"].label for s in list(server._sessions.values()) if s.client_id == client_id]
        except RuntimeError:  # the server thread changed the dict while we copied it
            continue
        assert len(labels) == 1, labels
        return labels[0]
    raise AssertionError("could not read the server's sessions")


def segment_mappings(label: str) -> int:
    """How many mappings of segments named ``label`` this process (the server) holds."""
    gc.collect()  # tensors over a mapping may sit in a reference cycle for a moment
    with open("/proc/self/maps") as maps:
        return sum(f"/memfd:{label} (deleted)" in line for line in maps)


@pytest.mark.slow
def test_killed_client_is_unregistered(open_client, server: ZmqServer, fake: FakeExecutorService, kind: str) -> None:
    client_id = f"doomed-{kind}"
    child = SPAWN.Process(
        target=call_and_wait, args=(client_address(kind, server.address), client_id, "slow"), daemon=True
    )
    child.start()
    try:
        assert fake.wait_for(lambda events: any(e[:3] == ("submit", client_id, "slow") for e in events), 60)
        # Only this session's segments: other sessions in this process make and free their own.
        label = segment_label(server, client_id) if kind.startswith("shm") else ""
        if kind.startswith("shm"):
            assert segment_mappings(label) == 1  # the child's buffer, mapped by the server
        os.kill(child.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        # Usually well under a second, but the server's last disconnect probe is 3 s after the
        # event: allow for a loaded host, still under client_timeout_s (15 s), so a death noticed
        # only by silence fails.
        assert fake.wait_for(lambda events: ("unregister", client_id, 1) in events, 10), fake.events[-5:]
        assert time.monotonic() - killed_at < 10
    finally:
        child.kill()
        child.join(timeout=10)
    if kind.startswith("shm"):
        assert segment_mappings(label) == 0  # the server's mapping of its shared memory is gone
    rows = torch.randn(6, 16)
    assert_same_product(
        open_client().call("q", Op.FORWARD, rows, LatencyClass.DECODE), fake.compute("q", Op.FORWARD, rows)
    )


@pytest.fixture(scope="module")
def remote_server() -> Iterator[dict[str, str]]:
    """One 'spawn' child process serving a fake (seed 3) on tcp and ipc, for the whole module."""
    sock_dir = tempfile.mkdtemp(prefix="symb-", dir="/tmp")
    ready, stop = SPAWN.Queue(), SPAWN.Event()
    addresses = [bind_address("tcp", sock_dir), bind_address("ipc", sock_dir)]
    child = SPAWN.Process(target=serve_in_process, args=(addresses, 3, ready, stop), daemon=True)
    child.start()
    try:
        tcp, ipc = ready.get(timeout=60)
        yield {"tcp": tcp, "ipc": ipc, "shm": ipc, "dist": tcp, "tcp-zmq": tcp, "shm-zmq": ipc}
    finally:
        stop.set()
        child.join(timeout=20)
        if child.is_alive():
            child.kill()
        shutil.rmtree(sock_dir, ignore_errors=True)
    assert child.exitcode == 0


@pytest.mark.slow
def test_server_in_another_process(kind: str, remote_server: dict[str, str]) -> None:
    reference = FakeExecutorService(seed=3)
    options = {"lane": False} if kind.endswith("-zmq") else {}
    with open_transport(
        client_address(kind, remote_server[kind]), expected_fingerprint=reference.fingerprint, **options
    ) as transport:
        for op in Op:
            for dtype in (torch.float32, torch.bfloat16):
                rows = torch.randn(33, input_width(reference, "q", op)).to(dtype)
                assert_same_product(
                    transport.call("q", op, rows, LatencyClass.PREFILL), reference.compute("q", op, rows)
                )
        rows = torch.randn(4096, 256)  # 4 MiB: large enough for the zero-copy paths
        assert_same_product(
            transport.call("wide", Op.FORWARD, rows, LatencyClass.PREFILL), reference.compute("wide", Op.FORWARD, rows)
        )
        with pytest.raises(ShapeError):
            transport.call("q", Op.FORWARD, torch.randn(2, 3), LatencyClass.PREFILL)


@pytest.mark.slow
def test_reconnects_after_server_crash(sock_dir: str) -> None:
    """kill -9 the server process (no Goodbye), start another at the same address: calls resume."""
    address = bind_address("ipc", sock_dir)
    reference = FakeExecutorService(seed=5)
    rows = torch.randn(4, 16)
    children = []
    try:
        for attempt in range(2):
            ready, stop = SPAWN.Queue(), SPAWN.Event()
            child = SPAWN.Process(target=serve_in_process, args=([address], 5, ready, stop), daemon=True)
            child.start()
            children.append(child)
            ready.get(timeout=60)
            if attempt == 0:
                transport = open_transport(client_address("shm", address), connect_timeout_s=10, timeout_s=30)
            got = transport.call("q", Op.FORWARD, rows, LatencyClass.PREFILL)
            assert_same_product(got, reference.compute("q", Op.FORWARD, rows))
            if attempt == 0:
                os.kill(child.pid, signal.SIGKILL)
                child.join(timeout=10)
        transport.close()
    finally:
        for child in children:
            child.kill()
            child.join(timeout=10)


def test_silent_client_times_out(fake: FakeExecutorService, sock_dir: str) -> None:
    """A peer that stops talking without disconnecting (hung host) is dropped after client_timeout_s."""
    server = ZmqServer(fake, bind_address("ipc", sock_dir), client_timeout_s=1.0).start()
    raw = RawPeer(server.address)
    try:
        # Timed from before the Hello: the server's silence clock starts when it reads the Hello,
        # so the lower bound holds however late this thread wakes up after the register event.
        started = time.monotonic()
        raw.hello()
        assert fake.wait_for(lambda events: ("register", "raw-peer") in events, 5)
        assert fake.wait_for(lambda events: ("unregister", "raw-peer", 0) in events, 10)
        # 1.0-1.5 s (idle check every 0.5 s); room for a loaded host, far under the default 15 s.
        assert 0.9 < time.monotonic() - started < 8
    finally:
        raw.close()
        server.close()


# ---- torch.distributed specifics -------------------------------------------------------------


def test_dist_peer_that_never_sends_its_payload_times_out(fake: FakeExecutorService, sock_dir: str) -> None:
    """A live peer declares a dist payload and never posts it: the group timeout ends its session
    (the executor is not wedged), while heartbeats alone would have kept it alive."""
    server = ZmqServer(fake, bind_address("dist", sock_dir), client_timeout_s=1.0).start()
    stuck = open_transport(client_address("dist", server.address), client_id="stuck")
    good = open_transport(client_address("dist", server.address), client_id="good")
    try:
        declare_dist_payload(stuck)
        started = time.monotonic()
        # The transfer times out after client_timeout_s (1 s); heartbeats alone would keep the
        # session forever, so a generous bound for a loaded host still catches a wedged executor.
        assert fake.wait_for(lambda events: ("unregister", "stuck", 0) in events, 10), fake.events[-5:]
        assert time.monotonic() - started < 8
        rows = torch.randn(3, 16)
        assert_same_product(good.call("q", Op.FORWARD, rows, LatencyClass.DECODE), fake.compute("q", Op.FORWARD, rows))
        assert_same_product(stuck.call("q", Op.FORWARD, rows, LatencyClass.DECODE), fake.compute("q", Op.FORWARD, rows))
    finally:
        stuck.close()
        good.close()
        server.close()


@pytest.mark.parametrize("kind", ["dist"])
def test_dist_client_killed_before_its_payload(
    open_client, server: ZmqServer, fake: FakeExecutorService, kind: str
) -> None:
    """kill -9 while the executor's pair worker waits for a declared payload: the wait fails at once."""
    address = client_address(kind, server.address)
    child = SPAWN.Process(target=declare_dist_payload_and_hang, args=(address, "doomed"), daemon=True)
    child.start()
    try:
        deadline = time.monotonic() + 60
        while server.stats().get("q", {}).get("requests", 0) < 1:  # header accepted: the worker now waits
            assert time.monotonic() < deadline, "the child's header never arrived"
            time.sleep(0.05)
        assert not any(e[0] == "submit" for e in fake.events)  # no rows reached the executor
        os.kill(child.pid, signal.SIGKILL)
        assert fake.wait_for(lambda events: ("unregister", "doomed", 0) in events, 5), fake.events[-5:]
    finally:
        child.kill()
        child.join(timeout=10)
    rows = torch.randn(6, 16)
    assert_same_product(
        open_client().call("q", Op.FORWARD, rows, LatencyClass.DECODE), fake.compute("q", Op.FORWARD, rows)
    )


def test_dist_refused_when_server_disallows_it(fake: FakeExecutorService, sock_dir: str) -> None:
    server = ZmqServer(fake, bind_address("dist", sock_dir), allow_dist=False).start()
    try:
        with pytest.raises(ProtocolError, match="torch.distributed"):
            open_transport(client_address("dist", server.address), connect_timeout_s=2)
    finally:
        server.close()
