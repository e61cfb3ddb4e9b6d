"""What a client says when it cannot reach its executor, or loses it (``zmq_client.py``,
``security.py:handshake_failure``, ``jobs/client.py:executor_restart_hint``).

Every message names the executor's address and the last thing known about it: nobody answered
the handshake within the connect timeout; the peer is not a Symbiosis executor (or wants CURVE);
the executor said goodbye or went silent and did not come back. Each test serves a
``FakeExecutorService`` from a ``ZmqServer`` in this process (or a bare TCP listener).
"""

from __future__ import annotations

import pickle
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import pytest
import torch
import zmq

from symbiosis.errors import ExecutorLostError, ExecutorTimeoutError, ExecutorUnavailableError
from symbiosis.jobs.client import ClientOptions, executor_restart_hint
from symbiosis.transport import zmq_client
from symbiosis.transport.schemes import open_transport
from symbiosis.transport.security import handshake_failure
from symbiosis.transport.zmq import ZmqServer
from symbiosis.vocabulary import LatencyClass, LayerSpec, Op

from .fakes import DEFAULT_SPECS, FakeExecutorService, raw_tcp_peer


def call_q(transport) -> torch.Tensor:
    return transport.call("q", Op.FORWARD, torch.ones(2, 16), LatencyClass.DECODE)


def bind_address(kind: str, sock_dir: str) -> str:
    return "tcp://127.0.0.1:0" if kind.startswith("tcp") else f"ipc://{sock_dir}/executor.sock"


def open_client(kind: str, server: ZmqServer, **kwargs: object):
    """A client of ``server``: ``ipc``/``tcp`` with a lane, ``tcp-zmq`` without (calls over ZeroMQ)."""
    return open_transport(server.address, lane=not kind.endswith("-zmq"), **kwargs)


# ---- connecting: the connect timeout is the handshake's deadline ------------------------------


def test_no_executor_names_the_address_and_the_wait(sock_dir: str) -> None:
    address = f"ipc://{sock_dir}/nobody.sock"
    with pytest.raises(ExecutorUnavailableError, match=rf"^no executor answered at {address} within 0.5s$"):
        open_transport(address, connect_timeout_s=0.5)


@pytest.mark.slow
def test_a_connect_timeout_over_five_seconds_is_waited_out(sock_dir: str) -> None:
    """The heartbeat thread's "silent" watchdog (5 s) used to cut the handshake short: a longer
    --connect-timeout was ignored and the error ("executor silent for 5.0s") named no address."""
    address = f"ipc://{sock_dir}/nobody.sock"
    started = time.monotonic()
    with pytest.raises(ExecutorUnavailableError, match=rf"^no executor answered at {address} within 6s$"):
        open_transport(address, connect_timeout_s=6)
    assert 5.9 < time.monotonic() - started < 12


def test_closing_a_client_does_not_wait_out_a_reconnection_in_progress(sock_dir: str) -> None:
    """A call reconnecting to an executor that is gone holds the session lock for its handshake:
    ``close`` (a server stopping after its executor died) waited out the whole connect timeout
    behind it. Now it fails that handshake and returns at once."""
    service = FakeExecutorService()
    server = ZmqServer(service, f"ipc://{sock_dir}/executor.sock").start()
    client = open_transport(server.address, connect_timeout_s=30)
    call_q(client)
    server.close()
    outcome: list[BaseException] = []

    def call_again() -> None:
        try:
            call_q(client)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            outcome.append(exc)

    caller = threading.Thread(target=call_again)
    caller.start()
    deadline = time.monotonic() + 10
    while client._opening is None:  # the call is reconnecting: its handshake waits for an answer
        assert time.monotonic() < deadline and caller.is_alive()
        time.sleep(0.005)
    started = time.monotonic()
    client.close()
    closed_s = time.monotonic() - started
    caller.join(5)
    assert closed_s < 2.0, f"close waited {closed_s:.1f} s for the reconnection"
    assert not caller.is_alive() and len(outcome) == 1 and isinstance(outcome[0], ExecutorUnavailableError)
    service.close()


# ---- a peer that is not a Symbiosis executor --------------------------------------------------


def _answer_http_400(conn: socket.socket) -> None:
    """What an HTTP server (the OpenAI API server of ``symbiosis api``) does with a ZeroMQ greeting."""
    conn.recv(1024)
    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    conn.close()


@pytest.fixture
def http_like_server() -> Iterator[str]:
    with raw_tcp_peer(_answer_http_400) as address:
        yield address


def test_an_http_server_is_not_taken_for_a_curve_executor(http_like_server: str) -> None:
    started = time.monotonic()
    with pytest.raises(ExecutorUnavailableError) as caught:
        open_transport(http_like_server, connect_timeout_s=10)
    assert time.monotonic() - started < 3.0  # reported, not waited out
    message = str(caught.value)
    assert http_like_server in message
    assert "not a Symbiosis executor" in message
    assert "HTTP server" in message
    assert "requires CURVE authentication" in message  # still the other possibility: a CURVE executor
    assert not message.startswith("the executor requires CURVE")  # not asserted as the cause


def test_a_peer_that_never_completes_the_handshake_is_named(sock_dir: str) -> None:
    """Python's ``http.server`` reads the ZeroMQ greeting as the start of a request line and waits
    for the rest: no handshake failure to report, so the connect timeout runs out -- and says that
    something accepted the connection without speaking ZeroMQ."""
    with raw_tcp_peer() as address:  # accepts, then says nothing
        with pytest.raises(ExecutorUnavailableError) as caught:
            open_transport(address, connect_timeout_s=0.5)
    message = str(caught.value)
    assert message.startswith(f"no executor answered at {address} within 0.5s: something accepted the connection")
    assert "not a Symbiosis executor" in message


# ---- an established session ends: the error says how, and where -------------------------------


@pytest.mark.parametrize("kind", ["ipc", "tcp", "tcp-zmq"])
def test_an_executor_that_said_goodbye_is_named(fake: FakeExecutorService, sock_dir: str, kind: str) -> None:
    server = ZmqServer(fake, bind_address(kind, sock_dir)).start()
    transport = open_client(kind, server, connect_timeout_s=1)
    try:
        call_q(transport)
        server.close()  # a clean stop: in-flight calls drained, a Goodbye to every client
        started = time.monotonic()
        with pytest.raises(ExecutorLostError) as caught:
            call_q(transport)
        assert time.monotonic() - started < 5  # about connect_timeout_s (1 s)
        assert str(caught.value) == (
            f"the executor at {server.address} shut down (it said goodbye), and the executor did not come back "
            "within 1s"
        )
    finally:
        transport.close()


class FreezingFake(FakeExecutorService):
    """A fake whose ``freeze`` layer blocks the server's own thread: no replies, no heartbeats --
    an executor that hangs without dropping its connections (a stopped process, a wedged host)."""

    def __init__(self) -> None:
        super().__init__([*DEFAULT_SPECS, LayerSpec("freeze", 16, 24, True)])
        self.thaw = threading.Event()

    def submit(self, client_id: str, layer_id: str, op: Op, rows: torch.Tensor, latency_class) -> Future:
        if layer_id == "freeze":
            self._record("frozen")
            self.thaw.wait(30)
        return super().submit(client_id, layer_id, op, rows, latency_class)


@pytest.mark.parametrize("kind", ["ipc", "tcp-zmq"])
def test_an_executor_that_went_silent_is_named(sock_dir: str, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zmq_client, "_SILENT_MIN_S", 0.3, raising=False)  # silent after 5 heartbeats: 0.5 s
    fake = FreezingFake()
    server = ZmqServer(fake, bind_address(kind, sock_dir), heartbeat_s=0.1).start()
    transport = open_client(kind, server, connect_timeout_s=1, timeout_s=20)
    try:
        call_q(transport)
        started = time.monotonic()
        with pytest.raises(ExecutorLostError) as caught:
            transport.call("freeze", Op.FORWARD, torch.ones(2, 16), LatencyClass.DECODE)
        assert time.monotonic() - started < 5  # silent after 0.5 s or so, not after timeout_s (20 s)
        message = str(caught.value)
        # The reconnection's handshake found it still there, not answering: the last try says so.
        assert re.fullmatch(
            rf"the executor at {re.escape(server.address)} went silent \(no reply or heartbeat for \d\.\ds\), "
            r"and the executor did not come back within 1s \(last try: no executor answered at \S+ within [\d.]+s: "
            r"a ZeroMQ peer accepted the connection but did not answer the Hello .*\)",
            message,
        ), message
    finally:
        fake.thaw.set()
        transport.close()
        server.close(drain=False)
        fake.close()


def test_a_hung_executor_is_told_from_no_executor(sock_dir: str) -> None:
    """Its ZeroMQ I/O thread still completes the handshake; nothing answers the Hello."""
    fake = FreezingFake()
    server = ZmqServer(fake, bind_address("tcp", sock_dir)).start()
    frozen = threading.Thread(target=_call_frozen, args=(server.address,), daemon=True)
    try:
        frozen.start()
        assert fake.wait_for(lambda events: ("frozen",) in events, 10)
        with pytest.raises(ExecutorUnavailableError) as caught:
            open_transport(server.address, connect_timeout_s=0.5)
        assert str(caught.value).startswith(
            f"no executor answered at {server.address} within 0.5s: a ZeroMQ peer accepted the connection but did "
            "not answer the Hello"
        )
    finally:
        fake.thaw.set()
        frozen.join(timeout=10)
        server.close(drain=False)
        fake.close()


def _call_frozen(address: str) -> None:
    with open_transport(address, connect_timeout_s=5, timeout_s=20) as transport:
        transport.call("freeze", Op.FORWARD, torch.ones(2, 16), LatencyClass.DECODE)


def test_an_executor_that_comes_back_in_time_is_not_an_error(fake: FakeExecutorService, sock_dir: str) -> None:
    """The other side of the above: a restart within connect_timeout_s is ridden out, even though
    the reconnections now wait only until connect_timeout_s after the call started."""
    server = ZmqServer(fake, bind_address("ipc", sock_dir)).start()
    transport = open_transport(server.address, connect_timeout_s=5)
    restarted: list[ZmqServer] = []
    try:
        call_q(transport)
        server.close()
        timer = threading.Timer(1.0, lambda: restarted.append(ZmqServer(fake, server.address).start()))
        timer.start()
        assert call_q(transport).shape == (2, 24)
        timer.join()
    finally:
        transport.close()
        for again in restarted:
            again.close(drain=False)


# ---- jobs: the hint names the flag and keeps the cause ----------------------------------------


def _run_in_job(address: str, connect_timeout_s: float, body: Callable[[], object]) -> ExecutorUnavailableError:
    options = ClientOptions(executor=address, connect_timeout_s=connect_timeout_s)
    with pytest.raises(ExecutorUnavailableError) as caught, executor_restart_hint(options):
        body()
    return caught.value


def test_a_job_says_the_executor_shut_down_and_which_flag_bounds_the_wait(
    fake: FakeExecutorService, sock_dir: str
) -> None:
    server = ZmqServer(fake, bind_address("ipc", sock_dir)).start()
    transport = open_transport(server.address, connect_timeout_s=1)
    try:
        call_q(transport)
        server.close()
        error = _run_in_job(server.address, 1, lambda: call_q(transport))
        assert isinstance(error, ExecutorLostError)  # a Python caller of a job can catch the type
        assert str(error) == (
            f"the executor at {server.address} shut down (it said goodbye), and the executor did not come back "
            "within --connect-timeout (1s): raise --connect-timeout to wait longer for a restarting executor"
        )
    finally:
        transport.close()


def test_a_job_hint_on_another_unavailable_error_names_the_address() -> None:
    error = _run_in_job("tcp://127.0.0.1:9", 10, lambda: (_ for _ in ()).throw(ExecutorUnavailableError("boom")))
    assert str(error) == (
        "boom; the executor at tcp://127.0.0.1:9 did not come back within --connect-timeout (10s): "
        "raise --connect-timeout to wait longer for a restarting executor"
    )


def test_the_lost_error_survives_pickling() -> None:
    error = ExecutorLostError("the executor at ipc:///x went silent (no reply or heartbeat for 5.0s)", 10, "boom")
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), str(copy), copy.cause, copy.waited_s, copy.last) == (
        ExecutorLostError,
        str(error),
        error.cause,
        10,
        "boom",
    )
    assert isinstance(copy, ExecutorUnavailableError) and not isinstance(copy, ExecutorTimeoutError)


# ---- handshake_failure: each monitor event its own message --------------------------------------


def test_handshake_failures_tell_what_is_known() -> None:
    address = "tcp://127.0.0.1:8000"
    mismatch = zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
    proven = handshake_failure(address, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, mismatch, curve_on=False)
    assert proven.startswith(f"the executor at {address} requires CURVE authentication; pass curve=")
    for event, value, detail in [
        (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 104, "closed the connection during the ZeroMQ handshake: "),
        (
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
            0x10000001,
            "broke the ZeroMQ handshake (ZMTP protocol error 0x10000001): ",
        ),
    ]:
        either = handshake_failure(address, event, value, curve_on=False)
        assert either.startswith(f"the peer at {address} {detail}either it is an executor that requires CURVE")
        assert "or it is not a Symbiosis executor at all (e.g. an HTTP server" in either
    assert "does not use CURVE" in handshake_failure(
        address, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, mismatch, curve_on=True
    )
    assert "not a Symbiosis executor" in handshake_failure(address, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32, True)
    assert "refused this client's CURVE key" in handshake_failure(address, zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400, True)
