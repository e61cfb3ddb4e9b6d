"""Lanes (``symbiosis/transport/lane.py``): a private Unix socket per session for same-host calls.

What a well-behaved client gets (calls over the lane give the same results as over ZeroMQ;
concurrent calls, large payloads and timeouts fall back to ZeroMQ; a restarted executor gives a
new lane) and what a hostile one cannot do with its lane (typed errors for garbage, a session
that never reads its lane is ended, a lane only for the session whose token one holds).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import zmq

from symbiosis import protocol as P
from symbiosis.errors import ERRORS_BY_CODE, ExecutorTimeoutError, ExecutorUnavailableError, SymbiosisError
from symbiosis.transport import lane as L
from symbiosis.transport.schemes import open_transport
from symbiosis.transport.shm_broker import ask_lane
from symbiosis.transport.zmq import ZmqServer
from symbiosis.vocabulary import LatencyClass, LayerSpec, Op

from .fakes import DEFAULT_SPECS, FakeExecutorService, assert_same_product

FAN = LayerSpec("fan", in_features=16, out_features=20000, has_bias=False)  # results larger than a lane datagram


@pytest.fixture
def fake() -> Iterator[FakeExecutorService]:
    service = FakeExecutorService((*DEFAULT_SPECS, FAN), threaded=True, hang_layers={"slow"})
    yield service
    service.close()


@pytest.fixture
def server(fake: FakeExecutorService, sock_dir: str) -> Iterator[ZmqServer]:
    srv = ZmqServer(fake, f"ipc://{sock_dir}/executor.sock").start()
    yield srv
    srv.close(drain=False)


@pytest.mark.parametrize("scheme", ["", "shm+"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_calls_take_the_lane_and_match_the_math(
    server: ZmqServer, fake: FakeExecutorService, scheme: str, dtype: torch.dtype
) -> None:
    with open_transport(scheme + server.address) as transport:
        lane = transport._conn.lane
        assert lane is not None and lane.max_payload_bytes > 64 * 1024
        for op in Op:
            for n in (0, 1, 5):
                rows = torch.randn(n, op.input_width(fake.layer_specs()["q"])).to(dtype)
                got = transport.call("q", op, rows, LatencyClass.DECODE)
                assert_same_product(got, fake.compute("q", op, rows))
                got.add_(1)  # a tensor of its own, writable
        assert lane.calls == 3 * len(Op)


def test_tcp_and_lane_false_use_zeromq_only(fake: FakeExecutorService, server: ZmqServer) -> None:
    tcp = ZmqServer(fake, "tcp://127.0.0.1:0").start()
    try:
        for address, options in (
            (tcp.address, {}),
            (server.address, {"lane": False}),
            ("shm+" + server.address, {"lane": False}),
        ):
            with open_transport(address, **options) as transport:
                assert transport._conn.lane is None
                rows = torch.randn(3, 16)
                assert_same_product(
                    transport.call("q", Op.FORWARD, rows, LatencyClass.DECODE), fake.compute("q", Op.FORWARD, rows)
                )
    finally:
        tcp.close(drain=False)


def test_no_lane_where_shared_memory_is_not_offered(fake: FakeExecutorService, sock_dir: str) -> None:
    server = ZmqServer(fake, f"ipc://{sock_dir}/plain.sock", allow_shm=False).start()
    try:
        with open_transport(server.address) as transport:
            assert transport._conn.lane is None
            rows = torch.randn(2, 16)
            assert_same_product(
                transport.call("q", Op.FORWARD, rows, LatencyClass.DECODE), fake.compute("q", Op.FORWARD, rows)
            )
    finally:
        server.close(drain=False)


def test_large_rows_or_results_go_over_zeromq(server: ZmqServer, fake: FakeExecutorService) -> None:
    with open_transport(server.address) as transport:
        lane = transport._conn.lane
        assert lane is not None
        big_rows = torch.randn(lane.max_payload_bytes // (4 * 256) + 1, 256)
        assert_same_product(
            transport.call("wide", Op.FORWARD, big_rows, LatencyClass.PREFILL),
            fake.compute("wide", Op.FORWARD, big_rows),
        )
        big_result = torch.randn(lane.max_payload_bytes // (4 * FAN.out_features) + 1, 16)
        assert_same_product(
            transport.call("fan", Op.FORWARD, big_result, LatencyClass.PREFILL),
            fake.compute("fan", Op.FORWARD, big_result),
        )
        assert lane.calls == 0
        small = torch.randn(2, 16)
        assert_same_product(
            transport.call("fan", Op.FORWARD, small, LatencyClass.PREFILL), fake.compute("fan", Op.FORWARD, small)
        )
        assert lane.calls == 1


def test_concurrent_threads_share_the_lane_and_zeromq(server: ZmqServer, fake: FakeExecutorService) -> None:
    transport = open_transport(server.address)
    failures: list[str] = []

    def work(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for i in range(30):
            rows = torch.randn(1 + (seed + i) % 4, 16, generator=generator)
            got = transport.call("q", Op.FORWARD, rows, LatencyClass.DECODE)
            try:
                assert_same_product(got, fake.compute("q", Op.FORWARD, rows))
            except AssertionError as exc:
                failures.append(str(exc))

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    assert 0 < transport._conn.lane.calls <= 180
    transport.close()


def test_a_timeout_closes_the_lane_and_calls_go_on(server: ZmqServer, fake: FakeExecutorService) -> None:
    with open_transport(server.address, timeout_s=0.5) as transport:
        lane = transport._conn.lane
        with pytest.raises(ExecutorTimeoutError):
            transport.call("slow", Op.FORWARD, torch.randn(2, 16), LatencyClass.DECODE)
        assert lane.closed  # a late reply must never answer the next call
        rows = torch.randn(3, 16)
        assert_same_product(
            transport.call("q", Op.FORWARD, rows, LatencyClass.DECODE), fake.compute("q", Op.FORWARD, rows)
        )
        assert lane.calls == 1


def test_a_restarted_executor_gives_a_new_lane(server: ZmqServer, fake: FakeExecutorService) -> None:
    with open_transport("shm+" + server.address, connect_timeout_s=5) as transport:
        rows = torch.randn(2, 16)
        transport.call("q", Op.FORWARD, rows, LatencyClass.DECODE)
        first = transport._conn.lane
        server.close()
        restarted = ZmqServer(fake, server.address).start()
        try:
            assert_same_product(
                transport.call("q", Op.FORWARD, rows, LatencyClass.DECODE), fake.compute("q", Op.FORWARD, rows)
            )
            assert first.closed and transport._conn.lane is not first and transport._conn.lane.calls == 1
        finally:
            restarted.close(drain=False)


# ---- a hostile lane peer ---------------------------------------------------------------------------


class LanePeer:
    """A raw session (a DEALER that said Hello) and the lane its token gets from the broker."""

    def __init__(self, address: str, client_id: str = "lane-peer") -> None:
        self.client_id = client_id
        self.ctx = zmq.Context()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(address)
        self.dealer.send(P.encode(P.Hello(P.PROTOCOL_VERSION, client_id, 1)))
        assert self.dealer.poll(5000)
        self.welcome = P.decode(self.dealer.recv_multipart()[0])
        assert isinstance(self.welcome, P.Welcome)
        fd, self.max_message_bytes = ask_lane(self.welcome.shm_socket, self.welcome.session_token, 5.0)
        self.lane = socket.socket(fileno=fd)
        self.lane.settimeout(5.0)

    def send(self, datagram: bytes) -> None:
        self.lane.send(datagram)

    def request(
        self, rid: int, layer_id: str, shape: list[int], payload: bytes | None = None, **fields: object
    ) -> bytes:
        fields = {"client_id": self.client_id, **fields}
        header = P.encode(
            P.Request(
                P.PROTOCOL_VERSION,
                fields.pop("client_id"),
                rid,
                layer_id,
                "forward",
                "float32",
                shape,
                "decode",
                **fields,
            )
        )
        if payload is None and not fields:
            payload = bytes(4 * shape[0] * shape[1])
        return b"".join(bytes(part) for part in L._frame(header, None if payload is None else memoryview(payload)))

    def reply(self) -> tuple[P.Reply, bytes]:
        data = self.lane.recv(1 << 22)
        assert data, "the executor closed the lane"
        header, payload = L._split(memoryview(data))
        reply = P.decode(header)
        assert isinstance(reply, P.Reply)
        return reply, bytes(payload)

    def close(self) -> None:
        self.lane.close()
        self.dealer.close()
        self.ctx.term()


def test_garbage_on_a_lane_gets_typed_errors_and_the_lane_keeps_serving(
    server: ZmqServer, fake: FakeExecutorService
) -> None:
    peer = LanePeer(server.address)
    try:
        attacks = [
            (b"\x01\x02", 0),  # no header length
            (b"\xff\xff\x00\x00" + b"x" * 60, 0),  # a header longer than the datagram
            (b"".join(bytes(p) for p in L._frame(b"\xc1 not msgpack", None)), 0),
            (b"".join(bytes(p) for p in L._frame(P.encode(P.Hello(P.PROTOCOL_VERSION, "x", 7)), None)), 7),
            (peer.request(11, "q", [2, 16], client_id="somebody-else"), 11),
            (peer.request(12, "nope", [2, 16]), 12),
            (peer.request(13, "q", [2, 16], payload=bytes(5)), 13),  # payload does not match the shape
            (peer.request(14, "q", [2, 16], shm_name="1"), 14),  # no such segment in this session
            (peer.request(15, "fan", [100, 16]), 15),  # its result would not fit a lane datagram
            (peer.request(16, "q", [2, 16], dist_tag=3, dist_nbytes=128), 16),  # no dist session
        ]
        for datagram, rid in attacks:
            peer.send(datagram)
            reply, payload = peer.reply()
            assert not reply.ok and reply.request_id == rid and payload == b""
            assert reply.error_code in ERRORS_BY_CODE and reply.error_code != SymbiosisError.code, reply
        if (
            peer.lane.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) > L.MAX_MESSAGE_BYTES + 4096
        ):  # we can send more than it reads
            peer.send(b"\0" * (L.MAX_MESSAGE_BYTES + 64))
            reply, _ = peer.reply()
            assert not reply.ok and "exceeds" in reply.error_message
        rows = torch.randn(2, 16)
        peer.send(peer.request(20, "q", [2, 16], payload=P.tensor_payload(rows).tobytes()))
        reply, payload = peer.reply()
        assert reply.ok and reply.request_id == 20
        got = torch.frombuffer(bytearray(payload), dtype=torch.float32).view(2, 24)
        assert_same_product(got, fake.compute("q", Op.FORWARD, rows))
    finally:
        peer.close()


def test_a_lane_only_for_the_token_of_a_live_session(server: ZmqServer) -> None:
    with pytest.raises(ExecutorUnavailableError):
        ask_lane(server.address.removeprefix("ipc://") + ".shm", "0" * 32, 5.0)
    peer = LanePeer(server.address)
    peer.dealer.send(P.encode(P.Goodbye(peer.client_id)))  # the session ends: its lane closes, no new one
    peer.lane.settimeout(5.0)
    assert peer.lane.recv(64) == b""
    with pytest.raises(ExecutorUnavailableError):
        ask_lane(peer.welcome.shm_socket, peer.welcome.session_token, 5.0)
    peer.close()


def test_a_peer_that_never_reads_its_lane_loses_its_session(server: ZmqServer, fake: FakeExecutorService) -> None:
    peer = LanePeer(server.address, client_id="deaf")
    try:
        deadline = time.monotonic() + 10
        peer.lane.setblocking(False)
        rid = 0
        while not fake.wait_for(lambda events: ("unregister", "deaf", 0) in events, 0.01):
            assert time.monotonic() < deadline, "the session of a peer that never reads was not ended"
            rid += 1
            try:
                peer.send(peer.request(rid, "wide", [200, 256]))  # 200 KB of results each, never read
            except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                time.sleep(0.01)
        with open_transport(server.address) as other:  # everyone else is served as before
            rows = torch.randn(2, 16)
            assert_same_product(
                other.call("q", Op.FORWARD, rows, LatencyClass.DECODE), fake.compute("q", Op.FORWARD, rows)
            )
    finally:
        peer.close()


# ---- fuzzing the lane ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LanePeer]:
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="symb-lf-", dir="/tmp")
    service = FakeExecutorService(threaded=True)
    server = ZmqServer(service, f"ipc://{folder}/fuzz.sock").start()
    peer = LanePeer(server.address, client_id="fuzz")
    yield peer
    peer.close()
    server.close(drain=False)
    service.close()
    shutil.rmtree(folder, ignore_errors=True)


def _lane_datagrams():
    from hypothesis import strategies as st

    from .test_fuzz_protocol import headers, requests

    framed = st.tuples(st.one_of(headers, requests.map(P.encode)), st.binary(max_size=256)).map(
        lambda parts: b"".join(bytes(p) for p in L._frame(parts[0], memoryview(parts[1])))
    )
    return st.one_of(st.binary(min_size=1, max_size=300), framed)  # an empty datagram reads as "closed"


def test_any_lane_datagram_gets_a_typed_answer_and_the_lane_keeps_serving(fuzz_peer: LanePeer) -> None:
    from hypothesis import HealthCheck, given, settings

    barriers = iter(range(2**62, 2**63))

    @settings(
        max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    @given(_lane_datagrams())
    def fuzz(datagram: bytes) -> None:
        barrier = next(barriers)
        fuzz_peer.send(datagram)
        fuzz_peer.send(fuzz_peer.request(barrier, "q", [1, 16]))
        while True:
            reply, _ = fuzz_peer.reply()
            if reply.request_id == barrier:
                assert reply.ok, reply
                return
            if not reply.ok:  # garbage is turned away with a typed error, never the last-resort guard's
                assert reply.error_code in ERRORS_BY_CODE and reply.error_code != SymbiosisError.code, reply

    fuzz()
