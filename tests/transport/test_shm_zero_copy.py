"""Shared memory against a real ``BaseExecutor``: a lone client's product is computed straight into
the segment's reply region (``Accepted.out``), so the server copies nothing, and the result the
client gets back is still exact, a tensor of its own, and outlives the next call.

The conformance suite (``test_conformance.py``) runs a fake service that is not driven, so it
covers the other path: the result copied into the region.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

import symbiosis
from symbiosis.transport import shm_channel, shm_client
from symbiosis.transport.schemes import open_transport
from symbiosis.vocabulary import LatencyClass, Op
from tests.transport.fakes import assert_same_product  # products from two processes: one-ulp rounding (see there)

# (arch, layer, op): no bias (mm) and bias (addmm), every op.
CASES = [
    ("llama", "model.layers.0.mlp.gate_proj", Op.FORWARD),
    ("llama", "model.layers.0.mlp.down_proj", Op.BACKWARD),
    ("llama", "model.layers.1.mlp.up_proj", Op.NOISE),
    ("gpt2", "transformer.h.0.attn.c_attn", Op.FORWARD),
]


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """One entry per result the shm channel sends: True if it had to be copied into the region
    (False: the executor computed it there)."""
    seen: list[bool] = []
    original = shm_channel.ShmChannel.reply

    def spy(self, session, req, result: torch.Tensor, ticket: torch.Tensor):
        seen.append(result.data_ptr() != ticket.data_ptr())
        return original(self, session, req, result, ticket)

    monkeypatch.setattr(shm_channel.ShmChannel, "reply", spy)
    return seen


@pytest.fixture
def serve(tiny_checkpoint, sock_dir: str) -> Iterator:
    """arch -> (executor, shm transport to it), closed afterwards."""
    opened: list = []

    def _serve(arch: str):
        executor = symbiosis.BaseExecutor.from_pretrained(tiny_checkpoint(arch))
        server = executor.serve(f"ipc://{sock_dir}/{arch}.sock")
        transport = open_transport(f"shm+{server.address}", inline_threshold=0)  # every call through a segment
        opened.append((executor, transport))
        return executor, transport

    yield _serve
    for executor, transport in opened:
        transport.close()
        executor.close()


def large_rows(executor, layer_id: str, op: Op, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Enough rows that the result is handed out as the segment's region (zero copy), but no more
    than the row budget: ``run`` would split a larger request into row chunks, and MKL may sum a
    chunk of a few rows in another order (other bits than one product of all rows)."""
    spec = executor.layer_specs()[layer_id]
    n = math.ceil(shm_client.HANDOUT_MIN_BYTES / (op.output_width(spec) * 4)) + 3  # +3: not a round size
    assert n <= executor.scheduler_config.row_budget
    return torch.randn(n, op.input_width(spec), generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize(("arch", "layer_id", "op"), CASES)
@pytest.mark.slow
def test_product_is_computed_into_the_segment(serve, copies: list[bool], arch: str, layer_id: str, op: Op) -> None:
    executor, transport = serve(arch)
    alone_before = executor.stats()["batches_run_by"]["alone"]
    x1, x2 = large_rows(executor, layer_id, op, 1), large_rows(executor, layer_id, op, 2)

    r1 = transport.call(layer_id, op, x1, LatencyClass.PREFILL)
    kept = r1.clone()
    r2 = transport.call(layer_id, op, x2, LatencyClass.PREFILL)

    assert copies == [False, False]  # both products were written where the reply is sent from
    assert executor.stats()["batches_run_by"]["alone"] == alone_before + 2
    assert r1.nbytes >= shm_client.HANDOUT_MIN_BYTES  # handed out: a region of a segment
    assert not r1._is_view() and r1._base is None and not r2._is_view()
    assert torch.equal(r1, kept)  # the next call did not write over it
    assert r1.data_ptr() != r2.data_ptr()
    r1.add_(1.0)  # writable in place, and only this result changes
    assert torch.equal(r1, kept + 1.0)
    # Last: ``run`` joins a second client ("direct"), after which nothing is served alone.
    assert_same_product(kept, executor.run(layer_id, op, x1))
    assert_same_product(r2, executor.run(layer_id, op, x2))


def test_rows_in_another_dtype_are_copied_not_computed_into_the_segment(serve, copies: list[bool]) -> None:
    """bfloat16 rows to a float32 executor: the product is in float32 and cast back, so it cannot
    be computed into the (bfloat16) reply region; the channel copies it there."""
    executor, transport = serve("llama")
    layer_id, op = "model.layers.0.mlp.up_proj", Op.FORWARD
    x = large_rows(executor, layer_id, op, 3, torch.bfloat16)
    got = transport.call(layer_id, op, x, LatencyClass.PREFILL)
    assert copies == [True]
    assert got.dtype == torch.bfloat16
    assert_same_product(got, executor.run(layer_id, op, x))


def test_small_result_is_read_after_the_rows(serve, copies: list[bool]) -> None:
    """A small result (copied out, not handed out) lies after the rows too, and rows wider than
    the result (backward of a wide layer) are not mistaken for it."""
    executor, transport = serve("llama")
    layer_id, op = "model.layers.0.mlp.up_proj", Op.BACKWARD  # rows of width 128 -> results of width 64
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(4))
    got = transport.call(layer_id, op, x, LatencyClass.DECODE)
    again = transport.call(layer_id, op, 2 * x, LatencyClass.DECODE)
    assert copies == [False, False]
    assert_same_product(got, executor.run(layer_id, op, x))
    assert_same_product(again, executor.run(layer_id, op, 2 * x))


def test_a_sibling_group_result_wider_than_its_rows_fits_the_segment(serve) -> None:
    # q/k/v served as one request: the result (sum of the members' widths) is wider than the
    # rows, and the client must size the segment from the group, not from a single layer.
    executor, transport = serve("llama")
    group = "+".join(f"model.layers.0.self_attn.{n}_proj" for n in "qkv")
    x = torch.randn(3000, 64, generator=torch.Generator().manual_seed(5))  # > the smallest segment
    got = transport.call(group, Op.FORWARD, x, LatencyClass.FINETUNE)
    assert got.shape == (3000, executor.layer_specs()[group].out_features)
    assert_same_product(got, executor.run(group, Op.FORWARD, x))
