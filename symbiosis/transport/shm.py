"""Same-host fast path: tensor payloads in shared memory, control messages over ZeroMQ.

Address form: ``shm+ipc:///path/executor.sock`` (or ``shm+tcp://127.0.0.1:PORT``): the part after
``shm+`` is the ``ZmqServer`` address; one server serves inline and shared-memory clients alike.

Why: copying activations through a socket costs two memcpys and a syscall per chunk; with a
shared buffer the client writes rows once, the server computes on a view of them and writes the
result back in place (the paper, §3.5). Like the paper, each client keeps a buffer sized
``rows × max(in, out) × itemsize`` that is reused across calls and replaced by a bigger one (at
least twice the size) when a call does not fit — so buffers are allocated O(log size) times. A
client that calls from several threads at once holds one buffer per concurrent call (a pool).

Buffer lifecycle: the *client* creates each segment (``multiprocessing.shared_memory``, mode
0600, name ``symb_<session token>_<random>``) and the server maps it on first use, checking the
name carries this session's secret token (so a client cannot name another's buffer) and that the
file is large enough. Segments live for one session: when the session ends — Goodbye, a detected
dead client (``kill -9``), or server shutdown — the server drops its mappings and unlinks the
names; the client unlinks them too when it retires a buffer, reconnects or closes (whoever comes
second gets ``FileNotFoundError``, which is fine). Mappings are ``torch.from_file`` storages, so
memory is returned when the last tensor viewing it (e.g. rows the executor still holds) dies.

Linux only (segments are files under ``/dev/shm``). Trust model: same host, same user — a peer
that can connect to the ipc socket could also truncate its own segment under the server.
"""

from __future__ import annotations

import math
import os
import re
import threading
import uuid
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import torch

from symbiosis import protocol as P
from symbiosis.errors import ProtocolError
from symbiosis.transport.channels import Accepted, ChannelHost, RequestKey, Session
from symbiosis.transport.zmq_client import ZmqTransport, _Connection
from symbiosis.vocabulary import LayerSpec, Op

SHM_DIR = "/dev/shm"
MIN_BUFFER_BYTES = 1 << 20
MAX_SEGMENTS_PER_SESSION = 64
_NAME = re.compile(r"[A-Za-z0-9_]{1,200}")


class SegmentMap:
    """Server side: the shared-memory segments one client session has named, mapped on demand."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._maps: dict[str, torch.Tensor] = {}

    def region(self, name: str, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` bytes at ``offset`` of segment ``name`` as a uint8 tensor (zero-copy)."""
        if not _NAME.fullmatch(name) or not name.startswith(self._prefix):
            raise ProtocolError(f"shared-memory segment {name!r} does not belong to this session")
        if offset < 0 or offset % 64:
            raise ProtocolError(f"shared-memory offset {offset} must be a non-negative multiple of 64")
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
    the segment a request names; the session's ``SegmentMap`` lives in its ``channel_state``."""

    def __init__(self, host: ChannelHost, specs: dict[str, LayerSpec], limits: P.Limits) -> None:
        self._host = host
        self._specs = specs
        self._limits = limits

    def accept(self, session: Session, key: RequestKey, req: P.Request, frames: list[Any]) -> Accepted:
        if frames:
            raise ProtocolError("a shared-memory request carries no payload frame")
        well_formed = req.dtype in P.ITEMSIZE and len(req.shape) == 2 and min(req.shape) >= 0
        nbytes = P.declared_nbytes(req.dtype, req.shape) if well_formed else -1
        spec = P.validate_request(req, nbytes, self._specs, self._limits)
        out_nbytes = req.shape[0] * Op(req.op).output_width(spec) * P.ITEMSIZE[req.dtype]
        segments = session.channel_state.get("shm")
        if segments is None:
            segments = session.channel_state["shm"] = SegmentMap(P.shm_prefix(session.token))
        assert req.shm_name is not None
        region = segments.region(req.shm_name, req.shm_offset, max(nbytes, out_nbytes))
        return Accepted(spec, region[:nbytes].view(P.WIRE_DTYPES[req.dtype]).view(req.shape), region)

    def reply(self, session: Session, req: P.Request, reply: P.Reply, result: torch.Tensor, ticket: Any) -> None:
        if result.numel():
            result = result.to("cpu").contiguous()
            ticket[: result.numel() * result.element_size()].copy_(result.reshape(-1).view(torch.uint8))
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


@dataclass(eq=False)
class _Buffer:
    """Client side: one segment, mapped as a uint8 tensor."""

    shm: shared_memory.SharedMemory
    data: torch.Tensor

    @property
    def name(self) -> str:
        return self.shm.name

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def _create_buffer(prefix: str, nbytes: int) -> _Buffer:
    shm = shared_memory.SharedMemory(name=f"{prefix}{uuid.uuid4().hex[:16]}", create=True, size=nbytes)
    try:
        data = torch.from_file(os.path.join(SHM_DIR, shm.name), shared=True, size=nbytes, dtype=torch.uint8)
    except BaseException:
        _unlink(shm)
        raise
    finally:
        shm.close()  # torch's mapping is the one we use; Python's would pin exports at close time
    return _Buffer(shm, data)


def _unlink(shm: shared_memory.SharedMemory) -> None:
    try:
        shm.unlink()
    except FileNotFoundError:
        # The server unlinked it first (session end); tell our resource tracker it is not leaked.
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]


class ShmTransport(ZmqTransport):
    """``ZmqTransport`` whose payloads travel in shared memory (address ``shm+ipc://…``)."""

    def __init__(self, address: str, **kwargs: Any) -> None:
        if not address.startswith("shm+"):
            raise ValueError(f"shared-memory address must start with 'shm+', got {address!r}")
        self._pool_lock = threading.Lock()
        self._free: list[_Buffer] = []
        self._leased: set[_Buffer] = set()
        self._prefix = ""
        self._session_conn: _Connection | None = None
        super().__init__(address[len("shm+") :], **kwargs)
        self.address = address

    def buffer_bytes(self) -> int:
        """Bytes of shared memory this client holds now (idle and in use)."""
        with self._pool_lock:
            return sum(b.nbytes for b in self._free) + sum(b.nbytes for b in self._leased)

    def _encode(self, request: P.Request, rows: torch.Tensor) -> tuple[P.Request, list[Any], Any]:
        in_nbytes = rows.numel() * rows.element_size()
        spec = self._specs.get(request.layer_id)
        out_nbytes = in_nbytes
        if spec is not None and rows.dim() == 2:
            out_nbytes = rows.shape[0] * Op(request.op).output_width(spec) * rows.element_size()
        buffer = self._lease(max(in_nbytes, out_nbytes, 1))
        if in_nbytes:
            buffer.data[:in_nbytes].copy_(rows.reshape(-1).view(torch.uint8))
        request = P.Request(
            request.version,
            request.client_id,
            request.request_id,
            request.layer_id,
            request.op,
            request.dtype,
            request.shape,
            request.latency_class,
            shm_name=buffer.name,
            shm_offset=0,
        )
        return request, [P.encode(request)], buffer

    def _decode(self, reply: P.Reply, frames: list[Any], lease: Any) -> torch.Tensor:
        if reply.dtype not in P.WIRE_DTYPES or len(reply.shape) != 2 or frames:
            raise ProtocolError(f"malformed reply: dtype {reply.dtype!r}, shape {reply.shape}, {len(frames)} frames")
        nbytes = P.declared_nbytes(reply.dtype, reply.shape)
        if nbytes > lease.nbytes:
            raise ProtocolError("reply does not fit the shared buffer")
        dtype = P.WIRE_DTYPES[reply.dtype]
        if nbytes == 0:
            return torch.empty(reply.shape, dtype=dtype)
        # Copy out: the buffer is reused by the next call, the result must outlive it. The result
        # is a tensor of its own, never a view (autograd forbids in-place ops on those).
        result = torch.empty(reply.shape, dtype=dtype)
        result.view(-1).view(torch.uint8).copy_(lease.data[:nbytes])
        return result

    def _release(self, lease: Any, reusable: bool) -> None:
        if lease is None:
            return
        with self._pool_lock:
            self._leased.discard(lease)
            if reusable and lease.name.startswith(self._prefix):
                self._free.append(lease)
                return
        # The server may still write into it (timeout, lost connection): never reuse it.
        self._retire([lease])

    def _on_session(self, welcome: P.Welcome, conn: _Connection) -> None:
        if not welcome.shm_supported:
            raise ProtocolError(f"executor at {self.address} does not accept shared-memory requests")
        with self._pool_lock:  # the old session's segments are unlinked by the server: start over
            stale, self._free = self._free, []
            self._prefix = P.shm_prefix(welcome.session_token)
            self._session_conn = conn
        self._retire(stale, notify=False)

    def _on_close(self) -> None:
        with self._pool_lock:
            buffers = self._free + list(self._leased)
            self._free, self._leased = [], set()
        self._retire(buffers, notify=False)

    def _lease(self, nbytes: int) -> _Buffer:
        """A free buffer of at least ``nbytes``; grows (replaces) the largest one when none fits."""
        with self._pool_lock:
            fitting = [b for b in self._free if b.nbytes >= nbytes]
            if fitting:
                buffer = min(fitting, key=lambda b: b.nbytes)
                self._free.remove(buffer)
                self._leased.add(buffer)
                return buffer
            grown = max(self._free, key=lambda b: b.nbytes, default=None)
            if grown is not None:
                self._free.remove(grown)
            prefix = self._prefix
        size = max(nbytes, MIN_BUFFER_BYTES, 2 * grown.nbytes if grown else 0)
        size = math.ceil(size / 4096) * 4096
        if grown is not None:
            self._retire([grown])
        buffer = _create_buffer(prefix, size)
        with self._pool_lock:
            self._leased.add(buffer)
        return buffer

    def _retire(self, buffers: list[_Buffer], notify: bool = True) -> None:
        """Unlink ``buffers`` and (best effort) tell the server to drop its mappings of them."""
        if not buffers:
            return
        conn = self._session_conn
        if notify and conn is not None and conn.dead is None:
            conn.send([P.encode(P.ShmRelease([b.name for b in buffers]))])
        for buffer in buffers:
            _unlink(buffer.shm)
