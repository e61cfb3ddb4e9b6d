"""Wire protocol of the ZeroMQ transports: message schema, tensor framing, request validation.

Every message is a multipart ZeroMQ message ``[header, *payload]``. The header is a msgspec
Struct encoded as msgpack (a tagged union, so one decoder reads every kind); payload frames are
raw tensor bytes in C order, sent zero-copy. Nothing is ever pickled: a peer can make us decode
only msgpack maps of known fields and copy bytes into tensors whose size we checked first.

Why validation lives here and runs before any byte is interpreted: the executor is shared by many
jobs, so one buggy or hostile client must get a typed error (``symbiosis.errors``), not crash the
server or make it allocate a tensor of a size the client merely *declared*.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping

import msgspec
import torch

from symbiosis.errors import ProtocolError, ShapeError, UnknownLayerError
from symbiosis.vocabulary import LATENCY_CLASSES_BY_VALUE, OPS_BY_VALUE, LatencyClass, LayerSpec, Op

#: 2: a shared-memory result lies after the rows (``shm_channel.reply_offset``), not over them.
#: 3: shared-memory segments are made by the executor and named by the id it issued
#: (``shm_broker``), never by a file name.
PROTOCOL_VERSION = 3

#: Tensor dtypes allowed on the wire, by wire name. bfloat16 has no numpy dtype, which is why
#: payloads are always handled as raw bytes (``uint8`` views), never via numpy dtypes.
WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}

DEFAULT_MAX_PAYLOAD_BYTES = 1 << 30  # 1 GiB: a whole 8k-token prefill of a 70B-wide layer fits
MAX_HEADER_BYTES = 64 * 1024  # headers are tiny; anything bigger is garbage or an attack
COPY_THRESHOLD = 64 * 1024  # smaller payload frames are copied into ZeroMQ messages (cheaper than tracking)
#: One client session's requests in flight at once. A client thread has one call in flight, so
#: only a client with more threads than this (or one that never reads its replies) meets it.
DEFAULT_MAX_INFLIGHT_REQUESTS = 64
#: Bytes one session may hold in the executor at once: rows and results of its requests in
#: flight, and results queued for it but not yet sent. A single request is always admitted (up
#: to ``max_payload_bytes`` each way), so a large lm_head call never meets this; it bounds what a
#: client that sends many and never reads can pin (issue 10: 64 lm_head calls pinned 660 MB).
DEFAULT_MAX_INFLIGHT_BYTES = 256 << 20


class WireLayerSpec(msgspec.Struct, frozen=True):
    layer_id: str
    in_features: int
    out_features: int
    has_bias: bool

    @classmethod
    def from_spec(cls, spec: LayerSpec) -> WireLayerSpec:
        return cls(spec.layer_id, spec.in_features, spec.out_features, spec.has_bias)

    def to_spec(self) -> LayerSpec:
        return LayerSpec(self.layer_id, self.in_features, self.out_features, self.has_bias)


class Limits(msgspec.Struct, frozen=True):
    """What a server accepts; sent in ``Welcome`` so clients can refuse oversize calls locally."""

    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    allowed_dtypes: tuple[str, ...] = tuple(WIRE_DTYPES)
    max_inflight_requests: int = DEFAULT_MAX_INFLIGHT_REQUESTS
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """Client -> server, first message of a session. ``request_id`` matches the answer to it."""

    version: int
    client_id: str
    request_id: int
    expected_fingerprint: str | None = None
    dist_backend: str = ""  # "gloo" / "nccl": open a torch.distributed pair group for payloads


class Route(msgspec.Struct, frozen=True):
    """A rank of a sharded executor that runs some layers itself (``symbiosis/sharding``): a client
    may send those layers' requests straight to ``address`` (``transport/routing.py``) rather than
    through the rank it connected to, which would relay them."""

    address: str  # a server address of the same kind as the one the client connected to
    layers: list[int]  # indices into ``Welcome.layers``


class Welcome(msgspec.Struct, tag="welcome", frozen=True):
    """Server -> client: what the executor serves and on which terms.

    ``session_token`` is a random 128-bit per-session secret; a client shows it to the executor's
    segment broker (``shm_socket``, a Unix socket next to the ipc socket; empty when shared memory
    is not offered) to get shared-memory segments for this session (``transport/shm_broker.py``).
    """

    version: int
    request_id: int
    fingerprint: str
    layers: list[WireLayerSpec]
    limits: Limits
    heartbeat_s: float
    session_token: str
    shm_supported: bool
    shm_socket: str = ""
    dist_store: str = ""  # "HOST:PORT" of the executor's TCPStore, when the Hello asked for dist
    dist_prefix: str = ""  # this session's secret key prefix in that store
    quantization: str = ""  # how the executor stores the base: "" (full precision), "int8", "fp8-rowwise"
    routes: list[Route] = []  # a sharded executor's other ranks (clients that ignore it are relayed)
    lane_port: int = 0  # where a tcp client may open a lane (``transport/lane.py``) on the same host; 0: none
    # A decode or prefill request of at most this many rows is latency work there (its scheduler's
    # ``decode_share_rows``); 0: not said (an older executor, or none is).
    latency_rows: int = 0
    # Whether requests may carry ``expert_rows`` (``Request``); False from an older executor, or
    # one that does not (a sharded one): a client then calls each expert on its own.
    expert_rows: bool = False


class Request(msgspec.Struct, tag="request", frozen=True):
    """One layer call. Inline payload: one frame follows. Shared memory: ``shm_name`` is set (the
    id the executor gave one of this session's segments), no frame follows, rows lie at
    ``shm_offset`` of that segment and the result right after them (``transport/shm_channel.py``:
    ``reply_offset``).
    torch.distributed: ``dist_tag`` is set, no frame follows, ``dist_nbytes`` bytes travel on the
    session's pair group with that tag, and so does the result (see ``transport/dist_channel.py``).

    ``expert_rows``: ``layer_id`` names a module list of base layers (an MoE's experts tensor,
    ``...experts.gate_up_proj``; ``vocabulary.module_lists``) and the rows are those of its member
    0, then member 1, ..., ``expert_rows[i]`` of them each; the result's rows are each member's
    products, in the same order. One round trip for every expert a layer's tokens chose, where a
    request per expert cost one each. Empty: an ordinary request.
    """

    version: int
    client_id: str
    request_id: int
    layer_id: str
    op: str
    dtype: str
    shape: list[int]
    latency_class: str
    shm_name: str | None = None
    shm_offset: int = 0
    dist_tag: int | None = None
    dist_nbytes: int = 0
    expert_rows: list[int] = []


class Reply(msgspec.Struct, tag="reply", frozen=True):
    """Answer to a ``Request`` (or an error answer to a ``Hello``); ``request_id`` 0 = unknown."""

    request_id: int
    ok: bool
    dtype: str = ""
    shape: list[int] = []
    error_code: str = ""
    error_message: str = ""


class Goodbye(msgspec.Struct, tag="goodbye", frozen=True):
    """Either side ends the session (client closing, or server shutting down)."""

    client_id: str = ""


class Ping(msgspec.Struct, tag="ping", frozen=True):
    """Heartbeat. Clients ping; servers answer ``Pong`` (and probe dead peers with ``Ping``)."""


class Pong(msgspec.Struct, tag="pong", frozen=True):
    pass


class ShmRelease(msgspec.Struct, tag="shm_release", frozen=True):
    """Client -> server: these segments (ids) are retired (grown or discarded); drop their mappings."""

    names: list[str]


Message = Hello | Welcome | Request | Reply | Goodbye | Ping | Pong | ShmRelease

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(header: bytes | memoryview) -> Message:
    """Decode one header frame; anything that is not a known message raises ``ProtocolError``."""
    if len(header) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        return _decoder.decode(header)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"undecodable header: {exc}") from None


def salvage_request_id(header: bytes | memoryview) -> int:
    """Best-effort request id of a header that failed typed decoding, so the error reply can be
    matched by the sender; 0 when there is none."""
    try:
        raw = msgspec.msgpack.decode(header)
    except Exception:  # noqa: BLE001 - garbage is expected here
        return 0
    rid = raw.get("request_id") if isinstance(raw, dict) else None
    return rid if isinstance(rid, int) and not isinstance(rid, bool) and 0 < rid < 2**63 else 0


def error_reply(request_id: int, code: str, message: str) -> Reply:
    return Reply(request_id=request_id, ok=False, error_code=code, error_message=message)


def declared_nbytes(dtype: str, shape: list[int]) -> int:
    return math.prod(shape) * ITEMSIZE[dtype]


def validate_request(header: Request, payload_nbytes: int, specs: Mapping[str, LayerSpec], limits: Limits) -> LayerSpec:
    """Check a request header against the layer registry before any payload byte is read.

    Raises ``ProtocolError`` (version, op, latency class, dtype, size cap), ``UnknownLayerError``
    or ``ShapeError`` (not 2-D, wrong width, bytes that do not match the declared shape). Sizes
    are computed with Python ints, so a huge declared shape cannot overflow into a small one.
    Returns the layer's spec for the caller's convenience.
    """
    if header.version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {header.version} not supported (server speaks {PROTOCOL_VERSION})")
    op = OPS_BY_VALUE.get(header.op)
    if op is None:
        raise ProtocolError(f"unknown op {header.op!r}; supported: {[o.value for o in Op]}")
    if header.latency_class not in LATENCY_CLASSES_BY_VALUE:
        supported = [c.value for c in LatencyClass]
        raise ProtocolError(f"unknown latency class {header.latency_class!r}; supported: {supported}")
    spec = specs.get(header.layer_id)
    if spec is None:
        raise UnknownLayerError(f"unknown layer {header.layer_id!r} (the executor serves {len(specs)} layers)")
    if header.dtype not in limits.allowed_dtypes or header.dtype not in WIRE_DTYPES:
        raise ProtocolError(f"dtype {header.dtype!r} not allowed; allowed: {list(limits.allowed_dtypes)}")
    shape = header.shape
    if len(shape) != 2 or any(d < 0 for d in shape):
        raise ShapeError(f"rows must be a 2-D shape with non-negative dims, got {shape}")
    width = op.input_width(spec)
    if shape[1] != width:
        raise ShapeError(f"{op.value} of layer {spec.layer_id!r} takes rows of width {width}, got {shape[1]}")
    nbytes = declared_nbytes(header.dtype, shape)
    out_nbytes = shape[0] * op.output_width(spec) * ITEMSIZE[header.dtype]
    if max(nbytes, out_nbytes) > limits.max_payload_bytes:
        raise ProtocolError(
            f"request of {nbytes} bytes (result {out_nbytes} bytes) exceeds the cap of {limits.max_payload_bytes} bytes"
        )
    if nbytes != payload_nbytes:
        raise ShapeError(f"shape {shape} of {header.dtype} needs {nbytes} payload bytes, got {payload_nbytes}")
    if header.expert_rows:
        check_expert_rows(header.layer_id, header.expert_rows, shape[0])
    return spec


def expert_row_counts(counts) -> list[int]:
    """A caller's ``expert_rows`` (a list, a tuple, numpy or tensor integers) as a list of Python
    ints, as the header carries them; ``ShapeError`` for anything else."""
    try:
        ints = [operator.index(n) for n in counts]
    except TypeError:
        ints = None
    if ints is None or any(not -(2**63) <= n < 2**63 for n in ints):  # (what msgpack carries)
        raise ShapeError(f"expert_rows must be integer row counts, got {list(counts)[:16]}")
    return ints


def check_expert_rows(layer_id: str, expert_rows, rows: int) -> None:
    """What a request's ``expert_rows`` must be whatever the layer: non-negative counts that add
    up to its rows (the executor checks the layer takes them: ``ExecutionEngine.validate``)."""
    if any(type(n) is not int or n < 0 for n in expert_rows) or sum(expert_rows) != rows:
        raise ShapeError(
            f"expert_rows of {layer_id!r} must be non-negative row counts adding up to the request's "
            f"{rows} rows, got {list(expert_rows)[:16]}{' ...' if len(expert_rows) > 16 else ''}"
        )


class CallShape(msgspec.Struct, frozen=True):
    """What every valid request of one (layer, op, dtype, latency class) sends and gets back
    (``call_shape``): checked once, it leaves only the row count to check per call."""

    op: Op
    in_width: int
    out_width: int
    itemsize: int
    max_rows: int  # most rows whose rows and result both fit ``Limits.max_payload_bytes``


def call_shape(
    layer_id: str, op: str, dtype: str, latency_class: str, specs: Mapping[str, LayerSpec], limits: Limits
) -> CallShape | None:
    """The ``CallShape`` of requests with this header, or None if ``validate_request`` refuses a
    one-row request of it (the caller then sends or serves it the general way, which says why).
    The lane fast paths of both sides use it (``transport/lane_routes.py``, ``ZmqTransport``)."""
    spec, op_enum, itemsize = specs.get(layer_id), OPS_BY_VALUE.get(op), ITEMSIZE.get(dtype)
    if spec is None or op_enum is None or itemsize is None:
        return None
    in_width, out_width = op_enum.input_width(spec), op_enum.output_width(spec)
    one_row = Request(PROTOCOL_VERSION, "", 1, layer_id, op, dtype, [1, in_width], latency_class)
    try:
        validate_request(one_row, in_width * itemsize, {layer_id: spec}, limits)
    except (ProtocolError, ShapeError, UnknownLayerError):
        return None
    max_rows = limits.max_payload_bytes // (max(in_width, out_width) * itemsize)
    return CallShape(op_enum, in_width, out_width, itemsize, max_rows)


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype (``torch.float32`` -> ``"float32"``), allowed or not."""
    name = WIRE_NAMES.get(dtype)
    return name if name is not None else str(dtype).removeprefix("torch.")


#: torch dtype -> wire name, for the allowed ones (a dict lookup, not a string operation, per call).
WIRE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in WIRE_DTYPES.items()}
#: numpy has no bfloat16: its bytes are exposed as int16 (same size) to get a buffer.
BUFFER_DTYPES = {torch.bfloat16: torch.int16}


def tensor_payload(tensor: torch.Tensor) -> memoryview:
    """Raw bytes of a contiguous CPU tensor, without copying (works for bfloat16 too)."""
    if not tensor.is_contiguous() or not tensor.is_cpu:
        raise ValueError("tensor_payload needs a contiguous CPU tensor")
    if tensor.numel() == 0:
        return memoryview(b"")
    as_dtype = BUFFER_DTYPES.get(tensor.dtype)
    return memoryview((tensor if as_dtype is None else tensor.view(as_dtype)).numpy()).cast("B")


def rows_from_payload(buffer: memoryview | bytes | bytearray, dtype: str, shape: list[int]) -> torch.Tensor:
    """Executor side: the rows of ``shape`` over ``buffer`` (zero-copy; a view, which is all a
    product needs). The caller has validated ``len(buffer)``. The bytes may lie at any address:
    the executor aligns what it multiplies in the thread that runs the product
    (``executor/runner.py`` ``aligned``), not in the server's socket thread that calls this."""
    torch_dtype = WIRE_DTYPES[dtype]
    count = shape[0] * shape[1]
    if count == 0:
        return torch.empty(shape, dtype=torch_dtype)
    return torch.frombuffer(buffer, dtype=torch_dtype, count=count).view(shape)


def tensor_from_payload(buffer: memoryview | bytes | bytearray, dtype: str, shape: list[int]) -> torch.Tensor:
    """Client side: a tensor of ``shape`` over ``buffer`` (zero-copy; the tensor keeps the buffer
    alive). The caller has validated ``len(buffer)``; misaligned bytes are copied (see
    ``executor/runner.py`` ``aligned``: downstream kernels then see what a torch allocation gives).

    The result is a tensor of its own, not a view: a transport's result flows out of a custom
    autograd Function, where autograd forbids in-place ops on views, and peft adds adapter
    outputs in place. (``resize_`` to the same number of elements only sets the shape.)
    """
    torch_dtype = WIRE_DTYPES[dtype]
    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=torch_dtype)
    flat = torch.frombuffer(buffer, dtype=torch_dtype, count=count)
    if flat.data_ptr() % 64:
        flat = flat.clone()  # 64-byte aligned like every torch allocation: same kernels, same bits
    return flat.resize_(shape)


def owned_tensor(flat_bytes: torch.Tensor, dtype: torch.dtype, shape: list[int] | tuple[int, ...]) -> torch.Tensor:
    """``flat_bytes`` (a contiguous ``uint8`` tensor) reinterpreted as ``dtype`` of ``shape``,
    sharing its memory but *not* a view of it (``_base`` is None), so autograd lets callers modify
    it in place. ``.view(dtype).view(shape)`` would give the same bits as a view."""
    assert flat_bytes.dtype == torch.uint8 and flat_bytes.is_contiguous()
    offset_bytes = flat_bytes.storage_offset()
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if offset_bytes % itemsize:
        flat_bytes = flat_bytes.clone()
        offset_bytes = 0
    owned = torch.empty(0, dtype=dtype, device=flat_bytes.device)
    return owned.set_(flat_bytes.untyped_storage(), offset_bytes // itemsize, tuple(shape))
