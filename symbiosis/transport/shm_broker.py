"""Shared-memory segments for ``shm+ipc://`` clients: the executor makes them, clients only map them.

Why (issue 10, finding 1): when a client created its segments under ``/dev/shm`` and named them
in requests, the executor opened whatever a name led to. A symlink under the client's prefix made
it write product output into a root-only file; a hard link made it write into another client's
buffer; ``ftruncate`` of a mapped segment killed it with SIGBUS; and names were listable.

Now every segment is an anonymous ``memfd`` that the executor creates, sizes and seals
(``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``) and maps *before* any client sees it; the
client gets the descriptor over a Unix socket (``SCM_RIGHTS``) and maps it too. Requests name a
segment by the id the executor issued for that session. So there is no file name to point
anywhere, nothing in ``/dev/shm`` to list or link to, the executor maps only memory it made, a
session reaches only its own segments (ids are looked up in that session's table), and no one can
shrink a segment under a mapping (the seal is checked by the kernel on every ``ftruncate``; the
size is checked once, when the segment is made, never per call). Writes stay allowed, so a client
can only change bytes of its own segments (a hole punched in one reads back as zeros, no fault).
The client checks the size and seals of what it maps too (``map_segment``).

The broker is a Unix stream socket next to the ZeroMQ ipc socket (``<ipc path>.shm``), created
the same way (same folder, same umask), so the users who can reach the executor can reach it, and
no others; it is not offered on ``tcp://`` (shared memory is same-host only) nor on abstract ipc names
(no file permissions). One connection per segment: the client sends one ``SegmentAsk`` (its
session's secret token and a size) and shuts its write side; the broker answers ``SegmentGiven``
with the descriptor attached, or ``SegmentRefused``, and closes. Clients make segments O(log size)
times, so a connection each costs nothing that matters. The broker's one thread never blocks:
connections are non-blocking, at most ``MAX_PENDING`` wait at once (``MAX_PENDING_PER_USER``
from one Unix user, ``SO_PEERCRED``) and each gets ``READ_TIMEOUT_S`` to say what it wants.

The broker hands out a session's *lane* the same way (``LaneAsk`` -> ``LaneGiven`` with the
client's end of a socket pair attached; ``lane.py``): the session's token and Unix user decide,
as for segments, and ipc clients without shared memory ask too.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from symbiosis.errors import (
    ExecutorUnavailableError,
    ProtocolError,
    SymbiosisError,
    error_from_code,
)
from symbiosis.transport.lane import LaneAsk, LaneGiven  # lanes are handed out here too (lane.py)
from symbiosis.transport.schemes import ipc_path
from symbiosis.transport.socket_paths import listen_unix, remove_own_socket
from symbiosis.transport.waker import Waker

log = logging.getLogger(__name__)

#: Seals every segment carries before a client sees it: its size can never change, and no one
#: can lift the seals. Writes stay allowed (rows and results are written in place).
SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0) | getattr(fcntl, "F_SEAL_SEAL", 0)
#: Whether this platform can make sealed segments and pass them (Linux).
SUPPORTED = hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS") and hasattr(socket, "SO_PEERCRED")
MAX_MESSAGE_BYTES = 1024
MAX_PENDING = 64  # connections waiting for an answer at once; more are closed at once
MAX_PENDING_PER_USER = 4  # of which one Unix user may hold: a user's flood starves only that user
READ_TIMEOUT_S = 2.0  # a connection that has not asked by then is closed
_UNIX_PATH_MAX = 107  # sockaddr_un.sun_path, minus the terminating NUL


class SegmentAsk(msgspec.Struct, tag="ask", frozen=True):
    """Client -> broker: a segment of at least ``nbytes`` for the session holding ``token``."""

    token: str
    nbytes: int


class SegmentGiven(msgspec.Struct, tag="given", frozen=True):
    """Broker -> client: segment ``segment_id`` of ``nbytes`` bytes; its descriptor rides along."""

    segment_id: str
    nbytes: int


class SegmentRefused(msgspec.Struct, tag="refused", frozen=True):
    """Broker -> client: no segment (or lane); ``code`` is a ``symbiosis.errors`` code."""

    code: str
    message: str


_encoder = msgspec.msgpack.Encoder()
_ask_decoder = msgspec.msgpack.Decoder(SegmentAsk | LaneAsk)
_answer_decoder = msgspec.msgpack.Decoder(SegmentGiven | LaneGiven | SegmentRefused)

#: ``allocate(token, nbytes, peer_uid) -> (segment_id, fd, nbytes)``; raises a ``SymbiosisError``
#: to refuse. The broker sends ``fd`` and closes it.
Allocate = Callable[[str, int, int], tuple[str, int, int]]
#: ``open_lane(token, peer_uid) -> (fd, max_message_bytes)``: the client's end of a new lane.
OpenLane = Callable[[str, int], tuple[int, int]]


def broker_path(ipc_address: str) -> str | None:
    """Where the broker of a server bound at ``ipc_address`` listens; None where shared memory is
    not offered (tcp, abstract names, paths too long for a Unix socket, no memfd here)."""
    socket_file = ipc_path(ipc_address)
    if not SUPPORTED or socket_file is None:
        return None
    path = os.path.abspath(socket_file) + ".shm"
    return path if len(os.fsencode(path)) <= _UNIX_PATH_MAX else None


def make_segment(nbytes: int, label: str) -> int:
    """A sealed anonymous shared-memory file of ``nbytes`` bytes (page-rounded by the caller)."""
    fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_segment(fd: int, nbytes: int) -> mmap.mmap:
    """Map a segment after checking it is what a broker promises: ``nbytes`` long and sealed
    against shrinking (so this mapping can never fault). Once per segment, never per call."""
    size = os.fstat(fd).st_size
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if size != nbytes or seals & SEALS != SEALS:
        raise ProtocolError(
            f"shared-memory segment is {size} bytes with seals {seals:#x}, expected {nbytes} and {SEALS:#x}"
        )
    return mmap.mmap(fd, nbytes)


# ---- client side ---------------------------------------------------------------------------------


def ask_segment(path: str, token: str, nbytes: int, timeout_s: float) -> tuple[str, int, int]:
    """Ask the broker at ``path`` for a segment of at least ``nbytes``: ``(segment_id, fd, size)``.
    Refusals raise their typed error; an unreachable broker raises ``ExecutorUnavailableError``."""
    answer, fd = _ask(path, SegmentAsk(token, nbytes), SegmentGiven, timeout_s)
    assert isinstance(answer, SegmentGiven)
    return answer.segment_id, fd, answer.nbytes


def ask_lane(path: str, token: str, timeout_s: float) -> tuple[int, int]:
    """Ask the broker at ``path`` for a lane (``lane.py``): ``(fd of the client's end,
    max_message_bytes)``. Errors as for ``ask_segment``."""
    answer, fd = _ask(path, LaneAsk(token), LaneGiven, timeout_s)
    assert isinstance(answer, LaneGiven)
    return fd, answer.max_message_bytes


def _ask(
    path: str, ask: SegmentAsk | LaneAsk, expected: type, timeout_s: float
) -> tuple[SegmentGiven | LaneGiven, int]:
    """One ask to the broker: ``ask`` out, the answer (of type ``expected``) and its one descriptor
    back. A broker that closes the connection without an answer is over its pending cap
    (``MAX_PENDING_PER_USER``: this user's other clients are asking at the same moment), not gone:
    ask again, backing off, until ``timeout_s``. Only a broker that cannot be reached, or that
    stays busy that long, makes the executor unavailable (which fails the client's connection and
    retries its calls, so it must not happen to a busy but live executor)."""
    deadline = time.monotonic() + timeout_s
    backoff_s = 0.001
    while True:
        try:
            return _ask_once(path, ask, expected, max(deadline - time.monotonic(), 0.001))
        except _BrokerBusy as busy:
            if time.monotonic() + backoff_s >= deadline:
                raise ExecutorUnavailableError(f"shared-memory broker at {path} stayed busy: {busy}") from None
            time.sleep(backoff_s)
            backoff_s = min(2 * backoff_s, 0.05)


class _BrokerBusy(Exception):
    """The broker accepted the connection and closed it unanswered (its pending cap)."""


def _ask_once(
    path: str, ask: SegmentAsk | LaneAsk, expected: type, timeout_s: float
) -> tuple[SegmentGiven | LaneGiven, int]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fds: list[int] = []
    try:
        sock.settimeout(timeout_s)
        sock.connect(path)
        try:
            sock.sendall(_encoder.encode(ask))
            sock.shutdown(socket.SHUT_WR)
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES, 1)
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise _BrokerBusy(str(exc)) from None
        if not data:
            raise _BrokerBusy("closed without an answer")
        while len(data) <= MAX_MESSAGE_BYTES and (chunk := sock.recv(MAX_MESSAGE_BYTES)):
            data += chunk
        answer = _answer_decoder.decode(data)
    except _BrokerBusy:
        _close_all(fds)
        raise
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        _close_all(fds)
        raise ExecutorUnavailableError(f"shared-memory broker at {path} failed: {exc}") from None
    finally:
        sock.close()
    if isinstance(answer, SegmentRefused):
        _close_all(fds)
        raise error_from_code(answer.code, answer.message)
    if not isinstance(answer, expected) or len(fds) != 1:
        _close_all(fds)
        raise ProtocolError(f"shared-memory broker sent {type(answer).__name__} with {len(fds)} descriptors")
    return answer, fds[0]


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


# ---- server side ---------------------------------------------------------------------------------


@dataclass
class _Pending:
    uid: int
    deadline: float
    data: bytearray = field(default_factory=bytearray)


class SegmentBroker:
    """Server side: listens at ``path`` and answers each ``SegmentAsk`` with ``allocate``'s
    segment and each ``LaneAsk`` with ``open_lane``'s lane (see module doc), from one thread of
    its own."""

    def __init__(self, path: str, allocate: Allocate, open_lane: OpenLane | None = None) -> None:
        self.path = path
        self._allocate = allocate
        self._open_lane = open_lane
        self._listener = listen_unix(path)
        self._inode = os.lstat(path).st_ino
        self._pending: dict[socket.socket, _Pending] = {}
        self._waker = Waker()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._waker.fileno(), selectors.EVENT_READ)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"shm-broker({path})", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stopping = True
        self._waker.wake()
        self._thread.join(timeout=5.0)
        for conn in list(self._pending):
            self._drop(conn)
        self._selector.close()
        self._listener.close()
        self._waker.close()
        remove_own_socket(self.path, self._inode)  # only ours: another executor may have bound the path since

    def _run(self) -> None:
        while not self._stopping:
            try:
                for key, _ in self._selector.select(timeout=0.25):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif isinstance(key.fileobj, socket.socket):
                        self._read(key.fileobj)
                    else:
                        self._waker.drain()
                now = time.monotonic()
                for conn in [c for c, p in self._pending.items() if p.deadline < now]:
                    self._drop(conn)
            except Exception:  # the broker must outlive any peer
                log.exception("shared-memory broker error")
                time.sleep(0.05)  # whatever it was, not in a tight loop

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # e.g. out of descriptors: try again on the next wake-up
                log.warning("shared-memory broker cannot accept: %s", exc)
                return
            _, uid, _ = _peer_credentials(conn)
            same_user = sum(p.uid == uid for p in self._pending.values())
            if len(self._pending) >= MAX_PENDING or same_user >= MAX_PENDING_PER_USER:
                conn.close()
                continue
            conn.setblocking(False)
            self._pending[conn] = _Pending(uid, time.monotonic() + READ_TIMEOUT_S)
            self._selector.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> None:
        pending = self._pending[conn]
        try:
            chunk = conn.recv(MAX_MESSAGE_BYTES + 1 - len(pending.data))
        except BlockingIOError:
            return
        except OSError:
            self._drop(conn)
            return
        pending.data += chunk
        if chunk and len(pending.data) <= MAX_MESSAGE_BYTES:
            return  # the ask is complete when the client shuts its write side
        self._selector.unregister(conn)
        del self._pending[conn]
        try:
            self._answer(conn, bytes(pending.data))
        finally:
            conn.close()

    def _answer(self, conn: socket.socket, data: bytes) -> None:
        answer, fd = self._decide(conn, data)
        try:
            socket.send_fds(conn, [_encoder.encode(answer)], [] if fd is None else [fd])
        except OSError:
            pass  # the client is gone; its segment goes when its session does
        finally:
            if fd is not None:
                os.close(fd)  # the executor keeps its mapping, not the descriptor

    def _decide(self, conn: socket.socket, data: bytes) -> tuple[SegmentGiven | LaneGiven | SegmentRefused, int | None]:
        try:
            ask = _ask_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return SegmentRefused(ProtocolError.code, f"undecodable segment request: {exc}"), None
        pid, uid, _ = _peer_credentials(conn)
        try:
            if isinstance(ask, LaneAsk):
                if self._open_lane is None:
                    raise ProtocolError("this executor offers no lanes")
                fd, max_message_bytes = self._open_lane(ask.token, uid)
                return LaneGiven(max_message_bytes), fd
            segment_id, fd, nbytes = self._allocate(ask.token, ask.nbytes, uid)
        except SymbiosisError as exc:
            return SegmentRefused(exc.code, str(exc)), None
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory: the client learns why
            log.warning("making a shared-memory segment or lane for pid %d failed: %s", pid, exc)
            return SegmentRefused(SymbiosisError.code, f"{type(exc).__name__}: {exc}"), None
        return SegmentGiven(segment_id, nbytes), fd

    def _drop(self, conn: socket.socket) -> None:
        if self._pending.pop(conn, None) is not None:
            self._selector.unregister(conn)
        conn.close()


def _peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket, from the kernel."""
    return struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
