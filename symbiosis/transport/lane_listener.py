"""The executor's side of tcp lanes (``lane.py``): a listening port next to a ``tcp://`` bind.

A client that got a ``Welcome`` with a ``lane_port`` connects to that port of the host it reached
the executor at and sends one lane message, ``LaneAsk(session token)``. The connection becomes
that session's lane (``LaneGiven``) or is refused (``LaneRefused``) and closed. The token is the
session's 128-bit secret from its ``Welcome``, so only the client of that session can ask.

Everything runs on the server's socket thread, which polls the listening socket and the waiting
connections next to its others; nothing blocks. Bounds, like the segment broker's: at most
``MAX_PENDING`` connections wait to say whose they are (more are closed at once), each for at
most ``ASK_TIMEOUT_S``, and an ask is one small message (a longer one closes the connection).

Not offered with CURVE: ZeroMQ would encrypt a call, a lane would not.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

import msgspec

from symbiosis.errors import ExecutorUnavailableError, ProtocolError
from symbiosis.transport.lane import (
    HEADER_ROOM_BYTES,
    ExecutorLane,
    LaneAsk,
    LaneClosed,
    LaneGiven,
    LaneRefused,
    prepare_stream,
)

log = logging.getLogger(__name__)

MAX_PENDING = 16
ASK_TIMEOUT_S = 2.0

_encoder = msgspec.msgpack.Encoder()
_ask_decoder = msgspec.msgpack.Decoder(LaneAsk)


class LaneListener:
    """Accepts tcp lanes for one ``ZmqServer`` (socket thread only). ``find_session(token)``
    gives the session holding a token, or None."""

    def __init__(self, host: str, find_session: Callable[[str], object | None]) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.sock.bind((host, 0))
            self.sock.listen(64)
            self.sock.setblocking(False)
        except BaseException:
            self.sock.close()
            raise
        self.fd = self.sock.fileno()
        self.port: int = self.sock.getsockname()[1]
        self._find_session = find_session
        self._pending: dict[int, tuple[ExecutorLane, float]] = {}  # by fd: (lane without a session, deadline)

    def accept(self, now: float) -> list[int]:
        """Take the connections waiting at the port; returns the descriptors to poll for their ask."""
        fds: list[int] = []
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return fds
            except OSError as exc:  # e.g. out of descriptors: try again on the next wake-up
                log.warning("cannot accept a lane: %s", exc)
                return fds
            if len(self._pending) >= MAX_PENDING:
                conn.close()
                continue
            conn.setblocking(False)
            try:
                max_message_bytes = prepare_stream(conn)
            except OSError:
                conn.close()
                continue
            lane = ExecutorLane(conn, None, max(max_message_bytes, HEADER_ROOM_BYTES), stream=True)
            self._pending[lane.fd] = (lane, now + ASK_TIMEOUT_S)
            fds.append(lane.fd)

    def is_pending(self, fd: int) -> bool:
        return fd in self._pending

    def read_ask(self, fd: int) -> ExecutorLane | None:
        """Read what waits on pending connection ``fd``: the lane, now its session's, once it
        asked for a live session's token (``LaneGiven`` is sent); None while the ask is not whole
        or after a refusal (the connection is then closed and forgotten: stop polling ``fd``)."""
        lane, _ = self._pending[fd]
        try:
            message = lane.receive(memoryview(b""))
            if message is None:
                return None
            ask = _ask_decoder.decode(message[0])
            session = self._find_session(ask.token)
            if session is None:
                raise ExecutorUnavailableError(
                    "no session holds this token (the executor restarted, or the session ended)"
                )
        except (LaneClosed, OSError):
            self._forget(fd)
            return None
        except (ProtocolError, ExecutorUnavailableError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            code = exc.code if isinstance(exc, (ProtocolError, ExecutorUnavailableError)) else ProtocolError.code
            try:
                lane.send(_encoder.encode(LaneRefused(code, str(exc))))
            except OSError:
                pass
            self._forget(fd)
            return None
        del self._pending[fd]
        lane.session = session
        try:
            lane.send(_encoder.encode(LaneGiven(lane.max_message_bytes)))
        except OSError:
            lane.close()
            return None
        return lane

    def expire(self, now: float) -> list[int]:
        """Close the connections that did not ask in time; returns their descriptors."""
        late = [fd for fd, (_, deadline) in self._pending.items() if deadline < now]
        for fd in late:
            self._forget(fd)
        return late

    def _forget(self, fd: int) -> None:
        lane, _ = self._pending.pop(fd)
        lane.close()

    def close(self) -> None:
        for fd in list(self._pending):
            self._forget(fd)
        self.sock.close()
