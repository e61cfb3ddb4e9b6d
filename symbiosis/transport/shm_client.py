"""Same-host fast path, client side: ``ShmTransport``, a ``ZmqTransport`` whose payloads travel in
shared memory (address ``shm+ipc://…``); control messages still go over ZeroMQ. The server side,
layout and security checks are in ``shm_channel.py``. Small calls (rows and result both under
``INLINE_THRESHOLD``: a decode step's) skip the segment and ride the session's lane inline, as an
``ipc://`` call would.

Copies per call: the rows are written straight into a segment (one copy, from any device or
layout: nothing is staged first); the executor reads them in place and writes the result into
the region right after them (``shm_channel.reply_offset``; ``BaseExecutor`` computes its product
there directly); a large result is then *handed out*: the caller gets a tensor over the segment's
region (zero copy). It is a tensor of its own (``protocol.owned_tensor``: not a view, safe to
modify in place, it outlives the call), and the segment leaves the pool until that tensor's
storage dies, then comes back to it (a ``weakref.finalize`` on the buffer object the storage
holds). A caller that drops results before the next call thus reuses one warm segment. One that
keeps them mostly gets copies (once, into fresh memory), as before: a region is handed out only
when the next call is unlikely to need a fresh segment for it (see ``_hand_out``), and never more
than ``MAX_HANDED_OUT`` at once. Small results (< ``HANDOUT_MIN_BYTES``) are always copied out: cheap,
and they would pin a whole segment each.

Pool: like the paper, a client keeps buffers sized ``rows × (in + out) × itemsize`` (rows and
result side by side, 64-byte aligned) that are reused across calls; when a call fits none, the
largest idle one is replaced by a bigger one (at least twice the size) — so buffers are allocated
O(log size) times. A client calling from several threads at once holds one buffer per concurrent
call; buffers coming back from callers are kept only up to one more than that (see
``_drain_returned``).

Lifecycle: the executor makes each segment when this client asks its broker (``shm_broker``:
a sealed ``memfd`` whose descriptor comes over a Unix socket; the client maps it after checking
its size and seals, once) and names it by an id valid in this session only. Retiring a buffer
(grown, surplus, reconnect, close) tells the server to drop its mapping (``ShmRelease``); the
memory goes when the last mapping does, so nothing is ever left behind in ``/dev/shm``, even by a
crashed client. A segment's mapping here lives until nothing uses it: a handed-out result stays
valid after the segment is retired or the session ends.
"""

from __future__ import annotations

import collections
import mmap
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from symbiosis import protocol as P
from symbiosis.errors import ConfigurationError, ExecutorUnavailableError, ProtocolError
from symbiosis.transport.shm_broker import ask_segment, map_segment
from symbiosis.transport.shm_channel import ALIGNMENT, max_segment_bytes, page_round, reply_nbytes, reply_offset
from symbiosis.transport.zmq_client import ZmqTransport, _Connection

MIN_BUFFER_BYTES = 1 << 20
#: Results of at least this many bytes are handed out (the segment region), smaller ones copied.
HANDOUT_MIN_BYTES = 1 << 20
#: At most this many segments are in callers' hands at once; past it, results are copied out.
MAX_HANDED_OUT = 4
#: Below this many in callers' hands, a result is handed out even if the next call must make a
#: segment for itself (see ``ShmTransport._hand_out``).
FREELY_HANDED_OUT = 2

#: Calls whose rows and result are both smaller than this travel inline, on the session's lane
#: (``lane.py``) like an ``ipc://`` call, not through a segment: below ``HANDOUT_MIN_BYTES`` a
#: result is copied out of the segment anyway, so the segment saves only the rows' kernel copies
#: and costs more (a lease from the pool, a second header, the executor's general request path and
#: mapping lookup) than the lane's copies of a payload this size, even one longer than a lane
#: message (whose size follows the host's socket buffer limits), sent as a long message.
#: Measured (2026-11-28, this 2-core host, one ``serve`` process, the fused gate/up product of the
#: hidden-512 llama, results of 256-960 KiB, clients of each kind in one throwaway process taking
#: turns): through a segment 1160-1181 us a call at 16 rows, inline 1089-1114 (ipc 1095-1119);
#: 2021 vs 1973 at 32 rows, 2385 vs 2329 at 60. In ``benchmarks.split_overhead`` a 16-sequence
#: decode step over shm+ipc then matched ipc (25.7/25.3, 25.2/25.7, 25.2/24.9 ms in three runs)
#: where it had trailed it by -0.6 to +4.2 ms. An earlier bound of 64 KiB (2026-11-25) was worse
#: still: x1.72-2.01 of monolithic against ipc's x1.55-1.84.
INLINE_THRESHOLD = HANDOUT_MIN_BYTES

assert MIN_BUFFER_BYTES % ALIGNMENT == 0


@dataclass(frozen=True, eq=False)
class _Session:
    """Where this client gets segments in its current executor session (from ``Welcome``)."""

    broker: str
    token: str
    max_segment: int
    conn: _Connection


@dataclass(eq=False)
class _Buffer:
    """Client side: one segment, mapped once (``mapping``; ``data`` is a uint8 tensor over it)."""

    segment_id: str
    session: _Session
    mapping: mmap.mmap
    data: torch.Tensor
    view: memoryview  # of ``mapping``: plain byte copies in and out, cheaper than torch ops for small calls
    handed_out: bool = False  # its region is a caller's result now
    retired: bool = False  # unlinked: never reused
    reply_at: int = 0  # while leased: where the call's result region starts (after its rows)

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def _create_buffer(session: _Session, nbytes: int, timeout_s: float) -> _Buffer:
    """A fresh segment of at least ``nbytes`` from the executor's broker, mapped here."""
    segment_id, fd, size = ask_segment(session.broker, session.token, nbytes, timeout_s)
    try:
        mapping = map_segment(fd, size)
    finally:
        os.close(fd)  # the mapping keeps the memory
    # Never ``mapping.close()``: tensors over it (``data``, handed-out results) hold references to
    # it, and it is unmapped when the last of them dies.
    return _Buffer(segment_id, session, mapping, torch.frombuffer(mapping, dtype=torch.uint8), memoryview(mapping))


def _give_back(returned: collections.deque[_Buffer], buffer: _Buffer) -> None:
    """Finalizer of a handed-out region: its buffer may go back to the pool (not if retired
    meanwhile, e.g. the transport closed: then the mapping goes when its last user does)."""
    if not buffer.retired:
        returned.append(buffer)


class ShmTransport(ZmqTransport):
    """``ZmqTransport`` whose payloads travel in shared memory (address ``shm+ipc://…``)."""

    def __init__(self, address: str, *, inline_threshold: int = INLINE_THRESHOLD, **kwargs: Any) -> None:
        """``inline_threshold``: calls whose rows and result are both smaller (bytes) travel inline
        (default ``INLINE_THRESHOLD``; 0: every call through shared memory)."""
        if not address.startswith("shm+ipc://"):
            raise ConfigurationError(f"shared memory is offered on ipc:// only: use shm+ipc:///PATH, got {address!r}")
        self._pool_lock = threading.Lock()
        self._free: list[_Buffer] = []
        self._leased: set[_Buffer] = set()
        self._handed_out: set[_Buffer] = set()
        # Buffers whose handed-out result died. Appended by finalizers, which run in whichever
        # thread drops the last reference (maybe one holding _pool_lock): a deque needs no lock.
        self._returned: collections.deque[_Buffer] = collections.deque()
        self._peak_leased = 0  # most calls in flight at once
        self._session: _Session | None = None
        self.inline_threshold = inline_threshold
        super().__init__(address[len("shm+") :], **kwargs)
        self.address = address

    # ---- ZmqTransport hooks ------------------------------------------------------------------

    @property
    def _inline_lane_limit(self) -> int:
        return self.inline_threshold

    def _stage(self, rows: torch.Tensor) -> torch.Tensor:
        # no staging copy: ``_encode`` copies from any device or layout
        return rows.detach() if rows.requires_grad else rows

    def _encode(self, request: P.Request, rows: torch.Tensor) -> tuple[P.Request, list[Any], Any]:
        in_nbytes = rows.numel() * rows.element_size()
        spec = self._spec(request.layer_id)  # sibling group ids too
        out_nbytes = in_nbytes
        if spec is not None and rows.dim() == 2:
            out_nbytes = reply_nbytes(request.op, spec, rows.shape[0], rows.element_size())
            if max(in_nbytes, out_nbytes) < self.inline_threshold and rows.is_cpu and rows.is_contiguous():
                return super()._encode(request, rows)  # small: inline (see ``INLINE_THRESHOLD``)
        reply_at = reply_offset(in_nbytes)
        buffer = self._lease(max(reply_at + out_nbytes, 1))
        buffer.reply_at = reply_at
        try:
            if in_nbytes:  # the one copy of the rows: straight into the segment
                if rows.is_cpu and rows.is_contiguous() and rows.dtype in P.WIRE_NAMES:
                    buffer.view[:in_nbytes] = P.tensor_payload(rows)  # a memcpy, without torch's per-op cost
                else:  # any device or layout
                    buffer.data[:in_nbytes].view(rows.dtype).view(rows.shape).copy_(rows)
        except BaseException:
            self._release(buffer, reusable=True)
            raise
        request = msgspec.structs.replace(request, shm_name=buffer.segment_id, shm_offset=0)
        return request, [P.encode(request)], buffer

    def _decode(self, reply: P.Reply, payload: list[memoryview], lease: Any) -> torch.Tensor:
        if lease is None:  # an inline request
            return super()._decode(reply, payload, lease)
        if reply.dtype not in P.WIRE_DTYPES or len(reply.shape) != 2 or min(reply.shape) < 0 or payload:
            raise ProtocolError(f"malformed reply: dtype {reply.dtype!r}, shape {reply.shape}, {len(payload)} frames")
        nbytes = P.declared_nbytes(reply.dtype, reply.shape)
        start = lease.reply_at
        if start + nbytes > lease.nbytes:
            raise ProtocolError("reply does not fit the shared buffer")
        dtype = P.WIRE_DTYPES[reply.dtype]
        if nbytes == 0:
            return torch.empty(reply.shape, dtype=dtype)
        if nbytes >= HANDOUT_MIN_BYTES and self._hand_out(lease):
            return self._region_result(lease, start, nbytes, dtype, reply.shape)
        # Copy out: the buffer is reused by the next call, the result must outlive it. The result
        # is a tensor of its own, never a view (autograd forbids in-place ops on those).
        result = torch.empty(reply.shape, dtype=dtype)
        P.tensor_payload(result)[:] = lease.view[start : start + nbytes]  # writes into ``result``
        return result

    def _release(self, lease: Any, reusable: bool) -> None:
        if lease is None:
            return
        with self._pool_lock:
            self._leased.discard(lease)
            if lease.handed_out:
                return  # in the caller's hands; back through ``_returned`` when its result dies
            if reusable and not lease.retired and lease.session is self._session:
                self._free.append(lease)
                return
        # The server may still write into it (timeout, lost connection): never reuse it.
        self._retire([lease])

    def _on_session(self, welcome: P.Welcome, conn: _Connection) -> None:
        if not welcome.shm_supported or not welcome.shm_socket:
            raise ProtocolError(
                f"executor at {self.address} does not offer shared memory (it does on ipc:// binds, on Linux)"
            )
        session = _Session(welcome.shm_socket, welcome.session_token, max_segment_bytes(welcome.limits), conn)
        with self._pool_lock:  # the old session's segments died with it on the server: start over
            stale = self._drain_returned() + self._free
            self._free = []
            self._session = session
        self._retire(stale, notify=False)

    def _on_close(self) -> None:
        with self._pool_lock:
            buffers = self._drain_returned() + self._free + list(self._leased) + list(self._handed_out)
            self._free, self._leased, self._handed_out = [], set(), set()
        self._retire(buffers, notify=False)  # the Goodbye ends the session; handed-out results stay valid

    # ---- the pool ----------------------------------------------------------------------------

    def _lease(self, nbytes: int) -> _Buffer:
        """A free buffer of at least ``nbytes``; grows (replaces) the largest one when none fits."""
        with self._pool_lock:
            stale = self._drain_returned()
            fitting = [b for b in self._free if b.nbytes >= nbytes]
            if fitting:
                buffer = min(fitting, key=lambda b: b.nbytes)
                self._free.remove(buffer)
                self._leased.add(buffer)
                self._peak_leased = max(self._peak_leased, len(self._leased))
                return buffer
            grown = max(self._free, key=lambda b: b.nbytes, default=None)
            if grown is not None:
                self._free.remove(grown)
            session = self._session
        assert session is not None
        self._retire(stale)
        size = max(nbytes, min(max(MIN_BUFFER_BYTES, 2 * grown.nbytes if grown else 0), session.max_segment))
        if grown is not None:
            self._retire([grown])
        buffer = self._new_buffer(session, page_round(size))
        with self._pool_lock:
            self._leased.add(buffer)
            self._peak_leased = max(self._peak_leased, len(self._leased))
        return buffer

    def _drain_returned(self) -> list[_Buffer]:
        """(Under ``_pool_lock``.) Take back buffers whose handed-out results died; returns those
        the pool does not keep, for the caller to retire outside the lock. The pool keeps one idle
        buffer more than calls were ever in flight at once (one to hand out while the caller holds
        the last result): no more memory than before handing out, and steady reuse for a caller
        that keeps a few results."""
        surplus: list[_Buffer] = []
        while self._returned:
            buffer = self._returned.popleft()
            buffer.handed_out = False
            self._handed_out.discard(buffer)
            if buffer.retired:
                continue
            if buffer.session is self._session and len(self._free) <= self._peak_leased:
                self._free.append(buffer)
            else:
                surplus.append(buffer)
        return surplus

    def _hand_out(self, lease: _Buffer) -> bool:
        """Whether ``lease``'s region may become the caller's result (then it leaves the pool).

        Only when the next call is unlikely to need a fresh segment for it: while fewer than
        ``FREELY_HANDED_OUT`` results are in the caller's hands (one that drops each result, or
        keeps the previous one while making the next, cycles through two warm segments), or when
        an idle buffer as large remains. A fresh segment costs more than copying out into fresh
        memory (first-touch faults on shared memory cost ~1.5x those of anonymous memory here), so
        a caller that keeps many results mostly gets copies, as it would without handing out."""
        with self._pool_lock:
            stale = self._drain_returned()
            outstanding = len(self._handed_out)
            spare = any(b.nbytes >= lease.nbytes for b in self._free)
            ok = not lease.retired and outstanding < MAX_HANDED_OUT and (outstanding < FREELY_HANDED_OUT or spare)
            if ok:
                lease.handed_out = True
                self._handed_out.add(lease)
        self._retire(stale)
        return ok

    def _region_result(
        self, lease: _Buffer, start: int, nbytes: int, dtype: torch.dtype, shape: list[int]
    ) -> torch.Tensor:
        """``nbytes`` of ``lease`` from ``start`` as the caller's result (zero copy, not a view).

        The storage holds the only reference to a fresh memoryview of the mapping; when the
        storage dies (the result and every view of it are gone) so does the memoryview, and its
        finalizer returns the buffer to the pool."""
        region = memoryview(lease.mapping)[start : start + nbytes]
        finalizer = weakref.finalize(region, _give_back, self._returned, lease)
        finalizer.atexit = False
        flat = torch.frombuffer(region, dtype=torch.uint8)
        del region
        return P.owned_tensor(flat, dtype, shape)

    def _new_buffer(self, session: _Session, nbytes: int) -> _Buffer:
        """A fresh segment from the session's broker. A broker that no longer knows the session
        (the executor restarted) fails the connection, so the call's retry re-handshakes."""
        try:
            return _create_buffer(session, nbytes, self.connect_timeout_s)
        except ExecutorUnavailableError as exc:
            session.conn.fail(str(exc))
            raise

    def _retire(self, buffers: list[_Buffer], notify: bool = True) -> None:
        """Never reuse ``buffers``; (best effort) tell the server to drop its mappings of them.
        Their memory goes when the last mapping (the server's, handed-out results) does."""
        if not buffers:
            return
        with self._pool_lock:  # once each: a late ``_release`` may meet a buffer ``close`` retired
            buffers = [b for b in buffers if not b.retired]
            for buffer in buffers:
                buffer.retired = True
            session = self._session
        if notify and session is not None and session.conn.dead is None:
            segment_ids = [b.segment_id for b in buffers if b.session is session]
            if segment_ids:
                session.conn.send([P.encode(P.ShmRelease(segment_ids))])
