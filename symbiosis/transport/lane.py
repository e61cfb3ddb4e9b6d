"""Lanes: a private Unix socket per session, beside ZeroMQ, for the calls of a same-host client.

Why. A ZeroMQ message passes through an I/O thread on each side (the caller's thread hands it
to libzmq's I/O thread, which writes the socket; the peer's I/O thread reads it and signals the
application thread), so one round trip wakes four threads more than the two that do the work.
Measured on this project's 2-core machine: a bare pyzmq DEALER/ROUTER echo over ipc costs
~50-80 µs, the same echo over a Unix ``SOCK_SEQPACKET`` pair ~12 µs. A decode step makes one
call per base-layer group (4 per llama layer + 1), each waiting for the last, so that difference
is paid ~25-50 times per token.

What a lane is. The executor makes a ``socketpair(AF_UNIX, SOCK_SEQPACKET)`` for one session when
its client asks the executor's broker (``shm_broker``: the Unix socket next to the ipc socket,
the session's secret token, ``SO_PEERCRED``; the same way shared-memory segments are handed
out), keeps one end and hands the other over ``SCM_RIGHTS``. Nothing has a name, only the two
processes hold it, and it dies with the session. The executor's socket thread polls its ends next
to the ZeroMQ socket; what arrives on a lane is served exactly like a request from ZeroMQ (same
validation, bounds, batching with other clients), and its reply goes back on the lane.

Wire. One datagram per message: a 4-byte little-endian header length, the msgpack header
(``protocol.Request`` one way, ``protocol.Reply`` the other), zeros up to the next multiple of
``ALIGNMENT`` bytes, then the payload bytes (the rows or the result; none for shared-memory
requests, whose payload lies in a segment). Both sides receive into 64-byte aligned memory, so a
payload lands aligned like any torch allocation: it is used where it lies (no copy) and the same
kernels run on it as on a tensor made in-process. A datagram holds at most ``max_message_bytes``
(what both ends' send buffers allow, at most ``MAX_MESSAGE_BYTES``).

Who uses it. One calling thread at a time per client (``ClientLane.lock``; a thread that finds
it taken uses ZeroMQ), and only for calls whose rows and result fit a datagram; everything else
— the handshake, heartbeats, concurrent calls, large payloads, tcp clients — goes over ZeroMQ.
A lane's end is closed by either side at will: a client closes it after a timeout (a late reply
must not answer its next call), the executor when the session ends; the client then takes its
calls to ZeroMQ, where a lost session is noticed and re-established.
"""

from __future__ import annotations

import socket
import struct
import threading

import torch

from symbiosis import protocol as P
from symbiosis.errors import ExecutorTimeoutError, ExecutorUnavailableError, ProtocolError

#: Largest datagram a lane carries (header and payload): calls whose rows or result need more go
#: over ZeroMQ, whose zero-copy frames suit large payloads better anyway.
MAX_MESSAGE_BYTES = (1 << 20) + 4096
#: Header room kept in every datagram: a ``Request``/``Reply`` header is ~100-300 bytes.
HEADER_ROOM_BYTES = 4096
#: What the kernel needs beside the data in a send buffer (``unix_dgram_sendmsg`` refuses a
#: datagram longer than ``SO_SNDBUF - 32``); generous, so a full buffer never surprises.
_KERNEL_SLACK_BYTES = 1024
#: Payloads start at a multiple of this in every datagram (torch's own allocation alignment).
ALIGNMENT = 64
_LENGTH = struct.Struct("<I")
_PADDING = bytes(ALIGNMENT)
_MSG_TRUNC = socket.MSG_TRUNC


def make_pair() -> tuple[socket.socket, socket.socket, int]:
    """A new lane: ``(executor_end, client_end, max_message_bytes)``; the executor's end does not
    block. The send buffers are raised as far as the system allows (``net.core.wmem_max``), which
    sets the largest datagram: ~200 KiB with Linux's default limit, ``MAX_MESSAGE_BYTES`` here."""
    executor_end, client_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for end in (executor_end, client_end):
        end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_MESSAGE_BYTES + _KERNEL_SLACK_BYTES)
    allowed = min(end.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) for end in (executor_end, client_end))
    executor_end.setblocking(False)
    return executor_end, client_end, min(MAX_MESSAGE_BYTES, allowed - _KERNEL_SLACK_BYTES)


def _frame(header: bytes, payload: memoryview | None) -> list:
    head = _LENGTH.pack(len(header)) + header
    head += _PADDING[: -len(head) % ALIGNMENT]
    return [head] if payload is None or not payload.nbytes else [head, payload]


def _split(buffer: memoryview) -> tuple[memoryview, memoryview]:
    """(header, payload) of one received datagram; ``ProtocolError`` if it is not one."""
    if buffer.nbytes < _LENGTH.size:
        raise ProtocolError(f"lane message of {buffer.nbytes} bytes has no header length")
    header_end = _LENGTH.size + _LENGTH.unpack_from(buffer)[0]
    payload_start = -(-header_end // ALIGNMENT) * ALIGNMENT
    if payload_start > buffer.nbytes or header_end - _LENGTH.size > P.MAX_HEADER_BYTES:
        raise ProtocolError("lane message header does not fit the message")
    return buffer[_LENGTH.size : header_end], buffer[payload_start:]


def aligned_buffer(nbytes: int) -> memoryview:
    """``nbytes`` of writable, 64-byte aligned memory (a torch allocation, not zeroed)."""
    return memoryview(torch.empty(nbytes, dtype=torch.uint8).numpy())


class LaneClosed(Exception):
    """The other side closed the lane."""


class ExecutorLane:
    """The executor's end of one session's lane (used by the server's socket thread only).

    ``receive`` reads into a buffer the caller owns (the server has one for all lanes: it reads
    and serves one message at a time), so a payload is valid until the next ``receive``."""

    __slots__ = ("fd", "max_message_bytes", "session", "sock")

    def __init__(self, sock: socket.socket, session: object, max_message_bytes: int) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.session = session
        self.max_message_bytes = max_message_bytes

    def receive(self, buffer: memoryview) -> tuple[memoryview, memoryview] | None:
        """The next message's (header, payload), both views into ``buffer`` (``aligned_buffer``);
        None when nothing is waiting. ``LaneClosed`` when the client closed its end;
        ``ProtocolError`` for a message that is not one (too long, no header)."""
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
        return _split(buffer[:nbytes])

    def send(self, header: bytes, payload: memoryview | None = None) -> None:
        """Send one reply without blocking. ``BlockingIOError``: the client's queue is full (it
        stopped reading); other ``OSError``: the lane is gone."""
        self.sock.sendmsg(_frame(header, payload))

    def close(self) -> None:
        self.sock.close()


class ClientLane:
    """The client's end of its session's lane; ``exchange`` under ``lock`` (one call at a time)."""

    def __init__(self, sock: socket.socket, max_message_bytes: int) -> None:
        self.sock = sock
        self.max_message_bytes = max_message_bytes
        self.max_payload_bytes = max_message_bytes - HEADER_ROOM_BYTES
        self.lock = threading.Lock()
        self._header_only = aligned_buffer(HEADER_ROOM_BYTES)  # replies without payload land here
        self.closed = False
        self.calls = 0  # exchanges made (observability: how many calls took the lane)

    def exchange(
        self, header: bytes, payload: memoryview | None, request_id: int, reply_nbytes: int, timeout_s: float
    ) -> tuple[P.Reply, memoryview]:
        """Send one request and return its reply header and payload. A reply payload of
        ``reply_nbytes`` lands in fresh aligned memory that the returned view keeps alive (a
        result may be wrapped without copying); a header-only reply in this lane's own buffer.

        A timeout closes the lane (a late reply must not answer the next call) and raises
        ``ExecutorTimeoutError``; a lane the executor closed raises ``ExecutorUnavailableError``."""
        sock = self.sock
        self.calls += 1
        buffer = aligned_buffer(HEADER_ROOM_BYTES + reply_nbytes) if reply_nbytes else self._header_only
        try:
            sock.settimeout(max(timeout_s, 1e-3))
            sock.sendmsg(_frame(header, payload))
            nbytes = sock.recv_into(buffer, buffer.nbytes, _MSG_TRUNC)
        except TimeoutError:
            self.close()
            raise ExecutorTimeoutError("no reply on the lane in time") from None
        except OSError as exc:
            self.close()
            raise ExecutorUnavailableError(f"the executor closed the lane: {exc}") from None
        if nbytes == 0:
            self.close()
            raise ExecutorUnavailableError("the executor closed the lane")
        if nbytes > buffer.nbytes:
            self.close()
            raise ProtocolError(f"lane reply of {nbytes} bytes exceeds the {buffer.nbytes} expected")
        header_view, payload_view = _split(buffer[:nbytes])
        reply = P.decode(header_view)
        if not isinstance(reply, P.Reply) or reply.request_id != request_id:
            self.close()
            raise ProtocolError(f"the executor answered request {request_id} on the lane with {type(reply).__name__}")
        return reply, payload_view

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
