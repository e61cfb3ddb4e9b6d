"""Same-host fast path, server side: ``ShmChannel`` reads rows from, and writes results into,
shared-memory segments the executor made for the client (``shm_broker``). The client side is
``shm_client.ShmTransport``; this module never imports it (the server must not depend on the
client), and the client takes the shared bits (``ALIGNMENT``, ``reply_nbytes``, ``reply_offset``,
``max_segment_bytes``) from here.

Address form: ``shm+ipc:///path/executor.sock``: the part after ``shm+`` is the ``ZmqServer``
address; one server serves inline and shared-memory clients alike. Shared memory is offered on
``ipc://`` binds only (same host; its broker socket is made like the ipc socket, in the same folder
under the same umask, so the same users can reach it).

Layout and copies (the paper, §3.5): a request names a segment of its session and an offset; the
rows lie there, and the result region follows them, disjoint, at ``offset + reply_offset(rows
bytes)`` (the rows' bytes rounded up to ``ALIGNMENT``; so a call needs ``reply_offset(in) + out``
bytes). Disjoint, because then the executor can write its product straight into the result region
while it still reads the rows. Per call:

1. the client writes its rows straight into the segment (one copy, from any device or layout);
2. the executor reads them through a zero-copy tensor over this server's mapping, valid until the
   reply (the client does not touch the segment before the reply comes);
3. the executor computes into the result region (``Accepted.out``: ``BaseExecutor`` does when the
   client is alone and the rows are in its dtype and on its device); otherwise the result is
   copied into the region once;
4. the client hands that region out as its result (zero copy), see ``shm_client``.

Segment lifecycle and trust (issue 10, finding 1): the *executor* makes each segment when the
client asks its broker (a sealed ``memfd``, mapped here at once; see ``shm_broker``), under the
client's session, and a request names it by the id it was given. A request is served only from a
segment of its own session's ``SegmentTable``: a client cannot name a file, another client's
segment, or memory that can shrink under the mapping. Per call the server only looks the id up
and checks bounds, after the header was validated (``protocol.validate_request``) and before any
payload byte is touched. Segments live for one session at most: ``ShmRelease`` (the client retired
one) or the session's end — Goodbye, a detected dead client (``kill -9``), server shutdown —
drops the server's mapping; the memory is returned when the client's mapping goes too (a dead
client's at once). Mappings are ``mmap`` objects under tensors, so memory is released when the
last tensor viewing it (e.g. rows the executor still holds) dies.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
from typing import Any

import torch

from symbiosis import protocol as P
from symbiosis.errors import ExecutorBusyError, ExecutorUnavailableError, ProtocolError
from symbiosis.transport.channels import Accepted, ChannelHost, RequestKey, Session
from symbiosis.transport.lane import ExecutorLane, make_pair
from symbiosis.transport.shm_broker import SegmentBroker, make_segment, map_segment
from symbiosis.vocabulary import OPS_BY_VALUE, LayerSpec, Op

MAX_SEGMENTS_PER_SESSION = 64
#: Bytes of live segments one session may have (at least two of the largest): pages the executor
#: writes are charged to it, so a client must not be able to park unbounded memory there.
MAX_SEGMENT_BYTES_PER_SESSION = 8 << 30
#: Live segments, server-wide: each is a mapping, and a process has ~65k (``vm.max_map_count``).
MAX_LIVE_SEGMENTS = 4096
#: Offsets into a segment are multiples of this (every torch kernel is happy with it).
ALIGNMENT = 64


def reply_nbytes(op: Op | str, spec: LayerSpec, rows: int, itemsize: int) -> int:
    """Bytes of the result of ``op`` on ``rows`` rows of ``spec``."""
    return rows * (OPS_BY_VALUE.get(op) or Op(op)).output_width(spec) * itemsize


def reply_offset(rows_nbytes: int) -> int:
    """Where the result region starts, relative to the request's ``shm_offset``: right after the
    rows, rounded up to ``ALIGNMENT`` (disjoint from them)."""
    return -(-rows_nbytes // ALIGNMENT) * ALIGNMENT


def page_round(nbytes: int) -> int:
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def max_segment_bytes(limits: P.Limits) -> int:
    """The largest segment a session may have: what the largest call allowed by ``limits`` needs."""
    return page_round(reply_offset(limits.max_payload_bytes) + limits.max_payload_bytes)


class SegmentTable:
    """Server side: one session's segments, by the id the broker issued for each.

    The broker thread adds segments; the socket thread looks them up (a plain dict read: one
    per call, no lock), releases them and closes the table when the session ends. The first
    segment binds the session to the Unix user who asked for it (``SO_PEERCRED``): a leaked
    token does not let another user add segments to it."""

    def __init__(self, label: str, max_bytes: int, max_segments: int = MAX_SEGMENTS_PER_SESSION) -> None:
        self.label = label  # the memfd name: visible in the executor's /proc/PID/maps, never secret
        self._max_segments = max_segments
        self._max_bytes = max_bytes
        self._bytes = 0
        self._segments: dict[str, mmap.mmap] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._owner_uid: int | None = None
        self._closed = False

    def claim(self, uid: int) -> None:
        """Bind the session to Unix user ``uid`` (its first segment or lane does); refuse another."""
        with self._lock:
            self._claim(uid)

    def _claim(self, uid: int) -> None:
        if self._closed:
            raise ExecutorUnavailableError("the session ended: no shared memory for it")
        if self._owner_uid is not None and uid != self._owner_uid:
            raise ProtocolError("this session's shared memory belongs to another user")
        self._owner_uid = uid

    def add(self, mapping: mmap.mmap, uid: int) -> str:
        with self._lock:
            self._claim(uid)
            if len(self._segments) >= self._max_segments:
                raise ProtocolError(f"more than {self._max_segments} live shared-memory segments in one session")
            if self._bytes + len(mapping) > self._max_bytes:
                raise ProtocolError(f"more than {self._max_bytes} bytes of live shared-memory segments in one session")
            segment_id = str(next(self._ids))
            self._segments[segment_id] = mapping
            self._bytes += len(mapping)
        return segment_id

    def segment(self, segment_id: str, offset: int, nbytes: int) -> mmap.mmap:
        """The mapping of segment ``segment_id``, after checking that ``nbytes`` bytes at
        ``offset`` lie in it (tensors made over it with ``torch.frombuffer`` keep it alive)."""
        segment = self._segments.get(segment_id)
        if segment is None:
            raise ProtocolError(f"no shared-memory segment {segment_id!r} in this session")
        if offset < 0 or offset % ALIGNMENT:
            raise ProtocolError(f"shared-memory offset {offset} must be a non-negative multiple of {ALIGNMENT}")
        if offset + nbytes > len(segment):
            raise ProtocolError(f"segment {segment_id!r} has {len(segment)} bytes, request needs {offset + nbytes}")
        return segment

    def __len__(self) -> int:
        return len(self._segments)

    def release(self, segment_ids: list[str]) -> None:
        with self._lock:
            for segment_id in segment_ids:
                segment = self._segments.pop(segment_id, None)
                self._bytes -= 0 if segment is None else len(segment)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._segments.clear()
            self._bytes = 0


class ShmChannel:
    """Server side (``channels.PayloadChannel``): rows are read from, and results written into,
    the segment a request names; the session's ``SegmentTable`` lives in its ``channel_state``
    (made by ``open_session``). The ticket of an accepted request is its reply region: ``[rows,
    out]`` in the wire dtype, right after the rows (see the module doc); it is also
    ``Accepted.out``, for the executor to compute into.

    ``broker_path``: where this channel's ``SegmentBroker`` listens (``shm_broker.broker_path``
    of the server's ipc address); it raises ``OSError`` if it cannot listen there."""

    def __init__(self, host: ChannelHost, specs: dict[str, LayerSpec], limits: P.Limits, broker_path: str) -> None:
        self._host = host
        self._specs = specs
        self._limits = limits
        self._max_segment = max_segment_bytes(limits)
        self._max_session_bytes = max(MAX_SEGMENT_BYTES_PER_SESSION, 2 * self._max_segment)
        self._tables: dict[str, SegmentTable] = {}  # by session token: what the broker serves
        self._sessions: dict[str, Session] = {}  # by session token: whom a lane is for
        self._labels = itertools.count(1)
        self.broker = SegmentBroker(broker_path, self._allocate, self._open_lane)

    def open_session(self, session: Session) -> None:
        """``session`` started (on the socket thread): its client may now ask for segments."""
        label = f"symbiosis-shm-{next(self._labels)}"
        table = session.channel_state["shm"] = SegmentTable(label, self._max_session_bytes)
        self._tables[session.token] = table
        self._sessions[session.token] = session

    def _open_lane(self, token: str, uid: int) -> tuple[int, int]:
        """On the broker's thread: a lane (``lane.py``) for the session holding ``token``; the
        server's socket thread takes the executor's end (``ChannelHost.attach_lane``)."""
        table, session = self._tables.get(token), self._sessions.get(token)
        if table is None or session is None:
            raise ExecutorUnavailableError("no session holds this token (the executor restarted, or the session ended)")
        table.claim(uid)
        executor_end, client_end, max_message_bytes = make_pair()
        lane = ExecutorLane(executor_end, session, max_message_bytes)
        self._host.call_soon(lambda: self._host.attach_lane(lane))
        return client_end.detach(), max_message_bytes

    def _allocate(self, token: str, nbytes: int, uid: int) -> tuple[str, int, int]:
        """On the broker's thread: make, seal and map a segment for the session holding ``token``."""
        table = self._tables.get(token)
        if table is None:
            raise ExecutorUnavailableError("no session holds this token (the executor restarted, or the session ended)")
        if not 0 < nbytes <= self._max_segment:
            raise ProtocolError(f"a shared-memory segment holds 1 to {self._max_segment} bytes, not {nbytes}")
        if sum(map(len, list(self._tables.values()))) >= MAX_LIVE_SEGMENTS:  # list(): one step under the GIL
            raise ExecutorBusyError(f"executor busy: {MAX_LIVE_SEGMENTS} shared-memory segments are live; retry later")
        size = page_round(nbytes)
        fd = make_segment(size, table.label)
        try:
            return table.add(map_segment(fd, size), uid), fd, size
        except BaseException:
            os.close(fd)
            raise

    def accept(self, session: Session, key: RequestKey, req: P.Request, payload: list[memoryview]) -> Accepted:
        if payload:
            raise ProtocolError("a shared-memory request carries no payload frame")
        well_formed = req.dtype in P.ITEMSIZE and len(req.shape) == 2 and min(req.shape) >= 0
        nbytes = P.declared_nbytes(req.dtype, req.shape) if well_formed else -1
        spec = P.validate_request(req, nbytes, self._specs, self._limits)  # before any payload byte
        dtype = P.WIRE_DTYPES[req.dtype]
        n, width = req.shape
        out_width = OPS_BY_VALUE[req.op].output_width(spec)
        itemsize = P.ITEMSIZE[req.dtype]
        table = session.channel_state.get("shm")
        if table is None:
            raise ProtocolError("no shared-memory segments in this session")
        assert req.shm_name is not None
        offset, result_at = req.shm_offset, reply_offset(nbytes)
        segment = table.segment(req.shm_name, offset, result_at + n * out_width * itemsize)  # checks the size once
        if n == 0:
            return Accepted(spec, torch.empty((0, width), dtype=dtype), None, None)
        # Zero-copy tensors over the segment, valid until the reply; the result region is disjoint from the rows.
        rows = torch.frombuffer(segment, dtype=dtype, count=n * width, offset=offset).view(n, width)
        out = torch.frombuffer(segment, dtype=dtype, count=n * out_width, offset=offset + result_at).view(n, out_width)
        return Accepted(spec, rows, out, out)

    def reply(self, session: Session, req: P.Request, result: torch.Tensor, ticket: Any) -> memoryview | None:
        if ticket is not None and result is not ticket and result.numel():  # ``ticket`` itself: computed in place
            _copy_into(ticket, result)
        return None

    def release(self, session: Session, segment_ids: list[str]) -> None:
        table = session.channel_state.get("shm")
        if table is not None:
            table.release(segment_ids)

    def end_session(self, session: Session) -> None:
        table = session.channel_state.pop("shm", None)
        if table is not None:
            self._tables.pop(session.token, None)
            self._sessions.pop(session.token, None)
            table.close()

    def close(self) -> None:
        self.broker.close()


def _copy_into(region: torch.Tensor, result: torch.Tensor) -> None:
    """Copy ``result`` (any device or layout, ``region``'s dtype and shape) into ``region`` once."""
    if result.device == region.device and result.untyped_storage().data_ptr() == region.untyped_storage().data_ptr():
        if result.data_ptr() == region.data_ptr() and result.stride() == region.stride():
            return  # computed in place (``out=`` into the reply region): nothing to copy
        if _overlaps(result, region):
            result = result.clone()  # e.g. a strided view of the region itself
    region.copy_(result)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte spans of ``a`` and ``b`` (same storage) intersect."""
    return a.data_ptr() < b.data_ptr() + _span(b) and b.data_ptr() < a.data_ptr() + _span(a)


def _span(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to just past its last (non-negative strides)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))) * t.element_size()
