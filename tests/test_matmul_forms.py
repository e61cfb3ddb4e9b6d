"""The executor times two ways of writing a small forward product and keeps the faster
(``symbiosis/executor/matmul_forms.py``): both give ``nn.Linear``'s result within float tolerance,
a choice is made once per (shape, rows, threads) and then every product runs it, and anything not
tuned runs ``nn.Linear``'s own form."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import symbiosis
from symbiosis.executor import matmul_forms as mf
from symbiosis.executor import packed_weights as pw
from symbiosis.executor import runner
from symbiosis.vocabulary import Op

# Both forms sum the same products in another order: float32 rounding, not a different result.
TOL = {"rtol": 1e-5, "atol": 1e-5}
#: The forms of a layer without a packed copy (``Form.PACKED``: ``tests/test_packed_weights.py``).
UNPACKED_FORMS = [mf.Form.ROWS_BY_WEIGHT, mf.Form.WEIGHT_BY_ROWS]


@pytest.fixture(autouse=True)
def _weights_unpacked(monkeypatch):
    """Forms decide only where weights are not packed (``packed_weights.py``): off here."""
    from symbiosis.executor.packed_weights import WEIGHT_PACKING

    monkeypatch.setattr(WEIGHT_PACKING, "enabled", False)


def _fake_timings(monkeypatch, seconds: dict[mf.Form, float]) -> list[mf.Form]:
    """Make every timed pass of ``form`` take ``seconds[form]``; returns the forms timed, in order."""
    timed: list[mf.Form] = []

    def time_pass(self, form, weights, bias, inputs, packs=None):
        timed.append(form)
        return [seconds[form]] * len(weights)

    monkeypatch.setattr(mf.MatmulForms, "_time_pass", time_pass)
    return timed


@pytest.mark.parametrize("rows", [1, 2, 5, 64])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("form", list(mf.Form))
def test_every_form_gives_nn_linears_result(rows, with_bias, form):
    g = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(48, 32, generator=g), torch.randn(rows, 32, generator=g)
    bias = torch.randn(48, generator=g) if with_bias else None
    packed = None
    if form is mf.Form.PACKED:
        packed = pw.WeightPacking(enabled=True).pack(weight)
        if packed is None:
            pytest.skip("this torch has no oneDNN linear")
    want = F.linear(x, weight, bias)
    got = mf.forward(form, weight, bias, x, packed=packed)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, **TOL)
    out = torch.empty(rows, 48)
    assert mf.forward(form, weight, bias, x, out, packed=packed) is out  # a reply region is written, not replaced
    torch.testing.assert_close(out, want, **TOL)


def test_the_first_form_is_nn_linears_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    weight, bias, x = torch.randn(40, 24, generator=g), torch.randn(40, generator=g), torch.randn(3, 24, generator=g)
    assert torch.equal(mf.forward(mf.Form.ROWS_BY_WEIGHT, weight, bias, x), F.linear(x, weight, bias))


@pytest.mark.parametrize(
    ("first_s", "second_s", "kept"),
    [
        (1.0, 0.5, mf.Form.WEIGHT_BY_ROWS),  # clearly faster: kept
        (1.0, 0.95, mf.Form.ROWS_BY_WEIGHT),  # within the margin: nn.Linear's form stays
        (1.0, 1.7, mf.Form.ROWS_BY_WEIGHT),
    ],
)
def test_a_trial_keeps_the_faster_form_by_a_margin(monkeypatch, first_s, second_s, kept):
    timed = _fake_timings(monkeypatch, {mf.Form.ROWS_BY_WEIGHT: first_s, mf.Form.WEIGHT_BY_ROWS: second_s})
    forms = mf.MatmulForms(enabled=True)
    weight = torch.randn(16, 8)
    assert forms.form(weight, None, 4) is kept
    assert timed == UNPACKED_FORMS * mf.ROUNDS  # alternating, so a slow spell hits both


@pytest.mark.parametrize("slowed", UNPACKED_FORMS)
def test_a_slow_spell_does_not_decide_a_trial(monkeypatch, slowed):
    """Another process taking the core mid-product makes some products slow: each product's
    fastest time decides, so a spell that slows most rounds of one form changes nothing."""
    calls = {form: 0 for form in UNPACKED_FORMS}
    quiet = {mf.Form.ROWS_BY_WEIGHT: 1.0, mf.Form.WEIGHT_BY_ROWS: 0.5}

    def time_pass(self, form, weights, bias, inputs, packs=None):
        calls[form] += 1
        spell = form is slowed and calls[form] < mf.ROUNDS  # every round but the last
        return [quiet[form] * (10.0 if spell and i % 2 == 0 else 1.0) for i in range(len(weights))]

    monkeypatch.setattr(mf.MatmulForms, "_time_pass", time_pass)
    forms = mf.MatmulForms(enabled=True)
    weight = torch.randn(16, 8)
    forms.remember([weight, torch.randn(16, 8), torch.randn(16, 8)])
    assert forms.form(weight, None, 4) is mf.Form.WEIGHT_BY_ROWS


def test_a_choice_is_made_once_per_shape_rows_and_bias(monkeypatch):
    _fake_timings(monkeypatch, {mf.Form.ROWS_BY_WEIGHT: 1.0, mf.Form.WEIGHT_BY_ROWS: 0.5})
    forms = mf.MatmulForms(enabled=True)
    weight, other = torch.randn(16, 8), torch.randn(16, 8)
    for _ in range(3):
        forms.form(weight, None, 4)
        forms.form(other, None, 4)  # same shape: the same choice
    assert forms.trials == 1
    forms.form(weight, torch.zeros(16), 4)
    forms.form(weight, None, 5)
    forms.form(torch.randn(8, 16), None, 4)
    assert forms.trials == 4
    assert forms.chosen() == {mf.Form.ROWS_BY_WEIGHT.value: 0, mf.Form.WEIGHT_BY_ROWS.value: 4, mf.Form.PACKED.value: 0}


def test_what_is_not_tuned_runs_nn_linears_form(monkeypatch):
    _fake_timings(monkeypatch, {mf.Form.ROWS_BY_WEIGHT: 1.0, mf.Form.WEIGHT_BY_ROWS: 0.1})
    forms = mf.MatmulForms(enabled=True)
    weight = torch.randn(16, 8)
    assert forms.form(weight, None, mf.LARGEST_TUNED_ROWS + 1) is mf.Form.ROWS_BY_WEIGHT  # training-sized
    assert forms.form(weight, None, 0) is mf.Form.ROWS_BY_WEIGHT
    off = mf.MatmulForms(enabled=False)
    assert off.form(weight, None, 4) is mf.Form.ROWS_BY_WEIGHT
    assert forms.trials == 0 and off.trials == 0


@pytest.mark.parametrize(("value", "enabled"), [("0", False), ("off", False), ("1", True), ("", True)])
def test_the_environment_turns_tuning_off(monkeypatch, value, enabled):
    monkeypatch.setenv(mf.TUNE_VARIABLE, value)
    assert mf.MatmulForms().enabled is enabled


def test_trials_time_peers_of_the_shape_and_read_the_rest_when_the_model_exceeds_the_cache():
    forms = mf.MatmulForms(enabled=True, cache_bytes=4096)
    same = [torch.randn(16, 16) for _ in range(6)]  # 1 KiB each
    others = [torch.randn(32, 16) for _ in range(20)]  # 2 KiB each
    forms.remember([*same, *others])
    timed, evict = forms.trial_weights(same[0])
    assert timed[0] is same[0] and len(timed) == mf.PEERS and all(t.shape == (16, 16) for t in timed)
    assert evict and all(all(e is not t for t in timed) for e in evict)
    assert sum(e.numel() * 4 for e in evict) >= 2 * 4096  # enough to push the timed weights out
    roomy = mf.MatmulForms(enabled=True, cache_bytes=1 << 30)  # a model that fits is served from the cache
    roomy.remember([*same, *others])
    assert roomy.trial_weights(same[0])[1] == []


def test_forgotten_weights_are_not_kept_alive():
    forms = mf.MatmulForms(enabled=True)
    weight = torch.randn(8, 8)
    forms.remember([weight])
    del weight
    forms.remember([])
    assert forms.trial_weights(torch.randn(8, 8))[0][1:] == []


def test_an_executors_products_run_the_chosen_form_every_time(monkeypatch, tiny_checkpoint):
    """Whichever form won, the executor's results agree with nn.Linear's, and repeat bit for bit."""
    path = tiny_checkpoint("llama")
    for winner in UNPACKED_FORMS:
        forms = mf.MatmulForms(enabled=True)
        monkeypatch.setattr(mf, "MATMUL_FORMS", forms)
        monkeypatch.setattr(runner, "MATMUL_FORMS", forms)
        monkeypatch.setattr(forms, "_trial", lambda weight, bias, rows, packed=None, winner=winner: winner)
        with symbiosis.BaseExecutor.from_pretrained(path) as executor:
            layer_id = next(iter(executor.layer_specs()))
            layer = executor.weights.layers[layer_id]
            for rows in (1, 3):
                x = torch.randn(rows, layer.weight.shape[1], generator=torch.Generator().manual_seed(rows))
                first = runner.apply_op(layer, Op.FORWARD, x)
                torch.testing.assert_close(first, F.linear(x, layer.weight, layer.bias), **TOL)
                assert torch.equal(runner.apply_op(layer, Op.FORWARD, x), first)
                noise = runner.apply_op(layer, Op.NOISE, x)  # no bias, whatever the layer has
                torch.testing.assert_close(noise, x @ layer.weight.t(), **TOL)
            assert forms.chosen()[winner.value] >= 2
            assert executor.stats()["matmul_forms"] == forms.chosen()


LAYER_NAMES = ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.up_proj")


@pytest.mark.parametrize("packing", [False, True])
def test_a_warmed_up_executor_runs_no_trial_at_a_clients_first_decode_sized_products(
    packing, monkeypatch, tiny_checkpoint
):
    """``BaseExecutor.warm_up`` decides the forms of 1-8 row forwards for every weight shape a
    client may ask for -- each layer's and each sibling group's (the fused q+k+v a split client
    sends) -- so that no request of those sizes waits behind a trial; it packs nothing for good
    (a shape's trial uses a copy made and dropped), and a layer's products then run the chosen
    form. Without it, the same first products run trials (the control)."""
    monkeypatch.setattr(pw.WEIGHT_PACKING, "enabled", packing and pw.WEIGHT_PACKING.supported)
    path = tiny_checkpoint("llama")
    for warm in (False, True):
        forms = mf.MatmulForms(enabled=True)
        monkeypatch.setattr(mf, "MATMUL_FORMS", forms)
        monkeypatch.setattr(runner, "MATMUL_FORMS", forms)
        monkeypatch.setattr(forms, "_trial", lambda weight, bias, rows, packed=None: mf.Form.WEIGHT_BY_ROWS)
        with symbiosis.BaseExecutor.from_pretrained(path) as executor:
            specs = executor.layer_specs()
            q, k, gate, up = (next(i for i in specs if i.endswith(f"layers.0.{n}")) for n in LAYER_NAMES)
            groups = ["+".join((q, k)), "+".join((gate, up))]  # shapes no single layer has
            assert {executor.weights.specs[g].out_features for g in groups}.isdisjoint(
                s.out_features for s in specs.values()
            )
            warmed = executor.warm_up() if warm else 0
            assert executor.weights.packed_nbytes() == 0
            before = forms.trials
            for layer_id in [*specs, *groups]:
                in_width = executor.weights.specs[layer_id].in_features
                for rows in range(1, 9):
                    executor.run(layer_id, Op.FORWARD, torch.randn(rows, in_width))
            if warm:
                assert warmed > 0 and forms.trials == before
            else:
                assert forms.trials > before
        assert all(executor.weights.layers[g].forms for g in groups)  # their products looked their form up


@pytest.mark.parametrize(
    ("flag", "setting", "variable"),
    [
        ("--no-tune-matmul", mf.MATMUL_FORMS, mf.TUNE_VARIABLE),
        ("--no-pack-weights", pw.WEIGHT_PACKING, pw.PACK_VARIABLE),
    ],
)
def test_serve_turns_a_product_setting_off_before_loading(flag, setting, variable, tmp_path, capsys, monkeypatch):
    """``symbiosis serve --no-tune-matmul`` / ``--no-pack-weights``: this process's setting and
    any rank it starts (which reads the environment) are off before the checkpoint is read."""
    from tests.cli_helpers import run_cli

    monkeypatch.setattr(setting, "enabled", True)
    monkeypatch.setenv(variable, "1")  # restored (unset, if it was) after the test
    code, _out, err = run_cli(["serve", str(tmp_path / "no-such-model"), flag], capsys, monkeypatch)
    assert code != 0 and "no-such-model" in err  # the load failed, after the flag took effect
    assert setting.enabled is False
    assert os.environ[variable] == "0"


@pytest.mark.parametrize("transport", ["inproc", "ipc", "shm", "tcp", "dist"])
def test_the_second_form_is_exact_over_every_transport(transport, tiny_checkpoint, tmp_path, monkeypatch):
    """With every small forward run as ``(W @ rows.T).T`` (written into the transport's reply
    region where there is one), a split model still matches monolithic transformers+peft: logits,
    loss, adapter gradients and greedy tokens."""
    from tests.reference import assert_matches_reference, close_client, loss_and_grads, make_pair

    forms = mf.MatmulForms(enabled=True)
    monkeypatch.setattr(forms, "_trial", lambda weight, bias, rows, packed=None: mf.Form.WEIGHT_BY_ROWS)
    monkeypatch.setattr(runner, "MATMUL_FORMS", forms)
    if transport == "dist":  # every payload over the gloo pair group: small ones would ride inline
        monkeypatch.setattr("symbiosis.transport.dist_client.INLINE_THRESHOLD", {"gloo": 0, "nccl": 0})
    path = tiny_checkpoint("llama")
    with symbiosis.BaseExecutor.from_pretrained(path) as executor:
        servers = []
        if transport == "inproc":
            address = executor
        else:
            server = executor.serve("tcp://127.0.0.1:0" if transport in ("tcp", "dist") else f"ipc://{tmp_path}/e.sock")
            servers.append(server)
            address = {"ipc": "", "shm": "shm+", "tcp": "", "dist": "dist+"}[transport] + server.address
        reference, split = make_pair(path, address, "lora", "llama")
        try:
            input_ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(1))
            # as tests/test_split_reference.py: float32 sums in another order, far inside these
            assert_matches_reference(
                loss_and_grads(split, input_ids), loss_and_grads(reference, input_ids), rtol=1e-4, atol=1e-5
            )
            prompt = input_ids[:1, :5]
            with torch.no_grad():
                want = reference.generate(input_ids=prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)
                got = split.generate(input_ids=prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)
            assert torch.equal(got, want)
            assert forms.chosen()[mf.Form.WEIGHT_BY_ROWS.value] > 0  # the products did run that form
        finally:
            close_client(split)
            for server in servers:
                server.close()
