"""Same-host fast path, server side: ``ShmChannel`` reads rows from, and writes results into, the
client's shared-memory segments. The client side is ``shm_client.ShmTransport``; this module
never imports it (the server must not depend on the client), and the client takes the shared
bits (``SHM_DIR``, ``segment_name_ok``, ``reply_nbytes``, ``reply_offset``) from here.

Address form: ``shm+ipc:///path/executor.sock`` (or ``shm+tcp://127.0.0.1:PORT``): the part after
``shm+`` is the ``ZmqServer`` address; one server serves inline and shared-memory clients alike.

Layout and copies (the paper, §3.5): a request names a segment of the client's and an offset; the
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

Segment lifecycle: the *client* creates each segment (``/dev/shm``, mode 0600, name ``symb_<session
token>_<random>``) and the server maps it on first use, checking the name carries this session's
secret token (so a client cannot name another's buffer), and — before any payload byte is
touched — that the header is valid (``protocol.validate_request``) and the file is large enough.
Segments live for one session: when the session ends — Goodbye, a detected dead client
(``kill -9``), or server shutdown — the server drops its mappings and unlinks the names; the
client unlinks them too when it retires a buffer, reconnects or closes (whoever comes second gets
``FileNotFoundError``, which is fine). Mappings are ``torch.from_file`` storages, so memory is
returned when the last tensor viewing it (e.g. rows the executor still holds) dies.

Linux only (segments are files under ``/dev/shm``). Trust model: same host, same user — a peer
that can connect to the ipc socket could also truncate its own segment under the server.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from symbiosis import protocol as P
from symbiosis.errors import ProtocolError
from symbiosis.transport.channels import Accepted, ChannelHost, RequestKey, Session
from symbiosis.vocabulary import LayerSpec, Op

SHM_DIR = "/dev/shm"
MAX_SEGMENTS_PER_SESSION = 64
#: Offsets into a segment are multiples of this (every torch kernel is happy with it).
ALIGNMENT = 64
_NAME = re.compile(r"[A-Za-z0-9_]{1,200}")


def segment_name_ok(name: str, prefix: str) -> bool:
    """Whether ``name`` is a plain file name under ``SHM_DIR`` that starts with ``prefix``."""
    return _NAME.fullmatch(name) is not None and name.startswith(prefix)


def reply_nbytes(op: Op | str, spec: LayerSpec, rows: int, itemsize: int) -> int:
    """Bytes of the result of ``op`` on ``rows`` rows of ``spec``."""
    return rows * Op(op).output_width(spec) * itemsize


def reply_offset(rows_nbytes: int) -> int:
    """Where the result region starts, relative to the request's ``shm_offset``: right after the
    rows, rounded up to ``ALIGNMENT`` (disjoint from them)."""
    return -(-rows_nbytes // ALIGNMENT) * ALIGNMENT


class SegmentMap:
    """Server side: the shared-memory segments one client session has named, mapped on demand."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._maps: dict[str, torch.Tensor] = {}

    def region(self, name: str, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` bytes at ``offset`` of segment ``name`` as a uint8 tensor (zero-copy)."""
        if not segment_name_ok(name, self._prefix):
            raise ProtocolError(f"shared-memory segment {name!r} does not belong to this session")
        if offset < 0 or offset % ALIGNMENT:
            raise ProtocolError(f"shared-memory offset {offset} must be a non-negative multiple of {ALIGNMENT}")
        segment = self._maps.get(name)
        if segment is None:
            if len(self._maps) >= MAX_SEGMENTS_PER_SESSION:
                raise ProtocolError(f"more than {MAX_SEGMENTS_PER_SESSION} live shared-memory segments")
            path = os.path.join(SHM_DIR, name)
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                raise ProtocolError(f"no shared-memory segment {name!r} on the executor's host") from None
            if size == 0:
                raise ProtocolError(f"shared-memory segment {name!r} is empty")
            segment = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            self._maps[name] = segment
        if offset + nbytes > segment.numel():
            raise ProtocolError(f"segment {name!r} has {segment.numel()} bytes, request needs {offset + nbytes}")
        return segment[offset : offset + nbytes]

    def release(self, names: list[str]) -> None:
        for name in names:
            self._maps.pop(name, None)

    def close(self) -> None:
        """End of session: forget every mapping and unlink every name (the client is gone)."""
        for name in self._maps:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass
        self._maps.clear()


class ShmChannel:
    """Server side (``channels.PayloadChannel``): rows are read from, and results written into,
    the segment a request names; the session's ``SegmentMap`` lives in its ``channel_state``.
    The ticket of an accepted request is its reply region: ``[rows, out]`` in the wire dtype,
    right after the rows (see the module doc); it is also ``Accepted.out``, for the executor to
    compute into."""

    def __init__(self, host: ChannelHost, specs: dict[str, LayerSpec], limits: P.Limits) -> None:
        self._host = host
        self._specs = specs
        self._limits = limits

    def accept(self, session: Session, key: RequestKey, req: P.Request, frames: list[Any]) -> Accepted:
        if frames:
            raise ProtocolError("a shared-memory request carries no payload frame")
        well_formed = req.dtype in P.ITEMSIZE and len(req.shape) == 2 and min(req.shape) >= 0
        nbytes = P.declared_nbytes(req.dtype, req.shape) if well_formed else -1
        spec = P.validate_request(req, nbytes, self._specs, self._limits)  # before any payload byte
        dtype = P.WIRE_DTYPES[req.dtype]
        out_shape = (req.shape[0], Op(req.op).output_width(spec))
        out_nbytes = reply_nbytes(req.op, spec, req.shape[0], P.ITEMSIZE[req.dtype])
        segments = session.channel_state.get("shm")
        if segments is None:
            segments = session.channel_state["shm"] = SegmentMap(P.shm_prefix(session.token))
        assert req.shm_name is not None
        result_at = reply_offset(nbytes)
        region = segments.region(req.shm_name, req.shm_offset, result_at + out_nbytes)  # checks the size once
        rows = region[:nbytes].view(dtype).view(req.shape)  # zero-copy, valid until the reply
        out = region[result_at:].view(dtype).view(out_shape)  # disjoint from the rows
        return Accepted(spec, rows, out, out)

    def reply(self, session: Session, req: P.Request, reply: P.Reply, result: torch.Tensor, ticket: Any) -> None:
        if result.numel():
            _copy_into(ticket, result)
        self._host.send(session.identity, reply)

    def release(self, session: Session, names: list[str]) -> None:
        segments = session.channel_state.get("shm")
        if segments is not None:
            segments.release(names)

    def end_session(self, session: Session) -> None:
        segments = session.channel_state.pop("shm", None)
        if segments is not None:
            segments.close()

    def close(self) -> None:
        pass


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
