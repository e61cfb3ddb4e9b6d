"""ZeroMQ client: ``ZmqTransport`` (implements ``Transport``).

Addresses: ``tcp://127.0.0.1:7000`` and ``ipc:///path/executor.sock``. ``schemes.open_transport()`` also accepts
``shm+ipc://…`` (same host: payloads in shared memory, see ``shm_client.py``) and
``dist+ipc://…`` / ``dist+tcp://…`` (payloads over torch.distributed, see ``dist_client.py``); one
``ZmqServer`` serves all of them. Those transports subclass ``ZmqTransport`` through its hooks.

Threading: a call sends and receives in the calling thread (no hand-off); a lock keeps the ZeroMQ
socket to one thread at a time, and among several waiting threads one reads replies for all
(see ``_Connection``). A small background thread heartbeats and watches the connection.

Lanes (``lane.py``): an ``ipc://`` (or ``shm+ipc://``) client asks the executor for a lane when a
session starts, a private Unix socket that skips ZeroMQ's I/O threads (over ``tcp://`` without
CURVE: a second tcp connection). A call goes over it when no other thread of this client is using
it, whatever its size (rows or results longer than one lane message go as long messages); every
other call, and all the rest (handshake, heartbeats), goes over ZeroMQ. ``lane=False`` turns it off.

Security: ``curve=CurveClientKeys(...)`` (or the ``SYMBIOSIS_CURVE_SERVER_KEY`` /
``SYMBIOSIS_CURVE_CLIENT_KEY`` environment variables, read by ``connect``) makes the socket a
CURVE client (``security.py``). A failed handshake (no CURVE against a CURVE server, a key the
server does not authorize, a wrong server key) is reported by the socket monitor and fails the
connection at once with ``ExecutorUnavailableError`` naming the cause, instead of a silent wait.

Failures name the executor's address and what is known: while connecting (no ``Welcome`` yet) the
handshake waits out ``connect_timeout_s`` and says "no executor answered at ADDR within Ns"; once a
session is established, the executor saying Goodbye, falling silent (no reply or heartbeat for
``max(5, 5 * heartbeat_s)`` seconds while a call waits) or dropping the connection ends it, and a
call that then cannot reconnect within ``connect_timeout_s`` raises ``ExecutorLostError`` naming
that cause.
"""

from __future__ import annotations

import itertools
import logging
import select
import socket
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import tenacity
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from symbiosis import protocol as P
from symbiosis.errors import (
    ConfigurationError,
    ExecutorLostError,
    ExecutorTimeoutError,
    ExecutorUnavailableError,
    ModelMismatchError,
    ProtocolError,
    SymbiosisError,
    error_from_code,
)
from symbiosis.transport.lane import ClientLane, connect_tcp
from symbiosis.transport.schemes import is_ipv6_tcp, tcp_host
from symbiosis.transport.security import HANDSHAKE_EVENTS, CurveClientKeys, configure_client_socket, handshake_failure
from symbiosis.transport.waker import Waker
from symbiosis.transport.zmq_context import new_context
from symbiosis.vocabulary import OPS_BY_VALUE, LatencyClass, LayerSpec, Op, spec_of

log = logging.getLogger(__name__)

_NO_ANSWER = "no executor answered at"  # how a handshake that timed out starts its message
_LANE_CAUSE_WAIT_S = 0.25  # how long a failed lane call waits for the ZeroMQ socket to say why
_SILENT_MIN_S = 5.0  # a session is silent after max(this, 5 heartbeats) without a word while a call waits


_EVENTS = int(zmq.EVENTS)  # plain ints: pyzmq's IntFlag arithmetic costs microseconds per call
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)


class _Reply:
    """Where one request's reply lands: set once, by whichever thread reads it (``_dispatch``) or
    fails the connection (``fail``). Lighter than a ``concurrent.futures.Future``: waiting is done
    by ``_Connection.wait``, not by the slot."""

    __slots__ = ("error", "frames", "message")

    def __init__(self) -> None:
        self.message: P.Message | None = None
        self.frames: list[zmq.Frame] = []
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self.message is not None or self.error is not None

    def result(self) -> tuple[P.Message, list[zmq.Frame]]:
        if self.error is not None:
            raise self.error
        assert self.message is not None
        return self.message, self.frames


class _Connection:
    """One DEALER socket (and its monitor); replaced whole on reconnect.

    Calls go from the caller's thread to the socket and back with no thread hand-off (vLLM's
    ``SyncMPClient`` idea, made safe for many calling threads):

    - ``submit`` sends from the calling thread, under ``_sock_lock`` (a ZeroMQ socket must never
      be used by two threads at once).
    - ``wait`` receives in the calling thread: one waiting thread at a time is the *leader*; it
      blocks on the socket's file descriptor and dispatches every reply that arrives to its
      future; the others wait on ``_cv`` until their future is done or the leadership is free.
    - ``ZMQ_FD`` is edge-triggered, so whoever holds ``_sock_lock`` reads every message already
      queued (``_drain``) before releasing it; whoever completes a future that another thread
      may be sleeping on wakes it (``_cv`` for followers, ``_leader_waker`` for the leader).

    A small background thread only heartbeats (a ``Ping`` every ``heartbeat_s``, reading what
    came meanwhile), watches the socket monitor (disconnects, CURVE handshake failures) and fails
    waiting calls when the executor falls silent.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        heartbeat_s: float,
        curve: CurveClientKeys | None = None,
        address: str | None = None,
    ) -> None:
        """``address``: the executor's address as errors name it (default: ``endpoint``)."""
        self.heartbeat_s = heartbeat_s
        self._endpoint = endpoint
        self._address = address or endpoint
        # False until the handshake got a Welcome: the "silent" watchdog applies to a session only;
        # a handshake waits for as long as its caller allows (``connect_timeout_s``).
        self.established = False
        # What the monitor saw, for a handshake that times out: a peer accepted the connection
        # (``accepted``), and completed the ZeroMQ handshake (``zmtp_ok``).
        self.accepted = False
        self.zmtp_ok = False
        self._curve_on = curve is not None
        self.dead: str | None = None
        self._pending: dict[int, _Reply] = {}
        self._lock = threading.Lock()  # guards _pending and dead
        self._sock_lock = threading.Lock()
        self._cv = threading.Condition()  # followers wait here; guards _leader
        self._leader: int | None = None  # thread id of the waiting thread that reads the socket
        self._leader_waker = Waker()
        self._io_waker = Waker()
        self._last_heard = time.monotonic()
        self._stop = False
        self._goodbye: bytes | None = None
        self.lane: ClientLane | None = None  # this session's lane, if the executor gave one
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        # The monitor listens before ``connect``: libzmq reports a CURVE mechanism mismatch once and
        # does not reconnect, so an event sent before the monitor's PAIR is attached is lost for
        # good and the call would wait the executor out as "silent" (a client thread that loses
        # the core right after connecting, on a loaded host).
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_EVENTS
        )
        try:
            if curve is not None:
                configure_client_socket(self._sock, curve)
            if is_ipv6_tcp(endpoint):
                self._sock.setsockopt(zmq.IPV6, 1)
            self._sock.connect(endpoint)
        except BaseException:
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._sock.close(linger=0)  # a socket left open makes the transport's Context.term() hang
            raise
        self._fd = self._sock.getsockopt(zmq.FD)
        self._leader_waker_fd = self._leader_waker.fileno()
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLIN)
        self._poll.register(self._leader_waker_fd, select.POLLIN)
        self._thread = threading.Thread(target=self._run, name=f"ZmqTransport({endpoint})", daemon=True)
        self._thread.start()

    def submit(self, request_id: int, frames: list[Any], copy: bool) -> _Reply:
        future = _Reply()
        with self._lock:
            if self.dead is not None:
                raise ExecutorUnavailableError(self.dead)
            self._pending[request_id] = future
        self.send(frames, copy)
        return future

    def send(self, frames: list[Any], copy: bool = True) -> None:
        with self._sock_lock:
            self._send(frames, copy)
            completed = self._drain()
        if completed:
            self._wake_waiters()

    def wait(self, future: _Reply, timeout_s: float) -> tuple[P.Message, list[zmq.Frame]]:
        """The reply ``future`` resolves to, read in this thread (see class doc); ``TimeoutError``."""
        deadline = time.monotonic() + timeout_s
        me = threading.get_ident()
        while not future.done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            with self._cv:
                if future.done():
                    break
                if self._leader is not None:
                    self._cv.wait(remaining)
                    continue
                self._leader = me
            try:
                self._lead(future, deadline)
            finally:
                with self._cv:
                    self._leader = None
                    self._cv.notify_all()  # a follower takes over
        return future.result()

    def _lead(self, future: _Reply, deadline: float) -> None:
        poll = self._poll  # one leader at a time uses it
        while True:
            with self._sock_lock:
                completed = self._drain()
            if completed > 1 or (completed and not future.done()):
                self._wake_waiters()
            if future.done():
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            for fd, _ in poll.poll(min(remaining, self.heartbeat_s) * 1000):
                if fd == self._leader_waker_fd:
                    self._leader_waker.drain()

    def forget(self, request_id: int) -> None:
        with self._lock:
            self._pending.pop(request_id, None)

    def fail(self, reason: str) -> None:
        """Mark the connection lost; every waiting call gets ``ExecutorUnavailableError``."""
        with self._lock:
            self.dead = self.dead or reason
            pending, self._pending = self._pending, {}
        if self.lane is not None:
            self.lane.close()  # a call on it gets an error at once
        for future in pending.values():
            if not future.done():
                future.error = ExecutorUnavailableError(reason)
        self._wake_waiters()

    def lane_failed(self, exc: ExecutorUnavailableError) -> ExecutorUnavailableError:
        """The executor closed this session's lane: fail the connection, with the cause its ZeroMQ
        socket gives a moment later (a Goodbye, a disconnect) when it gives one; the error to raise."""
        deadline = time.monotonic() + _LANE_CAUSE_WAIT_S
        while self.dead is None and time.monotonic() < deadline:
            with self._sock_lock:
                completed = self._drain()  # a Goodbye fails the connection with its own reason
            if completed:
                self._wake_waiters()
            if self.dead is None:
                time.sleep(0.005)  # the heartbeat thread reads a disconnect from the monitor meanwhile
        self.fail(f"the connection to the executor at {self._address} was lost ({exc})")
        return ExecutorUnavailableError(self.dead)

    def close(self, goodbye: bytes | None) -> None:
        self._goodbye = goodbye
        self._stop = True
        self._io_waker.wake()
        self._thread.join(timeout=5.0)
        self.fail("transport closed")
        if self.lane is not None:
            with self.lane.lock:  # a call still on it has returned (``fail`` closed it): free it
                self.lane.release()

    def _wake_waiters(self) -> None:
        """Futures were completed: wake the followers and a leader sleeping on the socket."""
        with self._cv:
            self._cv.notify_all()
            leader = self._leader
        if leader is not None and leader != threading.get_ident():
            self._leader_waker.wake()

    # ---- with _sock_lock held ----------------------------------------------------------------

    def _send(self, frames: list[Any], copy: bool) -> None:
        # Never block: a DEALER blocks when it has no pipe, which is the case for good once a
        # handshake failed on a protocol error (libzmq does not reconnect then). SNDHWM is 0,
        # so EAGAIN means exactly that.
        try:
            self._sock.send_multipart(frames, _NOBLOCK, copy=copy)
        except zmq.Again:
            # The heartbeat thread alone reads the monitor; give it a moment to report the
            # handshake failure, if that is why, so the error names the cause.
            if threading.current_thread() is self._thread:
                self._read_monitor(holding_sock_lock=True)
            else:
                self._io_waker.wake()
                deadline = time.monotonic() + 0.25
                while self.dead is None and time.monotonic() < deadline:
                    time.sleep(0.005)
            self.fail(self._lost())

    def _drain(self) -> int:
        """Read and dispatch every message queued on the socket; how many futures it completed."""
        completed = 0
        if self._sock.closed:
            return 0
        while self._sock.getsockopt(_EVENTS) & _POLLIN:
            try:
                frames = self._sock.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._last_heard = time.monotonic()
            completed += self._dispatch(frames)
        return completed

    def _dispatch(self, frames: list[zmq.Frame]) -> int:
        try:
            msg = P.decode(frames[0].buffer)
        except ProtocolError:
            log.warning("ignoring an undecodable message from the executor")
            return 0
        if isinstance(msg, (P.Reply, P.Welcome)):
            with self._lock:
                future = self._pending.pop(msg.request_id, None)
            if future is not None and not future.done():
                future.frames = frames[1:]
                future.message = msg  # last: a thread polling ``done()`` sees frames already set
                return 1
        elif isinstance(msg, P.Goodbye):
            self.fail(f"the executor at {self._address} shut down (it said goodbye)")
        return 0

    def _lost(self) -> str:
        return f"the connection to the executor at {self._address} was lost"

    # ---- the heartbeat thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # noqa: BLE001 - waiting callers must learn about it
            log.exception("transport heartbeat thread failed")
            self.fail(f"transport heartbeat thread failed: {exc}")
        finally:
            with self._sock_lock:
                if self._goodbye is not None and self.dead is None:
                    self._send([self._goodbye], True)
                self._sock.disable_monitor()
                self._monitor.close(0)
                self._sock.close(linger=500 if self._goodbye is not None else 0)
            self._io_waker.close()
            self._leader_waker.close()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._io_waker.fileno(), zmq.POLLIN)
        last_ping = time.monotonic()
        while not self._stop:
            events = dict(poller.poll(int(self.heartbeat_s * 1000)))
            self._io_waker.drain()
            if self._io_waker.fileno() in events:
                self._read_monitor()  # a sender found no pipe and waits to learn why
            if self._stop:
                return
            if self._monitor in events or not events:
                self._read_monitor()  # only this thread touches the monitor socket
            now = time.monotonic()
            if now - last_ping >= self.heartbeat_s:
                last_ping = now
                with self._sock_lock:
                    self._send([P.encode(P.Ping())], True)
                    completed = self._drain()  # late replies, Pongs, a Goodbye
                if completed:
                    self._wake_waiters()
            with self._lock:
                waiting = bool(self._pending)
            waiting = waiting or (self.lane is not None and self.lane.lock.locked())  # a call on the lane waits too
            if waiting and self.established and now - self._last_heard > max(_SILENT_MIN_S, 5 * self.heartbeat_s):
                silent_s = now - self._last_heard
                self.fail(f"the executor at {self._address} went silent (no reply or heartbeat for {silent_s:.1f}s)")
            elif not waiting:
                self._last_heard = max(self._last_heard, now - self.heartbeat_s)

    def _read_monitor(self, holding_sock_lock: bool = False) -> None:
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_CONNECTED:
                self.accepted = True
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.zmtp_ok = True
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                # Replies that arrived before the disconnect are already in the socket: hand them
                # out first (a draining executor answers, says Goodbye, then closes).
                if holding_sock_lock:
                    completed = self._drain()
                else:
                    with self._sock_lock:
                        completed = self._drain()
                if completed:
                    self._wake_waiters()
                self.fail(self._lost())
            elif event["event"] & HANDSHAKE_EVENTS:  # comes before its DISCONNECTED: the cause wins
                self.fail(handshake_failure(self._address, event["event"], event["value"], self._curve_on))


@dataclass(frozen=True, slots=True)
class _LaneShape:
    """What an inline lane call of one (layer, op, dtype) sends and gets back (``ZmqTransport._lane_shape``)."""

    wire_dtype: str
    in_width: int
    out_width: int
    out_row_bytes: int
    max_rows: int  # rows and result fit the payload cap, one lane message and ``_inline_lane_limit``
    buffer_dtype: torch.dtype | None  # what the rows are viewed as to export their bytes (bfloat16: int16)


class ZmqTransport:
    """Client of a ``ZmqServer`` at ``tcp://…`` or ``ipc://…`` (implements ``Transport``).

    Thread-safe: one I/O thread owns the socket, callers wait on per-request futures matched by
    request id. Payloads go in the caller's dtype (the executor casts at its boundary) and results
    come back in it, on the caller's device. When the connection is lost or the executor restarts,
    a call re-handshakes and retries with bounded exponential backoff (tenacity): safe because the
    executor keeps no state between calls. Large CPU payloads are sent zero-copy; ZeroMQ may drop
    its reference to them a moment after ``call`` returns (the bytes were sent before the reply).

    ``curve``: authenticate to (and encrypt traffic with) a CURVE executor; key files are checked
    here. The environment-variable route lives in ``connect``.
    """

    def __init__(
        self,
        address: str,
        *,
        client_id: str | None = None,
        expected_fingerprint: str | None = None,
        timeout_s: float = 60.0,
        connect_timeout_s: float = 10.0,
        curve: CurveClientKeys | None = None,
        lane: bool = True,
    ) -> None:
        if not address.startswith(("tcp://", "ipc://")):
            raise ConfigurationError(f"unsupported executor address {address!r}: use tcp://HOST:PORT or ipc:///PATH")
        self.address = address
        self._endpoint = address
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:12]}"
        self.expected_fingerprint = expected_fingerprint
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.curve = curve
        self.use_lane = lane and self._lanes_supported
        self._spec_cache: dict[str, LayerSpec | None] = {}  # layer or sibling group id -> spec
        self._lane_shapes: dict[tuple[str, Op, torch.dtype], _LaneShape] = {}  # see ``_call_on_lane_inline``
        self._ctx = new_context()
        self._request_ids = itertools.count(1)
        self._conn_lock = threading.Lock()
        self._closed = False  # set first thing by ``close`` (a handshake in progress reads it)
        self._close_done = False
        # The session a handshake is opening, outside ``_conn_lock``'s guard: ``close`` fails it
        # rather than wait out its connect timeout (a server stopping while its executor is gone).
        self._opening: _Connection | None = None
        self._welcome: P.Welcome | None = None
        self._specs: dict[str, LayerSpec] = {}
        self._conn: _Connection | None = None
        self._lost: str | None = None  # why the last session ended (its connection's ``dead``)
        try:
            self._conn = self._handshake(time.monotonic() + connect_timeout_s)
        except BaseException:
            self._ctx.term()
            raise

    @property
    def fingerprint(self) -> str:
        assert self._welcome is not None
        return self._welcome.fingerprint

    @property
    def quantization(self) -> str | None:
        """How the executor stores the base weights (None: full precision), from its Welcome."""
        assert self._welcome is not None
        return self._welcome.quantization or None

    @property
    def latency_rows(self) -> int | None:
        """Rows up to which a decode or prefill request is latency work on the executor (None: it
        did not say, or no Welcome yet), from its Welcome."""
        welcome = self._welcome
        return (welcome.latency_rows or None) if welcome is not None else None

    def layer_specs(self) -> Mapping[str, LayerSpec]:
        return dict(self._specs)

    @property
    def welcome(self) -> P.Welcome | None:
        """The executor's latest ``Welcome`` (a new one after each reconnect); ``transport/routing.py``
        reads a sharded executor's routes from it."""
        return self._welcome

    def call(
        self,
        layer_id: str,
        op: Op,
        rows: torch.Tensor,
        latency_class: LatencyClass,
        expert_rows: list[int] | None = None,
    ) -> torch.Tensor:
        """``expert_rows``: see ``call_expert_rows``."""
        started = time.monotonic()
        deadline = started + self.timeout_s
        op = op if type(op) is Op else Op(op)  # the enum call costs more than the check
        latency_class = latency_class if type(latency_class) is LatencyClass else LatencyClass(latency_class)
        staged = None
        try:  # the first attempt without tenacity: building a Retrying costs ~30 µs per call
            # The fast path takes only rows that staging would leave as they are (CPU,
            # contiguous, no grad), and its result is in their dtype: nothing to do around it.
            result = self._call_on_lane_inline(layer_id, op, rows, latency_class, deadline, expert_rows)
            if result is not None:
                return result
            staged = self._stage(rows)
            result = self._call_once(layer_id, op, staged, latency_class, deadline, expert_rows)
        except ExecutorUnavailableError as exc:
            if self._closed:
                raise
            if staged is None:
                staged = self._stage(rows)
            result = self._call_retrying(layer_id, op, staged, latency_class, started, deadline, exc, expert_rows)
        if result.dtype is rows.dtype and rows.is_cpu:  # the usual case: skip a no-op ``to`` (~1 µs)
            return result
        return result.to(device=rows.device, dtype=rows.dtype)

    @property
    def serves_expert_rows(self) -> bool:
        """Whether the executor takes ``call_expert_rows`` (its latest ``Welcome`` says so)."""
        welcome = self._welcome
        return welcome is not None and welcome.expert_rows

    def call_expert_rows(
        self, layer_id: str, expert_rows: Sequence[int], op: Op, rows: torch.Tensor, latency_class: LatencyClass
    ) -> torch.Tensor:
        """``call`` for the rows of several experts of the experts tensor ``layer_id``, ``expert_rows[i]``
        of them expert ``i``'s, one after another (``protocol.Request.expert_rows``): one round trip."""
        # The class's ``call``: a wrapper put on this instance's ``call`` (a benchmark counting calls)
        # sees this request once, as ``call_expert_rows``.
        return type(self).call(self, layer_id, op, rows, latency_class, P.expert_row_counts(expert_rows))

    def _call_retrying(
        self,
        layer_id: str,
        op: Op,
        staged: torch.Tensor,
        latency_class: LatencyClass,
        started: float,
        deadline: float,
        first: ExecutorUnavailableError,
        expert_rows: list[int] | None = None,
    ) -> torch.Tensor:
        """The further attempts of a call whose first attempt found the executor unavailable (lost
        connection, restart): re-handshake and retry with exponential backoff (at most a second
        apart), within ``connect_timeout_s`` of the call's start and never past its deadline. Safe
        because the executor keeps no state between calls.

        Bounded by time only, not by a number of attempts: an executor that drains before it
        restarts (SIGTERM) refuses every Hello at once ("shutting down") until it exits, and five
        attempts used to be spent in 1.6 s, so a drain longer than that failed the calls of every
        other client (found building the chaos tests, issue 10).

        Each reconnection waits only until then, so the call gives up about ``connect_timeout_s``
        after it started; it then raises ``ExecutorLostError``, naming why the session ended
        (``first``: the first attempt's error, unless the connection said more) and the wait."""
        first_wait_s = 0.05
        time.sleep(min(first_wait_s, max(0.0, deadline - time.monotonic())))
        connect_by = min(deadline, started + self.connect_timeout_s)
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(lambda e: isinstance(e, ExecutorUnavailableError) and not self._closed),
            stop=lambda state: time.monotonic() - started >= self.connect_timeout_s or time.monotonic() >= deadline,
            wait=tenacity.wait_exponential(multiplier=2 * first_wait_s, max=1.0),
            reraise=True,
        )
        try:
            for attempt in retrying:
                with attempt:
                    # A handshake ends by ``connect_by`` (a tenth of a second at least: the last
                    # attempt may start just before it), not ``connect_timeout_s`` from now.
                    self._live_connection(max(connect_by, min(deadline, time.monotonic() + 0.1)))
                    result = self._call_once(layer_id, op, staged, latency_class, deadline, expert_rows)
        except ExecutorUnavailableError as exc:
            if self._closed:
                raise
            cause = self._lost or str(first)
            if self._endpoint not in cause:  # (a shm+ or dist+ transport's first session names its endpoint)
                cause = f"{cause} (executor at {self.address})"
            last = str(exc)
            # The bare "no executor answered at ADDR within Ns" says nothing the cause does not;
            # what the monitor saw after it (not an executor, a hung one) does.
            bare = last.startswith(_NO_ANSWER) and ": " not in last
            useful = last != cause and last != str(first) and not bare
            waited_s = round(min(self.connect_timeout_s, deadline - started), 1)
            raise ExecutorLostError(cause, waited_s, last if useful else None) from exc
        return result

    def close(self) -> None:
        self._closed = True  # before reading ``_opening``, which a handshake sets before reading this
        opening = self._opening
        if opening is not None:  # a call reconnecting holds ``_conn_lock`` until its handshake ends
            opening.fail("the transport is closed")
        with self._conn_lock:
            if self._close_done:
                return
            self._close_done = True
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close(goodbye=P.encode(P.Goodbye(self.client_id)))
        self._on_close()
        self._ctx.term()

    def __enter__(self) -> ZmqTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- hooks the shared-memory and torch.distributed transports override ---------------

    _lanes_supported = True  # whether calls may travel on a lane (``lane.py``)
    _inline_lane_calls = True  # whether ``_call_on_lane_inline`` may take calls (inline payloads)

    @property
    def _inline_lane_limit(self) -> int:
        """Calls whose rows or result reach this many bytes are not sent inline by the fast path."""
        return 1 << 62

    def _stage(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` as the payload is sent: contiguous, on the device the payload leaves from."""
        if rows.is_cpu and not rows.requires_grad and rows.is_contiguous():
            return rows  # the usual case, without three no-op torch calls
        return rows.detach().to("cpu").contiguous()

    def _encode(self, request: P.Request, rows: torch.Tensor) -> tuple[P.Request, list[Any], Any]:
        """Frames to send for ``request`` and a lease to give back to ``_finish``/``_abandon``."""
        payload = P.tensor_payload(rows)
        return request, [P.encode(request), payload], None

    def _decode(self, reply: P.Reply, payload: list[memoryview], lease: Any) -> torch.Tensor:
        """The result of ``reply``; ``payload``: the buffers that came after its header."""
        if reply.dtype not in P.WIRE_DTYPES or len(reply.shape) != 2 or len(payload) != 1:
            raise ProtocolError(f"malformed reply: dtype {reply.dtype!r}, shape {reply.shape}, {len(payload)} frames")
        if payload[0].nbytes != P.declared_nbytes(reply.dtype, reply.shape):
            raise ProtocolError("reply payload size does not match its shape")
        return P.tensor_from_payload(payload[0], reply.dtype, reply.shape)

    def _lane_reply_nbytes(self, request: P.Request, rows: torch.Tensor) -> int:
        """Bytes of the result that will come back on the lane after the reply header (inline)."""
        spec = self._spec(request.layer_id)
        if spec is None or rows.dim() != 2:
            return 0  # the executor refuses it: only an error reply comes back
        return rows.shape[0] * OPS_BY_VALUE[request.op].output_width(spec) * rows.element_size()

    def _release(self, lease: Any, reusable: bool) -> None:
        """The server is done with ``lease`` (``reusable``) or may still touch it (not)."""

    def _hello_options(self) -> dict[str, Any]:
        """Extra ``Hello`` fields this transport asks for."""
        return {}

    def _on_session(self, welcome: P.Welcome, conn: _Connection) -> None:
        """A new session started (first connect or reconnect)."""

    def _on_close(self) -> None:
        """The transport closed; free what the hooks hold."""

    # ---- internals -----------------------------------------------------------------------

    def _handshake(self, deadline: float) -> _Connection:
        """A new session: Hello, and its Welcome before ``deadline`` (the connect timeout)."""
        budget_s = max(0.0, deadline - time.monotonic())
        conn = _Connection(self._ctx, self._endpoint, heartbeat_s=1.0, curve=self.curve, address=self.address)
        rid = next(self._request_ids)
        hello = P.Hello(P.PROTOCOL_VERSION, self.client_id, rid, self.expected_fingerprint, **self._hello_options())
        self._opening = conn
        try:
            if self._closed:  # ``close`` came before ``_opening`` was set: it did not fail this one
                raise ExecutorUnavailableError("transport is closed")
            future = conn.submit(rid, [P.encode(hello)], True)
            try:
                msg, _ = conn.wait(future, max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise ExecutorUnavailableError(self._no_answer(conn, budget_s)) from None
            if isinstance(msg, P.Reply):
                raise error_from_code(msg.error_code, msg.error_message)
            assert isinstance(msg, P.Welcome)
            expected = self.expected_fingerprint or (self._welcome.fingerprint if self._welcome else None)
            if expected is not None and msg.fingerprint != expected:
                raise ModelMismatchError(
                    f"executor at {self.address} serves {msg.fingerprint!r}, expected {expected!r}"
                )
            conn.heartbeat_s = msg.heartbeat_s
            conn.established = True  # from now on a silent executor fails the calls waiting on it
            self._welcome = msg
            self._specs = {w.layer_id: w.to_spec() for w in msg.layers}
            self._spec_cache = {}
            self._lane_shapes = {}
            self._on_session(msg, conn)
            if self.use_lane and (msg.shm_socket or msg.lane_port):
                conn.lane = self._open_lane(msg, deadline)
        except BaseException:
            conn.close(goodbye=None)
            raise
        finally:
            self._opening = None
        return conn

    def _no_answer(self, conn: _Connection, budget_s: float) -> str:
        """Why a handshake got no Welcome in ``budget_s``, from what its socket monitor saw."""
        message = f"{_NO_ANSWER} {self.address} within {round(budget_s, 1):g}s"
        if conn.zmtp_ok:
            return (
                f"{message}: a ZeroMQ peer accepted the connection but did not answer the Hello (an executor that "
                "is hung or overloaded, or a ZeroMQ program that is not a Symbiosis executor)"
            )
        if conn.accepted:
            return (
                f"{message}: something accepted the connection but did not complete the ZeroMQ handshake -- it is "
                "probably not a Symbiosis executor (an HTTP server, say; check the address), or a hung one"
            )
        return message

    def _open_lane(self, welcome: P.Welcome, deadline: float) -> ClientLane | None:
        """A lane for this session (``lane.py``): from the executor's broker on the same host, or
        a connection to its lane port over tcp; None if it offers none or it fails (calls then
        all go over ZeroMQ, as they would without lanes)."""
        timeout_s = max(0.1, deadline - time.monotonic())
        try:
            if welcome.shm_socket:
                from symbiosis.transport.shm_broker import ask_lane

                fd, max_message_bytes = ask_lane(welcome.shm_socket, welcome.session_token, timeout_s)
                return ClientLane(socket.socket(fileno=fd), max_message_bytes)
            if self._endpoint.startswith("tcp://"):
                return connect_tcp(tcp_host(self._endpoint), welcome.lane_port, welcome.session_token, timeout_s)
        except (SymbiosisError, OSError) as exc:
            log.info("no lane from the executor at %s (%s); calls go over ZeroMQ", self.address, exc)
        return None

    def _spec(self, layer_id: str) -> LayerSpec | None:
        """The spec of a layer or sibling group id (cached: group ids are parsed once)."""
        try:
            return self._spec_cache[layer_id]
        except KeyError:
            spec = self._spec_cache[layer_id] = spec_of(layer_id, self._specs)
            return spec

    def _live_connection(self, deadline: float) -> _Connection:
        with self._conn_lock:
            if self._closed:
                raise ExecutorUnavailableError("transport is closed")
            if self._conn is not None and self._conn.dead is None:
                return self._conn
            if self._conn is not None:
                self._lost = self._conn.dead  # named when a reconnection does not come in time
                self._conn.close(goodbye=None)
                self._conn = None
            self._conn = self._handshake(min(deadline, time.monotonic() + self.connect_timeout_s))
            self._lost = None
            return self._conn

    def _call_once(
        self,
        layer_id: str,
        op: Op,
        rows: torch.Tensor,
        latency_class: LatencyClass,
        deadline: float,
        expert_rows: list[int] | None = None,
    ) -> torch.Tensor:
        conn = self._conn
        if conn is None or conn.dead is not None or self._closed:
            conn = self._live_connection(deadline)
        welcome = self._welcome
        assert welcome is not None
        nbytes = rows.numel() * rows.element_size()
        if nbytes > welcome.limits.max_payload_bytes:
            raise ProtocolError(f"{nbytes} bytes exceed the executor's cap of {welcome.limits.max_payload_bytes}")
        rid = next(self._request_ids)
        request = P.Request(
            P.PROTOCOL_VERSION,
            self.client_id,
            rid,
            layer_id,
            op.value,
            P.dtype_name(rows.dtype),
            list(rows.shape),
            latency_class.value,
            expert_rows=expert_rows or [],
        )
        request, frames, lease = self._encode(request, rows)
        lane = conn.lane
        if lane is not None and not lane.closed and lane.lock.acquire(blocking=False):
            # Any size: rows or results longer than one lane message go as long messages (``lane.py``).
            reply_nbytes = self._lane_reply_nbytes(request, rows) if len(frames) > 1 else 0
            return self._call_on_lane(conn, lane, request, frames, lease, reply_nbytes, deadline)  # releases the lock
        try:
            future = conn.submit(rid, frames, copy=nbytes < P.COPY_THRESHOLD)
            try:
                reply, payload = conn.wait(future, max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                conn.forget(rid)
                raise ExecutorTimeoutError(f"{op.value} of {layer_id!r} took longer than {self.timeout_s}s") from None
        except BaseException:
            self._release(lease, reusable=False)
            raise
        assert isinstance(reply, P.Reply)
        return self._finish(conn, reply, [frame.buffer for frame in payload], lease)

    def _call_on_lane_inline(
        self,
        layer_id: str,
        op: Op,
        rows: torch.Tensor,
        latency_class: LatencyClass,
        deadline: float,
        expert_rows: list[int] | None = None,
    ) -> torch.Tensor | None:
        """The usual call in a few steps: inline rows on a free lane, for a layer, op and dtype
        checked once against the ``Welcome`` (``_LaneShape``). None (nothing sent) when the call
        needs anything else -- no lane or a busy one, another payload channel, rows this client
        cannot vouch for, a result too large for one message: ``_call_once`` then takes it.

        Why a path of its own: a round trip is a few dozen Python and torch calls on each side,
        and on the machines we measure every one costs about three times what a hot loop suggests
        (each call switches processes twice, and the code runs cold), so the general path's
        hooks, checks and wrappers were a third of the client's share of a 1-row call."""
        conn = self._conn
        if conn is None or conn.dead is not None or self._closed or not self._inline_lane_calls:
            return None
        lane = conn.lane
        if lane is None or lane.closed or rows.requires_grad or not rows.is_cpu:
            return None
        dtype = rows.dtype
        shape = self._lane_shapes.get((layer_id, op, dtype))
        if shape is None:
            shape = self._lane_shape(layer_id, op, dtype, lane)
            if shape is None:
                return None
        size = rows.shape
        if len(size) != 2 or size[1] != shape.in_width or not rows.is_contiguous():
            return None
        n = size[0]
        if not 0 < n <= shape.max_rows:
            return None
        request_id = next(self._request_ids)
        # Encoded before the lane is taken: a header that fails to encode must not leave it taken.
        header = P.encode(
            P.Request(
                P.PROTOCOL_VERSION,
                self.client_id,
                request_id,
                layer_id,
                op,  # a StrEnum is a str: encoded as its value (without ``.value``'s two calls)
                shape.wire_dtype,
                [n, shape.in_width],
                latency_class,
                expert_rows=expert_rows or [],
            )
        )
        if not lane.lock.acquire(blocking=False):
            return None
        try:
            try:
                # ``tensor_payload`` without its checks, made above (CPU, contiguous, n > 0). On a
                # same-host lane the result is received straight into a tensor of its own
                # (``ClientLane.exchange``); a tcp lane reads a stream, so it is wrapped after.
                as_buffer = shape.buffer_dtype
                payload = memoryview((rows if as_buffer is None else rows.view(as_buffer)).numpy())
                result = into = None
                if not lane.stream:
                    result = torch.empty((n, shape.out_width), dtype=dtype)
                    into = memoryview((result if as_buffer is None else result.view(as_buffer)).numpy()).cast("B")
                reply, payload = lane.exchange(
                    header, payload.cast("B"), request_id, n * shape.out_row_bytes, deadline - time.monotonic(), into
                )
            finally:
                lane.lock.release()
        except ExecutorTimeoutError:
            raise ExecutorTimeoutError(f"{op.value} of {layer_id!r} took longer than {self.timeout_s}s") from None
        except ExecutorUnavailableError as exc:
            raise conn.lane_failed(exc) from exc  # the executor closed the lane: its session ended or it is gone
        if not reply.ok:
            return self._finish(conn, reply, [] if payload is None else [payload], None)  # raises its typed error
        nbytes = n * shape.out_row_bytes if payload is None else payload.nbytes
        if reply.dtype != shape.wire_dtype or reply.shape != [n, shape.out_width] or nbytes != n * shape.out_row_bytes:
            raise ProtocolError(f"malformed reply: dtype {reply.dtype!r}, shape {reply.shape}, {nbytes} bytes")
        return result if payload is None else P.tensor_from_payload(payload, shape.wire_dtype, reply.shape)

    def _lane_shape(self, layer_id: str, op: Op, dtype: torch.dtype, lane: ClientLane) -> _LaneShape | None:
        """What a valid inline lane call of ``layer_id``/``op`` in ``dtype`` sends and gets back,
        checked once with the executor's own rules (``protocol.call_shape``); None if it is not
        one (the general path sends it anyway and the executor says why)."""
        wire_dtype, welcome = P.WIRE_NAMES.get(dtype), self._welcome
        spec = self._spec(layer_id)
        if spec is None or wire_dtype is None or welcome is None:
            return None
        call = P.call_shape(layer_id, op, wire_dtype, LatencyClass.DECODE, {layer_id: spec}, welcome.limits)
        if call is None:
            return None
        widest_row = max(call.in_width, call.out_width) * call.itemsize
        room = min(lane.max_payload_bytes, self._inline_lane_limit - 1) // widest_row
        shape = _LaneShape(
            wire_dtype,
            call.in_width,
            call.out_width,
            call.out_width * call.itemsize,
            min(call.max_rows, room),
            P.BUFFER_DTYPES.get(dtype),
        )
        self._lane_shapes[(layer_id, op, dtype)] = shape
        return shape

    def _call_on_lane(
        self,
        conn: _Connection,
        lane: ClientLane,
        request: P.Request,
        frames: list[Any],
        lease: Any,
        reply_nbytes: int,
        deadline: float,
    ) -> torch.Tensor:
        """``_call_once`` over the lane, whose lock the caller holds (released here)."""
        try:
            try:
                payload = frames[1] if len(frames) > 1 else None
                reply, reply_payload = lane.exchange(
                    frames[0], payload, request.request_id, reply_nbytes, deadline - time.monotonic()
                )
            finally:
                lane.lock.release()
        except ExecutorTimeoutError:
            self._release(lease, reusable=False)
            raise ExecutorTimeoutError(
                f"{request.op} of {request.layer_id!r} took longer than {self.timeout_s}s"
            ) from None
        except ExecutorUnavailableError as exc:
            self._release(lease, reusable=False)
            raise conn.lane_failed(exc) from exc  # the executor closed the lane: its session ended or it is gone
        except BaseException:
            self._release(lease, reusable=False)
            raise
        inline = len(frames) > 1 or (request.shm_name is None and request.dist_tag is None)
        return self._finish(conn, reply, [reply_payload] if inline or reply_payload.nbytes else [], lease)

    def _finish(self, conn: _Connection, reply: P.Reply, payload: list[memoryview], lease: Any) -> torch.Tensor:
        """The result of a reply (or its typed error); ``lease`` goes back to the transport."""
        if not reply.ok:
            self._release(lease, reusable=True)
            error = error_from_code(reply.error_code, reply.error_message)
            if isinstance(error, ExecutorUnavailableError):
                conn.fail(f'the executor at {self.address} answered "{reply.error_message}"')  # gone or going
                raise ExecutorUnavailableError(conn.dead) from error  # re-handshake (``call``)
            raise error
        try:
            return self._decode(reply, payload, lease)
        finally:
            self._release(lease, reusable=True)
