"""Payload channels: how a request's tensor bytes reach the executor and its result goes back.

A ``ZmqServer`` reads every control message (Hello, request headers, replies, errors) from its one
ZeroMQ socket; the *payload* of a request can travel three ways, chosen by its header:

- inline (``InlineChannel``, here): one raw frame after the header, the result likewise;
- shared memory (``shm_channel.ShmChannel``): the header names a segment of the client's;
- torch.distributed (``dist_channel.DistChannel``): the header names a tag on a per-session pair group.

The header itself arrives on the ZeroMQ socket or on the session's lane (``lane.py``), and the
reply goes back the way its request came; channels do not care which.

Every channel validates the header (``protocol.validate_request``) *before* touching a payload
byte, and runs on the server's socket thread unless it says otherwise.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from symbiosis import protocol as P
from symbiosis.errors import ProtocolError
from symbiosis.vocabulary import LayerSpec

#: (ZeroMQ identity of the connection, request id): the key of one in-flight request.
RequestKey = tuple[bytes, int]


class UnsentBytes:
    """Bytes of one session's inline results that ZeroMQ still holds (sent zero-copy, not yet all
    on the wire, or waiting in the backlog). ``track`` hands ZeroMQ a fresh view of the payload
    and keeps a weak reference to it; ZeroMQ's reference is dropped (by pyzmq's garbage-collector
    thread) once the bytes are out or the message is discarded, and the callback counts them
    off. Thread-safe: single dict and deque operations only."""

    __slots__ = ("_freed", "_refs", "nbytes")

    def __init__(self) -> None:
        self.nbytes = 0
        self._refs: dict[int, tuple[weakref.ref, int]] = {}  # by id(): a writable view is unhashable
        self._freed: deque[int] = deque()

    def track(self, payload: memoryview) -> memoryview:
        view = memoryview(payload)
        ref = weakref.ref(view, self._gone)
        self._refs[id(ref)] = (ref, view.nbytes)
        self.nbytes += view.nbytes
        return view

    def held(self) -> int:
        """Bytes not yet freed (socket thread)."""
        while self._freed:
            self.nbytes -= self._freed.popleft()
        return self.nbytes

    def _gone(self, ref: weakref.ref) -> None:
        self._freed.append(self._refs.pop(id(ref), (ref, 0))[1])


@dataclass(eq=False)
class Session:
    """One client connection's session on a server. ``channel_state`` is owned by the channels;
    the rest is the server's account of what the session holds (``ZmqServer``'s bounds)."""

    identity: bytes
    client_id: str
    token: str
    last_seen: float
    channel_state: dict[str, Any] = field(default_factory=dict)
    inflight: int = 0  # requests accepted and not answered yet
    inflight_bytes: int = 0  # their rows and results
    unsent: UnsentBytes = field(default_factory=UnsentBytes)
    backlog: deque[tuple[list[Any], bool]] = field(default_factory=deque)  # (frames, copy) awaiting room
    stalled_since: float = 0.0  # when the backlog last made progress (or started)
    lane: Any = None  # the session's ``lane.ExecutorLane``, once its client asked for one


@dataclass
class Accepted:
    """A request header a channel accepted.

    ``rows`` is ``None`` when the payload arrives later: the channel then calls
    ``ChannelHost.rows_arrived(key, rows)`` (or ``transfer_failed``) once it has. ``ticket`` is
    what the channel needs to send the result back (a shared-memory region, a dist tag).

    ``out`` (optional, ``[rows, out_width]`` in the wire dtype) is where the result will be sent
    from: an executor may compute the product straight into it, and ``reply`` then copies
    nothing (the shared-memory reply region). It never overlaps ``rows``.
    """

    spec: LayerSpec
    rows: torch.Tensor | None
    ticket: Any = None
    out: torch.Tensor | None = None


class ChannelHost(Protocol):
    """What a channel may call on its server. ``call_soon`` is thread-safe; the rest must run on
    the socket thread (use ``call_soon`` from any other thread)."""

    def send(self, identity: bytes, message: P.Message, payload: memoryview | None = None) -> None: ...

    def call_soon(self, task: Callable[[], None]) -> None: ...

    def rows_arrived(self, key: RequestKey, rows: torch.Tensor) -> None: ...

    def attach_lane(self, lane: Any) -> None:
        """Serve the session's new ``lane.ExecutorLane`` too (socket thread)."""
        ...

    def transfer_failed(self, session: Session, reason: str) -> None:
        """A payload transfer of ``session`` failed: its pending requests get errors, it ends."""
        ...


class PayloadChannel(Protocol):
    """One way for payloads to travel; the server holds one instance of each it allows."""

    def accept(self, session: Session, key: RequestKey, req: P.Request, payload: list[memoryview]) -> Accepted:
        """Validate ``req`` against the layer registry before any payload byte is read and take its
        rows (``payload``: the buffers that came after the header); raise a ``SymbiosisError`` to
        refuse it (nothing of the payload was accepted)."""
        ...

    def reply(self, session: Session, req: P.Request, result: torch.Tensor, ticket: Any) -> memoryview | None:
        """Deliver ``result`` (rows in the request's wire dtype); return the bytes to send after
        the reply header, if the result travels with it (the server sends the header)."""
        ...

    def end_session(self, session: Session) -> None:
        """``session`` ended (Goodbye, dead client, shutdown): free what the channel holds for it."""
        ...

    def close(self) -> None:
        """The server is shutting down (after every session ended)."""
        ...


class InlineChannel:
    """Payload in one raw ZeroMQ frame after the header; the result comes back the same way."""

    def __init__(self, host: ChannelHost, specs: dict[str, LayerSpec], limits: P.Limits) -> None:
        self._host = host
        self._specs = specs
        self._limits = limits

    def accept(self, session: Session, key: RequestKey, req: P.Request, payload: list[memoryview]) -> Accepted:
        if len(payload) != 1:
            raise ProtocolError(f"expected 1 payload frame, got {len(payload)}")
        spec = P.validate_request(req, payload[0].nbytes, self._specs, self._limits)
        return Accepted(spec, P.rows_from_payload(payload[0], req.dtype, req.shape))

    def reply(self, session: Session, req: P.Request, result: torch.Tensor, ticket: Any) -> memoryview | None:
        if not (result.is_cpu and result.is_contiguous()):
            result = result.to("cpu").contiguous()
        return P.tensor_payload(result)

    def end_session(self, session: Session) -> None:
        pass

    def close(self) -> None:
        pass
