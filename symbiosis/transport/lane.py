"""Lanes: a private socket per session, beside ZeroMQ, for the calls of one client thread at a time.

Why. A ZeroMQ message passes through an I/O thread on each side (the caller's thread hands it
to libzmq's I/O thread, which writes the socket; the peer's I/O thread reads it and signals the
application thread), so one round trip wakes four threads more than the two that do the work.
Measured on this project's 2-core machine: a bare pyzmq DEALER/ROUTER echo over ipc costs
~50-80 µs, the same echo over a Unix ``SOCK_SEQPACKET`` pair ~12 µs. A decode step makes one
call per base-layer group (4 per llama layer + 1), each waiting for the last, so that difference
is paid ~25-50 times per token.

Two kinds, one wire format:

- **Same host** (``ipc://``, ``shm+ipc://``): the executor makes a ``socketpair(AF_UNIX,
  SOCK_SEQPACKET)`` for a session when its client asks the executor's broker (``shm_broker``: the
  Unix socket next to the ipc socket, the session's secret token, ``SO_PEERCRED``; the way
  shared-memory segments are handed out), keeps one end and hands the other over ``SCM_RIGHTS``.
  Nothing has a name and only the two processes hold it. One datagram per message.
- **tcp** (``tcp://``, ``dist+tcp://``; not offered with CURVE, whose encryption a lane would
  bypass): the executor listens on a second port of the same host (``Welcome.lane_port``); the
  client connects and says ``LaneAsk(token)``, the executor answers ``LaneGiven`` or
  ``LaneRefused`` (``lane_listener.py``). A byte stream: messages carry their length.

Either way the executor's socket thread polls its end next to the ZeroMQ socket; what arrives on
a lane is served exactly like a request from ZeroMQ (same validation, bounds, batching with other
clients), and its reply goes back on the lane.

Wire. A message: a 4-byte little-endian length of what follows, a 4-byte header length, the
msgpack header (``protocol.Request`` one way, ``protocol.Reply`` the other), zeros up to the next
multiple of ``ALIGNMENT`` bytes from the message's start, then the payload bytes (the rows or the
result; none for shared-memory requests, whose payload lies in a segment). Both sides receive a
message at the start of 64-byte aligned memory, so a payload lands aligned like any torch
allocation: it is used where it lies (no copy) and the same kernels run on it as on a tensor made
in-process. A message holds at most ``max_message_bytes`` (what the executor's empty send buffer
takes at once, at most ``MAX_MESSAGE_BYTES``).

Who uses it. One calling thread at a time per client (``ClientLane.lock``; a thread that finds
it taken uses ZeroMQ), and only for calls whose rows and result fit a message; everything else
— the handshake, heartbeats, concurrent calls, large payloads — goes over ZeroMQ. A lane is
closed by either side at will: a client closes it after a timeout (a late reply must not answer
its next call), the executor when the session ends or the client sends what is not a message;
the client then takes its calls to ZeroMQ, where a lost session is noticed and re-established.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import msgspec
import torch

from symbiosis import protocol as P
from symbiosis.errors import ExecutorTimeoutError, ExecutorUnavailableError, ProtocolError, error_from_code
from symbiosis.transport.spin import CLIENT_SPIN_IF_WAITS_UNDER_S, RecentWaits, try_for

#: Largest message a lane carries (header and payload): calls whose rows or result need more go
#: over ZeroMQ, whose zero-copy frames suit large payloads better anyway.
MAX_MESSAGE_BYTES = (1 << 20) + 4096
#: Header room kept in every message: a ``Request``/``Reply`` header is ~100-300 bytes.
HEADER_ROOM_BYTES = 4096
#: What the kernel needs beside the data in a send buffer (``unix_dgram_sendmsg`` refuses a
#: datagram longer than ``SO_SNDBUF - 32``); generous, so a full buffer never surprises.
_KERNEL_SLACK_BYTES = 1024
#: Payloads start at a multiple of this in every message (torch's own allocation alignment).
ALIGNMENT = 64
_LENGTHS = struct.Struct("<II")  # message length (after this field), header length
_LENGTH = struct.Struct("<I")
_PADDING = bytes(ALIGNMENT)
_MSG_TRUNC = socket.MSG_TRUNC
_DONTWAIT = socket.MSG_DONTWAIT
_TIMEVAL = struct.Struct("@ll")  # struct timeval: seconds, microseconds
#: A lane call's timeout is re-set when it differs from the one set by more than this fraction.
_TIMEOUT_SLACK = 0.02


class LaneAsk(msgspec.Struct, tag="lane", frozen=True):
    """Client -> executor (broker, or a tcp lane's first message): a lane for the session
    holding ``token``."""

    token: str


class LaneGiven(msgspec.Struct, tag="lane_given", frozen=True):
    """Executor -> client: the lane is yours; messages of at most ``max_message_bytes``."""

    max_message_bytes: int


class LaneRefused(msgspec.Struct, tag="lane_refused", frozen=True):
    """Executor -> client on a tcp lane: no lane; ``code`` is a ``symbiosis.errors`` code."""

    code: str
    message: str


_encoder = msgspec.msgpack.Encoder()
_answer_decoder = msgspec.msgpack.Decoder(LaneGiven | LaneRefused)


def make_pair() -> tuple[socket.socket, socket.socket, int]:
    """A new same-host lane: ``(executor_end, client_end, max_message_bytes)``; the executor's
    end does not block. Send buffers are raised as far as the system allows
    (``net.core.wmem_max``), which sets the largest datagram: ~200 KiB with Linux's default
    limit, ``MAX_MESSAGE_BYTES`` where it allows more."""
    executor_end, client_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for end in (executor_end, client_end):
        end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_MESSAGE_BYTES + _KERNEL_SLACK_BYTES)
    allowed = min(end.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) for end in (executor_end, client_end))
    executor_end.setblocking(False)
    return executor_end, client_end, min(MAX_MESSAGE_BYTES, allowed - _KERNEL_SLACK_BYTES)


def prepare_stream(sock: socket.socket) -> int:
    """Set up one end of a tcp lane (no Nagle delay, a send buffer that takes a whole message);
    returns the largest message this end can send at once into its empty send buffer."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2 * MAX_MESSAGE_BYTES)
    # The kernel reports twice what it grants and charges tcp buffers with their overhead.
    return min(MAX_MESSAGE_BYTES, sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 2 - _KERNEL_SLACK_BYTES)


def frame(header: bytes, payload: memoryview | None = None) -> list:
    """The buffers of one message (send them with one ``sendmsg``)."""
    payload_nbytes = 0 if payload is None else payload.nbytes
    head_nbytes = _LENGTHS.size + len(header)
    pad = -head_nbytes % ALIGNMENT
    head = _LENGTHS.pack(head_nbytes + pad + payload_nbytes - _LENGTH.size, len(header)) + header + _PADDING[:pad]
    return [head] if not payload_nbytes else [head, payload]


def payload_start(header_nbytes: int) -> int:
    """Where a message's payload starts, from the message's start, after a header of ``header_nbytes``."""
    return -(-(_LENGTHS.size + header_nbytes) // ALIGNMENT) * ALIGNMENT


def split(message: memoryview) -> tuple[memoryview, memoryview]:
    """(header, payload) of one whole received message; ``ProtocolError`` if it is not one."""
    if message.nbytes < _LENGTHS.size:
        raise ProtocolError(f"lane message of {message.nbytes} bytes has no lengths")
    length, header_nbytes = _LENGTHS.unpack_from(message)
    header_end = _LENGTHS.size + header_nbytes
    payload_start = -(-header_end // ALIGNMENT) * ALIGNMENT  # ``payload_start()``, inline: the hot path
    if length != message.nbytes - _LENGTH.size or payload_start > message.nbytes or header_nbytes > P.MAX_HEADER_BYTES:
        raise ProtocolError("lane message lengths do not match the message")
    return message[_LENGTHS.size : header_end], message[payload_start:]


def aligned_buffer(nbytes: int) -> memoryview:
    """``nbytes`` of writable, 64-byte aligned memory (a torch allocation, not zeroed)."""
    return memoryview(torch.empty(nbytes, dtype=torch.uint8).numpy())


class LaneClosed(Exception):
    """The other side closed the lane, or sent what leaves the stream unreadable."""


class ExecutorLane:
    """The executor's end of one session's lane (used by the server's socket thread only).

    A same-host lane reads each datagram into a buffer the caller owns (the server has one for all
    lanes: it reads and serves one message at a time); a tcp lane keeps a buffer of its own,
    because a message may arrive in pieces. Either way a payload is valid until the next
    ``receive``. ``session`` is None while a tcp lane has not said whose it is."""

    __slots__ = ("_have", "_inbox", "_taken", "fd", "max_message_bytes", "session", "slots", "sock", "stream")

    def __init__(self, sock: socket.socket, session: object, max_message_bytes: int, stream: bool = False) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.session = session
        self.max_message_bytes = max_message_bytes
        self.stream = stream
        self._inbox: memoryview | None = None  # tcp: bytes received, from the next message's start
        self._have = 0
        self._taken = 0  # tcp: bytes of the message handed out last (dropped at the next receive)
        self.slots: dict = {}  # tcp: the server's views of this lane's inbox (``lane_routes.LaneRoutes.slot``)

    @property
    def inbox(self) -> memoryview | None:
        """tcp: where every message this lane hands out starts (at offset 0); None before the first."""
        return self._inbox

    def receive(self, buffer: memoryview) -> tuple[memoryview, memoryview] | None:
        """The next message's (header, payload); None when no whole message is waiting.
        ``LaneClosed`` when the client closed its end (or sent a tcp message longer than a lane
        carries: the stream cannot be read further); ``ProtocolError`` for a datagram that is not
        a message."""
        if self.stream:
            return self._receive_stream()
        try:
            nbytes = self.sock.recv_into(buffer, buffer.nbytes, _MSG_TRUNC)  # MSG_TRUNC: the real length
        except BlockingIOError:
            return None
        except OSError as exc:
            raise LaneClosed(str(exc)) from None
        if nbytes == 0:
            raise LaneClosed("the client closed its end")
        if nbytes > buffer.nbytes:
            raise ProtocolError(f"lane message of {nbytes} bytes exceeds {buffer.nbytes}")
        return split(buffer[:nbytes])

    def _receive_stream(self) -> tuple[memoryview, memoryview] | None:
        if self._inbox is None:
            self._inbox = aligned_buffer(self.max_message_bytes)
        inbox = self._inbox
        if self._taken:  # the last message was served: later bytes move to the front (aligned)
            rest = self._have - self._taken
            if rest:
                inbox[:rest] = bytes(inbox[self._taken : self._have])
            self._have, self._taken = rest, 0
        message = self._whole_message()
        if message is None:
            try:
                nbytes = self.sock.recv_into(inbox[self._have :], inbox.nbytes - self._have)
            except BlockingIOError:
                return None
            except OSError as exc:
                raise LaneClosed(str(exc)) from None
            if nbytes == 0:
                raise LaneClosed("the client closed its end")
            self._have += nbytes
            message = self._whole_message()
            if message is None:
                return None
        self._taken = message.nbytes
        return split(message)

    def _whole_message(self) -> memoryview | None:
        if self._have < _LENGTH.size:
            return None
        assert self._inbox is not None
        nbytes = _LENGTH.size + _LENGTH.unpack_from(self._inbox)[0]
        if nbytes > self._inbox.nbytes:
            raise LaneClosed(f"a lane message of {nbytes} bytes exceeds {self._inbox.nbytes}")
        return self._inbox[:nbytes] if self._have >= nbytes else None

    def send(self, header: bytes, payload: memoryview | None = None) -> None:
        """Send one message without blocking. ``BlockingIOError``: the client's queue is full (it
        stopped reading); other ``OSError``: the lane is gone."""
        buffers = frame(header, payload)
        sent = self.sock.sendmsg(buffers)
        if self.stream and sent != sum(memoryview(b).nbytes for b in buffers):
            # Part of a message is out: the stream cannot carry another one. Only a client that
            # stopped reading leaves its lane's send buffer too full for one whole reply.
            raise BlockingIOError("the client does not read its lane")

    def close(self) -> None:
        self.sock.close()


class ClientLane:
    """The client's end of its session's lane; ``exchange`` under ``lock`` (one call at a time)."""

    def __init__(self, sock: socket.socket, max_message_bytes: int, stream: bool = False) -> None:
        self.sock = sock
        self.stream = stream
        self.max_message_bytes = max_message_bytes
        self.max_payload_bytes = max_message_bytes - HEADER_ROOM_BYTES
        self.lock = threading.Lock()
        self._header_only = aligned_buffer(HEADER_ROOM_BYTES)  # replies without payload land here
        self._payload_start = 2 * ALIGNMENT  # where a result's payload starts in a reply (learned: ``exchange``)
        self._lengths = bytearray(_LENGTH.size)
        self.closed = False
        self.calls = 0  # exchanges made (observability: how many calls took the lane)
        # The socket blocks in the kernel, bounded by SO_RCVTIMEO/SO_SNDTIMEO, rather than
        # Python's ``settimeout``: that one costs an ``ioctl`` per call, and every receive then
        # fails once (nothing there yet) and ``poll``s before it reads -- three system calls
        # where one does. The bound is re-set only when a call's remaining time differs from it
        # by more than ``_TIMEOUT_SLACK`` (calls made with the transport's usual timeout never do).
        sock.settimeout(None)
        self._timeout_s = -1.0
        # How long this lane's replies have been taking: a reply is waited for awake (``spin.py``)
        # only while replies usually come soon; a client whose calls wait behind others' work
        # (many clients on few cores) sleeps at once and leaves the cores to them.
        self._reply_waits = RecentWaits(CLIENT_SPIN_IF_WAITS_UNDER_S)

    def exchange(
        self,
        header: bytes,
        payload: memoryview | None,
        request_id: int,
        reply_nbytes: int,
        timeout_s: float,
        into: memoryview | None = None,
    ) -> tuple[P.Reply, memoryview | None]:
        """Send one request and return its reply header and payload. A reply payload of
        ``reply_nbytes`` lands in fresh aligned memory that the returned view keeps alive (a
        result may be wrapped without copying); a header-only reply in this lane's own buffer.

        ``into`` (same-host lanes; ``reply_nbytes`` bytes, e.g. of the result tensor the caller
        made): where the expected result goes. The returned payload is then None when it landed
        there, and as above for any other reply (an error, a payload of another size).

        A timeout closes the lane (a late reply must not answer the next call) and raises
        ``ExecutorTimeoutError``; a lane the executor closed raises ``ExecutorUnavailableError``."""
        self.calls += 1
        spin_s = self._reply_waits.spin_budget_s()
        try:
            timeout_s = max(timeout_s, 1e-3)
            if abs(timeout_s - self._timeout_s) > _TIMEOUT_SLACK * self._timeout_s:
                self._set_timeout(timeout_s)
            started = time.perf_counter()
            if into is not None and not self.stream:
                self.sock.sendmsg(frame(header, payload))
                message, landed = self._receive_into(into, spin_s)
            else:
                message, landed = self._send_and_receive(frame(header, payload), reply_nbytes, spin_s), False
            self._reply_waits.observe(time.perf_counter() - started)
        except (TimeoutError, BlockingIOError):  # SO_RCVTIMEO passed: EAGAIN
            self.close()
            raise ExecutorTimeoutError("no reply on the lane in time") from None
        except OSError as exc:
            self.close()
            raise ExecutorUnavailableError(f"the executor closed the lane: {exc}") from None
        except BaseException:
            self.close()
            raise
        if landed:
            header_view, payload_view = message, None
        else:
            header_view, payload_view = split(message)
            if payload_view.nbytes:  # where the next result's payload will start, most likely
                self._payload_start = payload_start(header_view.nbytes)
        reply = P.decode(header_view)
        if not isinstance(reply, P.Reply) or reply.request_id != request_id:
            self.close()
            raise ProtocolError(f"the executor answered request {request_id} on the lane with {type(reply).__name__}")
        return reply, payload_view

    def _receive_into(self, into: memoryview, spin_s: float) -> tuple[memoryview, bool]:
        """Receive a reply scattered over this lane's header buffer up to where the last result's
        payload started, then ``into``, then the rest of the header buffer: ``(header, True)`` when
        the reply is a result that filled ``into`` exactly, else ``(whole message, False)``.

        Why: a result received into memory the caller made needs no tensor made around the bytes
        afterwards (on the 1-row round trip, those torch calls were ~5% of the client's time);
        a reply's header has the same length from one call to the next, so its payload lands
        where the last one did."""
        head, start = self._header_only, self._payload_start
        buffers = [head[:start], into, head[start:]]
        nbytes = try_for(lambda: _nonblocking(self.sock.recvmsg_into, buffers, 0, _MSG_TRUNC | _DONTWAIT), spin_s)
        nbytes = nbytes[0] if nbytes is not None else self.sock.recvmsg_into(buffers, 0, _MSG_TRUNC)[0]
        if nbytes == 0:
            raise ConnectionResetError("the executor closed the lane")
        if nbytes > head.nbytes + into.nbytes:
            raise ProtocolError(f"lane reply of {nbytes} bytes exceeds the {head.nbytes + into.nbytes} expected")
        if nbytes == start + into.nbytes:
            length, header_nbytes = _LENGTHS.unpack_from(head)
            if length == nbytes - _LENGTH.size and payload_start(header_nbytes) == start:
                return head[_LENGTHS.size : _LENGTHS.size + header_nbytes], True
        if nbytes <= start:
            return head[:nbytes], False
        # Not a result where the last one was: the message, put back together in order, in fresh
        # aligned memory (a result wrapped from it is then writable and needs no copy).
        message = aligned_buffer(nbytes)
        message[:start] = head[:start]
        in_into = min(nbytes - start, into.nbytes)
        message[start : start + in_into] = into[:in_into]
        message[start + in_into :] = head[start : start + nbytes - start - in_into]
        return message, False

    def _set_timeout(self, timeout_s: float) -> None:
        seconds = int(timeout_s)
        microseconds = max(int((timeout_s - seconds) * 1e6), 0 if seconds else 1)  # 0 and 0 would mean forever
        value = _TIMEVAL.pack(seconds, microseconds)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
        self._timeout_s = timeout_s

    def _send_and_receive(self, buffers: list, reply_nbytes: int, spin_s: float) -> memoryview:
        """One message out, the reply's whole message back (``OSError`` for a closed lane)."""
        sock = self.sock
        if not self.stream:
            sock.sendmsg(buffers)
            buffer = aligned_buffer(HEADER_ROOM_BYTES + reply_nbytes) if reply_nbytes else self._header_only
            nbytes = try_for(
                lambda: _nonblocking(sock.recv_into, buffer, buffer.nbytes, _MSG_TRUNC | _DONTWAIT), spin_s
            )
            if nbytes is None:
                nbytes = sock.recv_into(buffer, buffer.nbytes, _MSG_TRUNC)
            if nbytes == 0:
                raise ConnectionResetError("the executor closed the lane")
            if nbytes > buffer.nbytes:
                raise ProtocolError(f"lane reply of {nbytes} bytes exceeds the {buffer.nbytes} expected")
            return buffer[:nbytes]
        _send_all(sock, buffers)
        _receive_exactly(sock, memoryview(self._lengths))
        nbytes = _LENGTH.size + _LENGTH.unpack(self._lengths)[0]
        if nbytes > HEADER_ROOM_BYTES + max(reply_nbytes, 0) + ALIGNMENT:
            raise ProtocolError(f"lane reply of {nbytes} bytes exceeds the {HEADER_ROOM_BYTES + reply_nbytes} expected")
        if nbytes > HEADER_ROOM_BYTES and not reply_nbytes:
            raise ProtocolError(f"lane reply of {nbytes} bytes where a header alone was expected")
        buffer = aligned_buffer(nbytes) if reply_nbytes else self._header_only  # a result keeps its memory
        buffer[: _LENGTH.size] = self._lengths
        _receive_exactly(sock, buffer[_LENGTH.size : nbytes])
        return buffer[:nbytes]

    def close(self) -> None:
        """Close this end for good (idempotent). Safe while another thread is inside
        ``exchange``: it gets an error, never another call's reply."""
        if not self.closed:
            self.closed = True
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def release(self) -> None:
        """Free the descriptor, once no thread uses the lane any more."""
        self.close()
        self.sock.close()


def connect_tcp(host: str, port: int, token: str, timeout_s: float) -> ClientLane:
    """The client's end of a tcp lane to the executor at ``host:port`` for the session holding
    ``token``. Refusals raise their typed error; an unreachable listener ``ExecutorUnavailableError``."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise ExecutorUnavailableError(f"no lane at {host}:{port}: {exc}") from None
    try:
        prepare_stream(sock)
        _send_all(sock, frame(_encoder.encode(LaneAsk(token))))
        lengths = bytearray(_LENGTH.size)
        _receive_exactly(sock, memoryview(lengths))
        nbytes = _LENGTH.size + _LENGTH.unpack(lengths)[0]
        if nbytes > HEADER_ROOM_BYTES:
            raise ProtocolError(f"a lane answer of {nbytes} bytes")
        message = bytearray(nbytes)
        message[: _LENGTH.size] = lengths
        _receive_exactly(sock, memoryview(message)[_LENGTH.size :])
        answer = _answer_decoder.decode(split(memoryview(message))[0])
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        sock.close()
        raise ExecutorUnavailableError(f"the lane at {host}:{port} failed: {exc}") from None
    except BaseException:
        sock.close()
        raise
    if isinstance(answer, LaneRefused):
        sock.close()
        raise error_from_code(answer.code, answer.message)
    return ClientLane(sock, answer.max_message_bytes, stream=True)


def _send_all(sock: socket.socket, buffers: list) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


def _nonblocking(receive, *args):
    """``receive(*args)`` with ``MSG_DONTWAIT`` among them: its result, or None if nothing is there
    yet (for ``spin.try_for``: a same-host reply often comes before the caller would have slept)."""
    try:
        return receive(*args)
    except BlockingIOError:
        return None


def _receive_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        nbytes = sock.recv_into(view[got:], view.nbytes - got)
        if nbytes == 0:
            raise ConnectionResetError("the executor closed the lane")
        got += nbytes
