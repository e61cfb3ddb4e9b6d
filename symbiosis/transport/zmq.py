"""ZeroMQ transport: ``ZmqServer`` serves an ``ExecutorService``; ``ZmqTransport`` is the client.

Addresses: ``tcp://127.0.0.1:7000`` (port 0 picks a free one, see ``ZmqServer.address``) and
``ipc:///path/executor.sock``. ``connect()`` also accepts ``shm+ipc://…`` / ``shm+tcp://…`` (same
host: payloads in shared memory, see ``shm.py``); the server serves all of them on one socket.

Threading: a ZeroMQ socket must be used by one thread at a time, so each side has exactly one
thread that owns its socket. Other threads talk to it through a queue plus a socketpair "waker"
that the owner polls next to the ZeroMQ socket. On the server, ``service.submit`` futures complete
on executor threads; their callbacks only enqueue, and the socket thread sends the replies.

Dead clients: the ROUTER is ``ROUTER_MANDATORY``, so sending to a peer whose connection is gone
fails with ``EHOSTUNREACH``. A socket monitor reports every disconnect (a ``kill -9``ed process's
connection is closed by its kernel at once); the server then probes every session with a ``Ping``
and ends the ones that fail. Clients also ping every ``heartbeat_s``; a session silent for
``client_timeout_s`` is ended too (hung hosts, lost FINs). Ending a session calls
``unregister_client`` (the executor drops its pending work) and frees its shared memory.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import queue
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import tenacity
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from symbiosis import protocol as P
from symbiosis.errors import (
    ExecutorTimeoutError,
    ExecutorUnavailableError,
    ModelMismatchError,
    ProtocolError,
    SymbiosisError,
    error_from_code,
)
from symbiosis.executor.requests import LatencyClass, LayerSpec, Op
from symbiosis.transport.base import ExecutorService

log = logging.getLogger(__name__)

COPY_THRESHOLD = 64 * 1024  # below this, copying into a ZeroMQ message is cheaper than tracking a buffer
_INVALID = "<invalid>"  # stats key for requests that name no known layer


class _Waker:
    """Lets any thread wake the socket-owning thread out of ``zmq.Poller.poll``."""

    def __init__(self) -> None:
        self._recv, self._send = socket.socketpair()
        self._recv.setblocking(False)
        self._send.setblocking(False)

    def fileno(self) -> int:
        return self._recv.fileno()

    def wake(self) -> None:
        try:
            self._send.send(b"\0")
        except OSError:  # buffer full: a wake-up is already pending, which is all we need
            pass

    def drain(self) -> None:
        try:
            while self._recv.recv(4096):
                pass
        except OSError:
            pass

    def close(self) -> None:
        self._recv.close()
        self._send.close()


def check_bind_address(address: str, allow_non_loopback: bool) -> str:
    """Return the address to bind; refuse non-loopback tcp unless explicitly allowed."""
    if address.startswith(("ipc://", "inproc://")):
        return address
    if not address.startswith("tcp://"):
        raise ValueError(f"unsupported address {address!r}: use tcp://HOST:PORT or ipc:///PATH")
    host, _, port = address[len("tcp://") :].rpartition(":")
    host = host.strip("[]")
    if host == "localhost":
        host = "127.0.0.1"
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:  # '*', interface names, host names
        loopback = False
    if not loopback and not allow_non_loopback:
        raise ValueError(
            f"refusing to bind {address!r}: not a loopback address. Pass allow_non_loopback=True "
            "to serve other hosts (the wire is neither authenticated nor encrypted)."
        )
    return f"tcp://{'[' + host + ']' if ':' in host else host}:{port}"


@dataclass
class _Session:
    identity: bytes
    client_id: str
    token: str
    last_seen: float
    segments: Any = None  # shm.SegmentMap, created on the first shared-memory request


@dataclass
class _InFlight:
    identity: bytes
    request: P.Request
    spec: LayerSpec
    future: Future[torch.Tensor]
    shm_region: torch.Tensor | None  # uint8 view the result is written into (shared memory)


class ZmqServer:
    """Serves ``service`` on a ZeroMQ ROUTER socket from one background thread (see module doc)."""

    def __init__(
        self,
        service: ExecutorService,
        address: str,
        *,
        max_payload_bytes: int = P.DEFAULT_MAX_PAYLOAD_BYTES,
        allow_non_loopback: bool = False,
        allow_shm: bool = True,
        heartbeat_s: float = 1.0,
        client_timeout_s: float = 15.0,
        drain_timeout_s: float = 30.0,
    ) -> None:
        self._service = service
        self._bind_address = check_bind_address(address, allow_non_loopback)
        self._limits = P.Limits(max_payload_bytes=max_payload_bytes)
        self._allow_shm = allow_shm
        self._heartbeat_s = heartbeat_s
        self._client_timeout_s = client_timeout_s
        self._drain_timeout_s = drain_timeout_s
        self._specs: dict[str, LayerSpec] = {}
        self._sessions: dict[bytes, _Session] = {}
        self._identities_by_client: dict[str, set[bytes]] = {}
        self._inflight: dict[tuple[bytes, int], _InFlight] = {}
        self._completions: queue.SimpleQueue[tuple[bytes, int]] = queue.SimpleQueue()
        self._stats: dict[str, dict[str, int]] = {}
        self._stats_lock = threading.Lock()
        self._waker = _Waker()
        self._close_request: bool | None = None  # None: running; else drain flag
        self._thread: threading.Thread | None = None
        self._address = ""

    @property
    def address(self) -> str:
        """The bound address, with a tcp port 0 resolved to the real port."""
        return self._address

    def start(self) -> "ZmqServer":
        """Bind (errors raise here, in the caller's thread) and serve from a background thread."""
        self._specs = dict(self._service.layer_specs())
        self._fingerprint = self._service.fingerprint
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.SNDHWM, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, self._limits.max_payload_bytes + P.MAX_HEADER_BYTES)
        self._router.setsockopt(zmq.LINGER, 500)
        try:
            self._router.bind(self._bind_address)
        except zmq.ZMQError:
            self._router.close(0)
            self._ctx.term()
            raise
        self._address = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._monitor = self._router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._thread = threading.Thread(target=self._run, name=f"ZmqServer({self._address})", daemon=True)
        self._thread.start()
        return self

    def close(self, drain: bool = True) -> None:
        """Refuse new requests; with ``drain``, wait (up to ``drain_timeout_s``) for in-flight ones,
        otherwise answer them ``ExecutorUnavailableError``; say Goodbye to clients; close."""
        if self._thread is None or self._close_request is not None:
            return
        self._close_request = drain
        self._waker.wake()
        self._thread.join()
        self._ctx.term()
        self._waker.close()

    def stats(self) -> dict[str, dict[str, int]]:
        """Per layer id: requests accepted, rows accepted, error replies (unknown layers: '<invalid>')."""
        with self._stats_lock:
            return {layer: dict(counts) for layer, counts in self._stats.items()}

    # ---- socket thread -------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._waker.fileno(), zmq.POLLIN)
        probes: list[float] = []
        next_idle_check = 0.0
        drain_deadline: float | None = None
        while True:
            events = dict(poller.poll(100))
            now = time.monotonic()
            if self._waker.fileno() in events:
                self._waker.drain()
            if self._monitor in events:
                self._read_monitor(probes, now)
            if self._router in events:
                for _ in range(256):  # bounded, so completions and timers are not starved
                    try:
                        frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._guarded(lambda: self._on_message(frames), frames)
            self._flush_completions()
            if probes and probes[0] <= now:  # a peer disconnected: find which sessions are gone
                probes[:] = [t for t in probes if t > now]
                for identity in list(self._sessions):
                    self._send(identity, P.Ping())
            if now >= next_idle_check:
                next_idle_check = now + 0.5
                for identity, session in list(self._sessions.items()):
                    if now - session.last_seen > self._client_timeout_s:
                        log.warning("client %s silent for %.1fs; ending its session", session.client_id, now - session.last_seen)
                        self._end_session(identity)
            if self._close_request is not None:
                if drain_deadline is None:
                    drain_deadline = now + (self._drain_timeout_s if self._close_request else 0.0)
                if not self._inflight or now >= drain_deadline:
                    break
        self._shutdown()

    def _read_monitor(self, probes: list[float], now: float) -> None:
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                # ZeroMQ may process the pipe's end a moment after the event: probe again later.
                probes[:] = sorted(set(probes) | {now, now + 0.25, now + 1.0, now + 3.0})

    def _guarded(self, handler: Callable[[], None], frames: list[zmq.Frame]) -> None:
        """Run a message handler; no exception escapes, the sender gets an 'internal' error."""
        try:
            handler()
        except Exception as exc:  # noqa: BLE001 - the server must survive any input
            log.exception("error handling a message")
            if len(frames) >= 2:
                rid = P.salvage_request_id(frames[1].buffer)
                self._send(frames[0].bytes, P.error_reply(rid, SymbiosisError.code, f"{type(exc).__name__}: {exc}"))

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        if len(frames) < 2:
            self._send(identity, P.error_reply(0, ProtocolError.code, "message has no header frame"))
            return
        try:
            msg = P.decode(frames[1].buffer)
        except ProtocolError as exc:
            self._count(_INVALID, "errors")
            self._send(identity, P.error_reply(P.salvage_request_id(frames[1].buffer), exc.code, str(exc)))
            return
        session = self._sessions.get(identity)
        if session is not None:
            session.last_seen = time.monotonic()
        if isinstance(msg, P.Request):
            self._on_request(identity, session, msg, frames[2:])
        elif isinstance(msg, P.Hello):
            self._on_hello(identity, msg)
        elif isinstance(msg, P.Ping):
            self._send(identity, P.Pong())
        elif isinstance(msg, P.Goodbye):
            self._end_session(identity)
        elif isinstance(msg, P.ShmRelease):
            if session is not None and session.segments is not None:
                session.segments.release(msg.names)
        elif not isinstance(msg, P.Pong):
            rid = P.salvage_request_id(frames[1].buffer)
            self._count(_INVALID, "errors")
            self._send(identity, P.error_reply(rid, ProtocolError.code, f"unexpected message {type(msg).__name__}"))

    def _on_hello(self, identity: bytes, hello: P.Hello) -> None:
        rid = hello.request_id
        if self._close_request is not None:
            self._send(identity, P.error_reply(rid, ExecutorUnavailableError.code, "executor is shutting down"))
        elif hello.version != P.PROTOCOL_VERSION:
            msg = f"protocol version {hello.version} not supported (server speaks {P.PROTOCOL_VERSION})"
            self._send(identity, P.error_reply(rid, ProtocolError.code, msg))
        elif hello.expected_fingerprint is not None and hello.expected_fingerprint != self._fingerprint:
            msg = f"client expects checkpoint {hello.expected_fingerprint!r}, executor serves {self._fingerprint!r}"
            self._send(identity, P.error_reply(rid, ModelMismatchError.code, msg))
        else:
            session = self._sessions.get(identity)
            if session is None or session.client_id != hello.client_id:
                self._end_session(identity)
                identities = self._identities_by_client.setdefault(hello.client_id, set())
                if not identities:  # one client may hold several sessions (reconnects): count once
                    self._service.register_client(hello.client_id)
                identities.add(identity)
                session = _Session(identity, hello.client_id, secrets.token_hex(4), time.monotonic())
                self._sessions[identity] = session
            layers = [P.WireLayerSpec.from_spec(s) for s in self._specs.values()]
            welcome = P.Welcome(
                P.PROTOCOL_VERSION, rid, self._fingerprint, layers, self._limits, self._heartbeat_s, session.token, self._allow_shm
            )
            self._send(identity, welcome)

    def _on_request(self, identity: bytes, session: _Session | None, req: P.Request, payload: list[zmq.Frame]) -> None:
        rid = req.request_id
        stats_key = req.layer_id if req.layer_id in self._specs else _INVALID
        try:
            if session is None:
                raise ExecutorUnavailableError("no session for this connection: say Hello first (executor restarted?)")
            if self._close_request is not None:
                raise ExecutorUnavailableError("executor is shutting down")
            if req.client_id != session.client_id:
                raise ProtocolError(f"request names client {req.client_id!r}, session is {session.client_id!r}")
            if (identity, rid) in self._inflight:
                raise ProtocolError(f"request id {rid} is already in flight")
            shm_region = None
            if req.shm_name is None:
                if len(payload) != 1:
                    raise ProtocolError(f"expected 1 payload frame, got {len(payload)}")
                spec = P.validate_request(req, len(payload[0].buffer), self._specs, self._limits)
                rows = P.tensor_from_payload(payload[0].buffer, req.dtype, req.shape)
            else:
                rows, shm_region, spec = self._shm_rows(session, req, payload)
            future = self._service.submit(session.client_id, req.layer_id, Op(req.op), rows, LatencyClass(req.latency_class))
        except SymbiosisError as exc:
            self._count(stats_key, "errors")
            self._send(identity, P.error_reply(rid, exc.code, str(exc)))
            return
        self._count(stats_key, "requests")
        self._count(stats_key, "rows", req.shape[0])
        key = (identity, rid)
        self._inflight[key] = _InFlight(identity, req, spec, future, shm_region)
        future.add_done_callback(lambda _f: self._on_done(key))

    def _shm_rows(self, session: _Session, req: P.Request, payload: list[zmq.Frame]) -> tuple[torch.Tensor, torch.Tensor, LayerSpec]:
        from symbiosis.transport.shm import SegmentMap  # shm.py imports this module

        if not self._allow_shm:
            raise ProtocolError("this executor does not accept shared-memory requests")
        if payload:
            raise ProtocolError("a shared-memory request carries no payload frame")
        well_formed = req.dtype in P.ITEMSIZE and len(req.shape) == 2 and min(req.shape) >= 0
        nbytes = P.declared_nbytes(req.dtype, req.shape) if well_formed else -1
        spec = P.validate_request(req, nbytes, self._specs, self._limits)
        out_nbytes = req.shape[0] * Op(req.op).output_width(spec) * P.ITEMSIZE[req.dtype]
        if session.segments is None:
            session.segments = SegmentMap(P.shm_prefix(session.token))
        region = session.segments.region(req.shm_name, req.shm_offset, max(nbytes, out_nbytes))
        rows = region[:nbytes].view(P.WIRE_DTYPES[req.dtype]).view(req.shape)
        return rows, region, spec

    def _on_done(self, key: tuple[bytes, int]) -> None:
        """Future callback, on whatever thread completed it: hand the reply to the socket thread."""
        self._completions.put(key)
        self._waker.wake()

    def _flush_completions(self) -> None:
        while True:
            try:
                key = self._completions.get_nowait()
            except queue.Empty:
                return
            entry = self._inflight.pop(key, None)
            if entry is not None:  # None: its session ended meanwhile; nobody waits for it
                self._guarded(lambda: self._reply_result(entry), [])

    def _reply_result(self, entry: _InFlight) -> None:
        req = entry.request
        try:
            if entry.future.cancelled():
                raise ExecutorUnavailableError("the executor dropped this request")
            exc = entry.future.exception()
            if exc is not None:
                raise exc
            result = entry.future.result()
            expected = [req.shape[0], Op(req.op).output_width(entry.spec)]
            if not isinstance(result, torch.Tensor) or list(result.shape) != expected:
                raise SymbiosisError(f"executor returned {getattr(result, 'shape', type(result))}, expected {expected}")
            result = result.detach().to(device="cpu", dtype=P.WIRE_DTYPES[req.dtype]).contiguous()
            reply = P.Reply(req.request_id, True, req.dtype, expected)
            if entry.shm_region is None:
                self._send(entry.identity, reply, P.tensor_payload(result))
                return
            if result.numel():
                entry.shm_region[: result.numel() * result.element_size()].copy_(result.reshape(-1).view(torch.uint8))
            self._send(entry.identity, reply)
        except Exception as exc:  # noqa: BLE001 - any executor failure becomes a typed reply
            code = exc.code if isinstance(exc, SymbiosisError) else SymbiosisError.code
            self._count(req.layer_id, "errors")
            self._send(entry.identity, P.error_reply(req.request_id, code, f"{type(exc).__name__}: {exc}"))

    def _send(self, identity: bytes, message: P.Message, payload: memoryview | None = None) -> None:
        frames: list[Any] = [identity, P.encode(message)]
        if payload is not None:
            frames.append(payload)
        copy = payload is None or payload.nbytes < COPY_THRESHOLD
        try:
            self._router.send_multipart(frames, zmq.NOBLOCK, copy=copy)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                self._end_session(identity)  # the peer's connection is gone
            else:
                log.warning("dropping a reply: %s", exc)

    def _end_session(self, identity: bytes) -> None:
        session = self._sessions.pop(identity, None)
        if session is None:
            return
        for key in [k for k in self._inflight if k[0] == identity]:
            del self._inflight[key]
        if session.segments is not None:  # first, so the names are gone once the executor hears of it
            session.segments.close()
        identities = self._identities_by_client.get(session.client_id, set())
        identities.discard(identity)
        if not identities:
            self._identities_by_client.pop(session.client_id, None)
            try:
                self._service.unregister_client(session.client_id)
            except Exception:  # noqa: BLE001
                log.exception("unregister_client(%r) failed", session.client_id)

    def _shutdown(self) -> None:
        for entry in list(self._inflight.values()):
            msg = "executor shut down before the request completed"
            self._send(entry.identity, P.error_reply(entry.request.request_id, ExecutorUnavailableError.code, msg))
        self._inflight.clear()
        for identity in list(self._sessions):
            self._send(identity, P.Goodbye())
            self._end_session(identity)
        self._router.disable_monitor()
        self._monitor.close(0)
        self._router.close()

    def _count(self, layer_id: str, field: str, n: int = 1) -> None:
        with self._stats_lock:
            counts = self._stats.setdefault(layer_id, {"requests": 0, "rows": 0, "errors": 0})
            counts[field] += n


# ---- client ------------------------------------------------------------------------------


class _Connection:
    """One DEALER socket (and its monitor) owned by one I/O thread; replaced whole on reconnect.

    Callers hand frames over through ``submit`` and wait on the returned future, which the I/O
    thread resolves with ``(Welcome | Reply, payload frames)`` when the matching request id comes
    back, or fails with ``ExecutorUnavailableError`` when the connection is lost.
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, heartbeat_s: float) -> None:
        self.heartbeat_s = heartbeat_s
        self.dead: str | None = None
        self._pending: dict[int, Future[tuple[P.Message, list[zmq.Frame]]]] = {}
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue[tuple[list[Any], bool]] = queue.SimpleQueue()
        self._waker = _Waker()
        self._stop = False
        self._goodbye: bytes | None = None
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.connect(endpoint)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._thread = threading.Thread(target=self._run, name=f"ZmqTransport({endpoint})", daemon=True)
        self._thread.start()

    def submit(self, request_id: int, frames: list[Any], copy: bool) -> Future[tuple[P.Message, list[zmq.Frame]]]:
        future: Future[tuple[P.Message, list[zmq.Frame]]] = Future()
        with self._lock:
            if self.dead is not None:
                raise ExecutorUnavailableError(self.dead)
            self._pending[request_id] = future
        self.send(frames, copy)
        return future

    def send(self, frames: list[Any], copy: bool = True) -> None:
        self._outbox.put((frames, copy))
        self._waker.wake()

    def forget(self, request_id: int) -> None:
        with self._lock:
            self._pending.pop(request_id, None)

    def fail(self, reason: str) -> None:
        """Mark the connection lost; every waiting call gets ``ExecutorUnavailableError``."""
        with self._lock:
            self.dead = self.dead or reason
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(ExecutorUnavailableError(reason))

    def close(self, goodbye: bytes | None) -> None:
        self._goodbye = goodbye
        self._stop = True
        self._waker.wake()
        self._thread.join(timeout=5.0)
        self.fail("transport closed")

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # noqa: BLE001 - waiting callers must learn about it
            log.exception("transport I/O thread failed")
            self.fail(f"transport I/O thread failed: {exc}")
        finally:
            if self._goodbye is not None and self.dead is None:
                self._sock.send(self._goodbye)
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._sock.close(linger=500 if self._goodbye is not None else 0)
            self._waker.close()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._waker.fileno(), zmq.POLLIN)
        last_heard = last_ping = time.monotonic()
        while not self._stop:
            events = dict(poller.poll(int(self.heartbeat_s * 1000)))
            now = time.monotonic()
            self._waker.drain()
            while True:
                try:
                    frames, copy = self._outbox.get_nowait()
                except queue.Empty:
                    break
                self._sock.send_multipart(frames, copy=copy)
            if self._sock in events:
                while self._sock.poll(0):
                    last_heard = now
                    self._dispatch(self._sock.recv_multipart(copy=False))
            if self._monitor in events and recv_monitor_message(self._monitor)["event"] == zmq.EVENT_DISCONNECTED:
                self.fail("connection to the executor was lost")
            if now - last_ping >= self.heartbeat_s:
                self._sock.send(P.encode(P.Ping()))
                last_ping = now
            if self._pending and now - last_heard > max(5.0, 5 * self.heartbeat_s):
                self.fail(f"executor silent for {now - last_heard:.1f}s")

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        try:
            msg = P.decode(frames[0].buffer)
        except ProtocolError:
            log.warning("ignoring an undecodable message from the executor")
            return
        if isinstance(msg, (P.Reply, P.Welcome)):
            with self._lock:
                future = self._pending.pop(msg.request_id, None)
            if future is not None and not future.done():
                future.set_result((msg, frames[1:]))
        elif isinstance(msg, P.Goodbye):
            self.fail("the executor shut down")


class ZmqTransport:
    """Client of a ``ZmqServer`` at ``tcp://…`` or ``ipc://…`` (implements ``Transport``).

    Thread-safe: one I/O thread owns the socket, callers wait on per-request futures matched by
    request id. Payloads go in the caller's dtype (the executor casts at its boundary) and results
    come back in it, on the caller's device. When the connection is lost or the executor restarts,
    a call re-handshakes and retries with bounded exponential backoff (tenacity): safe because the
    executor keeps no state between calls. Large CPU payloads are sent zero-copy; ZeroMQ may drop
    its reference to them a moment after ``call`` returns (the bytes were sent before the reply).
    """

    def __init__(
        self,
        address: str,
        *,
        client_id: str | None = None,
        expected_fingerprint: str | None = None,
        timeout_s: float = 60.0,
        connect_timeout_s: float = 10.0,
    ) -> None:
        if not address.startswith(("tcp://", "ipc://")):
            raise ValueError(f"unsupported executor address {address!r}: use tcp://HOST:PORT or ipc:///PATH")
        self.address = address
        self._endpoint = address
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:12]}"
        self.expected_fingerprint = expected_fingerprint
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._ctx = zmq.Context()
        self._request_ids = itertools.count(1)
        self._conn_lock = threading.Lock()
        self._closed = False
        self._welcome: P.Welcome | None = None
        self._specs: dict[str, LayerSpec] = {}
        self._conn: _Connection | None = None
        try:
            self._conn = self._handshake(time.monotonic() + connect_timeout_s)
        except BaseException:
            self._ctx.term()
            raise

    @property
    def fingerprint(self) -> str:
        assert self._welcome is not None
        return self._welcome.fingerprint

    def layer_specs(self) -> Mapping[str, LayerSpec]:
        return dict(self._specs)

    def call(self, layer_id: str, op: Op, rows: torch.Tensor, latency_class: LatencyClass) -> torch.Tensor:
        deadline = time.monotonic() + self.timeout_s
        rows_cpu = rows.detach().to("cpu").contiguous()
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(lambda e: isinstance(e, ExecutorUnavailableError) and not self._closed),
            # A restart window of connect_timeout_s, never past the call's own deadline.
            stop=lambda state: state.attempt_number >= 6
            or (state.seconds_since_start or 0.0) >= self.connect_timeout_s
            or time.monotonic() >= deadline,
            wait=tenacity.wait_exponential(multiplier=0.05, max=1.0),
            reraise=True,
        )
        for attempt in retrying:
            with attempt:
                result = self._call_once(layer_id, Op(op), rows_cpu, LatencyClass(latency_class), deadline)
        return result.to(device=rows.device, dtype=rows.dtype)

    def close(self) -> None:
        with self._conn_lock:
            if self._closed:
                return
            self._closed = True
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close(goodbye=P.encode(P.Goodbye(self.client_id)))
        self._on_close()
        self._ctx.term()

    def __enter__(self) -> "ZmqTransport":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- hooks the shared-memory transport overrides -------------------------------------

    def _encode(self, request: P.Request, rows: torch.Tensor) -> tuple[P.Request, list[Any], Any]:
        """Frames to send for ``request`` and a lease to give back to ``_finish``/``_abandon``."""
        payload = P.tensor_payload(rows)
        return request, [P.encode(request), payload], None

    def _decode(self, reply: P.Reply, frames: list[zmq.Frame], lease: Any) -> torch.Tensor:
        if reply.dtype not in P.WIRE_DTYPES or len(reply.shape) != 2 or len(frames) != 1:
            raise ProtocolError(f"malformed reply: dtype {reply.dtype!r}, shape {reply.shape}, {len(frames)} frames")
        if len(frames[0].buffer) != P.declared_nbytes(reply.dtype, reply.shape):
            raise ProtocolError("reply payload size does not match its shape")
        return P.tensor_from_payload(frames[0].buffer, reply.dtype, reply.shape)

    def _release(self, lease: Any, reusable: bool) -> None:
        """The server is done with ``lease`` (``reusable``) or may still touch it (not)."""

    def _on_session(self, welcome: P.Welcome, conn: _Connection) -> None:
        """A new session started (first connect or reconnect)."""

    def _on_close(self) -> None:
        """The transport closed; free what the hooks hold."""

    # ---- internals -----------------------------------------------------------------------

    def _handshake(self, deadline: float) -> _Connection:
        conn = _Connection(self._ctx, self._endpoint, heartbeat_s=1.0)
        rid = next(self._request_ids)
        hello = P.Hello(P.PROTOCOL_VERSION, self.client_id, rid, self.expected_fingerprint)
        try:
            future = conn.submit(rid, [P.encode(hello)], True)
            try:
                msg, _ = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise ExecutorUnavailableError(f"no executor answered at {self.address}") from None
            if isinstance(msg, P.Reply):
                raise error_from_code(msg.error_code, msg.error_message)
            assert isinstance(msg, P.Welcome)
            expected = self.expected_fingerprint or (self._welcome.fingerprint if self._welcome else None)
            if expected is not None and msg.fingerprint != expected:
                raise ModelMismatchError(f"executor at {self.address} serves {msg.fingerprint!r}, expected {expected!r}")
            conn.heartbeat_s = msg.heartbeat_s
            self._welcome = msg
            self._specs = {w.layer_id: w.to_spec() for w in msg.layers}
            self._on_session(msg, conn)
        except BaseException:
            conn.close(goodbye=None)
            raise
        return conn

    def _live_connection(self, deadline: float) -> _Connection:
        with self._conn_lock:
            if self._closed:
                raise ExecutorUnavailableError("transport is closed")
            if self._conn is not None and self._conn.dead is None:
                return self._conn
            if self._conn is not None:
                self._conn.close(goodbye=None)
                self._conn = None
            self._conn = self._handshake(min(deadline, time.monotonic() + self.connect_timeout_s))
            return self._conn

    def _call_once(self, layer_id: str, op: Op, rows: torch.Tensor, latency_class: LatencyClass, deadline: float) -> torch.Tensor:
        conn = self._live_connection(deadline)
        assert self._welcome is not None
        nbytes = rows.numel() * rows.element_size()
        if nbytes > self._welcome.limits.max_payload_bytes:
            raise ProtocolError(f"{nbytes} bytes exceed the executor's cap of {self._welcome.limits.max_payload_bytes}")
        rid = next(self._request_ids)
        request = P.Request(
            P.PROTOCOL_VERSION, self.client_id, rid, layer_id, op.value, P.dtype_name(rows.dtype), list(rows.shape), latency_class.value
        )
        request, frames, lease = self._encode(request, rows)
        try:
            future = conn.submit(rid, frames, copy=nbytes < COPY_THRESHOLD)
            try:
                reply, payload = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                conn.forget(rid)
                raise ExecutorTimeoutError(f"{op.value} of {layer_id!r} took longer than {self.timeout_s}s") from None
        except BaseException:
            self._release(lease, reusable=False)
            raise
        assert isinstance(reply, P.Reply)
        if not reply.ok:
            self._release(lease, reusable=True)
            error = error_from_code(reply.error_code, reply.error_message)
            if isinstance(error, ExecutorUnavailableError):
                conn.fail(reply.error_message)  # the session is gone or going: re-handshake
            raise error
        try:
            return self._decode(reply, payload, lease)
        finally:
            self._release(lease, reusable=True)


def connect(address: str, **kwargs: Any) -> ZmqTransport:
    """Open the transport for ``address``: ``tcp://``, ``ipc://``, or ``shm+ipc://``/``shm+tcp://``."""
    if address.startswith("shm+"):
        from symbiosis.transport.shm import ShmTransport

        return ShmTransport(address, **kwargs)
    return ZmqTransport(address, **kwargs)
