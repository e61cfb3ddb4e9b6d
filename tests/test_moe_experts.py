"""Served MoE experts (``symbiosis/client/experts.py``) behave as the module tree would have them.

Their layers are not registered modules (so peft's ``all-linear`` cannot adapt them where the
monolithic model has no layer), so what the module tree does for registered base layers is done
for them by hand: moves and casts, copies, state dicts, activation noise, refusals. Exactness
against the monolithic model, per architecture and transport: tests/test_more_architectures.py.
"""

from __future__ import annotations

import copy

import peft
import pytest
import torch

import symbiosis
from symbiosis.client.experts import ExpertWeights, expert_layers
from symbiosis.client.privacy import NoisyLink
from symbiosis.sharding.placement import Layout
from tests.reference import adapter_grads, assert_matches_reference, close_client, loss_and_grads, make_pair
from tests.test_more_architectures import checkpoint

IDS = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])


def mixtral_checkpoint(folder, experts: int = 4) -> str:
    """A tiny Mixtral checkpoint (the modelzoo's tiny size, top 2 of ``experts``)."""
    return checkpoint(folder, "mixtral", dict(num_local_experts=experts, num_experts_per_tok=2))


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A tiny Mixtral checkpoint (4 experts, top 2) and an executor of it."""
    path = mixtral_checkpoint(tmp_path_factory.mktemp("mixtral"))
    with symbiosis.BaseExecutor.from_pretrained(path) as executor:
        yield path, executor


@pytest.fixture
def split(mixtral):
    path, executor = mixtral
    model = symbiosis.load_client_model(path, executor=executor)
    yield model
    close_client(model)


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def test_each_experts_tensor_is_a_frozen_placeholder_with_a_layer_per_expert(split):
    experts = split.model.layers[0].mlp.experts
    weights = experts.gate_up_proj
    assert isinstance(weights, ExpertWeights) and isinstance(weights, torch.nn.Parameter)
    assert not weights.requires_grad and tuple(weights.shape) == (4, 256, 64)
    assert [layer.layer_id for layer in weights.expert_layers] == [
        f"model.layers.0.mlp.experts.gate_up_proj.{e}" for e in range(4)
    ]
    assert weights[torch.tensor(2)] is weights.expert_layers[2].weight
    assert len(list(expert_layers(split))) == 2 * 2 * 4  # (layers x tensors x experts)
    # Not modules of the model (peft's all-linear would adapt them), and not in its state dict:
    assert not any(".experts.gate_up_proj." in name for name, _ in split.named_modules())
    assert not any(".experts." in key for key in split.state_dict())


def test_each_expert_is_a_unit_of_its_own_whatever_the_number_of_experts(tmp_path):
    """Experts are not sibling layers (they read tokens of their own): as one block, the shapes
    timed at warm-up grew with the number of experts (every contiguous run of the block; 138
    trials in 129 s for 32 experts of a tiny model), and a sharded executor gathered or placed
    all of a layer's experts at once."""
    shapes, units = {}, {}
    for experts in (4, 16):
        path = mixtral_checkpoint(tmp_path / str(experts), experts)
        with symbiosis.BaseExecutor.from_pretrained(path) as executor:
            shapes[experts] = len(executor.weights.forward_shapes())
            units[experts] = Layout(executor.weights.specs).units
    assert shapes[4] == shapes[16]
    expert_units = [unit for unit in units[16] if ".experts." in unit.layer_ids[0]]
    assert len(expert_units) == 2 * 2 * 16 and all(len(unit.layer_ids) == 1 for unit in expert_units)


@pytest.mark.parametrize(
    "use",
    [
        lambda w: w.sum(),
        lambda w: w[0:2],
        lambda w: w[0] @ torch.ones(64, 1),  # (a product with W itself, not of rows by it: F.linear's)
        lambda w: w.add_(1.0),
        lambda w: w.requires_grad_(),
    ],
    ids=["sum", "slice", "matmul", "add_", "requires_grad"],
)
def test_other_uses_of_an_experts_tensor_are_refused(split, use):
    with pytest.raises(symbiosis.BaseWeightAccessError):
        use(split.model.layers[0].mlp.experts.gate_up_proj)


def test_the_refusal_says_how_served_experts_are_used(split):
    with pytest.raises(symbiosis.BaseWeightAccessError, match="grouped experts forward"):
        split.model.layers[0].mlp.experts.down_proj.sum()


@pytest.mark.parametrize("implementation", ["batched_mm", "eager"])
def test_another_experts_implementation_still_runs_the_served_forward(split, implementation):
    """transformers' batched products gather every chosen expert's matrix (``W[expert_ids]``),
    reading the weights (refused with a hint to keep the experts in every client); the split
    model's experts keep the grouped forward whatever is set later."""
    expected = logits(split)
    split.set_experts_implementation(implementation)
    torch.testing.assert_close(logits(split), expected, atol=0, rtol=0)


def test_a_cast_or_move_of_the_model_moves_the_experts_and_their_layers(split):
    expected = logits(split)
    split.to(torch.bfloat16)
    weights = split.model.layers[1].mlp.experts.down_proj
    assert weights.dtype == torch.bfloat16 and isinstance(weights, ExpertWeights)
    assert all(layer.weight.dtype == torch.bfloat16 for layer in expert_layers(split))
    torch.testing.assert_close(logits(split), expected, atol=0.05, rtol=0.05)  # (bf16 rows)
    split.float()  # (the client's own tensors keep their bf16 rounding, as a monolithic model's would)
    assert all(layer.weight.dtype == torch.float32 for layer in expert_layers(split))
    torch.testing.assert_close(logits(split), expected, atol=0.05, rtol=0.05)


def test_a_copy_of_the_model_has_expert_layers_of_its_own_and_a_copy_of_the_experts_alone_is_refused(split):
    copied = copy.deepcopy(split)
    ours, theirs = list(expert_layers(split)), list(expert_layers(copied))
    assert len(theirs) == len(ours) and not {id(layer) for layer in ours} & {id(layer) for layer in theirs}
    assert copied.model.layers[0].mlp.experts.gate_up_proj.owner is copied.model.layers[0].mlp.experts
    # Parameters still (peft's LoRA on experts, a parametrization, made the copy's buffers, which
    # its state dict then failed to save)
    held = [w for w in copied.parameters() if isinstance(w, ExpertWeights)]
    assert len(held) == 2 * 2 and all(isinstance(w, torch.nn.Parameter) for w in held)
    torch.testing.assert_close(logits(copied), logits(split), atol=0, rtol=0)
    with pytest.raises(symbiosis.BaseWeightAccessError):
        copy.deepcopy(split.model.layers[0].mlp.experts)  # (peft's modules_to_save makes such copies)


def test_activation_noise_covers_the_experts(split):
    expected = logits(split)
    with symbiosis.enable_activation_noise(split, seed=0):
        assert all(isinstance(layer.link, NoisyLink) for layer in expert_layers(split))
        torch.testing.assert_close(logits(split), expected, atol=1e-3, rtol=1e-3)
    assert not any(isinstance(layer.link, NoisyLink) for layer in expert_layers(split))


def test_full_fine_tuning_is_refused(split):
    with pytest.raises(symbiosis.BaseWeightAccessError):
        split.requires_grad_()


def test_lora_on_the_experts_with_two_adapters_active_matches_the_monolithic_model(mixtral):
    """One active adapter folds into a ``baddbmm`` of its factors (peft's ``_LoraFactorsProxy``);
    two add their summed delta, ``W + Δ`` (``_LoraParameterProxy``): both served."""
    path, executor = mixtral
    config = peft.LoraConfig(r=2, target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    reference, split = make_pair(path, executor, config, "mixtral")
    try:
        for model in (reference, split):
            model.add_adapter("second", copy.deepcopy(config))
            torch.manual_seed(1)
            for name, p in model.named_parameters():
                if ".second." in name:
                    p.data.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
            model.base_model.set_adapter(["default", "second"])
        assert_matches_reference(loss_and_grads(split, IDS), loss_and_grads(reference, IDS))
    finally:
        close_client(split)


@pytest.mark.slow
def test_torch_compile_of_a_split_moe_model_with_lora_on_its_experts(mixtral):
    """The tracer went into the experts' placeholder arithmetic (peft's parametrization of the
    experts tensor: InternalTorchDynamoError); it is a graph break now, as the experts' forward
    is. Loss and gradients are the monolithic model's. (One compile: ~10-20 s.)"""
    path, executor = mixtral
    config = peft.LoraConfig(r=2, target_modules=["q_proj"], target_parameters=["experts.gate_up_proj"])
    reference, split = make_pair(path, executor, config, "mixtral")
    try:
        compiled = loss_and_grads(torch.compile(split), IDS)[:2]  # its gradients: on split's parameters
        assert_matches_reference((*compiled, adapter_grads(split)), loss_and_grads(reference, IDS))
    finally:
        close_client(split)


def test_publishing_an_adapter_the_api_server_would_refuse_is_refused_before_training(split, tmp_path):
    """finetune's default LoRA (all-linear) on an MoE model adapts the experts (peft's
    target_parameters), which the multi-adapter server refuses: with --publish-to, each publication
    was refused with a warning while the job trained on and exited 0, publishing nothing."""
    from symbiosis.jobs.base import JobError
    from symbiosis.jobs.publish import AdapterPublisher, PublishOptions

    model = peft.get_peft_model(split, peft.LoraConfig(r=2, target_modules="all-linear"))
    assert model.peft_config["default"].target_parameters  # (what peft picks for an MoE model)
    with pytest.raises(JobError, match="target_parameters"):
        AdapterPublisher(PublishOptions("http://127.0.0.1:1", "live", every=2), model, tmp_path / "out")


@pytest.mark.parametrize("targets", [dict(target_modules=["q_proj"]), dict(target_parameters=["experts.down_proj"])])
def test_distributed_data_parallel_wraps_a_split_moe_model(mixtral, targets, tmp_path):
    """DDP broadcasts every parameter when it wraps a model, and an experts placeholder has none
    to broadcast: it failed (BaseWeightAccessError on detach). The split model lists them where
    DDP looks for parameters to leave alone, as the split model or a PeftModel of it names them."""
    import torch.distributed as dist

    path, executor = mixtral
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        reference, split = make_pair(path, executor, peft.LoraConfig(r=2, **targets), "mixtral")
        try:
            wrapped = torch.nn.parallel.DistributedDataParallel(split)
            assert_matches_reference(
                loss_and_grads(wrapped, IDS)[:2] + (adapter_grads(split),), loss_and_grads(reference, IDS)
            )
        finally:
            close_client(split)
    finally:
        dist.destroy_process_group()
