"""Rows that arrive at any address (a ZeroMQ frame's bytes) are aligned where the product runs,
not where they arrive: accepting a request copies nothing (the bulk lane's thread copies bulk
work, not the socket thread), and the product still sees an input aligned like every torch
allocation (the bits it has in-process). A failed copy leaves the engine usable."""

from __future__ import annotations

import pytest
import torch

import symbiosis
from symbiosis import protocol as P
from symbiosis.executor import engine as engine_module
from symbiosis.executor import runner
from symbiosis.transport.channels import InlineChannel
from symbiosis.vocabulary import LatencyClass, LayerSpec, Op

LAYER = "model.layers.0.self_attn.q_proj"


def misaligned_rows(n: int, width: int, offset_bytes: int = 8) -> tuple[torch.Tensor, memoryview]:
    """Rows ``offset_bytes`` past a 64-byte boundary (as libzmq hands frames), and their bytes."""
    values = torch.randn(n, width, generator=torch.Generator().manual_seed(n))
    raw = bytearray(n * width * 4 + 128)
    start = -torch.frombuffer(raw, dtype=torch.uint8).data_ptr() % 64 + offset_bytes
    view = memoryview(raw)[start : start + n * width * 4]
    rows = torch.frombuffer(view, dtype=torch.float32).view(n, width)
    rows.copy_(values)
    assert rows.data_ptr() % 64 == offset_bytes
    return rows, view


def test_aligned_copies_only_misaligned_rows():
    rows, _ = misaligned_rows(3, 16)
    copy = runner.aligned(rows)
    assert copy.data_ptr() % 64 == 0 and torch.equal(copy, rows)
    fresh = torch.randn(3, 16)
    assert runner.aligned(fresh) is fresh  # the usual case costs no copy


def test_inline_channel_accepts_rows_where_they_lie():
    """Accepting a payload makes no copy of it, aligned or not (a 48 MiB flood request's copy
    there held up every other client's call)."""
    specs = {LAYER: LayerSpec(LAYER, 16, 16, has_bias=False)}
    channel = InlineChannel(None, specs, P.Limits())
    rows, payload = misaligned_rows(4, 16)
    req = P.Request(P.PROTOCOL_VERSION, "c", 1, LAYER, Op.FORWARD.value, "float32", [4, 16], "finetune")
    accepted = channel.accept(None, (b"x", 1), req, [payload])
    assert accepted.rows.data_ptr() == rows.data_ptr()  # a view of the payload's bytes
    assert torch.equal(accepted.rows, rows)


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture
def product_inputs(monkeypatch):
    """The address of every product's input (``apply_op`` as the engine calls it)."""
    seen: list[int] = []
    real = runner.apply_op

    def recording(layer, op, rows, *args, **kwargs):
        seen.append(rows.data_ptr() % 64)
        return real(layer, op, rows, *args, **kwargs)

    monkeypatch.setattr(engine_module, "apply_op", recording)
    monkeypatch.setattr(runner, "apply_op", recording)
    return seen


@pytest.mark.parametrize("how", ["alone", "queued"])
def test_a_request_is_aligned_before_its_product(path, product_inputs, how):
    """A driver's lone request (``try_alone``, the product in the driver's thread) and a queued one
    (``submit``, the product in a runner) reach ``apply_op`` aligned, with the bits of an aligned
    copy's product."""
    with symbiosis.BaseExecutor.from_pretrained(path) as executor:
        rows, _raw = misaligned_rows(5, executor.layer_specs()[LAYER].in_features)
        expected = runner.apply_op(executor.weights.layers[LAYER], Op.FORWARD, rows.clone())
        product_inputs.clear()
        if how == "alone":
            executor.register_client("driver")
            result = executor.try_alone("driver", LAYER, Op.FORWARD, rows, LatencyClass.FINETUNE)
        else:
            result = executor.submit("queued", LAYER, Op.FORWARD, rows, LatencyClass.FINETUNE).result(timeout=30)
        assert product_inputs and all(offset == 0 for offset in product_inputs)
        assert torch.equal(result, expected)


def test_a_failed_copy_leaves_the_engine_usable(path, monkeypatch):
    """The copy comes after the lone-client path took the engine: a copy that fails (memory) must
    give the engine back, or every later request would wait forever."""
    with symbiosis.BaseExecutor.from_pretrained(path) as executor:
        width = executor.layer_specs()[LAYER].in_features
        rows, _raw = misaligned_rows(3, width)
        executor.register_client("driver")

        def failing(_rows):
            raise MemoryError("no room for the copy")

        monkeypatch.setattr(engine_module, "aligned", failing)
        with pytest.raises(MemoryError):
            executor.try_alone("driver", LAYER, Op.FORWARD, rows, LatencyClass.FINETUNE)
        monkeypatch.undo()
        result = executor.try_alone("driver", LAYER, Op.FORWARD, rows, LatencyClass.FINETUNE)
        assert result is not None
        torch.testing.assert_close(result, runner.apply_op(executor.weights.layers[LAYER], Op.FORWARD, rows.clone()))
