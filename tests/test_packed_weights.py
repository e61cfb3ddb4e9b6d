"""Forward products against weights packed in oneDNN's layout (``symbiosis/executor/packed_weights.py``):
``nn.Linear``'s result within float tolerance, the same bits every time, a layer packed once and
only on a forward, backward products untouched, and an off switch that restores ``nn.Linear``'s
own bits. Exactness against monolithic ``transformers``+``peft`` over every transport is the
reference matrix's (``tests/test_split_reference.py``, ``tests/transport``), which runs packed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import symbiosis
from symbiosis.executor import packed_weights as pw
from symbiosis.executor import runner
from symbiosis.executor.weights import LayerWeights
from symbiosis.vocabulary import Op

pytestmark = pytest.mark.skipif(not pw.WeightPacking().supported, reason="this torch has no oneDNN linear")

# oneDNN sums each output's products in another order than MKL: float32 rounding (its error
# against a float64 reference was ~2x MKL's here, 1-2e-6 on outputs of ~0.5), not another result.
TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture
def packing_on(monkeypatch):
    """Packing on and product forms untimed: every forward runs the packed form."""
    from symbiosis.executor import matmul_forms as mf

    monkeypatch.setattr(pw.WEIGHT_PACKING, "enabled", True)
    monkeypatch.setattr(runner, "MATMUL_FORMS", mf.MatmulForms(enabled=False))


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 65, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_packed_forward_gives_nn_linears_result(packing_on, rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(96, 40, generator=g), torch.randn(rows, 40, generator=g)
    bias = torch.randn(96, generator=g) if with_bias else None
    layer = LayerWeights(weight, bias)
    got = runner.apply_op(layer, Op.FORWARD, x)
    assert isinstance(layer.packed, torch.Tensor)  # the forward packed it
    assert got.shape == (rows, 96) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, weight, bias), **TOL)
    assert torch.equal(runner.apply_op(layer, Op.FORWARD, x), got)  # the same bits every time
    torch.testing.assert_close(runner.apply_op(layer, Op.NOISE, x), x @ weight.t(), **TOL)  # noise: no bias
    out = torch.empty(rows, 96)
    assert runner.apply_op(layer, Op.FORWARD, x, out=out) is out  # a reply region is written, not replaced
    assert torch.equal(out, got)


def test_a_row_s_result_does_not_depend_on_where_its_bytes_lie(packing_on):
    """Rows arrive at any address (a ZeroMQ frame, a shared-memory segment): the same bits."""
    g = torch.Generator().manual_seed(3)
    layer = LayerWeights(torch.randn(64, 48, generator=g), None)
    x = torch.randn(5, 48, generator=g)
    backing = torch.empty(5 * 48 + 3)
    shifted = backing[3:].view(5, 48)
    shifted.copy_(x)
    assert shifted.data_ptr() % 64 != 0
    assert torch.equal(runner.apply_op(layer, Op.FORWARD, shifted), runner.apply_op(layer, Op.FORWARD, x))


def test_backward_products_read_the_plain_weight_bit_for_bit(packing_on):
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(32, 24, generator=g)
    layer = LayerWeights(weight, torch.randn(32, generator=g))
    grad = torch.randn(6, 32, generator=g)
    assert torch.equal(runner.apply_op(layer, Op.BACKWARD, grad), grad @ weight)
    assert layer.packed is None  # a backward never packs


def test_packing_off_runs_nn_linears_bits(monkeypatch):
    from symbiosis.executor import matmul_forms as mf

    monkeypatch.setattr(pw.WEIGHT_PACKING, "enabled", False)
    monkeypatch.setattr(runner, "MATMUL_FORMS", mf.MatmulForms(enabled=False))
    g = torch.Generator().manual_seed(5)
    weight, bias, x = torch.randn(40, 24, generator=g), torch.randn(40, generator=g), torch.randn(3, 24, generator=g)
    layer = LayerWeights(weight, bias)
    assert torch.equal(runner.apply_op(layer, Op.FORWARD, x), F.linear(x, weight, bias))
    assert layer.packed is False and layer.packed_nbytes() == 0


def test_what_is_not_packed(packing_on):
    gathered = LayerWeights(torch.randn(8, 8), None, packable=False)  # an fsdp rank's per-call gather
    assert gathered.pack() is False and gathered.rows(0, 4).packable is False
    assert LayerWeights(torch.randn(8, 8, dtype=torch.float64), None).pack() is False  # dtype not measured
    assert pw.WEIGHT_PACKING.pack(torch.randn(8, 8).to(torch.bfloat16)) is None


@pytest.mark.parametrize(("value", "enabled"), [("0", False), ("off", False), ("1", True), ("", True)])
def test_the_environment_turns_packing_off(monkeypatch, value, enabled):
    monkeypatch.setenv(pw.PACK_VARIABLE, value)
    assert pw.WeightPacking().enabled is enabled


def test_an_executor_packs_what_forwards_use_and_reports_it(packing_on, tiny_checkpoint):
    """Only layers and sibling groups that forwards ran against hold a packed copy, and the
    executor's stats say how much memory those copies take."""
    path = tiny_checkpoint("llama")
    with symbiosis.BaseExecutor.from_pretrained(path) as executor:
        assert executor.stats()["packed_weights_bytes"] == 0  # nothing packed at load
        specs = executor.layer_specs()
        layer_id = next(iter(specs))
        layer = executor.weights.layers[layer_id]
        x = torch.randn(3, layer.weight.shape[1])
        runner.apply_op(layer, Op.FORWARD, x)
        assert executor.stats()["packed_weights_bytes"] == layer.weight.numel() * 4
        model = symbiosis.load_client_model(path, executor=executor)
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2, 3]]))
        packed = executor.stats()["packed_weights_bytes"]
        assert executor.weights.nbytes() // 2 < packed <= 2 * executor.weights.nbytes()


def test_packing_stops_at_its_budget(monkeypatch):
    """Past the budget a layer keeps torch's mm (and keeps it: its products never change)."""
    packing = pw.WeightPacking(enabled=True, budget_bytes=3 * 16 * 16 * 4)
    monkeypatch.setattr(pw, "WEIGHT_PACKING", packing)
    monkeypatch.setattr("symbiosis.executor.weights.WEIGHT_PACKING", packing)
    layers = [LayerWeights(torch.randn(16, 16), None) for _ in range(5)]
    x = torch.randn(2, 16)
    for layer in layers:
        torch.testing.assert_close(runner.apply_op(layer, Op.FORWARD, x), x @ layer.weight.t(), **TOL)
    assert [isinstance(layer.packed, torch.Tensor) for layer in layers] == [True, True, True, False, False]
    assert packing.packed_bytes == 3 * 16 * 16 * 4
    assert layers[3].pack() is False  # decided once


def test_the_default_budget_leaves_most_of_the_machine_s_memory_alone():
    """Packed copies may double the forward-used weights: by default never past a part of memory."""
    import psutil

    total = psutil.virtual_memory().total
    assert 0 < pw.WeightPacking().budget_bytes <= total // 2


def test_a_dropped_layer_gives_its_share_of_the_budget_back():
    import gc

    packing = pw.WeightPacking(enabled=True, budget_bytes=1 << 20)
    packed = packing.pack(torch.randn(32, 32))
    assert packed is not None and packing.packed_bytes == 32 * 32 * 4
    del packed
    gc.collect()
    assert packing.packed_bytes == 0


def test_a_packed_layer_times_three_forms_at_few_rows_and_runs_packed_above(monkeypatch):
    from symbiosis.executor import matmul_forms as mf

    seconds = {mf.Form.ROWS_BY_WEIGHT: 1.0, mf.Form.WEIGHT_BY_ROWS: 0.7, mf.Form.PACKED: 0.4}
    timed = []

    def time_pass(self, form, weights, bias, inputs, packs=None):
        timed.append(form)
        if form is mf.Form.PACKED:
            assert packs is not None and len(packs) == len(weights)  # the timed peers' packed copies
        return [seconds[form]] * len(weights)

    monkeypatch.setattr(mf.MatmulForms, "_time_pass", time_pass)
    forms = mf.MatmulForms(enabled=True)
    weight = torch.randn(16, 8)
    forms.remember([weight, torch.randn(16, 8)])
    packed = pw.WeightPacking(enabled=True).pack(weight)
    assert forms.form(weight, None, 1, packed) is mf.Form.PACKED
    assert timed == list(mf.Form) * mf.ROUNDS
    assert forms.form(weight, None, 1) is mf.Form.WEIGHT_BY_ROWS  # no packed copy: two forms, another trial
    seconds[mf.Form.PACKED] = 0.95  # not 10% better than nn.Linear's, and slower than the second form
    assert forms.form(weight, None, mf.PACKED_TIMED_ROWS, packed) is mf.Form.WEIGHT_BY_ROWS
    trials = forms.trials
    for rows in (mf.PACKED_TIMED_ROWS + 1, mf.LARGEST_TUNED_ROWS, mf.LARGEST_TUNED_ROWS + 1):
        assert forms.form(weight, None, rows, packed) is mf.Form.PACKED  # untimed above: packed
    assert forms.trials == trials
    off = mf.MatmulForms(enabled=False)
    assert off.form(weight, None, 1, packed) is mf.Form.PACKED and off.form(weight, None, 1) is mf.Form.ROWS_BY_WEIGHT
