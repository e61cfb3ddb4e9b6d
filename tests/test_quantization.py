"""A quantized base (issue 13): int8 and fp8-rowwise executors.

Two references, for each architecture family:

- the *dequantized* monolithic model (its base weights replaced by ``Ŵ = diag(scale)·Q``, exactly
  what the executor stores): the split model must match it like any split model matches its
  monolithic twin, which proves every op (forward, backward, the kernels' row-count switch, sibling
  groups) computes with ``Ŵ`` and nothing else;
- the fp32 monolithic model: the distance is the quantization error itself, bounded as stated
  next to each bound (measured worst case over the ten families about 1/2 to 1/3 of the bound).

Then the kernels one by one against ``Ŵ`` in float64, the bytes held, bad input, a remote
transport, and (slow) fine-tuning a demo task against an int8 base.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch

import symbiosis
from symbiosis.checkpoint import Conv1D, build_skeleton, discover_base_layers, expert_tensors
from symbiosis.errors import CheckpointError, ModelMismatchError, UnsupportedQuantizationError
from symbiosis.executor import quantized as Q
from symbiosis.executor.quantized import (
    FORMATS,
    FbgemmInt8Weights,
    Quantizer,
    RowwiseQuantizedWeights,
    parse_quantization,
    quantize_rows,
)
from symbiosis.modelzoo import ARCHS
from symbiosis.vocabulary import Op
from tests.cli_helpers import run_cli
from tests.reference import assert_matches_reference, close_client, loss_and_grads, make_pair

QUANTIZATIONS = ("int8", "fp8-rowwise")

# ---- bounds against the fp32 monolithic model (tiny random-weight models, LoRA, 2x16 tokens) ----
# int8: a row's step is max|w|/127, so each weight is off by at most half of it (rms ~ max|w|/440,
# under 1% of a random row's rms), and each base layer's output by about that much relative. Through
# two blocks, attention and the norms the logits move ~0.6-1.3% (measured); adapter gradients, a
# difference of two nearly equal terms in places, move more (<= 8.4%, gemma2 with its soft-capping).
# fp8 (e4m3): 3 mantissa bits, each weight rounded to within 2**-4 of itself (rms ~2.5%): logits
# move 2.6-6.9% (gemma2 the most), gradients up to 29%. Top-1 agreement is over 32 positions of a
# random network whose logits are nearly flat, so near-ties flip (measured >= 0.969 int8, 0.875 fp8).
VS_FP32 = {
    "int8": {"logits_rel": 0.03, "top1": 0.90, "grads_rel": 0.15},
    "fp8-rowwise": {"logits_rel": 0.12, "top1": 0.75, "grads_rel": 0.45},
}
# Against the dequantized model. fp8 on CPU dequantizes before a float32 matmul: the split
# reference's float tolerance holds. int8 runs fbgemm, whose activations are two 7-bit digits: each
# product is off by <= 6.3e-5 of the row's largest |x| per element (quantized.py), ~1e-4 relative on
# the logits (measured <= 2.3e-4) and <= 2e-3 on the gradients (gemma2): bounds 1e-3 and 1e-2.
VS_DEQUANTIZED = {"int8": {"logits_rel": 1e-3, "grads_rel": 1e-2}, "fp8-rowwise": None}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([grads[name].flatten() for name in sorted(grads)])


def dequantize_base_layers(model: torch.nn.Module, quantization: str) -> None:
    """Replace every base layer's weight by ``Ŵ`` (as the executor quantizes it), each expert's
    matrix of served MoE experts too; a tied ``lm_head`` gets a parameter of its own, so the
    embedding keeps its full-precision table as the split client does."""

    def dequantize(name: str, weight: torch.Tensor) -> torch.Tensor:
        codes, scale = quantize_rows(name, weight, FORMATS[quantization])
        return codes.to(torch.float32) * scale[:, None]

    skeleton = build_skeleton(model.config)
    experts = expert_tensors(skeleton)
    for name in discover_base_layers(skeleton):
        if name.rpartition(".")[0] in experts:
            continue  # (below)
        module = model.get_submodule(name)
        module = getattr(module, "base_layer", module)  # wrapped by peft
        weight = module.weight.detach()
        conv1d = isinstance(module, Conv1D)
        dequantized = dequantize(name, weight.t() if conv1d else weight)
        module.weight = torch.nn.Parameter(
            (dequantized.t() if conv1d else dequantized).contiguous(), requires_grad=False
        )
    for tensor in experts.values():
        module_name, _, param_name = tensor.name.rpartition(".")
        module = model.get_submodule(module_name)
        while hasattr(module, "base_layer"):  # (peft's LoRA on experts nests a wrapper per tensor)
            module = module.base_layer
        stacked = getattr(module, param_name).detach()
        matrices = [w.t() if tensor.transposed else w for w in stacked]
        dequantized = [dequantize(layer_id, w) for layer_id, w in zip(tensor.layer_ids, matrices, strict=True)]
        stacked = torch.stack([w.t() if tensor.transposed else w for w in dequantized])
        setattr(module, param_name, torch.nn.Parameter(stacked.contiguous(), requires_grad=False))


def quantized_split_outputs(path, executor, arch: str, quantization: str, device: str = "cpu"):
    """``loss_and_grads`` of a LoRA split client of the quantized ``executor`` (closed after), of
    the fp32 monolithic model and of the dequantized one, all on ``device``: (got, fp32, exact)."""
    reference, split = make_pair(path, executor, "lora", arch, device=device)
    dequantized = copy.deepcopy(reference)
    dequantize_base_layers(dequantized.get_base_model(), quantization)
    input_ids = torch.randint(3, 1000, (2, 16), generator=torch.Generator().manual_seed(0)).to(device)
    try:
        return tuple(loss_and_grads(model, input_ids) for model in (split, reference, dequantized))
    finally:
        close_client(split)
        executor.close()


def assert_near_fp32(got, fp32, exact, quantization: str) -> None:
    """The split's distance to the fp32 model is within the quantization error (``VS_FP32``), and
    quantizing changed the model at all (else the comparison could not fail)."""
    bound = VS_FP32[quantization]
    assert _rel(exact[0], fp32[0]) > 1e-4, "quantization changed nothing: the comparison could not fail"
    assert _rel(got[0], fp32[0]) <= bound["logits_rel"]
    assert (got[0].argmax(-1) == fp32[0].argmax(-1)).float().mean() >= bound["top1"]
    assert _rel(_flat(got[2]), _flat(fp32[2])) <= bound["grads_rel"]


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_split_matches_dequantized_model_and_stays_near_fp32(tiny_checkpoint, arch, quantization):
    path = tiny_checkpoint(arch)
    executor = symbiosis.BaseExecutor.from_pretrained(path, quantization=quantization)
    got, fp32, exact = quantized_split_outputs(path, executor, arch, quantization)
    bound = VS_DEQUANTIZED[quantization]
    if bound is None:
        assert_matches_reference(got, exact)
    else:
        assert _rel(got[0], exact[0]) <= bound["logits_rel"]
        assert _rel(_flat(got[2]), _flat(exact[2])) <= bound["grads_rel"]
    assert_near_fp32(got, fp32, exact, quantization)


# ---- the kernels against Ŵ in float64 ---------------------------------------------------------


def _layer(quantization: str, out_features: int = 40, in_features: int = 24, bias: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g) * 0.1
    weight[3] = 0.0  # an all-zero row must survive
    b = torch.randn(out_features, generator=g) if bias else None
    codes, scale = quantize_rows("test.layer", weight, FORMATS[quantization])
    reference = codes.to(torch.float64) * scale.to(torch.float64)[:, None]
    return weight, codes, scale, b, reference


def _expected(op: Op, rows: torch.Tensor, reference: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    x = rows.to(torch.float64)
    if op is Op.BACKWARD:
        return x @ reference
    y = x @ reference.t()
    return y + bias.to(torch.float64) if op is Op.FORWARD and bias is not None else y


def _rows(op: Op, n: int, codes: torch.Tensor, seed: int = 1) -> torch.Tensor:
    width = codes.shape[0] if op is Op.BACKWARD else codes.shape[1]
    rows = torch.randn(n, width, generator=torch.Generator().manual_seed(seed))
    rows[0, 0] = 30.0  # an outlier: a per-tensor activation scale would blur every other element
    return rows


def test_quantize_rows_error_bounds_and_refusals():
    _, codes, scale, _, _ = _layer("int8")
    weight = _layer("int8")[0]
    deq = codes.float() * scale[:, None]
    assert codes.dtype == torch.int8 and codes.abs().max() <= 127
    assert torch.all((deq - weight).abs() <= scale[:, None] / 2 * (1 + 1e-5))  # rounding: half a step
    assert torch.all(deq[3] == 0)
    fp8_codes, fp8_scale = quantize_rows("x", weight, FORMATS["fp8-rowwise"])
    fp8_deq = fp8_codes.float() * fp8_scale[:, None]
    # e4m3 keeps 3 mantissa bits: within 2**-4 of each value, or 2**-10 of the row scale below 2**-6
    assert torch.all((fp8_deq - weight).abs() <= 2**-4 * weight.abs() + 2**-10 * fp8_scale[:, None] + 1e-12)
    weight[5, 2] = float("inf")
    with pytest.raises(CheckpointError, match="test.bad"):
        quantize_rows("test.bad", weight, FORMATS["int8"])


def test_parse_quantization_names_what_is_supported():
    assert parse_quantization(None) is None and parse_quantization("none") is None
    assert parse_quantization("INT8") == "int8" and parse_quantization("fp8-rowwise") == "fp8-rowwise"
    with pytest.raises(UnsupportedQuantizationError, match="none, int8, fp8-rowwise"):
        parse_quantization("int4")
    with pytest.raises(UnsupportedQuantizationError, match="fp8-rowwise needs a cpu or cuda device"):
        Quantizer("fp8-rowwise", torch.device("meta"), torch.float32)


@pytest.mark.parametrize("op", list(Op))
@pytest.mark.parametrize("rows", [3, 40], ids=["few-rows", "many-rows"])
def test_fbgemm_paths_match_the_dequantized_weight(op, rows, monkeypatch):
    monkeypatch.setattr(Q, "FBGEMM_MAX_ROWS", 8)  # 40 rows take the dequantize+BLAS path
    _, codes, scale, bias, reference = _layer("int8")
    layer = FbgemmInt8Weights(Q.fbgemm_pack(codes, scale), 40, 24, bias, torch.float32)
    x = _rows(op, rows, codes)
    got = layer.apply(op, x).double()
    expected = _expected(op, x, reference, bias)
    if op is not Op.BACKWARD and rows <= Q.FBGEMM_MAX_ROWS:
        # two 7-bit digits: each activation off by <= 0.5/(63*126) of its row's largest |x|
        digit = x.abs().amax(1, keepdim=True).double() * 0.5 / (63 * 126)
        bound = digit * reference.abs().sum(1)[None, :] + 1e-5 * expected.abs() + 1e-6
        assert torch.all((got - expected).abs() <= bound)
        assert not torch.allclose(got, expected, rtol=0, atol=0)  # it is fbgemm, not an exact path
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("op", list(Op))
def test_dequantizing_path_in_chunks_matches_the_dequantized_weight(quantization, op, monkeypatch):
    """The path of fp8 on CPU and of int8 off CPU (here on CPU), with chunks of 5 weight rows."""
    _, codes, scale, bias, reference = _layer(quantization)
    layer = RowwiseQuantizedWeights(codes, scale, bias, torch.float32)
    x = _rows(op, 7, codes)
    whole = layer.apply(op, x)
    monkeypatch.setattr(Q, "CHUNK_ELEMENTS", 5 * 24)
    chunked = layer.apply(op, x)
    torch.testing.assert_close(whole.double(), _expected(op, x, reference, bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)


def test_scaled_mm_twin_and_a_layer_it_cannot_take_falls_back(monkeypatch, caplog):
    """The GPU fp8 path (``torch._scaled_mm``) runs on CPU too: checked here against Ŵ with the
    fp8 activation rounding as the bound, and a layer whose width is not a multiple of 16 falls
    back to dequantize+matmul, logged with its name."""
    monkeypatch.setattr(Q, "hardware_fp8", lambda device: True)
    quantizer = Quantizer("fp8-rowwise", torch.device("cpu"), torch.float32)
    weight, codes, scale, bias, reference = _layer("fp8-rowwise", out_features=32, in_features=48)
    fast = quantizer("model.fast", weight, bias)
    with caplog.at_level(logging.WARNING, logger="symbiosis.executor.quantized"):
        slow = quantizer("model.odd", weight[:, :40], None)
    assert fast.kernel == "scaled_mm" and slow.kernel == "dequantize+matmul"
    assert "model.odd" in caplog.text and "multiples of 16" in caplog.text
    x = _rows(Op.FORWARD, 5, codes)
    got = fast.apply(Op.FORWARD, x).double()
    expected = _expected(Op.FORWARD, x, reference, bias)
    x_scale = x.abs().amax(1, keepdim=True).double() / 448
    bound = 2**-4 * (x.abs().double() @ reference.abs().t()) + 2**-10 * x_scale * reference.abs().sum(1)[None, :] + 1e-5
    assert torch.all((got - expected).abs() <= bound)


def test_fbgemm_rows_do_not_depend_on_their_batch_and_bad_rows_stay_bad():
    _, codes, scale, bias, _ = _layer("int8")
    layer = FbgemmInt8Weights(Q.fbgemm_pack(codes, scale), 40, 24, bias, torch.float32)
    x = _rows(Op.FORWARD, 6, codes)
    batched = layer.apply(Op.FORWARD, x)
    for i in range(6):  # integer accumulation: the same bits alone as in any batch
        assert torch.equal(layer.apply(Op.FORWARD, x[i : i + 1]), batched[i : i + 1])
    x[2, 1] = float("nan")
    x[4, 0] = float("inf")
    y = layer.apply(Op.FORWARD, x)
    assert torch.isnan(y[2]).all() and torch.isnan(y[4]).all()
    assert torch.equal(y[[0, 1, 3, 5]], batched[[0, 1, 3, 5]])


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_blocks_hold_nothing_twice_and_groups_resolve(tiny_checkpoint, quantization):
    path = tiny_checkpoint("llama")
    executor = symbiosis.BaseExecutor.from_pretrained(path, quantization=quantization)
    full = symbiosis.BaseExecutor.from_pretrained(path)
    try:
        weights = executor.weights
        specs = weights.specs
        per_row = 12 if quantization == "int8" else 4  # fbgemm: scale, zero point, column offset; fp8: scale
        expected = sum(
            s.out_features * (s.in_features + per_row) + 4 * s.out_features * s.has_bias for s in specs.values()
        )
        assert weights.nbytes() == expected
        assert weights.nbytes() < 0.3 * full.weights.nbytes()
        attention = "model.layers.0.self_attn"
        group = f"{attention}.q_proj+{attention}.k_proj+{attention}.v_proj"
        x = torch.randn(3, specs[f"{attention}.q_proj"].in_features)
        members = [executor.run(f"{attention}.{m}", Op.FORWARD, x) for m in ("q_proj", "k_proj", "v_proj")]
        torch.testing.assert_close(executor.run(group, Op.FORWARD, x), torch.cat(members, dim=1), rtol=1e-6, atol=1e-6)
        g = torch.randn(3, sum(m.shape[1] for m in members))
        parts, start = [], 0
        for m, out in zip(("q_proj", "k_proj", "v_proj"), members):
            parts.append(executor.run(f"{attention}.{m}", Op.BACKWARD, g[:, start : start + out.shape[1]]))
            start += out.shape[1]
        torch.testing.assert_close(executor.run(group, Op.BACKWARD, g), sum(parts), rtol=1e-5, atol=1e-6)
        if quantization == "fp8-rowwise":  # members are row views of their block's codes
            q_codes = weights.layers[f"{attention}.q_proj"].codes
            k_codes = weights.layers[f"{attention}.k_proj"].codes
            assert q_codes.untyped_storage().data_ptr() == k_codes.untyped_storage().data_ptr()
        stats = executor.stats()
        assert stats["quantization"] == quantization and stats["weights_bytes"] == expected
        assert set(stats["kernels"]) == {"fbgemm" if quantization == "int8" else "dequantize+matmul"}
    finally:
        executor.close()
        full.close()


def test_unknown_quantization_is_a_clear_error(tiny_checkpoint, capsys, monkeypatch):
    path = tiny_checkpoint("llama")
    with pytest.raises(UnsupportedQuantizationError, match="supported: none, int8, fp8-rowwise"):
        symbiosis.BaseExecutor.from_pretrained(path, quantization="nf4")
    code, _, err = run_cli(
        ["generate", "--embedded", "--model", str(path), "--prompt", "x", "--quantization", "int4"], capsys, monkeypatch
    )
    assert code != 0 and "unknown quantization 'int4'; supported: none, int8, fp8-rowwise" in err


# ---- a remote transport; the fingerprint check ---------------------------------------------------


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_quantized_executor_over_ipc_equals_in_process(tiny_checkpoint, tmp_path, quantization, caplog):
    """Over ipc the client fuses siblings (group requests: fbgemm runs member by member), and the
    client is told the executor's quantization at connect; results equal the in-process ones."""
    path = tiny_checkpoint("llama")
    executor = symbiosis.BaseExecutor.from_pretrained(path, quantization=quantization)
    server = executor.serve(f"ipc://{tmp_path}/q.sock")
    try:
        _, in_process = make_pair(path, executor, "lora", "llama")
        with caplog.at_level(logging.INFO, logger="symbiosis.client.surgery"):
            _, remote = make_pair(path, f"ipc://{tmp_path}/q.sock", "lora", "llama")
        assert f"{quantization}-quantized base weights: accepted" in caplog.text
        base = remote.get_base_model()
        assert base.symbiosis_transport.quantization == quantization
        assert in_process.get_base_model().symbiosis_transport.quantization == quantization
        input_ids = torch.randint(3, 1000, (2, 12), generator=torch.Generator().manual_seed(1))
        assert_matches_reference(loss_and_grads(remote, input_ids), loss_and_grads(in_process, input_ids))
        other = tiny_checkpoint("mistral")  # same shapes as llama's tiny preset, other checkpoint
        with pytest.raises(ModelMismatchError), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            symbiosis.load_client_model(other, executor=f"ipc://{tmp_path}/q.sock")
        close_client(remote)
        close_client(in_process)
    finally:
        server.close()
        executor.close()


# ---- fine-tuning against an int8 base (slow) --------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(1200)  # two 150-step runs; about 2 minutes on a quiet 2-core machine
def test_finetuning_a_demo_task_on_an_int8_base_matches_fp32_and_loads_with_plain_peft(tiny_checkpoint, tmp_path):
    """The demo's LoRA task ("reverse") trained against an int8 base reaches the accuracy the fp32
    base reaches (within 10 points on 48 held-out inputs, i.e. 5 answers), and the adapter it
    writes, loaded with plain peft on the fp32 monolithic model, scores within 10 points of that."""
    import peft
    from transformers import AutoModelForCausalLM

    from benchmarks.quantization_quality import finetune_task
    from symbiosis.jobs.client import load_tokenizer
    from symbiosis.jobs.tasks import exact_match_accuracy

    path = tiny_checkpoint("llama")
    tokenizer = load_tokenizer(path)
    scores = {}
    for quantization in (None, "int8"):
        result = finetune_task(path, "lora", quantization=quantization, steps=150, save_to=tmp_path / str(quantization))
        scores[quantization] = result
    assert scores[None]["accuracy_after"] >= 0.5, scores  # the task is learned at all: the comparison means something
    assert scores["int8"]["accuracy_after"] >= scores[None]["accuracy_after"] - 0.10, scores
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), str(tmp_path / "int8"))
    on_fp32 = exact_match_accuracy(model, tokenizer, scores["int8"]["held_out"])
    assert on_fp32 >= scores["int8"]["accuracy_after"] - 0.10, (on_fp32, scores)


@pytest.mark.slow
def test_benchmark_quick_writes_its_results(tmp_path):
    from benchmarks import quantization

    summary = quantization.main(["--quick", "--output", str(tmp_path), "--sections", "bytes", "decode", "train"])
    assert (tmp_path / "quantization.json").is_file() and (tmp_path / "quantization.png").is_file()
    assert summary["results"]["bytes"]["int8"]["bytes_ratio"] < 0.35  # the tiny preset: 12 bytes a row weigh more
    assert summary["results"]["decode"]["int8"]["tokens_per_s"] > 0
