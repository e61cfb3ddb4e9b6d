"""peft's ``bias="all"`` and ``bias="lora_only"`` on a split model: exactly as on the monolithic one.

A base layer's bias, made trainable, becomes a parameter of the client (a copy of the served bias,
read as the product of a zero row); the weight stays served and frozen, and the layer adds
``bias - served bias`` to the executor's product. Each test compares against `transformers`+`peft`
on the same checkpoint: trainable names, logits, loss and gradients (the biases' included), after
optimizer steps, and adapters saved with their biases loaded either way.
"""

from __future__ import annotations

import copy
import warnings

import peft
import pytest
import torch
from torch.nn import functional as F
from transformers import AutoModelForCausalLM

import symbiosis
from symbiosis.client.placeholders import BaseWeightPlaceholder
from symbiosis.client.virt import VirtConv1D, VirtLinear
from tests.reference import (
    assert_matches_reference,
    close_client,
    executor_at,
    loss_and_grads,
    make_pair,
    randomize_adapters,
)

TOL = dict(rtol=1e-4, atol=1e-5)
#: After optimizer steps where products sum in another order than the monolithic model's (fused siblings,
#: another process's kernels): float32 rounding differences grow with each step. Unfused in-process, a
#: layer whose bias the client holds asks for x·Wᵀ and adds it, as nn.Linear does: equal to the bit
#: after 3 steps at lr 0.5 on opt, gpt2 and qwen2 (where adding the change to the served bias was not).
TRAINED_TOL = dict(rtol=1e-3, atol=1e-4)
IDS = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
#: Targets of a ``lora_only`` adapter on some layers only: the others' biases stay served.
SOME = {"opt": ["q_proj", "v_proj"], "qwen2": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}


def lora(bias: str, targets="all-linear") -> peft.LoraConfig:
    return peft.LoraConfig(
        task_type=peft.TaskType.CAUSAL_LM, r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, bias=bias
    )


def trainable(model) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def virt_layers(model) -> list:
    return [m for m in model.modules() if isinstance(m, (VirtLinear, VirtConv1D))]


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def assert_close_logits(got: torch.Tensor, expected: torch.Tensor, what: str, tol: dict) -> None:
    torch.testing.assert_close(got, expected, **tol, msg=lambda message: f"{what}: {message}")


def sgd_steps(model, steps: int = 3) -> None:
    """(In eval mode: dropout, where a model has some, draws alike in neither.)"""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        model(input_ids=IDS, labels=IDS).loss.backward()
        optimizer.step()


def load(path, adapter, executor=None, *, second: bool):
    """The adapter saved at ``adapter`` on a fresh split model (``executor`` given) or monolithic one:
    as its first adapter (``PeftModel.from_pretrained``), or as a second one made active."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = (
            symbiosis.load_client_model(path, executor=executor)
            if executor is not None
            else AutoModelForCausalLM.from_pretrained(path)
        )
        if not second:
            return peft.PeftModel.from_pretrained(base, adapter)
        model = peft.get_peft_model(base, lora("none"))  # (B = 0: the first adapter changes nothing)
        model.load_adapter(adapter, adapter_name="second")
        model.set_adapter("second")
        model.eval()
        return model


CASES = [
    ("opt", "all", "all-linear", "inproc"),
    ("opt", "lora_only", "some", "inproc"),
    ("gpt2", "all", "all-linear", "inproc"),
    ("gpt2", "lora_only", "some", "inproc"),
    ("qwen2", "all", "all-linear", "inproc"),
    ("qwen2", "lora_only", "some", "inproc"),
    ("qwen2", "all", "all-linear", "fused"),  # q/k/v in one request, each adding its own trained bias
    ("opt", "all", "all-linear", "tcp"),  # (fused by default over tcp)
    ("qwen2", "lora_only", "all-linear", "tcp"),
]


@pytest.mark.parametrize(("arch", "bias", "targets", "transport"), CASES)
def test_trained_base_biases_match_the_monolithic_model(arch, bias, targets, transport, tiny_checkpoint, tmp_path):
    """Trainable names, loss, logits and every gradient; then after SGD steps on both; then the
    adapters each saved, loaded into fresh split and monolithic models, first or second adapter."""
    path = tiny_checkpoint(arch)
    config = lora(bias, SOME[arch] if targets == "some" else targets)
    options = {"fuse_siblings": True} if transport == "fused" else {}
    with executor_at(path, transport == "tcp") as executor:
        reference, split = make_pair(path, executor, config, arch, **options)
        try:
            names = trainable(split)
            assert names == trainable(reference)
            biases = [n for n in names if n.endswith(".base_layer.bias")]
            assert biases, "no base-layer bias trained: the test could not fail"
            served_biases = {f"{m.layer_id}.bias" for m in virt_layers(split) if m._has_bias}
            trained = {m.layer_id for m in virt_layers(split) if m.trained_bias() is not None}
            assert len(trained) == len(biases)
            if targets == "some":
                assert len(trained) < len(served_biases)  # the other layers' biases stay served
            assert split.get_nb_trainable_parameters() == reference.get_nb_trainable_parameters()
            assert split.get_base_model().num_parameters() == reference.get_base_model().num_parameters()
            if transport != "inproc":  # siblings fused from the second forward on, but not those whose
                logits(split), logits(split)  # bias the client holds: they ask for x·Wᵀ alone (exact)
                fusion = virt_layers(split)[0].fusion
                assert fusion is not None
                assert not {member for group in fusion.groups() for member in group} & trained
                if arch == "qwen2" and bias == "all":
                    assert fusion.groups()  # (gate/up, without biases, still fused)
            assert_matches_reference(loss_and_grads(split, IDS), loss_and_grads(reference, IDS))

            sgd_steps(reference)
            sgd_steps(split)
            expected = logits(reference)
            tol = TOL if transport == "inproc" else TRAINED_TOL
            assert_close_logits(logits(split), expected, "after 3 steps", tol)

            reference.save_pretrained(tmp_path / "monolithic")
            split.save_pretrained(tmp_path / "split")
            for saved in ("monolithic", "split"):
                for second in (False, True):
                    for target in (executor, None):
                        loaded = load(path, tmp_path / saved, target, second=second)
                        try:
                            where = "split" if target is not None else "monolithic"
                            what = f"{saved}'s adapter on a {where} model, second={second}"
                            assert_close_logits(logits(loaded), expected, what, tol)
                        finally:
                            if target is not None:
                                close_client(loaded)
        finally:
            close_client(split)


def test_a_bf16_client_trains_its_biases_as_a_bf16_monolithic_model(tiny_checkpoint):
    path = tiny_checkpoint("qwen2")
    config = lora("all")
    with warnings.catch_warnings(), executor_at(path, False) as executor:
        warnings.simplefilter("ignore")
        reference = peft.get_peft_model(
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), copy.deepcopy(config)
        )
        split = peft.get_peft_model(
            symbiosis.load_client_model(path, executor=executor, dtype="bfloat16"), copy.deepcopy(config)
        )
        try:
            values = randomize_adapters(reference)
            split.load_state_dict(values, strict=False)
            assert trainable(split) == trainable(reference)
            biases = [n for n in values if n.endswith("base_layer.bias")]
            assert biases and all(split.get_parameter(n).dtype == torch.bfloat16 for n in biases)
            got, want = loss_and_grads(split, IDS), loss_and_grads(reference, IDS)
            torch.testing.assert_close(got[0], want[0], rtol=0.05, atol=0.05)
            torch.testing.assert_close(got[1], want[1], rtol=0.02, atol=0.02)
            for name, grad in want[2].items():
                if name.endswith("bias"):
                    cosine = F.cosine_similarity(got[2][name].float().flatten(), grad.float().flatten(), dim=0)
                    assert cosine > 0.99, (name, cosine)
        finally:
            close_client(split)


@pytest.fixture(scope="module")
def opt(tiny_checkpoint):
    return tiny_checkpoint("opt")


@pytest.fixture(scope="module")
def opt_executor(opt):
    with symbiosis.BaseExecutor.from_pretrained(opt) as ex:
        yield ex


def test_full_fine_tuning_stays_refused_with_trained_biases_and_materializes_nothing(opt, opt_executor):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fresh = symbiosis.load_client_model(opt, executor=opt_executor)
        split = peft.get_peft_model(symbiosis.load_client_model(opt, executor=opt_executor), lora("all"))
    try:
        before = {n: p.requires_grad for n, p in fresh.named_parameters()}
        with pytest.raises(symbiosis.BaseWeightAccessError, match=r"self_attn\.\w+_proj\.weight' cannot be trained"):
            fresh.requires_grad_()
        assert {n: p.requires_grad for n, p in fresh.named_parameters()} == before
        assert not any(m.trained_bias() is not None for m in virt_layers(fresh))  # nothing materialized
        with pytest.raises(symbiosis.BaseWeightAccessError, match=r"\.weight' cannot be trained"):
            for parameter in fresh.parameters():
                parameter.requires_grad = True  # reaches a layer's weight probe before its bias

        assert all(m.trained_bias() is not None for m in virt_layers(split) if m._has_bias)
        flags = {n: p.requires_grad for n, p in split.named_parameters()}
        for module in (split, split.get_base_model(), split.get_base_model().model.decoder.layers[0]):
            with pytest.raises(symbiosis.BaseWeightAccessError, match=r"\.weight' cannot be trained"):
                module.requires_grad_()
            assert {n: p.requires_grad for n, p in split.named_parameters()} == flags
    finally:
        fresh.symbiosis_transport.close()


def test_copies_and_casts_of_a_model_with_trained_biases_train_their_own(opt, opt_executor):
    reference, split = make_pair(opt, opt_executor, lora("all"), "opt")
    try:
        # A copy (or a cast) made before the biases are trained: its probes make its own trainable.
        fresh = symbiosis.load_client_model(opt, executor=opt_executor)
        for derived in (copy.deepcopy(fresh), copy.deepcopy(fresh).to(torch.bfloat16)):
            adapted = peft.get_peft_model(derived, lora("all"))
            assert trainable(adapted) == trainable(reference)
            assert all(m.trained_bias() is not None for m in virt_layers(derived) if m._has_bias)
            assert not any(m.trained_bias() is not None for m in virt_layers(fresh))
        copied = copy.deepcopy(split)
        torch.testing.assert_close(logits(copied), logits(reference), **TOL)
        original = {n: p.detach().clone() for n, p in split.named_parameters() if n.endswith("base_layer.bias")}
        sgd_steps(copied)
        sgd_steps(reference)
        torch.testing.assert_close(logits(copied), logits(reference), **TOL)
        for name, value in original.items():
            assert torch.equal(split.get_parameter(name), value), name  # the original's own, untouched
            expected = reference.get_parameter(name)  # (k_proj's is not trained: softmax ignores a key bias)
            torch.testing.assert_close(copied.get_parameter(name), expected, **TOL, msg=name)
        assert any(not torch.equal(copied.get_parameter(name), value) for name, value in original.items())
        torch.testing.assert_close(logits(split), logits(make_pair(opt, opt_executor, lora("all"), "opt")[0]), **TOL)

        narrow = copy.deepcopy(copied).to(torch.bfloat16)
        wide = copy.deepcopy(reference).to(torch.bfloat16)
        assert all(p.dtype == torch.bfloat16 for n, p in narrow.named_parameters() if n.endswith("base_layer.bias"))
        torch.testing.assert_close(logits(narrow).float(), logits(wide).float(), rtol=0.05, atol=0.05)
        sgd_steps(narrow, 1)
        assert any(
            not torch.equal(narrow.get_parameter(n), copied.get_parameter(n).bfloat16()) for n in original
        )  # trained in bf16, the copy's own
    finally:
        close_client(split)


def test_functional_call_with_a_replaced_bias_computes_with_it(opt, opt_executor):
    monolithic = AutoModelForCausalLM.from_pretrained(opt)
    model = symbiosis.load_client_model(opt, executor=opt_executor)
    try:
        name = "model.decoder.layers.0.self_attn.q_proj.bias"
        bias = torch.randn(monolithic.get_parameter(name).shape, requires_grad=True)
        expected = torch.func.functional_call(monolithic, {name: bias}, (IDS,)).logits
        got = torch.func.functional_call(model, {name: bias}, (IDS,)).logits
        torch.testing.assert_close(got, expected, **TOL)
        (want,) = torch.autograd.grad(expected.square().sum(), bias)
        (have,) = torch.autograd.grad(got.square().sum(), bias)
        torch.testing.assert_close(have, want, **TOL)
        assert isinstance(model.get_submodule(name.rsplit(".", 1)[0]).bias, BaseWeightPlaceholder)  # restored
        torch.testing.assert_close(logits(model), logits(monolithic), **TOL)
    finally:
        model.symbiosis_transport.close()


def test_linear_of_a_derived_weight_adds_a_trained_bias_once(opt, opt_executor):
    """HRA, ShiRA: ``F.linear(x, W', layer.bias)`` from the layer's product, whose forward adds the
    trained bias itself: the bias counted, and given its gradient, once."""
    monolithic = AutoModelForCausalLM.from_pretrained(opt).model.decoder.layers[0].fc1
    W = monolithic.weight.detach()
    model = symbiosis.load_client_model(opt, executor=opt_executor)
    try:
        layer = model.model.decoder.layers[0].fc1
        trained = layer.bias.requires_grad_()  # (peft's lora_only: the placeholder made trainable)
        assert trained is layer.bias and isinstance(trained, torch.nn.Parameter) and trained.requires_grad
        with torch.no_grad():
            trained.add_(torch.randn(trained.shape))
        b = trained.detach().clone().requires_grad_()
        x = torch.randn(3, W.shape[1])
        H = torch.randn(W.shape[1], W.shape[1])
        for got, expected in (
            (F.linear(x, layer.weight @ H, layer.bias), F.linear(x, W @ H, b)),
            (F.linear(x, layer.weight.clone() + H[:1].expand_as(W), layer.bias), F.linear(x, W + H[:1], b)),
            (F.linear(x, layer.weight, layer.bias * 1.0), F.linear(x, W, b)),
        ):
            torch.testing.assert_close(got, expected, **TOL)
            (want,) = torch.autograd.grad(expected.square().sum(), b)
            (have,) = torch.autograd.grad(got.square().sum(), trained)
            torch.testing.assert_close(have, want, **TOL)
    finally:
        model.symbiosis_transport.close()


@pytest.mark.parametrize("method", ["hra", "boft"])
def test_other_methods_with_trained_biases_match_the_monolithic_model(method, opt, opt_executor):
    """HRA's forward is ``F.linear(x, W·H, b)``, BOFT's scales ``result - b``: with the bias trained."""
    kind, options = {
        "hra": (peft.HRAConfig, dict(r=4)),
        "boft": (peft.BOFTConfig, dict(boft_block_size=4, boft_n_butterfly_factor=1)),
    }[method]
    config = kind(task_type=peft.TaskType.CAUSAL_LM, target_modules="all-linear", bias="all", **options)
    reference, split = make_pair(opt, opt_executor, config, "opt")
    try:
        assert trainable(split) == trainable(reference)
        assert any(n.endswith("base_layer.bias") for n in trainable(split))
        assert_matches_reference(loss_and_grads(split, IDS), loss_and_grads(reference, IDS))
    finally:
        close_client(split)


def test_an_adapter_with_trained_biases_loads_with_low_cpu_mem_usage(opt, opt_executor, tmp_path):
    """peft's ``low_cpu_mem_usage=True`` loads with ``load_state_dict(assign=True)``, which assigns
    each loaded parameter to its module: a VirtLayer refused any ``bias`` assignment (a helper's
    probe), so such an adapter loaded everywhere but there."""
    reference = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(opt), lora("all"))
    randomize_adapters(reference)
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if name.endswith("base_layer.bias") or name.endswith("proj.bias"):
                parameter.add_(0.05)
    reference.save_pretrained(tmp_path / "adapter")
    reference.eval()
    expected = logits(reference)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        split = peft.PeftModel.from_pretrained(
            symbiosis.load_client_model(opt, executor=opt_executor), tmp_path / "adapter", low_cpu_mem_usage=True
        )
    try:
        assert any(m.trained_bias() is not None for m in virt_layers(split))
        torch.testing.assert_close(logits(split), expected, **TOL)
        layer = next(m for m in virt_layers(split) if m.trained_bias() is not None)
        moved = {f"{name}.bias": layer.bias.detach() + 1 for name, m in split.named_modules() if m is layer}
        before = logits(split)
        split.load_state_dict(moved, strict=False, assign=True)
        assert torch.equal(layer.bias.detach(), next(iter(moved.values())))
        assert not torch.equal(logits(split), before)
    finally:
        close_client(split)
