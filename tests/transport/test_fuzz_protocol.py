"""Property-based fuzzing of header decoding and request validation (issue 10, Fuzz).

Any byte string a peer sends as a header is either a valid message or a typed error
(``ProtocolError`` and its subclasses), never another exception; the same holds for the server
loop, which answers garbage with a typed error reply and keeps serving. Examples are few and
small so the file runs in a few seconds.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from symbiosis import protocol as P
from symbiosis.errors import ERRORS_BY_CODE, ProtocolError, SymbiosisError
from symbiosis.transport.zmq import ZmqServer
from symbiosis.transport.zmq_context import new_context
from symbiosis.vocabulary import LayerSpec

from .fakes import FakeExecutorService

MESSAGES = (P.Hello, P.Welcome, P.Request, P.Reply, P.Goodbye, P.Ping, P.Pong, P.ShmRelease)
TAGS = ("hello", "welcome", "request", "reply", "goodbye", "ping", "pong", "shm_release", "bogus")
FIELDS = sorted({f for cls in MESSAGES for f in cls.__struct_fields__} | {"type"})
SPECS = {"q": LayerSpec("q", 16, 24, True), "o": LayerSpec("o", 24, 16, False)}
LIMITS = P.Limits(max_payload_bytes=1 << 16)

FUZZ = settings(max_examples=150, deadline=None, database=None)

# ---- strategies ---------------------------------------------------------------------------------

# Everything msgpack can carry, nested a little.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.binary(max_size=12),
)
msgpack_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)

# Values a field of a real header might hold, valid or just off.
near_values = st.one_of(
    msgpack_values,
    st.sampled_from(
        [
            "q",
            "o",
            "k",
            "forward",
            "backward",
            "noise",
            "merge",
            "float32",
            "bfloat16",
            "float64",
            "decode",
            "prefill",
            "finetune",
            "gloo",
            "",
            "symb_x_",
        ]
    ),
    st.integers(-3, 3),
    st.just(P.PROTOCOL_VERSION),
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3),
    st.lists(st.integers(-1, 40), min_size=2, max_size=2),
)

CLIENTS = ("fuzz", "fuzz", "fuzz", "other", "")  # the server fuzz's peer has a session as "fuzz"

# Requests whose every field is usually valid, so that validation gets past its first check.
request_fields = st.fixed_dictionaries(
    {
        "version": st.sampled_from([P.PROTOCOL_VERSION] * 4 + [0, 2**40]),
        "client_id": st.sampled_from(["fuzz"] * 6 + ["other", "", "fuzz\x00"]),
        "request_id": st.integers(0, 2**63 - 1),
        "layer_id": st.sampled_from(["q", "q", "o", "o", "k", "", "q\x00"]),
        "op": st.sampled_from(["forward", "forward", "backward", "noise", "merge"]),
        "dtype": st.sampled_from(["float32", "float32", "bfloat16", "float16", "float64", ""]),
        "shape": st.one_of(
            st.tuples(st.integers(0, 8) | st.integers(-(2**63), 2**63 - 1), st.sampled_from([16, 24, 17, -1])).map(
                list
            ),
            st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4),
        ),
        "latency_class": st.sampled_from(["decode", "prefill", "finetune", "urgent"]),
    }
)
requests = request_fields.map(lambda fields: P.Request(**fields))
hellos = st.builds(
    P.Hello,
    version=st.sampled_from([P.PROTOCOL_VERSION, P.PROTOCOL_VERSION, 1]),
    client_id=st.sampled_from(CLIENTS),
    request_id=st.integers(0, 2**63 - 1),
    expected_fingerprint=st.none() | st.sampled_from(["fake-0", "fake-1"]),
    dist_backend=st.sampled_from(["", "", "gloo", "mpi"]),
)
valid_messages = st.one_of(
    requests,
    hellos,
    st.builds(P.Goodbye, client_id=st.sampled_from(CLIENTS)),
    st.just(P.Ping()),
    st.builds(P.ShmRelease, names=st.lists(st.text(max_size=12), max_size=2)),
)


@st.composite
def mutated_headers(draw) -> bytes:
    """A real message as a msgpack map, with up to three fields dropped or given other values."""
    fields = msgspec.to_builtins(draw(valid_messages))
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(FIELDS))
        if draw(st.booleans()):
            fields.pop(name, None)
        else:
            fields[name] = draw(st.sampled_from(TAGS) if name == "type" else near_values)
    return msgspec.msgpack.encode(fields)


headers = st.one_of(st.binary(max_size=200), msgpack_values.map(msgspec.msgpack.encode), mutated_headers())


def exact_nbytes(request: P.Request) -> int | None:
    """The payload size a request declares, where it declares one."""
    if request.dtype not in P.ITEMSIZE or any(d < 0 for d in request.shape):
        return None
    return P.declared_nbytes(request.dtype, request.shape)


# ---- decoding and validation --------------------------------------------------------------------


def decode_or_typed_error(header: bytes) -> P.Message | None:
    """The decoded message, or None after a typed error; any other exception fails the test."""
    try:
        message = P.decode(header)
    except ProtocolError:
        return None
    assert isinstance(message, MESSAGES)
    return message


def validate_or_typed_error(request: P.Request, payload_nbytes: int) -> LayerSpec | None:
    try:
        spec = P.validate_request(request, payload_nbytes, SPECS, LIMITS)
    except ProtocolError:  # UnknownLayerError and ShapeError are ProtocolErrors
        return None
    assert spec is SPECS[request.layer_id] and len(request.shape) == 2
    assert P.declared_nbytes(request.dtype, request.shape) == payload_nbytes <= LIMITS.max_payload_bytes
    return spec


@FUZZ
@given(headers, st.integers(0, 1 << 17))
def test_any_header_is_a_message_or_a_protocol_error(header: bytes, payload_nbytes: int) -> None:
    message = decode_or_typed_error(header)
    if isinstance(message, P.Request):
        validate_or_typed_error(message, payload_nbytes)
    rid = P.salvage_request_id(header)
    assert type(rid) is int and 0 <= rid < 2**63


@FUZZ
@given(requests, st.integers(0, 1 << 17))
def test_any_request_is_valid_or_a_protocol_error(request: P.Request, payload_nbytes: int) -> None:
    validate_or_typed_error(request, payload_nbytes)
    exact = exact_nbytes(request)  # the one size that may pass
    if exact is not None:
        validate_or_typed_error(request, exact)
    assert decode_or_typed_error(P.encode(request)) == request


def test_oversize_header_is_refused_before_decoding() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        P.decode(b"\x80" * (P.MAX_HEADER_BYTES + 1))


# ---- the server loop ----------------------------------------------------------------------------


class Peer:
    """A bare DEALER socket that sends anything, then a Hello as "fuzz" as a barrier.

    The barrier's Welcome shows the server still serves, and leaves the peer a session as "fuzz"
    (so the next requests reach validation). A Welcome, unlike a Pong, is never dropped when the
    peer's send queue is full, and its request id tells it from a Welcome that fuzz asked for.
    """

    def __init__(self, address: str) -> None:
        self.ctx = new_context(linger_ms=0)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.barriers = itertools.count(2**62)
        self.answers_after([P.encode(P.Ping())])

    def answers_after(self, frames: list[bytes]) -> list[P.Message]:
        """Send ``frames`` and a barrier; every message before the barrier's Welcome but heartbeats."""
        barrier = next(self.barriers)
        self.sock.send_multipart(frames)
        self.sock.send_multipart([P.encode(P.Hello(P.PROTOCOL_VERSION, "fuzz", barrier))])
        seen: list[P.Message] = []
        while True:
            assert self.sock.poll(5000), "the server stopped answering"
            header, *_ = self.sock.recv_multipart()
            message = P.decode(header)
            if isinstance(message, P.Welcome) and message.request_id == barrier:
                return seen
            if not isinstance(message, (P.Ping, P.Pong)):
                seen.append(message)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    folder = tempfile.mkdtemp(prefix="symb-fuzz-", dir="/tmp")
    service = FakeExecutorService(threaded=True)
    # Shared memory and torch.distributed payloads have their own tests; this fuzzes the headers.
    server = ZmqServer(service, f"ipc://{folder}/fuzz.sock", allow_shm=False, allow_dist=False).start()
    client = Peer(server.address)
    yield client
    client.close()
    server.close(drain=False)
    service.close()
    shutil.rmtree(folder, ignore_errors=True)


@st.composite
def messages(draw) -> list[bytes]:
    """Header and payload frames; a request's payload is often exactly the size it declares."""
    header = draw(st.one_of(headers, hellos.map(P.encode), requests.map(P.encode)))
    try:
        request = P.decode(header)
    except ProtocolError:
        request = None
    if isinstance(request, P.Request) and draw(st.sampled_from([True, True, False])):
        nbytes = exact_nbytes(request)
        if nbytes is not None and nbytes <= 4096:
            return [header, bytes(nbytes)]
    return [header, *draw(st.lists(st.binary(max_size=64), max_size=2))]


@settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages())
def test_server_answers_garbage_with_typed_errors_and_keeps_serving(peer: Peer, frames: list[bytes]) -> None:
    for message in peer.answers_after(frames):
        if isinstance(message, P.Reply) and not message.ok:
            # "internal" is what the server's last-resort guard sends when a handler raised
            # something untyped: garbage must be turned away before that.
            assert message.error_code != SymbiosisError.code, message.error_message
            assert message.error_code in ERRORS_BY_CODE, message.error_code
