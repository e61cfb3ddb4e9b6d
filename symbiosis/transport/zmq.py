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
            self._send(identity, P.error_reply(0, ProtocolError.code, f"unexpected message {type(msg).__name__}"))

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
        identities = self._identities_by_client.get(session.client_id, set())
        identities.discard(identity)
        if not identities:
            self._identities_by_client.pop(session.client_id, None)
            try:
                self._service.unregister_client(session.client_id)
            except Exception:  # noqa: BLE001
                log.exception("unregister_client(%r) failed", session.client_id)
        if session.segments is not None:
            session.segments.close()

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
