"""Server configuration and wire-protocol validation, without a running client."""

from __future__ import annotations

import pytest
import torch

from symbiosis import protocol as P
from symbiosis.errors import ProtocolError, ShapeError, UnknownLayerError
from symbiosis.transport.zmq import ZmqServer, ZmqTransport
from symbiosis.vocabulary import LayerSpec

from .fakes import FakeExecutorService


def test_non_loopback_bind_is_refused(fake: FakeExecutorService) -> None:
    for address in ("tcp://0.0.0.0:0", "tcp://*:0", "tcp://10.1.2.3:0"):
        with pytest.raises(ValueError, match="allow_non_loopback"):
            ZmqServer(fake, address)
    server = ZmqServer(fake, "tcp://0.0.0.0:0", allow_non_loopback=True).start()
    server.close()


def test_transport_refuses_unknown_scheme() -> None:
    with pytest.raises(ValueError):
        ZmqTransport("http://127.0.0.1:80")


SPECS = {"q": LayerSpec("q", 16, 24, True)}
LIMITS = P.Limits(max_payload_bytes=1 << 20)


def header(**overrides: object) -> P.Request:
    fields: dict[str, object] = dict(
        version=P.PROTOCOL_VERSION,
        client_id="c",
        request_id=1,
        layer_id="q",
        op="forward",
        dtype="float32",
        shape=[2, 16],
        latency_class="decode",
    )
    fields.update(overrides)
    return P.Request(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "nbytes", "error"),
    [
        ({}, 128, None),
        ({"shape": [0, 16]}, 0, None),
        ({"op": "backward", "shape": [2, 24]}, 192, None),
        ({"dtype": "bfloat16"}, 64, None),
        ({"version": 99}, 128, ProtocolError),
        ({"op": "merge"}, 128, ProtocolError),
        ({"latency_class": "urgent"}, 128, ProtocolError),
        ({"layer_id": "k"}, 128, UnknownLayerError),
        ({"dtype": "float64"}, 256, ProtocolError),
        ({"shape": [32]}, 128, ShapeError),
        ({"shape": [2, 8, 2]}, 128, ShapeError),
        ({"shape": [-2, 16]}, 128, ShapeError),
        ({"shape": [2, 17]}, 136, ShapeError),
        ({"op": "backward"}, 128, ShapeError),
        ({}, 127, ShapeError),
        ({"shape": [2**62, 16]}, 128, ProtocolError),
        ({"shape": [1 << 14, 16]}, 1 << 20, ProtocolError),  # result (width 24) over the cap
    ],
)
def test_validate_request(overrides: dict[str, object], nbytes: int, error: type[Exception] | None) -> None:
    if error is None:
        assert P.validate_request(header(**overrides), nbytes, SPECS, LIMITS) == SPECS["q"]
    else:
        with pytest.raises(error):
            P.validate_request(header(**overrides), nbytes, SPECS, LIMITS)


def test_payload_round_trip_without_numpy_dtypes() -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        tensor = torch.randn(5, 7).to(dtype)
        name = P.dtype_name(dtype)
        back = P.tensor_from_payload(bytearray(P.tensor_payload(tensor)), name, [5, 7])
        assert back.dtype == dtype and torch.equal(back, tensor)
    assert P.tensor_from_payload(b"", "bfloat16", [0, 3]).shape == (0, 3)


def test_call_shape_is_what_validate_request_allows_for_every_row_count() -> None:
    specs = {"up": LayerSpec("up", 16, 64, has_bias=False)}
    limits = P.Limits(max_payload_bytes=64 * 4 * 10)  # results of 10 rows at most
    forward = P.call_shape("up", "forward", "float32", "decode", specs, limits)
    assert forward is not None and (forward.in_width, forward.out_width, forward.itemsize) == (16, 64, 4)
    backward = P.call_shape("up", "backward", "bfloat16", "finetune", specs, limits)
    assert backward is not None and (backward.in_width, backward.out_width, backward.itemsize) == (64, 16, 2)
    for shape in (forward, backward):
        dtype = "float32" if shape is forward else "bfloat16"
        for n in (shape.max_rows, shape.max_rows + 1):  # the largest allowed, and one more: refused
            op = "forward" if shape is forward else "backward"
            request = P.Request(P.PROTOCOL_VERSION, "c", 1, "up", op, dtype, [n, shape.in_width], "decode")
            allowed = True
            try:
                P.validate_request(request, n * shape.in_width * shape.itemsize, specs, limits)
            except ProtocolError:
                allowed = False
            assert allowed == (n == shape.max_rows), (op, n)
    for bad in (("nope", "forward", "float32", "decode"), ("up", "sideways", "float32", "decode")):
        assert P.call_shape(*bad, specs, limits) is None
    assert P.call_shape("up", "forward", "float64", "decode", specs, limits) is None
    assert P.call_shape("up", "forward", "float32", "urgent", specs, limits) is None
