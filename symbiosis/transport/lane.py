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
  Nothing has a name and only the two processes hold it. One datagram per message (a long
  message, below: several).
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

Long messages. A payload (rows or result) larger than one message carries beside its header
(``max_message_bytes - HEADER_ROOM_BYTES``, ~1 MiB: a training step's calls, a long prefill)
travels on the lane too, as a *long message*: the same bytes, but on a same-host lane the head
(lengths, header, padding) is one datagram and the payload follows in datagrams of at most
``max_message_bytes``; on a tcp lane the stream simply goes on. The receiver sees from the
head's length field that more follows, checks the header (the executor: the same
``protocol.validate_request`` as any request, before it allocates anything) and receives the
payload straight into aligned memory of its own: one kernel copy a side, against ZeroMQ's
frames, which land unaligned and were copied once more on each side (32 MiB each way: ~11 ms
over a Unix socket, ~98 ms through ZeroMQ, measured 2026-11-27). The executor receives and sends
long messages a piece at a time as its socket allows (``ExecutorLane.receive`` / ``flush``), so
one client's 100 MiB never holds another's call; a long message the executor refuses is read to
its end and thrown away, then answered with the typed error, and the lane serves on.

Who uses it. One calling thread at a time per client (``ClientLane.lock``; a thread that finds
it taken uses ZeroMQ); everything else -- the handshake, heartbeats, concurrent calls -- goes
over ZeroMQ. A lane is closed by either side at will: a client closes it after a timeout (a late reply must not answer
its next call), the executor when the session ends or the client sends what is not a message;
the client then takes its calls to ZeroMQ, where a lost session is noticed and re-established.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable

import msgspec
import torch

from symbiosis import protocol as P
from symbiosis.errors import (
    ExecutorTimeoutError,
    ExecutorUnavailableError,
    ProtocolError,
    SymbiosisError,
    error_from_code,
)
from symbiosis.transport.spin import CLIENT_SPIN_IF_WAITS_UNDER_S, RecentWaits, try_for

#: Largest message a lane sends at once (header and payload; one datagram on a same-host lane):
#: calls whose rows or result need more go as long messages, in pieces of at most this.
MAX_MESSAGE_BYTES = (1 << 20) + 4096
#: Send buffer asked for each end of a lane (the kernel grants at most ``net.core.wmem_max``):
#: several messages in flight, so a long message's pieces flow without a wake-up for each (an
#: 8 MiB echo over ipc: 2.8-3.1 ms with this, 3.7-4.2 with room for one message, 5.4-5.9 with half
#: of one; 2026-11-27, interleaved).
SEND_BUFFER_BYTES = 4 * MAX_MESSAGE_BYTES
#: What the executor reads of one long message per wake-up before it serves other clients.
LONG_BURST_BYTES = 4 << 20
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
# Plain ints: the socket module's flags are IntFlags, and ``|`` on them costs ~0.5 us each time
# (a spin loop retrying a nonblocking receive paid it at every try).
_MSG_TRUNC = int(socket.MSG_TRUNC)
_TRUNC_NOWAIT = _MSG_TRUNC | int(socket.MSG_DONTWAIT)
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
    (``net.core.wmem_max``), up to ``SEND_BUFFER_BYTES``, which sets the largest datagram:
    ~200 KiB with Linux's default limit, ``MAX_MESSAGE_BYTES`` where it allows more."""
    executor_end, client_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for end in (executor_end, client_end):
        end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    allowed = min(end.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) for end in (executor_end, client_end))
    executor_end.setblocking(False)
    return executor_end, client_end, min(MAX_MESSAGE_BYTES, allowed - _KERNEL_SLACK_BYTES)


def prepare_stream(sock: socket.socket) -> int:
    """Set up one end of a tcp lane (no Nagle delay, a send buffer that takes a whole message);
    returns the largest message this end can send at once into its empty send buffer."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
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


class RefusedMessage(Exception):
    """A long message the executor refused (``ExecutorLane.accept_long``), read to its end:
    answer request ``request_id`` with ``error``; the lane serves on."""

    def __init__(self, error: SymbiosisError, request_id: int) -> None:
        super().__init__(str(error))
        self.error = error
        self.request_id = request_id


class _LongMessage:
    """A long message being received: its header, where its payload goes (None: thrown away
    after a refusal), how much has come."""

    __slots__ = ("got", "header", "payload", "refusal", "total")

    def __init__(self, header: bytes, total: int, payload: memoryview | None, refusal: RefusedMessage | None) -> None:
        self.header = header
        self.total = total
        self.payload = payload
        self.refusal = refusal
        self.got = 0


#: Where a refused long message's payload is read to be thrown away (socket thread only).
_DISCARD = bytearray(1 << 16)


class ExecutorLane:
    """The executor's end of one session's lane (used by the server's socket thread only).

    A same-host lane reads each datagram into a buffer the caller owns (the server has one for all
    lanes: it reads and serves one message at a time); a tcp lane keeps a buffer of its own,
    because a message may arrive in pieces. Either way a payload is valid until the next
    ``receive`` -- except a long message's, which has memory of its own. ``session`` is None while
    a tcp lane has not said whose it is.

    ``accept_long(header, payload_nbytes)`` (set by the server) checks the head of a long message
    before its payload is received, raising a ``SymbiosisError`` to refuse it (its payload is
    read and thrown away, then ``receive`` raises ``RefusedMessage``) or ``LaneClosed`` where the
    lane is not worth reading on; without it a long message closes the lane. A reply that does
    not fit the socket's send buffer waits in an outbox (``sending``) for ``flush``; a client
    that sends again before it took the last reply gets its session ended (``send`` raises
    ``BlockingIOError``)."""

    __slots__ = (
        "_have",
        "_inbox",
        "_long",
        "_outbox",
        "_taken",
        "accept_long",
        "fd",
        "max_message_bytes",
        "session",
        "slots",
        "sock",
        "stream",
    )

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
        self.accept_long: Callable[[memoryview, int], None] | None = None
        self._long: _LongMessage | None = None
        self._outbox: deque[memoryview] = deque()

    @property
    def inbox(self) -> memoryview | None:
        """tcp: where every message this lane hands out starts (at offset 0); None before the first."""
        return self._inbox

    @property
    def receiving(self) -> bool:
        """Whether a long message is part-way in (its next piece is no new call)."""
        return self._long is not None

    @property
    def sending(self) -> bool:
        """Whether a reply waits for room in the socket (``flush`` when it is writable)."""
        return bool(self._outbox)

    def receive(self, buffer: memoryview) -> tuple[memoryview, memoryview, bool] | None:
        """The next message's (header, payload, long); None when no whole message is waiting.
        ``long``: the payload has memory of its own (a long message), valid as long as it is
        referenced. ``LaneClosed`` when the client closed its end (or sent what leaves the lane
        unreadable); ``ProtocolError`` for a message that is not one; ``RefusedMessage`` for a
        long message ``accept_long`` refused."""
        if self._long is not None:
            return self._receive_long()
        if self.stream:
            return self._receive_stream()
        nbytes = self._recv_into(buffer, _MSG_TRUNC)  # MSG_TRUNC: the datagram's real length
        if nbytes is None:
            return None
        if nbytes > buffer.nbytes:
            raise ProtocolError(f"lane message of {nbytes} bytes exceeds {buffer.nbytes}")
        if nbytes >= _LENGTHS.size:
            declared = _LENGTH.size + _LENGTH.unpack_from(buffer)[0]
            if declared > nbytes:  # the head of a long message, or garbage
                header_nbytes = _LENGTHS.unpack_from(buffer)[1]
                if header_nbytes > P.MAX_HEADER_BYTES or nbytes != payload_start(header_nbytes):
                    raise ProtocolError("lane message lengths do not match the message")
                self._start_long(buffer[_LENGTHS.size : _LENGTHS.size + header_nbytes], declared - nbytes)
                return self._receive_long()
        header, payload = split(buffer[:nbytes])
        return header, payload, False

    def _receive_stream(self) -> tuple[memoryview, memoryview, bool] | None:
        if self._inbox is None:
            self._inbox = aligned_buffer(self.max_message_bytes)
        inbox = self._inbox
        if self._taken:  # the last message was served: later bytes move to the front (aligned)
            rest = self._have - self._taken
            if rest:
                inbox[:rest] = bytes(inbox[self._taken : self._have])
            self._have, self._taken = rest, 0
        message = self._whole_message()
        if message is None and self._long is None:
            nbytes = self._recv_into(inbox[self._have :])
            if nbytes is None:
                return None
            self._have += nbytes
            message = self._whole_message()
        if message is None:
            return None if self._long is None else self._receive_long()
        self._taken = message.nbytes
        header, payload = split(message)
        return header, payload, False

    def _whole_message(self) -> memoryview | None:
        """The whole next message in the inbox, or None: not all there yet, or the head of a long
        message, whose receipt it starts (``_long``) with the payload bytes already in."""
        if self._have < _LENGTH.size:
            return None
        assert self._inbox is not None
        inbox = self._inbox
        nbytes = _LENGTH.size + _LENGTH.unpack_from(inbox)[0]
        if nbytes <= inbox.nbytes:
            return inbox[:nbytes] if self._have >= nbytes else None
        if self._have < _LENGTHS.size:
            return None
        header_nbytes = _LENGTHS.unpack_from(inbox)[1]
        start = payload_start(header_nbytes)
        if header_nbytes > P.MAX_HEADER_BYTES or start > min(nbytes, inbox.nbytes):
            raise LaneClosed("lane message lengths do not match the message")
        if self._have < start:
            return None
        self._start_long(inbox[_LENGTHS.size : _LENGTHS.size + header_nbytes], nbytes - start)
        long = self._long
        assert long is not None
        arrived = self._have - start  # all of it this message's: the inbox is shorter than it
        if long.payload is not None:
            long.payload[:arrived] = inbox[start : self._have]
        long.got = arrived
        self._have = 0
        return None

    def _start_long(self, header: memoryview, payload_nbytes: int) -> None:
        """A long message's head came: check it, and say where its payload goes."""
        if self.accept_long is None:
            raise LaneClosed("a message longer than this lane carries")
        header_bytes = bytes(header)
        refusal = None
        try:
            self.accept_long(header, payload_nbytes)
        except SymbiosisError as exc:
            refusal = RefusedMessage(exc, P.salvage_request_id(header_bytes))
        payload = aligned_buffer(payload_nbytes) if refusal is None else None
        self._long = _LongMessage(header_bytes, payload_nbytes, payload, refusal)

    def _receive_long(self) -> tuple[memoryview, memoryview, bool] | None:
        """Receive more of the long message under way: (header, payload, True) once it is whole;
        None while more is to come (at most ``LONG_BURST_BYTES`` a call, so other clients are
        served between the pieces of a large one)."""
        long = self._long
        assert long is not None
        flags, budget = 0 if self.stream else _MSG_TRUNC, LONG_BURST_BYTES
        while long.got < long.total:
            left = long.total - long.got
            if long.payload is not None:
                view = long.payload[long.got :]
            else:
                view = memoryview(_DISCARD)[: min(left, len(_DISCARD))]
            nbytes = self._recv_into(view, flags)
            if nbytes is None:
                return None
            if nbytes > left:  # a datagram that runs past its message: the lane cannot be read on
                raise LaneClosed(f"a datagram of {nbytes} bytes where {left} were left of a long message")
            long.got += nbytes
            budget -= nbytes
            if budget <= 0 and long.got < long.total:
                return None  # poll reports the lane again: the rest waits in the socket
        self._long = None
        if long.refusal is not None:
            raise long.refusal
        assert long.payload is not None
        return memoryview(long.header), long.payload, True

    def _recv_into(self, view: memoryview, flags: int = 0) -> int | None:
        """``recv_into(view)`` without blocking: the byte count (the datagram's whole length with
        ``MSG_TRUNC``), None when nothing waits; ``LaneClosed`` when the client closed its end."""
        try:
            nbytes = self.sock.recv_into(view, view.nbytes, flags)
        except BlockingIOError:
            return None
        except OSError as exc:
            raise LaneClosed(str(exc)) from None
        if nbytes == 0:
            raise LaneClosed("the client closed its end")
        return nbytes

    def send(self, header: bytes, payload: memoryview | None = None) -> None:
        """Send one message without blocking; what the socket does not take now waits in the
        outbox (``sending``; ``flush``). ``BlockingIOError``: the client's queue is full, or its
        last reply still waits (it stopped reading); other ``OSError``: the lane is gone."""
        if self._outbox:
            raise BlockingIOError("the client does not read its lane")
        buffers = frame(header, payload)
        if payload is None or payload.nbytes <= self.max_message_bytes - HEADER_ROOM_BYTES:
            sent = self.sock.sendmsg(buffers)
            if self.stream and sent != sum(memoryview(b).nbytes for b in buffers):
                # Part of a message is out: the stream cannot carry another one. Only a client that
                # stopped reading leaves its lane's send buffer too full for one whole reply.
                raise BlockingIOError("the client does not read its lane")
            return
        # A long message: the head, then the payload in pieces the socket takes at once.
        body = payload.cast("B") if payload.format != "B" else payload
        step = self.max_message_bytes
        self._outbox.append(memoryview(buffers[0]))
        self._outbox.extend(body[i : i + step] for i in range(0, body.nbytes, step))
        self.flush()

    def flush(self) -> bool:
        """Send what waits in the outbox as far as the socket takes it: True when all is out.
        ``OSError`` (not ``BlockingIOError``): the lane is gone."""
        outbox, sock = self._outbox, self.sock
        while outbox:
            piece = outbox[0]
            try:
                sent = sock.send(piece)
            except BlockingIOError:
                return False
            if sent < piece.nbytes:  # a stream takes part of a piece
                outbox[0] = piece[sent:]
            else:
                outbox.popleft()
        return True

    def close(self) -> None:
        self._outbox.clear()
        self._long = None
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
            long_call = reply_nbytes > self.max_payload_bytes
            if payload is not None and payload.nbytes > self.max_payload_bytes:
                self._send_long(header, payload)
                long_call, spin_s = True, 0.0  # a large product follows: no reply comes soon
            elif self.stream:
                _send_all(self.sock, frame(header, payload))
            else:
                self.sock.sendmsg(frame(header, payload))
            if self.stream:
                received = self._receive_stream(reply_nbytes)
            elif reply_nbytes > self.max_payload_bytes:
                received = self._receive_long_reply(into, reply_nbytes)
            elif into is not None:
                received = self._receive_into(into, spin_s)
            else:
                received = self._receive_datagram(reply_nbytes, spin_s)
            if not long_call:  # a long call's wait says little about the next short one's
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
        if isinstance(received, tuple):  # header and payload apart (None: the payload landed in ``into``)
            header_view, payload_view = received
        else:
            header_view, payload_view = split(received)
            if payload_view.nbytes:  # where the next result's payload will start, most likely
                self._payload_start = payload_start(header_view.nbytes)
        reply = P.decode(header_view)
        if not isinstance(reply, P.Reply) or reply.request_id != request_id:
            self.close()
            raise ProtocolError(f"the executor answered request {request_id} on the lane with {type(reply).__name__}")
        return reply, payload_view

    def _receive_into(self, into: memoryview, spin_s: float) -> tuple[memoryview, None] | memoryview:
        """Receive a reply scattered over this lane's header buffer up to where the last result's
        payload started, then ``into``, then the rest of the header buffer: ``(header, None)`` when
        the reply is a result that filled ``into`` exactly, else the whole message.

        Why: a result received into memory the caller made needs no tensor made around the bytes
        afterwards (on the 1-row round trip, those torch calls were ~5% of the client's time);
        a reply's header has the same length from one call to the next, so its payload lands
        where the last one did."""
        head, start = self._header_only, self._payload_start
        buffers = [head[:start], into, head[start:]]
        nbytes = try_for(lambda: _nonblocking(self.sock.recvmsg_into, buffers, 0, _TRUNC_NOWAIT), spin_s)
        nbytes = nbytes[0] if nbytes is not None else self.sock.recvmsg_into(buffers, 0, _MSG_TRUNC)[0]
        if nbytes == 0:
            raise ConnectionResetError("the executor closed the lane")
        if nbytes > head.nbytes + into.nbytes:
            raise ProtocolError(f"lane reply of {nbytes} bytes exceeds the {head.nbytes + into.nbytes} expected")
        if nbytes == start + into.nbytes:
            length, header_nbytes = _LENGTHS.unpack_from(head)
            if length == nbytes - _LENGTH.size and payload_start(header_nbytes) == start:
                return head[_LENGTHS.size : _LENGTHS.size + header_nbytes], None
        if nbytes <= start:
            return head[:nbytes]
        # Not a result where the last one was: the message, put back together in order, in fresh
        # aligned memory (a result wrapped from it is then writable and needs no copy).
        message = aligned_buffer(nbytes)
        message[:start] = head[:start]
        in_into = min(nbytes - start, into.nbytes)
        message[start : start + in_into] = into[:in_into]
        message[start + in_into :] = head[start : start + nbytes - start - in_into]
        return message

    def _set_timeout(self, timeout_s: float) -> None:
        seconds = int(timeout_s)
        microseconds = max(int((timeout_s - seconds) * 1e6), 0 if seconds else 1)  # 0 and 0 would mean forever
        value = _TIMEVAL.pack(seconds, microseconds)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
        self._timeout_s = timeout_s

    def _receive_datagram(self, reply_nbytes: int, spin_s: float) -> memoryview:
        """A same-host lane's reply, one datagram, in fresh aligned memory when it carries
        ``reply_nbytes`` of result (``OSError`` for a closed lane)."""
        sock = self.sock
        buffer = aligned_buffer(HEADER_ROOM_BYTES + reply_nbytes) if reply_nbytes else self._header_only
        nbytes = try_for(lambda: _nonblocking(sock.recv_into, buffer, buffer.nbytes, _TRUNC_NOWAIT), spin_s)
        if nbytes is None:
            nbytes = sock.recv_into(buffer, buffer.nbytes, _MSG_TRUNC)
        if nbytes == 0:
            raise ConnectionResetError("the executor closed the lane")
        if nbytes > buffer.nbytes:
            raise ProtocolError(f"lane reply of {nbytes} bytes exceeds the {buffer.nbytes} expected")
        return buffer[:nbytes]

    def _receive_stream(self, reply_nbytes: int) -> memoryview:
        """A tcp lane's next whole message (a reply of at most ``reply_nbytes`` payload bytes)."""
        sock = self.sock
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

    def _send_long(self, header: bytes, payload: memoryview) -> None:
        """Send a message longer than one lane message: on a stream all of it, on a same-host
        lane its head, then its payload in datagrams of at most ``max_message_bytes`` (the
        executor receives them straight into the memory the rows will be multiplied from)."""
        buffers = frame(header, payload)
        if self.stream:
            _send_all(self.sock, buffers)
            return
        sock, body, step = self.sock, memoryview(buffers[1]).cast("B"), self.max_message_bytes
        sock.sendmsg(buffers[:1])
        for offset in range(0, body.nbytes, step):
            sock.send(body[offset : offset + step])

    def _receive_long_reply(
        self, into: memoryview | None, reply_nbytes: int
    ) -> tuple[memoryview, memoryview | None] | memoryview:
        """A same-host lane's reply where a long one is expected: ``(header, payload)`` (payload
        None when it landed in ``into``), or the whole message of a short reply (an error)."""
        sock, head = self.sock, self._header_only
        nbytes = sock.recv_into(head, head.nbytes, _MSG_TRUNC)
        if nbytes == 0:
            raise ConnectionResetError("the executor closed the lane")
        if nbytes > head.nbytes:
            raise ProtocolError(f"lane reply of {nbytes} bytes where a long reply's head was expected")
        if nbytes < _LENGTHS.size or _LENGTH.size + _LENGTH.unpack_from(head)[0] == nbytes:
            return head[:nbytes]  # a whole reply: an error (a result would be long)
        length, header_nbytes = _LENGTHS.unpack_from(head)
        payload_nbytes = _LENGTH.size + length - nbytes
        if nbytes != payload_start(header_nbytes) or payload_nbytes != reply_nbytes:
            raise ProtocolError(f"a long lane reply of {payload_nbytes} bytes where {reply_nbytes} were expected")
        landed = into is not None and into.nbytes == payload_nbytes
        payload = into if landed else aligned_buffer(payload_nbytes)
        assert payload is not None
        got = 0
        while got < payload_nbytes:
            received = sock.recv_into(payload[got:], payload_nbytes - got, _MSG_TRUNC)
            if received == 0:
                raise ConnectionResetError("the executor closed the lane")
            if received > payload_nbytes - got:
                raise ProtocolError("a long lane reply's datagram runs past its payload")
            got += received
        return head[_LENGTHS.size : _LENGTHS.size + header_nbytes], None if landed else payload

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
