"""CURVE authentication and encryption of the ZeroMQ transports (``symbiosis/transport/security.py``).

Every test runs a ``ZmqServer`` over a ``FakeExecutorService`` in this process. Traffic only ever
goes to 127.0.0.1 or ipc; the non-loopback cases only construct or bind (port 0) and close.
"""

from __future__ import annotations

import os
import select
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

import symbiosis
from symbiosis import protocol as P
from symbiosis.errors import ExecutorUnavailableError
from symbiosis.transport.schemes import open_transport
from symbiosis.transport.security import (
    CLIENT_KEY_ENV,
    SERVER_KEY_ENV,
    CurveClientKeys,
    CurveServerKeys,
    generate_keypair,
    load_public_key,
    load_secret_key,
)
from symbiosis.transport.zmq import ZmqServer
from symbiosis.transport.zmq_context import new_context
from symbiosis.vocabulary import LatencyClass, Op
from tests.cli_helpers import run_cli

from .fakes import FakeExecutorService, assert_same_product, raw_tcp_peer

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")

MARKER = "plaintext-marker-7f3a9c"  # a client id that must never be readable on the wire
PATTERN = torch.full((64, 16), 1234.5)  # float32 bytes 0x449a5000 repeated


@pytest.fixture(scope="module")
def keys() -> Iterator[Path]:
    """server/, authorized/ (alice's public key), and alice's and mallory's key pairs."""
    root = Path(tempfile.mkdtemp(prefix="symb-keys-", dir="/tmp"))
    generate_keypair(root / "server", "server")
    generate_keypair(root / "alice", "alice")
    generate_keypair(root / "mallory", "mallory")
    (root / "authorized").mkdir()
    shutil.copy(root / "alice" / "alice.key", root / "authorized" / "alice.key")
    yield root
    shutil.rmtree(root, ignore_errors=True)


def server_keys(root: Path) -> CurveServerKeys:
    return CurveServerKeys(root / "server" / "server.key_secret", root / "authorized")


def client_keys(root: Path, who: str = "alice", server_public: str = "server/server.key") -> CurveClientKeys:
    return CurveClientKeys(root / server_public, root / who / f"{who}.key_secret")


@pytest.fixture
def sock_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="symb-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def fake() -> Iterator[FakeExecutorService]:
    service = FakeExecutorService(threaded=True)
    yield service
    service.close()


@pytest.fixture
def curve_server(fake: FakeExecutorService, keys: Path) -> Iterator[ZmqServer]:
    server = ZmqServer(fake, "tcp://127.0.0.1:0", curve=server_keys(keys)).start()
    yield server
    server.close(drain=False)


def call_q(transport, rows: torch.Tensor) -> torch.Tensor:
    return transport.call("q", Op.FORWARD, rows, LatencyClass.PREFILL)


# ---- authorized clients ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tcp", "ipc", "shm", "dist"])
def test_authorized_client_gets_correct_results(
    fake: FakeExecutorService, keys: Path, sock_dir: str, kind: str
) -> None:
    bind = "tcp://127.0.0.1:0" if kind == "tcp" else f"ipc://{sock_dir}/executor.sock"
    server = ZmqServer(fake, bind, curve=server_keys(keys)).start()
    try:
        address = f"{kind}+{server.address}" if kind in ("shm", "dist") else server.address
        with open_transport(address, curve=client_keys(keys), connect_timeout_s=5) as transport:
            rows = torch.randn(5, 16)
            assert_same_product(call_q(transport, rows), fake.compute("q", Op.FORWARD, rows))
            grads = torch.randn(3, 24, dtype=torch.bfloat16)
            assert_same_product(
                transport.call("q", Op.BACKWARD, grads, LatencyClass.FINETUNE), fake.compute("q", Op.BACKWARD, grads)
            )
    finally:
        server.close(drain=False)


def test_keys_from_environment(curve_server: ZmqServer, fake: FakeExecutorService, keys: Path, monkeypatch) -> None:
    monkeypatch.setenv(SERVER_KEY_ENV, str(keys / "server" / "server.key"))
    monkeypatch.setenv(CLIENT_KEY_ENV, str(keys / "alice" / "alice.key_secret"))
    with open_transport(curve_server.address, connect_timeout_s=5) as transport:
        rows = torch.randn(2, 16)
        assert_same_product(call_q(transport, rows), fake.compute("q", Op.FORWARD, rows))
    monkeypatch.delenv(CLIENT_KEY_ENV)
    with pytest.raises(ValueError, match=CLIENT_KEY_ENV):
        open_transport(curve_server.address, connect_timeout_s=5)


# ---- refused clients: typed, fast, clear -----------------------------------------------------


@pytest.mark.parametrize(
    "who, match",
    [
        (None, "requires CURVE authentication"),
        ("mallory", "refused this client's CURVE key"),
        ("wrong-server-key", "is not the executor.s"),
    ],
)
def test_unauthenticated_clients_are_refused_fast(
    curve_server: ZmqServer, fake: FakeExecutorService, keys: Path, who, match
) -> None:
    curve = {
        None: None,
        "mallory": client_keys(keys, "mallory"),
        "wrong-server-key": client_keys(keys, "alice", "mallory/mallory.key"),
    }[who]
    start = time.monotonic()
    with pytest.raises(ExecutorUnavailableError, match=match):
        open_transport(curve_server.address, curve=curve, connect_timeout_s=10)
    assert time.monotonic() - start < 3.0  # the handshake failure is reported, not waited out
    assert not any(event[0] == "register" for event in fake.events)  # never got a session
    with open_transport(
        curve_server.address, curve=client_keys(keys), connect_timeout_s=5
    ) as transport:  # still serving
        assert call_q(transport, torch.ones(1, 16)).shape == (1, 24)


def test_curve_client_refuses_a_plain_server(fake: FakeExecutorService, keys: Path) -> None:
    server = ZmqServer(fake, "tcp://127.0.0.1:0").start()
    try:
        with pytest.raises(ExecutorUnavailableError, match="does not use CURVE"):
            open_transport(server.address, curve=client_keys(keys), connect_timeout_s=10)
    finally:
        server.close(drain=False)


#: A ZMTP 3.0 greeting naming the NULL mechanism: a peer that sends it and then keeps the connection
#: open makes a CURVE client see the mismatch itself, every time, on its first try (a real NULL
#: socket sometimes closes first, and the client then retries).
NULL_GREETING = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + bytes(1) + bytes(31)


def test_a_handshake_that_fails_at_once_is_still_reported(keys: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """libzmq reports a mechanism mismatch once and does not reconnect: the client's monitor must
    be listening before ``connect``, or a client thread that loses the core right after connecting
    (a loaded host) misses the only event and waits the executor out as "silent" (seen in CI)."""
    connect = zmq.Socket.connect

    def connect_then_lose_the_core(self: zmq.Socket, addr: str) -> object:
        result = connect(self, addr)
        time.sleep(0.3)  # the handshake fails meanwhile
        return result

    monkeypatch.setattr(zmq.Socket, "connect", connect_then_lose_the_core)
    with raw_tcp_peer(lambda conn: conn.sendall(NULL_GREETING)) as address:
        start = time.monotonic()
        with pytest.raises(ExecutorUnavailableError, match="does not use CURVE"):
            open_transport(address, curve=client_keys(keys), connect_timeout_s=10)
        assert time.monotonic() - start < 3.0


def test_raw_plain_peer_gets_nothing(curve_server: ZmqServer, fake: FakeExecutorService) -> None:
    ctx = new_context(linger_ms=0)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(curve_server.address)
        sock.send(P.encode(P.Hello(P.PROTOCOL_VERSION, "intruder", 1, None)))
        assert not sock.poll(1000), "a NULL-mechanism peer got an answer from a CURVE server"
        assert not fake.events
    finally:
        sock.close()
        ctx.term()


# ---- the wire is encrypted -------------------------------------------------------------------


class Recorder:
    """A TCP relay on 127.0.0.1 that forwards one connection to ``target`` and keeps every byte."""

    def __init__(self, target: str) -> None:
        host, _, port = target[len("tcp://") :].rpartition(":")
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self.captured = bytearray()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._listener.settimeout(0.1)
        while not self._stop:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            upstream = socket.create_connection(self._target)
            peers = {client: upstream, upstream: client}
            while not self._stop:
                readable, _, _ = select.select(list(peers), [], [], 0.1)
                for sock in readable:
                    data = sock.recv(1 << 16)
                    if not data:
                        self._stop = True
                        break
                    self.captured += data
                    peers[sock].sendall(data)
            client.close()
            upstream.close()

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=5)
        self._listener.close()


@pytest.mark.parametrize("use_curve", [False, True])
def test_traffic_is_encrypted(fake: FakeExecutorService, keys: Path, use_curve: bool) -> None:
    server = ZmqServer(fake, "tcp://127.0.0.1:0", curve=server_keys(keys) if use_curve else None).start()
    relay = Recorder(server.address)
    try:
        curve = client_keys(keys) if use_curve else None
        # lane=False: without CURVE a call would otherwise take a tcp lane (lane.py), a connection
        # of its own that the relay does not see; with CURVE no lane is offered at all.
        with open_transport(
            relay.address, client_id=MARKER, curve=curve, connect_timeout_s=5, lane=use_curve
        ) as transport:
            assert (transport._welcome.lane_port == 0) is use_curve and transport._conn.lane is None
            assert_same_product(call_q(transport, PATTERN), fake.compute("q", Op.FORWARD, PATTERN))
    finally:
        relay.close()
        server.close(drain=False)
    wire = bytes(relay.captured)
    payload = PATTERN.numpy().tobytes()[:64]
    # Without CURVE (the control case) both are in the clear; with CURVE neither is.
    assert (MARKER.encode() in wire) is not use_curve
    assert (payload in wire) is not use_curve
    assert len(wire) > PATTERN.numel() * 4  # the payload did cross the relay


# ---- binding beyond loopback -----------------------------------------------------------------


def test_non_loopback_bind_needs_curve_or_explicit_consent(fake: FakeExecutorService, keys: Path) -> None:
    with pytest.raises(ValueError, match="CURVE"):
        ZmqServer(fake, "tcp://0.0.0.0:0")
    server = ZmqServer(fake, "tcp://0.0.0.0:0", curve=server_keys(keys)).start()  # bound, never used
    assert server.address.startswith("tcp://0.0.0.0:")
    server.close(drain=False)
    # dist payloads are plaintext: a CURVE server keeps them on loopback unless told otherwise.
    with pytest.raises(ValueError, match="not encrypted"):
        ZmqServer(fake, "tcp://10.1.2.3:0", curve=server_keys(keys), dist_host="10.1.2.3")
    ZmqServer(fake, "tcp://10.1.2.3:0", curve=server_keys(keys), dist_host="10.1.2.3", allow_non_loopback=True)


def test_dist_client_refuses_non_loopback_with_curve(keys: Path) -> None:
    with pytest.raises(ValueError, match="not encrypted"):
        open_transport("dist+tcp://10.1.2.3:7000", curve=client_keys(keys))  # refused before any connection


# ---- key handling and the CLI ----------------------------------------------------------------


def test_key_files(tmp_path: Path) -> None:
    public, secret = generate_keypair(tmp_path, "bob")
    assert (public.name, secret.name) == ("bob.key", "bob.key_secret")
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    pub, sec = load_secret_key(secret)
    assert load_public_key(public) == pub == zmq.curve_public(sec)
    with pytest.raises(FileExistsError):
        generate_keypair(tmp_path, "bob")
    with pytest.raises(ValueError, match="no secret key"):
        load_secret_key(public)
    os.chmod(secret, 0o644)
    with pytest.raises(ValueError, match="readable by other users"):
        load_secret_key(secret)
    with pytest.raises(FileNotFoundError):
        CurveClientKeys(tmp_path / "missing.key", secret)
    (tmp_path / "empty").mkdir()
    os.chmod(secret, 0o600)
    with pytest.raises(ValueError, match="no client public keys"):
        CurveServerKeys(secret, tmp_path / "empty")


@pytest.mark.slow
def test_cli_keys_and_serve_options(tmp_path: Path, capsys, monkeypatch) -> None:
    code, out, _ = run_cli(["keys", "--output", str(tmp_path), "--name", "server"], capsys, monkeypatch)
    assert code == 0 and "server.key_secret" in out
    assert load_secret_key(tmp_path / "server.key_secret")[0] == load_public_key(tmp_path / "server.key")
    code, _, err = run_cli(["keys", "--output", str(tmp_path), "--name", "server"], capsys, monkeypatch)
    assert code == 2 and err.startswith("error: ") and "exists" in err
    code, out, _ = run_cli(["serve", "--help"], capsys, monkeypatch)
    assert code == 0 and "--curve-secret-key" in out and "--authorized-clients" in out
    # Bad key options fail in one line before the checkpoint is read.
    args = [
        "serve",
        str(tmp_path / "no-model"),
        "--curve-secret-key",
        str(tmp_path / "nope"),
        "--authorized-clients",
        str(tmp_path),
    ]
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 2 and "no CURVE key file" in err


# ---- end to end: a real executor and a client model --------------------------------------------


def test_load_client_model_over_curve(tiny_checkpoint, keys: Path) -> None:
    path = tiny_checkpoint("llama")
    executor = symbiosis.BaseExecutor.from_pretrained(path)
    try:
        server = executor.serve("tcp://127.0.0.1:0", curve=server_keys(keys))
        ids = torch.tensor([[1, 5, 9, 2]])
        local = symbiosis.load_client_model(path, executor=executor)
        remote = symbiosis.load_client_model(path, executor=server.address, curve=client_keys(keys), timeout_s=30)
        try:
            torch.testing.assert_close(remote(ids).logits, local(ids).logits)
        finally:
            remote.symbiosis_transport.close()
        with pytest.raises(ExecutorUnavailableError, match="requires CURVE"):
            symbiosis.load_client_model(path, executor=server.address, timeout_s=30)
    finally:
        executor.close(drain=False)
