"""ZeroMQ links between the ranks of a sharded executor: control messages and row payloads.

Every rank binds one ROUTER (requests from peers arrive there, answers leave from it) and connects
one DEALER to each other rank's ROUTER (its own requests leave there, answers arrive there). The
addresses are exchanged through the torch.distributed store of the launch (``world.py``), so the
links need nothing but what ``torchrun`` already gives every rank.

Why ZeroMQ and not the process group for control: a rank waits for work for as long as clients
are idle, and a posted gloo/NCCL receive that waits longer than the group's timeout breaks the
group; a collective also cannot say *which* layer to run next. So control messages and small
row payloads ride these links (the rows of a client request arrive as host bytes anyway), and
the process group carries only what is announced here and runs at once (``gather.py``).

Threading: one *link thread* per rank reads every socket and calls the ``LinkHandler``; any
thread may send (``send`` on a peer's DEALER, ``answer`` on the ROUTER), each socket guarded by
its own lock, as ``zmq_client._Connection`` does. The link thread polls the sockets' file
descriptors; they are edge-triggered, so a sender that finds a message waiting on the socket it
used wakes the link thread rather than reading it itself.

Failures: a peer is *down* when its DEALER connection drops after it was up (a killed process's
sockets are closed by its kernel at once), or when nothing came from it for ``peer_timeout_s``
(pings go out every ``heartbeat_s``; a hung host; the link thread of a rank that runs a long
relayed product answers no ping meanwhile, so the timeout must exceed the longest product: 60 s
by default, ``ShardOptions``). ``on_peer_down`` is called once per peer, on
the link thread, with ``clean=True`` when the peer had said ``Bye`` (a deliberate stop).
Sending to a down peer raises ``ExecutorUnavailableError`` naming the shard.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from symbiosis import protocol as P
from symbiosis.errors import ExecutorUnavailableError
from symbiosis.sharding import messages as M
from symbiosis.threads import with_torch_threads
from symbiosis.transport.schemes import is_ipv6_tcp, tcp_address
from symbiosis.transport.waker import Waker
from symbiosis.transport.zmq_context import new_context

log = logging.getLogger(__name__)

_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)


class LinkHandler(Protocol):
    """What a rank does with its peers' messages (called on the link thread; must not block)."""

    def on_message(self, peer: int, message: M.LinkMessage, payload: list[zmq.Frame]) -> None: ...

    def on_peer_down(self, peer: int, reason: str, clean: bool) -> None: ...

    def after_messages(self) -> float | None:
        """Called after each burst of messages and on ``wake``: work the handler queued meanwhile
        (it may run products here); returns when to be called again (monotonic) or None."""
        ...


@dataclass
class _Peer:
    rank: int
    dealer: zmq.Socket
    monitor: zmq.Socket
    lock: threading.Lock = field(default_factory=threading.Lock)
    info: M.Ready | None = None
    last_heard: float = field(default_factory=time.monotonic)
    connected: bool = False
    leaving: bool = False  # said Bye
    down: str | None = None


def identity(rank: int) -> bytes:
    return b"r%d" % rank


class PeerLinks:
    """The links of rank ``rank`` of ``world_size``; ``bind`` on construction, then ``start``."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        host: str = "127.0.0.1",
        *,
        heartbeat_s: float = 1.0,
        peer_timeout_s: float = 10.0,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self._ctx = new_context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # answers to a gone peer fail, never queue
        self._router.setsockopt(zmq.SNDHWM, 0)
        self._router.setsockopt(zmq.RCVHWM, 0)
        self._router.setsockopt(zmq.LINGER, 0)
        bind_address = tcp_address(host, 0)
        if is_ipv6_tcp(bind_address):
            self._router.setsockopt(zmq.IPV6, 1)
        self._router.bind(bind_address)
        self.address = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._router_lock = threading.Lock()
        self._peers: dict[int, _Peer] = {}
        self._handler: LinkHandler | None = None
        self._waker = Waker()
        self._ready = threading.Condition()
        self._stop = False
        self._closed = False
        self._thread: threading.Thread | None = None

    # ---- set-up ---------------------------------------------------------------------------

    def start(self, addresses: Sequence[str], handler: LinkHandler, me: M.Ready) -> None:
        """Connect to every other rank's address (``addresses[rank]``), start the link thread and
        tell every peer who this rank is."""
        self._handler = handler
        for peer, address in enumerate(addresses):
            if peer == self.rank:
                continue
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.ROUTING_ID, identity(self.rank))
            dealer.setsockopt(zmq.SNDHWM, 0)
            dealer.setsockopt(zmq.RCVHWM, 0)
            dealer.setsockopt(zmq.LINGER, 0)
            monitor = dealer.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            if is_ipv6_tcp(address):
                dealer.setsockopt(zmq.IPV6, 1)
            dealer.connect(address)
            self._peers[peer] = _Peer(peer, dealer, monitor)
        self._thread = threading.Thread(
            target=with_torch_threads(self._run), name=f"shard-links(rank {self.rank})", daemon=True
        )
        self._thread.start()
        self.broadcast(me)

    def wait_ready(self, timeout_s: float) -> dict[int, M.Ready]:
        """Block until every peer said ``Ready``; raise ``ExecutorUnavailableError`` naming the
        ranks that did not in ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._ready:
            while True:
                missing = [p.rank for p in self._peers.values() if p.info is None]
                if not missing:
                    return {rank: p.info for rank, p in self._peers.items()}  # type: ignore[misc]
                down = [p for p in self._peers.values() if p.down is not None]
                remaining = deadline - time.monotonic()
                if down or remaining <= 0:
                    reason = down[0].down if down else f"no answer in {timeout_s:.0f} s"
                    raise ExecutorUnavailableError(f"ranks {missing} of the sharded executor did not come up: {reason}")
                self._ready.wait(min(remaining, 0.1))

    # ---- sending (any thread) ---------------------------------------------------------------

    def send(self, peer: int, message: M.LinkMessage, payload: memoryview | None = None) -> None:
        """Send a request to ``peer`` (its answer arrives on the link thread)."""
        state = self._peers[peer]
        if state.down is not None:
            raise ExecutorUnavailableError(self.describe_down(peer))
        frames: list[Any] = [M.encode(message)]
        if payload is not None:
            frames.append(payload)
        with state.lock:
            self._send_frames(state.dealer, frames, payload)
            readable = state.dealer.getsockopt(_EVENTS) & _POLLIN
        if readable and threading.current_thread() is not self._thread:
            self._waker.wake()

    def broadcast(self, message: M.LinkMessage) -> None:
        """``send`` to every peer that is not down."""
        for peer, state in self._peers.items():
            if state.down is None:
                self.send(peer, message)

    def answer(self, peer: int, message: M.LinkMessage, payload: memoryview | None = None) -> None:
        """Answer a request of ``peer`` (dropped if the peer is gone: it will not wait for it)."""
        frames: list[Any] = [identity(peer), M.encode(message)]
        if payload is not None:
            frames.append(payload)
        with self._router_lock:
            try:
                self._send_frames(self._router, frames, payload)
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
            readable = self._router.getsockopt(_EVENTS) & _POLLIN
        if readable and threading.current_thread() is not self._thread:
            self._waker.wake()

    @staticmethod
    def _send_frames(socket: zmq.Socket, frames: list[Any], payload: memoryview | None) -> None:
        copy = payload is None or payload.nbytes < P.COPY_THRESHOLD
        last = len(frames) - 1
        for i, frame in enumerate(frames):
            socket.send(frame, _SNDMORE if i < last else 0, copy=copy)

    def wake(self) -> None:
        """Have the link thread call ``after_messages`` soon (from any thread)."""
        self._waker.wake()

    # ---- what the others know about a peer --------------------------------------------------

    def info(self, peer: int) -> M.Ready | None:
        state = self._peers.get(peer)
        return state.info if state is not None else None

    def is_down(self, peer: int) -> bool:
        return self._peers[peer].down is not None

    def describe(self, peer: int) -> str:
        """``shard K of N (rank K, pid P on HOST)``: how errors and logs name a rank."""
        info = self.info(peer)
        where = f", pid {info.pid} on {info.host}" if info is not None else ""
        return f"shard {peer} of {self.world_size} (rank {peer}{where})"

    def describe_down(self, peer: int) -> str:
        return f"{self.describe(peer)} is unavailable: {self._peers[peer].down}"

    # ---- the link thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:
            log.exception("shard link thread failed")
            for peer in list(self._peers):
                self._mark_down(peer, f"link thread of rank {self.rank} failed: {exc!r}", clean=False)

    def _loop(self) -> None:
        poll = select.poll()
        poll.register(self._waker.fileno(), select.POLLIN)
        poll.register(self._router.getsockopt(zmq.FD), select.POLLIN)
        for state in self._peers.values():
            poll.register(state.dealer.getsockopt(zmq.FD), select.POLLIN)
            poll.register(state.monitor.getsockopt(zmq.FD), select.POLLIN)
        next_ping = time.monotonic() + self.heartbeat_s
        wakeup: float | None = None  # the handler's next scheduled work
        busy = False
        while not self._stop:
            if not busy:
                until = next_ping if wakeup is None else min(next_ping, wakeup)
                poll.poll(max(0.0, until - time.monotonic()) * 1e3)
            self._waker.drain()
            now = time.monotonic()
            self._read_monitors()
            received = self._receive()
            for peer, frames in received:
                self._dispatch(peer, frames, now)
            busy = bool(received)
            if self._handler is not None:
                wakeup = self._handler.after_messages()
            if now >= next_ping:
                next_ping = now + self.heartbeat_s
                self._heartbeat(now)

    def _receive(self) -> list[tuple[int, list[zmq.Frame]]]:
        """Every message waiting on every socket, as (peer, [header, *payload])."""
        received: list[tuple[int, list[zmq.Frame]]] = []
        with self._router_lock:
            while self._router.getsockopt(_EVENTS) & _POLLIN:
                frames = self._router.recv_multipart(_NOBLOCK, copy=False)
                peer = _peer_of(frames[0].bytes)
                if peer is not None and peer in self._peers:
                    received.append((peer, frames[1:]))
        for peer, state in self._peers.items():
            with state.lock:
                while state.dealer.getsockopt(_EVENTS) & _POLLIN:
                    received.append((peer, state.dealer.recv_multipart(_NOBLOCK, copy=False)))
        return received

    def _dispatch(self, peer: int, frames: list[zmq.Frame], now: float) -> None:
        state = self._peers[peer]
        state.last_heard = now
        try:
            message = M.decode(frames[0].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("ignoring an undecodable message from rank %d: %s", peer, exc)
            return
        if isinstance(message, M.Ping):
            self.answer(peer, M.Pong())
        elif isinstance(message, M.Pong):
            pass
        elif isinstance(message, M.Ready):
            with self._ready:
                state.info = message
                self._ready.notify_all()
        elif isinstance(message, M.Bye):
            with self._ready:
                state.leaving = True
                self._ready.notify_all()
        elif state.down is None:
            try:
                assert self._handler is not None
                self._handler.on_message(peer, message, frames[1:])
            except Exception:
                log.exception("handling %s from rank %d failed", type(message).__name__, peer)

    def _read_monitors(self) -> None:
        for peer, state in self._peers.items():
            while state.monitor.poll(0):
                event = recv_monitor_message(state.monitor)["event"]
                if event == zmq.EVENT_CONNECTED:
                    state.connected = True
                elif event == zmq.EVENT_DISCONNECTED and state.connected:
                    self._mark_down(
                        peer,
                        "stopped" if state.leaving else "its connection was lost (process died?)",
                        clean=state.leaving,
                    )

    def _heartbeat(self, now: float) -> None:
        for peer, state in self._peers.items():
            if state.down is not None:
                continue
            if state.info is not None and now - state.last_heard > self.peer_timeout_s:
                self._mark_down(peer, f"silent for {now - state.last_heard:.1f} s", clean=False)
                continue
            try:
                self.send(peer, M.Ping())
            except ExecutorUnavailableError:
                pass

    def _mark_down(self, peer: int, reason: str, clean: bool) -> None:
        state = self._peers[peer]
        if state.down is not None or self._stop:
            return
        state.down = reason
        with self._ready:
            self._ready.notify_all()
        if not clean:
            log.error("%s is unavailable: %s", self.describe(peer), reason)
        if self._handler is not None:
            self._handler.on_peer_down(peer, reason, clean)

    # ---- shutdown -------------------------------------------------------------------------

    def say_bye(self, reason: str) -> None:
        """Tell every live peer this rank stops on purpose."""
        if self._closed:
            return
        for peer, state in self._peers.items():
            if state.down is None:
                try:
                    self.send(peer, M.Bye(reason))
                except (ExecutorUnavailableError, zmq.ZMQError):
                    pass

    def wait_peers_gone(self, timeout_s: float) -> bool:
        """Wait until every peer said ``Bye`` or is down; False if some did not in ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._ready:
            while not self._closed and any(p.down is None and not p.leaving for p in self._peers.values()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._ready.wait(min(remaining, 0.05))
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop = True
        self._waker.wake()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        for state in self._peers.values():
            state.dealer.disable_monitor()
            state.monitor.close(0)
            state.dealer.close(linger=200)  # a Bye still queued goes out (else the peer sees a failure)
        self._router.close(0)
        self._ctx.term()
        self._waker.close()


def _peer_of(routing_id: bytes) -> int | None:
    if not routing_id.startswith(b"r"):
        return None
    try:
        return int(routing_id[1:])
    except ValueError:
        return None
