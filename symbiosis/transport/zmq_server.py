"""``ZmqServer``: serves an ``ExecutorService`` to ZeroMQ clients (``tcp://…``, ``ipc://…``).

One ROUTER socket carries every control message of every client; request payloads travel over a
*payload channel* chosen by the request header (``channels.py``): inline frames, shared memory
(``shm_channel.py``) or a torch.distributed pair group (``dist_channel.py``). One server serves all of them.

Threading: one thread owns the socket. With an executor that can be driven (``BaseExecutor``:
``attach_driver``/``run_ready``/``try_alone``), that thread also runs the products: it reads a
burst of requests, runs every batch that is ready, and answers, so a request meets no thread
hand-off in the server; a lone client's request is computed at once (``try_alone``), into the
channel's reply region when it has one (``Accepted.out``: shared memory). Other threads
(in-process clients that ran a batch holding remote rows, the executor's compute thread, dist
receiver threads) never touch the socket: they ``call_soon`` a task, which queues it and wakes
the socket thread through a ``Waker``.

Dead clients: the ROUTER is ``ROUTER_MANDATORY``, so sending to a peer whose connection is gone
fails with ``EHOSTUNREACH``. A socket monitor reports every disconnect (a ``kill -9``ed process's
connection is closed by its kernel at once); the server then probes every session with a ``Ping``
and ends the ones that fail. Clients also ping every ``heartbeat_s``; a session silent for
``client_timeout_s`` is ended too (hung hosts, lost FINs). Ending a session calls
``unregister_client`` (the executor drops its pending work) and lets every channel free what it
holds for the session (shared-memory mappings, the dist pair group).

Security: with ``curve=CurveServerKeys(...)`` the ROUTER is a CURVE server and a ZAP handler in
the server's context admits only the authorized client keys (``security.py``); every ZeroMQ
frame is then authenticated and encrypted, which is what makes a non-loopback bind acceptable.
Without CURVE, non-loopback binds need ``allow_non_loopback=True``.

Bounds on what one client can make the server hold (issue 10, finding 2), all configurable:

- per session, at most ``max_inflight_requests`` requests and ``max_inflight_bytes`` bytes in
  flight (``protocol.Limits``). Bytes are the rows and results of requests not yet answered
  plus inline results ZeroMQ still holds, unsent (tracked by a weak reference on the frame ZeroMQ
  keeps, dropped once the bytes are out): a client that never reads its replies stops getting
  work done. A request past either bound gets ``ExecutorBusyError`` at once, before its channel
  touches a payload byte; one request alone is always admitted (``max_payload_bytes`` caps it).
- a finite send queue per peer (``send_hwm`` messages). A reply that finds it full waits in the
  session's backlog, in order, and goes out when there is room; a session whose backlog makes no
  progress for ``send_stall_s`` is ended (a peer that stopped reading; vLLM's CVE-2025-30202).
- ZeroMQ refuses any frame larger than the largest legal one (``ZMQ_MAXMSGSIZE``) before reading
  it, and queues at most ``max_inflight_requests`` + a few whole messages per peer before it
  stops reading from it (``ZMQ_RCVHWM``). How many frames one message has cannot be bounded
  before ZeroMQ has received it all; extra frames are refused right after.
- when a session ends or a peer disconnects, everything held for it is dropped, and freed heap
  is handed back to the OS (``malloc_trim``: glibc otherwise keeps large freed results).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import inspect
import ipaddress
import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from symbiosis import __version__ as symbiosis_version
from symbiosis import protocol as P
from symbiosis.errors import (
    BindError,
    ConfigurationError,
    ExecutorBusyError,
    ExecutorUnavailableError,
    ModelMismatchError,
    ProtocolError,
    SymbiosisError,
    UnsafeBindError,
)
from symbiosis.threads import with_torch_threads
from symbiosis.transport.base import ExecutorService
from symbiosis.transport.channels import InlineChannel, PayloadChannel, RequestKey, Session
from symbiosis.transport.lane import HEADER_ROOM_BYTES, ExecutorLane, LaneClosed, RefusedMessage
from symbiosis.transport.lane_listener import LaneListener
from symbiosis.transport.lane_routes import LaneRoutes, Route
from symbiosis.transport.schemes import ipc_path, is_ipv6_tcp, is_loopback_host, split_tcp_address, tcp_host
from symbiosis.transport.security import CurveServerKeys, configure_server_socket, start_authenticator
from symbiosis.transport.socket_paths import check_path_free, claiming, remove_own_socket
from symbiosis.transport.spin import SERVER_SPIN_IF_GAPS_UNDER_S, RecentWaits, spin_window_s, try_for
from symbiosis.transport.waker import Waker
from symbiosis.transport.zmq_context import new_context
from symbiosis.vocabulary import LATENCY_CLASSES_BY_VALUE, OPS_BY_VALUE, LayerSpec

log = logging.getLogger(__name__)
_NOT_LENT: dict[str, bool] = {}  # ``_submit``'s keyword arguments for rows that are its own

_INVALID = "<invalid>"  # stats key for requests that name no known layer
#: Messages queued for one peer before ``send`` finds its queue full (then replies wait in the
#: session's backlog). A client's I/O thread reads everything that arrives, so only a peer that
#: stopped reading gets near it; the bytes it can pin are bounded by ``max_inflight_bytes``.
DEFAULT_SEND_HWM = 64
#: A session whose backlog makes no progress this long is ended: its peer stopped reading.
DEFAULT_SEND_STALL_S = 5.0
#: torch.distributed pair-group set-ups pending at once, server-wide, and how long one may take.
DEFAULT_MAX_PENDING_DIST_SETUPS = 8
DEFAULT_DIST_SETUP_TIMEOUT_S = 10.0
_FRAME_SLACK = 1024  # ZMQ_MAXMSGSIZE headroom over the largest legal frame: CURVE's box overhead
#: Messages read from one lane per wake-up (a well-behaved client has one in flight per lane).
_LANE_BURST = 16


def check_bind_address(address: str, allow_non_loopback: bool, authenticated: bool = False) -> str:
    """Return the address to bind; refuse non-loopback tcp unless the service is ``authenticated``
    (CURVE) or unauthenticated exposure is explicitly allowed."""
    if address.startswith(("ipc://", "inproc://")):
        return address
    if not address.startswith("tcp://"):
        raise ConfigurationError(f"unsupported address {address!r}: use tcp://HOST:PORT or ipc:///PATH")
    host, port = split_tcp_address(address, bind=True)
    if host == "localhost":
        host = "127.0.0.1"
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:  # '*', interface names, host names
        loopback = False
    if not loopback and not allow_non_loopback and not authenticated:
        raise UnsafeBindError(
            f"refusing to bind {address!r}: not a loopback address. Turn on CURVE "
            "(curve=CurveServerKeys(...); `symbiosis serve --curve-secret-key FILE --authorized-clients DIR`) "
            "to serve other hosts authenticated and encrypted, or pass allow_non_loopback=True to serve them "
            "without authentication or encryption."
        )
    return f"tcp://{'[' + host + ']' if ':' in host else host}:{port}"


def _channel_name(req: P.Request) -> str:
    if req.shm_name is not None and req.dist_tag is not None:
        raise ProtocolError("a request names both a shared-memory segment and a dist tag")
    return "shm" if req.shm_name is not None else "dist" if req.dist_tag is not None else "inline"


@dataclass
class _InFlight:
    session: Session
    request: P.Request
    spec: LayerSpec
    channel: PayloadChannel
    ticket: Any
    lane: ExecutorLane | None = None  # where it came from and its reply goes (None: the ZeroMQ socket)
    future: Future[torch.Tensor] | _ReplySink | None = None  # None while the payload is still on its way
    cost: int = 0  # bytes it pins (``_cost``), counted in ``session.inflight_bytes``


class _ReplySink:
    """Where the executor puts a queued request's result (``ResultSink`` in
    ``executor/engine.py``): the reply goes out at once when the socket thread itself ran the
    batch (the usual case: it drives the executor), else from that thread soon. It copies the
    result into the reply as it sends, so the executor may hand it a view of the batch output.
    Used instead of a ``Future`` with a done-callback and a task hop: queued 1-row round trips
    took 15-18 us less (x0.85-0.88, ``benchmarks/roundtrip.py``)."""

    __slots__ = ("_server", "_key", "_done")
    takes_views = True

    def __init__(self, server: ZmqServer, key: RequestKey) -> None:
        self._server, self._key, self._done = server, key, False

    def done(self) -> bool:
        return self._done

    def set_result(self, result: torch.Tensor) -> None:
        self._finish(result, None)

    def set_exception(self, error: BaseException) -> None:
        self._finish(None, error)

    def _finish(self, result: torch.Tensor | None, error: BaseException | None) -> None:
        self._done = True
        server, key = self._server, self._key
        # At once only once the request is on the server's books: a result that comes back inside
        # ``submit`` (an empty request, a relayed one already answered) waits until it is.
        if threading.get_ident() == server._socket_thread_id and key in server._inflight:
            server._finish(key, self, result, error)
        else:
            server.call_soon(lambda: server._finish(key, self, result, error))


def _cost(req: P.Request, spec: LayerSpec | None) -> int:
    """Bytes of executor memory a request pins while in flight: its rows and its result; only the
    result for shared memory (the rows stay in the client's segment). 0 for a header that names
    no layer, op or dtype the executor knows (its channel refuses it)."""
    itemsize, op = P.ITEMSIZE.get(req.dtype), OPS_BY_VALUE.get(req.op)
    if spec is None or itemsize is None or op is None or len(req.shape) != 2 or min(req.shape) < 0:
        return 0
    rows_width = 0 if req.shm_name is not None else req.shape[1]
    return req.shape[0] * (rows_width + op.output_width(spec)) * itemsize


class ZmqServer:
    """Serves ``service`` on a ZeroMQ ROUTER socket from one background thread (see module doc).

    ``allow_shm`` / ``allow_dist`` enable those payload channels; ``dist_host`` is the address the
    dist channel listens on (default: the tcp bind host, or loopback for ipc) and ``dist_device``
    where it receives payloads (``cuda:N`` for NCCL clients).

    ``curve``: authenticate and encrypt every client (see module doc). gloo/NCCL payloads are not
    encrypted, so with CURVE the dist channel stays on loopback (same-host clients) unless
    ``allow_non_loopback=True`` accepts plaintext payloads on the network.

    Shared memory is offered on ``ipc://`` binds only (``shm_broker``). Bounds (see module doc):
    ``max_inflight_requests`` / ``max_inflight_bytes`` per session, ``send_hwm`` messages queued
    per peer, ``send_stall_s`` before a peer that stopped reading loses its session;
    ``max_pending_dist_setups`` dist pair groups being set up at once (server-wide, one per
    session), each given ``dist_setup_timeout_s``. ``routes``: where a client may send some layers'
    requests directly (a sharded executor's other ranks, ``symbiosis/sharding``).
    """

    def __init__(
        self,
        service: ExecutorService,
        address: str,
        *,
        max_payload_bytes: int = P.DEFAULT_MAX_PAYLOAD_BYTES,
        allow_non_loopback: bool = False,
        allow_shm: bool = True,
        allow_dist: bool = True,
        dist_host: str | None = None,
        dist_device: str | torch.device = "cpu",
        heartbeat_s: float = 1.0,
        client_timeout_s: float = 15.0,
        drain_timeout_s: float = 30.0,
        curve: CurveServerKeys | None = None,
        max_inflight_requests: int = P.DEFAULT_MAX_INFLIGHT_REQUESTS,
        max_inflight_bytes: int = P.DEFAULT_MAX_INFLIGHT_BYTES,
        send_hwm: int = DEFAULT_SEND_HWM,
        send_stall_s: float = DEFAULT_SEND_STALL_S,
        max_pending_dist_setups: int = DEFAULT_MAX_PENDING_DIST_SETUPS,
        dist_setup_timeout_s: float = DEFAULT_DIST_SETUP_TIMEOUT_S,
        routes: list[P.Route] | None = None,
    ) -> None:
        self._service = service
        self._routes = list(routes or [])  # a sharded executor's other ranks, told to clients in Welcome
        self._curve = curve
        self._bind_address = check_bind_address(address, allow_non_loopback, authenticated=curve is not None)
        if curve is not None and allow_dist and not allow_non_loopback:
            if dist_host is not None and not is_loopback_host(dist_host):
                raise UnsafeBindError(
                    f"refusing dist_host={dist_host!r} with CURVE: torch.distributed payloads are not encrypted. "
                    "Pass allow_dist=False, a loopback dist_host, or allow_non_loopback=True to accept plaintext "
                    "payloads."
                )
            if dist_host is None and not is_loopback_host(_dist_host_for(self._bind_address)):
                dist_host = "127.0.0.1"  # same-host dist clients only: their payloads never leave the host
        if min(max_inflight_requests, max_inflight_bytes, send_hwm, max_pending_dist_setups) < 1:
            raise ConfigurationError("the max_inflight_*, send_hwm and max_pending_dist_setups bounds must be >= 1")
        self._limits = P.Limits(
            max_payload_bytes=max_payload_bytes,
            max_inflight_requests=max_inflight_requests,
            max_inflight_bytes=max_inflight_bytes,
        )
        self._send_hwm = send_hwm
        self._send_stall_s = send_stall_s
        self._max_pending_dist_setups = max_pending_dist_setups
        self._dist_setup_timeout_s = dist_setup_timeout_s
        self._allow_shm = allow_shm
        self._allow_dist = allow_dist
        self._dist_host = dist_host
        self._dist_device = torch.device(dist_device)
        self._heartbeat_s = heartbeat_s
        self._client_timeout_s = client_timeout_s
        self._drain_timeout_s = drain_timeout_s
        self._specs: dict[str, LayerSpec] = {}
        self._channels: dict[str, PayloadChannel] = {}
        self._sessions: dict[bytes, Session] = {}
        self._identities_by_client: dict[str, set[bytes]] = {}
        self._inflight: dict[RequestKey, _InFlight] = {}
        self._lanes: dict[int, ExecutorLane] = {}  # by file descriptor
        self._lane_listener: LaneListener | None = None  # tcp lanes (lane_listener.py)
        self._sessions_by_token: dict[str, Session] = {}
        self._lane_buffer: memoryview | None = None  # where every same-host lane message is read (socket thread)
        self._poller: zmq.Poller | None = None
        self._backlogged: set[bytes] = set()  # identities whose session has a backlog
        # When a same-host lane's call was last served (answered, for a lone client), and how long
        # clients have been computing from an answer to their next call (``spin.py``).
        self._lane_served_at = -1e9
        self._lane_gaps = RecentWaits(SERVER_SPIN_IF_GAPS_UNDER_S)
        self._trims: list[float] = []  # when to hand freed heap back to the OS
        self._tasks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stats: dict[str, dict[str, int]] = {}
        self._lane_routes: LaneRoutes | None = None  # validated lane request headers (lane_routes.py)
        self._waker = Waker()
        self._close_request: bool | None = None  # None: running; else drain flag
        self._thread: threading.Thread | None = None
        self._socket_thread_id: int | None = None
        self._driving = False  # the socket thread runs the executor's ready batches (see module doc)
        # Whether the service's ``submit`` takes a ``sink`` (``BaseExecutor``'s does; a test double's may not).
        self._takes_sinks = "sink" in inspect.signature(service.submit).parameters
        # Whether it takes rows that lie in a receive buffer and copies them itself (once, with
        # its cast to its device or dtype: ``ExecutionEngine.submit``); else they are cloned here.
        self._takes_borrowed = "borrowed" in inspect.signature(service.submit).parameters
        self._lend: dict[str, bool] = {"borrowed": True} if self._takes_borrowed else {}  # made once, not per call
        # Whether requests may carry expert_rows (told to clients in the Welcome).
        self._expert_rows = bool(getattr(service, "serves_expert_rows", False))
        self._submitted = False  # requests went to the executor since the last _drive
        self._auth: Any = None  # the ZAP handler (zmq ThreadAuthenticator) while CURVE is on
        self._address = ""
        self._socket_file: tuple[str, int] | None = None  # (path, inode) of the ipc socket file we bound

    @property
    def address(self) -> str:
        """The bound address, with a tcp port 0 resolved to the real port."""
        return self._address

    @property
    def serving(self) -> bool:
        """Whether its socket thread runs (started, not closed, not died)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> ZmqServer:
        """Bind (errors raise here, in the caller's thread) and serve from a background thread."""
        self._specs = self._service.layer_specs()  # not a copy: it resolves sibling group ids
        self._lane_routes = LaneRoutes(self._specs, self._limits, self._stats)
        self._fingerprint = self._service.fingerprint
        # Told to clients in Welcome; services without the attribute (sharded) store full precision.
        self._quantization = getattr(self._service, "quantization", None) or ""
        self._ctx = new_context()
        self._router = self._ctx.socket(zmq.ROUTER)
        try:
            if self._curve is not None:  # the ZAP handler first: a CURVE server without one admits any key
                self._auth = start_authenticator(self._ctx, self._curve)
                configure_server_socket(self._router, self._curve)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._router.setsockopt(zmq.SNDHWM, self._send_hwm)
            self._router.setsockopt(zmq.RCVHWM, self._limits.max_inflight_requests + 16)  # + control messages
            # Per frame (ZeroMQ cannot bound a message's frame count): a header or one payload.
            largest_frame = max(self._limits.max_payload_bytes, P.MAX_HEADER_BYTES)
            self._router.setsockopt(zmq.MAXMSGSIZE, largest_frame + _FRAME_SLACK)
            self._router.setsockopt(zmq.LINGER, 500)
            if is_ipv6_tcp(self._bind_address):
                self._router.setsockopt(zmq.IPV6, 1)
            with claiming(ipc_path(self._bind_address)):  # (no file, no lock: tcp, abstract names)
                check_ipc_path_free(self._bind_address)
                try:
                    self._router.bind(self._bind_address)
                except zmq.ZMQError as exc:
                    raise BindError(f"cannot listen at {self._bind_address}: {exc.strerror}") from None
            self._address = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
            self._socket_file = _socket_file(self._address)
            self._channels = self._make_channels()  # after bind: shared memory lives next to the ipc socket
            self._lane_listener = self._make_lane_listener()
        except BaseException:
            self._router.close(0)
            self._stop_authenticator()
            self._ctx.term()
            raise
        self._monitor = self._router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._thread = threading.Thread(
            target=with_torch_threads(self._run), name=f"ZmqServer({self._address})", daemon=True
        )
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
        self._stop_authenticator()
        self._ctx.term()
        self._waker.close()
        _remove_socket_file(self._socket_file)

    @property
    def curve(self) -> CurveServerKeys | None:
        """The CURVE keys this server authenticates with (None: no authentication)."""
        return self._curve

    def _stop_authenticator(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def stats(self) -> dict[str, dict[str, int]]:
        """Per layer id: requests accepted, rows accepted, error replies (unknown layers: '<invalid>')."""
        while True:  # written by the socket thread only, without a lock: copy until a copy is whole
            try:
                return {layer: dict(counts) for layer, counts in list(self._stats.items())}
            except RuntimeError:  # changed size during the copy
                continue

    def _make_channels(self) -> dict[str, PayloadChannel]:
        channels: dict[str, PayloadChannel] = {"inline": InlineChannel(self, self._specs, self._limits)}
        if self._allow_shm:
            shm = self._make_shm_channel()
            if shm is not None:
                channels["shm"] = shm
        if self._allow_dist:
            from symbiosis.transport.dist_channel import DistChannel

            host = self._dist_host or _dist_host_for(self._bind_address)
            channels["dist"] = DistChannel(
                self,
                self._specs,
                self._limits,
                host,
                self._dist_device,
                self._client_timeout_s,
                setup_timeout_s=self._dist_setup_timeout_s,
                max_pending_setups=self._max_pending_dist_setups,
            )
        return channels

    def _make_lane_listener(self) -> LaneListener | None:
        """tcp lanes next to a tcp bind, unless CURVE encrypts the calls (a lane would not)."""
        if not self._address.startswith("tcp://") or self._curve is not None:
            return None
        try:
            return LaneListener(tcp_host(self._address), self._sessions_by_token.get)
        except OSError as exc:
            log.warning("not offering tcp lanes at %s: %s", self._address, exc)
            return None

    def _make_shm_channel(self) -> PayloadChannel | None:
        """The shared-memory channel, where it can be offered: ipc binds only (see ``shm_broker``)."""
        from symbiosis.transport.shm_broker import broker_path
        from symbiosis.transport.shm_channel import ShmChannel

        path = broker_path(self._address)
        if path is None:
            if self._address.startswith("ipc://"):
                log.warning("no shared memory at %s (abstract name, path too long, or no memfd)", self._address)
            return None
        try:
            return ShmChannel(self, self._specs, self._limits, path)
        except OSError as exc:
            log.warning("not offering shared memory at %s: cannot listen at %s: %s", self._address, path, exc)
            return None

    # ---- ChannelHost: what payload channels call back ------------------------------------

    def call_soon(self, task: Callable[[], None]) -> None:
        """Run ``task`` on the socket thread (thread-safe)."""
        self._tasks.put(task)
        if threading.get_ident() != self._socket_thread_id:  # the socket thread runs its tasks next anyway
            self._waker.wake()

    def send(self, identity: bytes, message: P.Message, payload: memoryview | None = None) -> None:
        frames: list[Any] = [identity, P.encode(message)]
        copy = payload is None or payload.nbytes < P.COPY_THRESHOLD
        session = self._sessions.get(identity)
        if payload is not None:
            if not copy and session is not None:
                payload = session.unsent.track(payload)  # counted until ZeroMQ lets go of it
            frames.append(payload)
        if session is not None and session.backlog:  # after what waits already: replies stay in order
            self._defer(session, message, frames, copy)
        elif not self._send_frames(frames, copy) and session is not None and identity in self._sessions:
            self._defer(session, message, frames, copy)  # its send queue is full

    def _answer(
        self, identity: bytes, lane: ExecutorLane | None, message: P.Message, payload: memoryview | None = None
    ) -> None:
        """Send the answer to a request the way the request came: the ZeroMQ socket, or its lane."""
        if lane is None:
            self.send(identity, message, payload)
        else:
            self._lane_send(lane, message, payload)

    def _lane_send(self, lane: ExecutorLane, message: P.Message, payload: memoryview | None = None) -> None:
        header = P.encode(message)
        if len(header) > HEADER_ROOM_BYTES // 2 and isinstance(message, P.Reply):  # a long error message
            header = P.encode(P.error_reply(message.request_id, message.error_code, message.error_message[:500] + "…"))
        try:
            lane.send(header, payload)
            if lane.sending:  # a long reply: the rest goes as the client reads (``_serve_lanes``)
                assert self._poller is not None
                self._poller.register(lane.fd, zmq.POLLIN | zmq.POLLOUT)
        except BlockingIOError:  # its queue is full: the client sends and never reads
            if self._sessions.get(lane.session.identity) is lane.session:
                log.warning("client %s does not read its lane; ending its session", lane.session.client_id)
                self._end_session(lane.session.identity)
        except OSError:  # the client closed its end (e.g. after a timeout): nobody waits for this
            self._drop_lane(lane)

    def attach_lane(self, lane: ExecutorLane) -> None:
        """(Socket thread.) Serve ``lane`` too, if its session still runs; it replaces an older one."""
        session = lane.session
        if self._sessions.get(session.identity) is not session or self._poller is None:
            lane.close()
            return
        if session.lane is not None:
            self._drop_lane(session.lane)
        if self._lane_buffer is None:
            assert self._lane_routes is not None
            self._lane_buffer = self._lane_routes.receive_buffer  # its slots are views of it (lane_routes.py)
        session.lane = lane
        lane.accept_long = self._accept_long
        self._lanes[lane.fd] = lane
        self._poller.register(lane.fd, zmq.POLLIN)

    def _accept_long(self, header: memoryview, payload_nbytes: int) -> None:
        """Check the head of a long lane message before its payload is received (``lane.py``):
        an inline request this executor would serve, whose payload is what its shape says.
        Raises the typed error the general path would give (the payload is then read and thrown
        away, and the request answered with it), or ``LaneClosed`` where nothing is worth reading
        on: a header that is not an inline request, or more bytes than any request may carry."""
        try:
            req = P.decode(header)
        except ProtocolError as exc:
            raise LaneClosed(f"a long lane message whose header is not one: {exc}") from None
        if not isinstance(req, P.Request) or req.shm_name is not None or req.dist_tag is not None:
            raise LaneClosed("a long lane message must be a request with its rows (inline)")
        if payload_nbytes > self._limits.max_payload_bytes:
            raise LaneClosed(f"a long lane message of {payload_nbytes} bytes, past the cap of any request")
        P.validate_request(req, payload_nbytes, self._specs, self._limits)

    def _drop_lane(self, lane: ExecutorLane) -> None:
        if self._lanes.pop(lane.fd, None) is lane and self._poller is not None:
            self._poller.unregister(lane.fd)
        if lane.session.lane is lane:
            lane.session.lane = None
        lane.close()

    def _read_lane(self, lane: ExecutorLane) -> None:
        """Serve what waits on ``lane`` (a bounded burst, so other clients are not starved)."""
        assert self._lane_buffer is not None
        # A same-host lane holds at most one message (its client waits for each reply before it
        # sends again, and poll reports the lane again if a stray one waits): reading once saves
        # a receive that would only find the lane empty. A tcp lane may hold several, in pieces.
        for _ in range(_LANE_BURST if lane.stream else 1):
            try:
                message = lane.receive(self._lane_buffer)
            except LaneClosed:
                self._drop_lane(lane)
                return
            except ProtocolError as exc:
                self._count(_INVALID, "errors")
                self._lane_send(lane, P.error_reply(0, exc.code, str(exc)))
                continue
            except RefusedMessage as refused:  # a long message, read to its end and thrown away
                self._count(_INVALID, "errors")
                self._lane_send(lane, P.error_reply(refused.request_id, refused.error.code, str(refused.error)))
                continue
            if message is None:
                return
            try:
                self._on_lane_message(lane, *message)
            except Exception as exc:  # the server must survive any input
                log.exception("error handling a lane message")
                rid = P.salvage_request_id(message[0])
                self._lane_send(lane, P.error_reply(rid, SymbiosisError.code, f"{type(exc).__name__}: {exc}"))
            if self._lanes.get(lane.fd) is not lane:
                return  # dropped meanwhile (its session ended)

    def _serve_lanes(self, events: dict[Any, int], now: float) -> None:
        """Serve the lanes (and tcp lane connections still asking) that ``poll`` found readable."""
        listener, poller = self._lane_listener, self._poller
        assert poller is not None
        for key in list(events):
            if type(key) is not int:
                continue
            lane = self._lanes.get(key)
            if lane is not None:
                event = events[key]
                if event & _POLLOUT:
                    self._flush_lane(lane)
                    if event == _POLLOUT:
                        continue
                # How long the client computed since its last reply; the pieces of a long message
                # are no such gaps (they arrive back to back and would make this thread spin).
                if not lane.stream and not lane.receiving:
                    self._lane_gaps.observe(now - self._lane_served_at)
                self._read_lane(lane)
                if not lane.stream and not lane.receiving:
                    self._lane_served_at = time.monotonic()
            elif listener is not None and key == listener.fd:
                for fd in listener.accept(now):
                    poller.register(fd, zmq.POLLIN)
            elif listener is not None and listener.is_pending(key):
                asked = listener.read_ask(key)
                if asked is not None or not listener.is_pending(key):
                    poller.unregister(key)
                if asked is not None:
                    self.attach_lane(asked)

    def _flush_lane(self, lane: ExecutorLane) -> None:
        """Send more of a long reply to a client that reads it; poll only for its requests once
        all of it is out."""
        try:
            done = lane.flush()
        except OSError:  # the client closed its end
            self._drop_lane(lane)
            return
        if done and self._poller is not None:
            self._poller.register(lane.fd, zmq.POLLIN)

    def _on_lane_message(self, lane: ExecutorLane, header: memoryview, payload: memoryview, long: bool) -> None:
        session = lane.session
        try:
            msg = P.decode(header)
        except ProtocolError as exc:
            self._count(_INVALID, "errors")
            self._lane_send(lane, P.error_reply(P.salvage_request_id(header), exc.code, str(exc)))
            return
        session.last_seen = time.monotonic()
        if not isinstance(msg, P.Request):
            self._count(_INVALID, "errors")
            rid = P.salvage_request_id(header)
            self._lane_send(
                lane, P.error_reply(rid, ProtocolError.code, f"a lane carries requests only, not {type(msg).__name__}")
            )
            return
        if long:  # rows in memory of their own, the header checked (``_accept_long``): the general path
            self._on_request(session.identity, session, msg, [payload], lane, owned=True)
            return
        inline = msg.shm_name is None and msg.dist_tag is None  # an inline request always has its payload, maybe empty
        if inline and self._serve_lane_call_now(lane, session, msg, payload, header.nbytes):
            return
        self._on_request(session.identity, session, msg, [payload] if inline or payload.nbytes else [], lane)  # type: ignore[arg-type]

    def _serve_lane_call_now(
        self, lane: ExecutorLane, session: Session, req: P.Request, payload: memoryview, header_nbytes: int
    ) -> bool:
        """The short path of an inline lane call whose header matches a known route
        (``lane_routes.py``): computed and answered here when its client is alone, else queued for
        the executor without checking again what the route vouches for; True when done (answered,
        queued, or refused with its typed error). False (nothing done) when anything needs the
        general path's checks -- which then serves it, or refuses it with the typed error."""
        if self._close_request is not None or req.client_id != session.client_id:
            return False
        if req.expert_rows and not self._expert_rows:
            return False  # (refused on the general path)
        routes = self._lane_routes
        assert routes is not None
        route = routes.route(req)
        key = (session.identity, req.request_id)
        if route is None or (session.inflight and key in self._inflight):
            return False
        slot = routes.slot(route, req, payload, header_nbytes, lane.max_message_bytes - HEADER_ROOM_BYTES, lane)
        if slot is None:
            return False
        rows = slot.rows
        counts = route.counts
        try:
            # Asked whatever the number of sessions: a client that reconnected has two until the
            # old one ends, and is still alone (test_an_executor_error_on_the_fast_path_...).
            if not self._driving:
                result = None
            elif req.expert_rows:  # (only then: a sharded executor's ``try_alone`` takes no expert_rows)
                result = self._service.try_alone(
                    session.client_id,
                    route.layer_id,
                    route.shape.op,
                    rows,
                    route.latency_class,
                    expert_rows=req.expert_rows,
                )
            else:
                result = self._service.try_alone(
                    session.client_id, route.layer_id, route.shape.op, rows, route.latency_class, slot.out
                )
            if result is None:
                self._queue_routed(key, lane, session, req, route, rows)
                return True
        except SymbiosisError as exc:  # typed, as on the general path (busy, a sharded executor's dead rank, ...)
            counts["errors"] += 1
            self._lane_send(lane, P.error_reply(req.request_id, exc.code, str(exc)))
            return True
        n = req.shape[0]
        counts["requests"] += 1
        counts["rows"] += n
        if result is slot.out:  # the product was written into the reply buffer
            self._lane_send(lane, P.Reply(req.request_id, True, route.wire_dtype, slot.reply_shape), slot.out_bytes)
            return True
        if result.dtype is not route.dtype or result.requires_grad:
            result = result.detach().to(dtype=route.dtype)
        reply = P.Reply(req.request_id, True, route.wire_dtype, [n, route.shape.out_width])
        self._lane_send(lane, reply, P.tensor_payload(result))
        return True

    def _queue_routed(
        self, key: RequestKey, lane: ExecutorLane, session: Session, req: P.Request, route: Route, rows: torch.Tensor
    ) -> None:
        """Queue a routed lane call for the executor (its client is not alone): what
        ``_on_request`` does after its checks, which the route already made."""
        if session.inflight or session.unsent.nbytes or session.backlog:  # one alone is always admitted
            self._admit(session, req)
        entry = _InFlight(session, req, self._specs[route.layer_id], self._channels["inline"], None, lane)
        self._submit(key, entry, rows, borrowed=True)  # they lie in the lane buffer, which the next message overwrites
        self._track(key, entry, route.counts)

    def _send_frames(self, frames: list[Any], copy: bool) -> bool:
        """Send one message now; False if the peer's send queue is full (``send_hwm``). A peer
        whose connection is gone loses its session."""
        try:  # frame by frame with int flags: send_multipart's IntFlag arithmetic costs more
            last = len(frames) - 1
            for i, frame in enumerate(frames):
                self._router.send(frame, _NOBLOCK | _SNDMORE if i < last else _NOBLOCK, copy=copy)
        except zmq.Again:  # on the identity frame, before any part is queued (ROUTER_MANDATORY)
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                self._end_session(frames[0])  # the peer's connection is gone
            else:
                log.warning("dropping a reply: %s", exc)
        return True

    def _defer(self, session: Session, message: P.Message, frames: list[Any], copy: bool) -> None:
        """Keep a message for a peer whose send queue is full; heartbeats are not worth keeping.
        A backlog longer than a well-behaved client could cause (it has at most
        ``max_inflight_requests`` replies coming) means a peer that keeps sending and never
        reads: it loses its session at once."""
        if isinstance(message, (P.Ping, P.Pong)):
            return
        if len(session.backlog) >= 2 * self._limits.max_inflight_requests:
            log.warning("client %s sends and never reads its replies; ending its session", session.client_id)
            self._end_session(session.identity)
            return
        if not session.backlog:
            session.stalled_since = time.monotonic()
            self._backlogged.add(session.identity)
        session.backlog.append((frames, copy))

    def _flush_backlogs(self, now: float) -> None:
        """Send what waits for room; end the sessions whose backlog made no progress for
        ``send_stall_s`` (their peer stopped reading)."""
        for identity in list(self._backlogged):
            session = self._sessions.get(identity)
            if session is None:
                self._backlogged.discard(identity)
                continue
            while session.backlog and self._send_frames(*session.backlog[0]):
                if self._sessions.get(identity) is not session:
                    break  # the peer is gone (its session ended, backlog dropped)
                session.backlog.popleft()
                session.stalled_since = now
            if self._sessions.get(identity) is not session or not session.backlog:
                self._backlogged.discard(identity)
            elif now - session.stalled_since > self._send_stall_s:
                log.warning(
                    "client %s has not read its replies for %.1fs (%d waiting); ending its session",
                    session.client_id,
                    now - session.stalled_since,
                    len(session.backlog),
                )
                self._end_session(identity)

    def rows_arrived(self, key: RequestKey, rows: torch.Tensor) -> None:
        entry = self._inflight.get(key)
        if entry is None or entry.future is not None:  # its session ended meanwhile
            return
        try:
            self._submit(key, entry, rows)
        except SymbiosisError as exc:
            self._forget(key)
            self._count(entry.request.layer_id, "errors")
            self._answer(key[0], entry.lane, P.error_reply(entry.request.request_id, exc.code, str(exc)))

    def transfer_failed(self, session: Session, reason: str) -> None:
        if self._sessions.get(session.identity) is not session:
            return  # already ended
        log.warning("payload transfer of client %s failed (%s); ending its session", session.client_id, reason)
        for key, entry in [(k, e) for k, e in self._inflight.items() if k[0] == session.identity]:
            msg = f"payload transfer failed: {reason}"
            self._answer(session.identity, entry.lane, P.error_reply(key[1], ExecutorUnavailableError.code, msg))
        self._end_session(session.identity)

    # ---- socket thread -------------------------------------------------------------------

    def _run(self) -> None:
        self._socket_thread_id = threading.get_ident()
        # (thread-local) Nothing this thread computes records autograd: the executor's products it
        # runs would otherwise each pay a ``no_grad`` around them (``ExecutionEngine._compute``).
        torch.set_grad_enabled(False)
        attach = getattr(self._service, "attach_driver", None)
        if attach is not None:
            attach(self._waker.wake)
            self._driving = True
        try:
            self._serve()
        finally:
            if self._driving:
                self._service.detach_driver(self._waker.wake)
                self._driving = False

    def _serve(self) -> None:
        poller = self._poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        if self._lane_listener is not None:
            poller.register(self._lane_listener.fd, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._waker.fileno(), zmq.POLLIN)
        probes: list[float] = []
        next_idle_check = 0.0
        drain_deadline: float | None = None
        wakeup: float | None = None  # the executor's next scheduled batch, while driving
        while True:
            timeout_ms = 100.0 if wakeup is None else min(100.0, max(0.0, (wakeup - time.monotonic()) * 1e3))
            if self._backlogged:
                timeout_ms = min(timeout_ms, 5.0)  # retry soon: ZeroMQ does not say when a peer's queue drains
            # A same-host lane's client computes between its calls: after serving one, check for
            # the next a while before sleeping (``spin.py``: a sleeping thread wakes slowly).
            spin_s = spin_window_s(self._lane_gaps, time.monotonic() - self._lane_served_at, timeout_ms * 1e-3)
            events = None
            if spin_s > 0:
                events = try_for(lambda: dict(poller.poll(0)) or None, spin_s)
                timeout_ms = max(0.0, timeout_ms - spin_s * 1e3)
            if events is None:
                events = dict(poller.poll(timeout_ms))
            now = time.monotonic()
            if self._waker.fileno() in events:
                self._waker.drain()
            if self._monitor in events:
                self._read_monitor(probes, now)
            woken = self._waker.fileno() in events
            if self._router in events:
                for _ in range(256):  # bounded, so completions and timers are not starved
                    if not self._router.getsockopt(_EVENTS) & _POLLIN:  # cheaper than catching zmq.Again
                        break
                    frames = self._router.recv_multipart(_NOBLOCK, copy=False)
                    self._guarded(lambda f=frames: self._on_message(f), frames)
            if self._lanes or self._lane_listener is not None:
                self._serve_lanes(events, now)
            self._run_tasks()
            if self._driving and (self._submitted or woken or (wakeup is not None and now >= wakeup)):
                self._submitted = False
                wakeup = self._drive()
            if self._backlogged:
                self._flush_backlogs(now)
            if probes and probes[0] <= now:  # a peer disconnected: find which sessions are gone
                probes[:] = [t for t in probes if t > now]
                for identity in list(self._sessions):
                    self.send(identity, P.Ping())
            if now >= next_idle_check:
                next_idle_check = now + 0.5
                for identity, session in list(self._sessions.items()):
                    if now - session.last_seen > self._client_timeout_s:
                        log.warning(
                            "client %s silent for %.1fs; ending its session", session.client_id, now - session.last_seen
                        )
                        self._end_session(identity)
                if self._lane_listener is not None:
                    for fd in self._lane_listener.expire(now):
                        poller.unregister(fd)
                if self._trims and self._trims[0] <= now:
                    self._trims[:] = [t for t in self._trims if t > now]
                    _trim_heap()
            if self._close_request is not None:
                if drain_deadline is None:
                    drain_deadline = now + (self._drain_timeout_s if self._close_request else 0.0)
                if (not self._inflight and not self._backlogged) or now >= drain_deadline:  # replies out too
                    break
        self._shutdown()

    def _drive(self) -> float | None:
        """Run the executor's ready batches here, then send the replies they completed."""
        try:
            wakeup = self._service.run_ready()
        except Exception:  # a failing batch fails its requests, never the server
            log.exception("running ready batches failed")
            wakeup = None
        self._run_tasks()
        return wakeup

    def _run_tasks(self) -> None:
        while not self._tasks.empty():  # only this thread takes tasks: empty() is exact here
            self._guarded(self._tasks.get_nowait(), [])

    def _read_monitor(self, probes: list[float], now: float) -> None:
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                # ZeroMQ may process the pipe's end a moment after the event: probe again later.
                probes[:] = sorted(set(probes) | {now, now + 0.25, now + 1.0, now + 3.0})
                self._schedule_trim(now)  # ZeroMQ drops what it queued for the peer

    def _schedule_trim(self, now: float) -> None:
        """Hand freed heap back to the OS soon (twice: ZeroMQ frees a gone peer's queue a moment
        after its session ends, on its own threads)."""
        self._trims[:] = sorted({*self._trims, now + 0.5, now + 3.0})

    def _guarded(self, handler: Callable[[], None], frames: list[zmq.Frame]) -> None:
        """Run a handler; no exception escapes, the sender (if known) gets an 'internal' error."""
        try:
            handler()
        except Exception as exc:  # the server must survive any input
            log.exception("error handling a message")
            if len(frames) >= 2:
                rid = P.salvage_request_id(frames[1].buffer)
                self.send(frames[0].bytes, P.error_reply(rid, SymbiosisError.code, f"{type(exc).__name__}: {exc}"))

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        if len(frames) < 2:
            self.send(identity, P.error_reply(0, ProtocolError.code, "message has no header frame"))
            return
        try:
            msg = P.decode(frames[1].buffer)
        except ProtocolError as exc:
            self._count(_INVALID, "errors")
            self.send(identity, P.error_reply(P.salvage_request_id(frames[1].buffer), exc.code, str(exc)))
            return
        session = self._sessions.get(identity)
        if session is not None:
            session.last_seen = time.monotonic()
        if isinstance(msg, P.Request):
            self._on_request(identity, session, msg, [frame.buffer for frame in frames[2:]])
        elif isinstance(msg, P.Hello):
            self._on_hello(identity, msg)
        elif isinstance(msg, P.Ping):
            self.send(identity, P.Pong())
        elif isinstance(msg, P.Goodbye):
            self._end_session(identity)
        elif isinstance(msg, P.ShmRelease):
            shm = self._channels.get("shm")
            if session is not None and shm is not None:
                shm.release(session, msg.names)
        elif not isinstance(msg, P.Pong):
            rid = P.salvage_request_id(frames[1].buffer)
            self._count(_INVALID, "errors")
            self.send(identity, P.error_reply(rid, ProtocolError.code, f"unexpected message {type(msg).__name__}"))

    def _on_hello(self, identity: bytes, hello: P.Hello) -> None:
        rid = hello.request_id
        if self._close_request is not None:
            self.send(identity, P.error_reply(rid, ExecutorUnavailableError.code, "executor is shutting down"))
            return
        if hello.version != P.PROTOCOL_VERSION:
            msg = f"protocol version {hello.version} not supported (server speaks {P.PROTOCOL_VERSION})"
            self.send(identity, P.error_reply(rid, ProtocolError.code, msg))
            return
        if hello.expected_fingerprint is not None and hello.expected_fingerprint != self._fingerprint:
            msg = (
                f"client expects checkpoint {hello.expected_fingerprint!r}, executor serves {self._fingerprint!r}: "
                "another checkpoint, or the same one split differently by another Symbiosis version (the "
                f"executor runs {symbiosis_version}; MoE experts are served since 2026-12-07)"
            )
            self.send(identity, P.error_reply(rid, ModelMismatchError.code, msg))
            return
        dist = self._channels.get("dist")
        if hello.dist_backend and dist is None:
            msg = "this executor does not accept torch.distributed clients"
            self.send(identity, P.error_reply(rid, ProtocolError.code, msg))
            return
        session = self._sessions.get(identity)
        shm = self._channels.get("shm")
        if session is None or session.client_id != hello.client_id:
            self._end_session(identity)
            identities = self._identities_by_client.setdefault(hello.client_id, set())
            if not identities:  # one client may hold several sessions (reconnects): count once
                self._service.register_client(hello.client_id)
            identities.add(identity)
            session = Session(identity, hello.client_id, secrets.token_hex(16), time.monotonic())
            self._sessions[identity] = session
            self._sessions_by_token[session.token] = session
            if shm is not None:
                shm.open_session(session)
        store = prefix = ""
        if hello.dist_backend:
            try:
                store, prefix = dist.open(session, hello.dist_backend)  # type: ignore[union-attr]
            except SymbiosisError as exc:
                self.send(identity, P.error_reply(rid, exc.code, str(exc)))
                return
        layers = [P.WireLayerSpec.from_spec(s) for s in self._specs.values()]
        welcome = P.Welcome(
            P.PROTOCOL_VERSION,
            rid,
            self._fingerprint,
            layers,
            self._limits,
            self._heartbeat_s,
            session.token,
            shm is not None,
            shm_socket=shm.broker.path if shm is not None else "",
            dist_store=store,
            dist_prefix=prefix,
            quantization=self._quantization,
            routes=self._routes,
            lane_port=self._lane_listener.port if self._lane_listener is not None else 0,
            latency_rows=getattr(self._service, "latency_rows", None) or 0,
            expert_rows=self._expert_rows,
        )
        self.send(identity, welcome)

    def _on_request(
        self,
        identity: bytes,
        session: Session | None,
        req: P.Request,
        payload: list[memoryview],
        lane: ExecutorLane | None = None,
        owned: bool = False,
    ) -> None:
        """Serve one request header (and its payload buffers) from the ZeroMQ socket or ``lane``
        (``owned``: a lane payload with memory of its own, a long message's, not the lane buffer's)."""
        rid = req.request_id
        key = (identity, rid)
        stats_key = req.layer_id if req.layer_id in self._specs else _INVALID
        try:
            if session is None:
                raise ExecutorUnavailableError("no session for this connection: say Hello first (executor restarted?)")
            if self._close_request is not None:
                raise ExecutorUnavailableError("executor is shutting down")
            if req.client_id != session.client_id:
                raise ProtocolError(f"request names client {req.client_id!r}, session is {session.client_id!r}")
            if key in self._inflight:
                raise ProtocolError(f"request id {rid} is already in flight")
            name = _channel_name(req)
            channel = self._channels.get(name)
            if channel is None:
                kind = {"shm": "shared-memory (offered on ipc:// binds only)", "dist": "torch.distributed"}[name]
                raise ProtocolError(f"this executor does not accept {kind} requests")
            if req.expert_rows and not self._expert_rows:
                raise ProtocolError("this executor does not take requests with expert_rows (its Welcome says so)")
            if session.inflight or session.unsent.nbytes or session.backlog:  # one alone is always admitted
                self._admit(session, req)  # before the channel touches a payload byte
            accepted = channel.accept(session, key, req, payload)
            entry = _InFlight(session, req, accepted.spec, channel, accepted.ticket, lane)
            rows = accepted.rows
            if rows is not None and self._try_alone(key, entry, rows, stats_key, accepted.out):
                return
            if rows is not None:
                # Inline rows from a lane lie in the lane buffer, which the next lane message overwrites.
                self._submit(key, entry, rows, borrowed=lane is not None and name == "inline" and not owned)
        except SymbiosisError as exc:
            self._count(stats_key, "errors")
            self._answer(identity, lane, P.error_reply(rid, exc.code, str(exc)))
            return
        self._track(key, entry, self._counts(stats_key))

    def _track(self, key: RequestKey, entry: _InFlight, counts: dict[str, int]) -> None:
        """Book a request handed to the executor: in flight, on its session's account, counted."""
        entry.cost = _cost(entry.request, entry.spec)
        session = entry.session
        session.inflight += 1
        session.inflight_bytes += entry.cost
        self._inflight[key] = entry
        counts["requests"] += 1
        counts["rows"] += entry.request.shape[0]

    def _admit(self, session: Session, req: P.Request) -> None:
        """Refuse ``req`` (``ExecutorBusyError``) if it would take ``session`` past its bounds."""
        limits = self._limits
        waiting = session.inflight + len(session.backlog)
        if waiting >= limits.max_inflight_requests:
            raise ExecutorBusyError(
                f"executor busy: this client has {waiting} requests in flight or unread, the most one client may "
                f"have (max_inflight_requests={limits.max_inflight_requests}); wait for replies before sending more"
            )
        held = session.inflight_bytes + session.unsent.held()
        cost = _cost(req, self._specs.get(req.layer_id))
        if held + cost > limits.max_inflight_bytes:
            raise ExecutorBusyError(
                f"executor busy: this client's requests in flight and unread results hold {held} bytes; {cost} more "
                f"would pass max_inflight_bytes={limits.max_inflight_bytes}; wait for replies before sending more"
            )

    def _try_alone(
        self, key: RequestKey, entry: _InFlight, rows: torch.Tensor, stats_key: str, out: torch.Tensor | None
    ) -> bool:
        """Serve a request of the executor's only client at once, here (no queue, no future):
        True if done and answered. The channel validated the header against the same registry
        (``protocol.validate_request``), so it is not validated twice. ``out`` is the channel's
        reply region (``Accepted.out``) when it has one: the executor may compute into it, and
        then the reply copies nothing."""
        if not self._driving or rows.shape[0] == 0:
            return False
        req = entry.request
        op, latency_class = OPS_BY_VALUE[req.op], LATENCY_CLASSES_BY_VALUE[req.latency_class]  # validated
        if req.expert_rows:  # (only then: a sharded executor's ``try_alone`` takes no expert_rows)
            result = self._service.try_alone(
                entry.session.client_id, req.layer_id, op, rows, latency_class, expert_rows=req.expert_rows
            )
        else:
            result = self._service.try_alone(entry.session.client_id, req.layer_id, op, rows, latency_class, out=out)
        if result is None:
            return False
        self._count(stats_key, "requests")
        self._count(stats_key, "rows", req.shape[0])
        self._reply(key, entry, result)
        return True

    def _submit(self, key: RequestKey, entry: _InFlight, rows: torch.Tensor, borrowed: bool = False) -> None:
        """Hand ``rows`` to the executor; a synchronous refusal raises (the caller replies).
        ``borrowed``: they lie in a buffer this thread reuses (see ``_takes_borrowed``)."""
        req = entry.request
        lent = self._lend if borrowed else _NOT_LENT
        if req.expert_rows:
            lent = {**lent, "expert_rows": req.expert_rows}
        if borrowed and not self._takes_borrowed:
            rows = rows.clone()
        client_id, op, latency_class = (
            entry.session.client_id,
            OPS_BY_VALUE[req.op],
            LATENCY_CLASSES_BY_VALUE[req.latency_class],
        )
        if self._takes_sinks:  # the result comes straight back to a reply (``_ReplySink``), no future
            if self._driving:  # this thread runs it after the burst: wake no one
                self._submitted = True
            sink = _ReplySink(self, key)
            entry.future = sink
            self._service.submit(
                client_id, req.layer_id, op, rows, latency_class, wake=not self._driving, sink=sink, **lent
            )  # type: ignore[call-arg]
            return
        if self._driving:
            self._submitted = True
            future = self._service.submit(client_id, req.layer_id, op, rows, latency_class, wake=False, **lent)  # type: ignore[call-arg]
        else:
            future = self._service.submit(client_id, req.layer_id, op, rows, latency_class, **lent)  # type: ignore[call-arg]
        entry.future = future
        future.add_done_callback(lambda done: self.call_soon(lambda: self._complete(key, done)))

    def _forget(self, key: RequestKey) -> _InFlight | None:
        """Take an in-flight request off the books (its session's account too)."""
        entry = self._inflight.pop(key, None)
        if entry is not None:
            entry.session.inflight -= 1
            entry.session.inflight_bytes -= entry.cost
        return entry

    def _complete(self, key: RequestKey, future: Future) -> None:
        """A future completed: reply (on the socket thread)."""
        if future.cancelled():
            self._finish(key, future, None, ExecutorUnavailableError("the executor dropped this request"))
        else:
            error = future.exception()
            self._finish(key, future, None if error is not None else future.result(), error)

    def _finish(
        self, key: RequestKey, source: object, result: torch.Tensor | None, error: BaseException | None
    ) -> None:
        """The result or failure of the request ``source`` (its future or sink) is in: reply (on the
        socket thread, which may be inside the executor's ``run_ready``: nothing may escape to it)."""
        entry = self._inflight.get(key)
        if entry is None or entry.future is not source:  # its session ended meanwhile; nobody waits for it
            return
        self._forget(key)
        try:
            if error is None:
                self._reply(key, entry, result)
            else:
                self._reply_error(key, entry, error)
        except Exception:  # the server must survive anything
            log.exception("replying to request %s failed", key[1])

    def _reply(self, key: RequestKey, entry: _InFlight, result: Any) -> None:
        """Send a computed result (on the socket thread); a malformed one becomes an error reply."""
        req = entry.request
        try:
            expected = [req.shape[0], OPS_BY_VALUE[req.op].output_width(entry.spec)]
            if not isinstance(result, torch.Tensor) or list(result.shape) != expected:
                raise SymbiosisError(f"executor returned {getattr(result, 'shape', type(result))}, expected {expected}")
            wire_dtype = P.WIRE_DTYPES[req.dtype]
            if result.dtype != wire_dtype or result.requires_grad:
                result = result.detach().to(dtype=wire_dtype)
            payload = entry.channel.reply(entry.session, req, result, entry.ticket)
            self._answer(key[0], entry.lane, P.Reply(req.request_id, True, req.dtype, expected), payload)
        except Exception as exc:  # noqa: BLE001 - any executor failure becomes a typed reply
            self._reply_error(key, entry, exc)

    def _reply_error(self, key: RequestKey, entry: _InFlight, exc: BaseException) -> None:
        code = exc.code if isinstance(exc, SymbiosisError) else SymbiosisError.code
        self._count(entry.request.layer_id, "errors")
        self._answer(key[0], entry.lane, P.error_reply(entry.request.request_id, code, f"{type(exc).__name__}: {exc}"))

    def _end_session(self, identity: bytes) -> None:
        session = self._sessions.pop(identity, None)
        if session is None:
            return
        self._sessions_by_token.pop(session.token, None)
        for key in [k for k in self._inflight if k[0] == identity]:
            self._forget(key)
        session.backlog.clear()  # the results it holds go now
        self._backlogged.discard(identity)
        # The channels first: shm names are gone once the executor hears, and the segment broker
        # (its own thread) forgets the session's token before its lane closes -- else a client that
        # saw its lane close could ask at once and be handed a new one for an ended session.
        for channel in self._channels.values():
            channel.end_session(session)
        if session.lane is not None:
            self._drop_lane(session.lane)
        self._schedule_trim(time.monotonic())
        identities = self._identities_by_client.get(session.client_id, set())
        identities.discard(identity)
        if not identities:
            self._identities_by_client.pop(session.client_id, None)
            try:
                self._service.unregister_client(session.client_id)
            except Exception:
                log.exception("unregister_client(%r) failed", session.client_id)

    def _shutdown(self) -> None:
        for key, entry in list(self._inflight.items()):
            msg = "executor shut down before the request completed"
            self._answer(
                key[0], entry.lane, P.error_reply(entry.request.request_id, ExecutorUnavailableError.code, msg)
            )
            self._forget(key)
        for identity in list(self._sessions):
            self.send(identity, P.Goodbye())
            self._end_session(identity)
        for channel in self._channels.values():
            channel.close()
        if self._lane_listener is not None:
            self._lane_listener.close()
        self._router.disable_monitor()
        self._monitor.close(0)
        self._router.close()

    def _count(self, layer_id: str, field: str, n: int = 1) -> None:
        self._counts(layer_id)[field] += n

    def _counts(self, layer_id: str) -> dict[str, int]:
        """The per-layer stats entry of ``layer_id`` (requests, rows, errors), made on first use."""
        counts = self._stats.get(layer_id)
        if counts is None:
            counts = self._stats[layer_id] = {"requests": 0, "rows": 0, "errors": 0}
        return counts


_EVENTS = int(zmq.EVENTS)  # plain ints: pyzmq's IntFlag arithmetic costs microseconds per message
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)


def _find_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _find_malloc_trim()


def _trim_heap() -> None:
    """Give freed heap back to the OS. glibc raises its mmap threshold after large blocks are
    freed, so later large results come from the heap and stay there once freed: a client that
    queued 660 MB of results left the executor 660 MB larger after it was gone (issue 10)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def check_ipc_path_free(address: str) -> None:
    """Refuse to bind ``ipc:///PATH`` where a server already listens, or where a file that is not
    a socket lies: libzmq unlinks whatever is at the path and binds anew, so a second executor
    took a live one's address without a word (the first kept running, unreachable there, and lost
    its socket file when the second exited), and a file given by mistake was deleted. A socket
    file nobody listens at (a crashed server's) is replaced, as before (``socket_paths``)."""
    path = ipc_path(address)
    if path is not None:
        check_path_free(path, shown_as=address)


def check_tcp_port_free(address: str, shown_as: str | None = None) -> None:
    """Refuse a ``tcp://HOST:PORT`` whose port another program listens on, before anything loads:
    the bind itself comes after the model is read and its products timed (minutes for a large
    model). Only a port in use is refused here; any other trouble (a host that is not this
    machine's) is left to the bind, which says it. A port taken between the two still fails at the
    bind, as before. Port 0 and ``*`` (any free port) and other schemes pass. ``shown_as``: how
    the error names it (a flag), if not by the address."""
    if not address.startswith("tcp://"):
        return
    host, port = split_tcp_address(address, bind=True)
    if port in ("0", "*"):
        return
    host = "" if host == "*" else "127.0.0.1" if host == "localhost" else host
    # Bound, never listening: two such probes at once (the ranks of a sharded executor, each
    # checking --bind) do not refuse each other; a listener there still refuses the bind.
    probe = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq binds: a port in TIME_WAIT is free
        probe.bind((host, int(port)))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            where = shown_as or address
            raise BindError(f"cannot listen at {where}: {exc.strerror} (another program listens there)") from None
    finally:
        probe.close()


def _socket_file(address: str) -> tuple[str, int] | None:
    """(path, inode) of the socket file a bind at ``address`` made; None for tcp and abstract names."""
    path = ipc_path(address)
    if path is None:
        return None
    try:
        return path, os.lstat(path).st_ino
    except OSError:
        return None


def _remove_socket_file(socket_file: tuple[str, int] | None) -> None:
    """Remove the ipc socket file a closed server bound: libzmq 4.3 leaves it behind (it removes
    only the files of wildcard binds), so every clean shutdown left a dead socket file (the soak
    test, issue 10). Only our own file: another executor may have bound the path since."""
    if socket_file is not None:
        remove_own_socket(*socket_file)


def _dist_host_for(bind_address: str) -> str:
    """The address the dist channel listens on: the tcp bind host when concrete, else loopback."""
    if bind_address.startswith("tcp://"):
        host = tcp_host(bind_address)
        try:
            if not ipaddress.ip_address(host).is_unspecified:
                return host
        except ValueError:
            pass
    return "127.0.0.1"
