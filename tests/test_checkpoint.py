"""Base-layer discovery, selective loading, and the errors a bad checkpoint gets."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

import symbiosis
from symbiosis.checkpoint import Checkpoint, build_skeleton, discover_base_layers
from symbiosis.modelzoo import ARCHS


@pytest.mark.parametrize("arch", ARCHS)
def test_executor_weights_equal_what_transformers_loads(arch, tiny_checkpoint):
    """Selective loading agrees with transformers' own loading path, tensor by tensor: each linear
    layer's, and each expert's matrix of an MoE model (joined from the checkpoint's one matrix
    per expert by transformers' converters, then sliced)."""
    path = tiny_checkpoint(arch)
    reference = AutoModelForCausalLM.from_pretrained(path)
    weights = symbiosis.BaseExecutor.from_pretrained(path).weights
    modules = dict(reference.named_modules())
    expected = {
        name: module.weight if isinstance(module, nn.Linear) else module.weight.t()
        for name, module in modules.items()
        if isinstance(module, (nn.Linear, symbiosis.checkpoint.Conv1D))
    }
    biases = {name: modules[name].bias for name in expected}
    for tensor in symbiosis.checkpoint.expert_tensors(reference).values():
        stacked = reference.get_parameter(tensor.name)
        for layer_id, matrix in zip(tensor.layer_ids, stacked, strict=True):
            expected[layer_id], biases[layer_id] = (matrix.t() if tensor.transposed else matrix), None
    assert set(weights.specs) == set(expected)
    assert "lm_head" in weights.specs
    assert (arch == "mixtral") == any(".experts." in layer_id for layer_id in expected)
    for layer_id, layer in weights.layers.items():
        torch.testing.assert_close(layer.weight, expected[layer_id], rtol=0, atol=0)
        if biases[layer_id] is None:
            assert layer.bias is None
        else:
            torch.testing.assert_close(layer.bias, biases[layer_id], rtol=0, atol=0)


def test_experts_past_the_tenth_are_joined_in_their_order(tmp_path):
    """The checkpoint names experts 0..11; joined in text order, expert 10 would come after 1."""
    config = AutoConfig.for_model(
        "mixtral", vocab_size=64, hidden_size=16, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=12, num_experts_per_tok=2,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path)
    weights = symbiosis.BaseExecutor.from_pretrained(tmp_path).weights
    stacked = reference.get_parameter("model.layers.0.mlp.experts.down_proj")
    for expert in range(12):
        layer = weights.layers[f"model.layers.0.mlp.experts.down_proj.{expert}"]
        torch.testing.assert_close(layer.weight, stacked[expert], rtol=0, atol=0)


def test_a_checkpoint_whose_tensors_need_splitting_is_refused_saying_so(tmp_path):
    """hrm_text stores q/k/v (and gate/up) fused where transformers holds them apart: the loader
    joins tensors (MoE experts) but does not split them, and said the tensors were missing."""
    from tests.test_more_architectures import BASE

    AutoModelForCausalLM.from_config(AutoConfig.for_model("hrm_text", **BASE)).save_pretrained(tmp_path)
    with pytest.raises(symbiosis.CheckpointError, match="stored with others in .*gqkv_proj.*does not split"):
        symbiosis.BaseExecutor.from_pretrained(tmp_path)


def test_layer_specs_are_module_names(tiny_checkpoint):
    specs = symbiosis.BaseExecutor.from_pretrained(tiny_checkpoint("gpt2")).layer_specs()
    spec = specs["transformer.h.0.attn.c_attn"]
    assert (spec.in_features, spec.out_features, spec.has_bias) == (64, 192, True)


def test_missing_folder(tmp_path):
    with pytest.raises(symbiosis.CheckpointError, match="does not exist"):
        symbiosis.BaseExecutor.from_pretrained(tmp_path / "nope")


def test_missing_config(tiny_checkpoint, tmp_path):
    broken = shutil.copytree(tiny_checkpoint("llama"), tmp_path / "c")
    (broken / "config.json").unlink()
    with pytest.raises(symbiosis.CheckpointError, match="config.json"):
        symbiosis.BaseExecutor.from_pretrained(broken)


def test_an_adapter_folder_given_as_the_base_model_says_what_to_pass(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "base_model_name_or_path": "ckpt/llama"}')
    with pytest.raises(symbiosis.CheckpointError, match="PEFT adapter.*base model's checkpoint.*'ckpt/llama'"):
        symbiosis.BaseExecutor.from_pretrained(adapter)


def test_missing_weights(tiny_checkpoint, tmp_path):
    broken = shutil.copytree(tiny_checkpoint("llama"), tmp_path / "w")
    (broken / "model.safetensors").unlink()
    with pytest.raises(symbiosis.CheckpointError, match="safetensors"):
        symbiosis.load_client_model(broken, executor="tcp://127.0.0.1:1")


def test_missing_shard(tiny_checkpoint, tmp_path):
    broken = shutil.copytree(tiny_checkpoint("llama"), tmp_path / "s")
    (broken / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00002.safetensors"}}))
    with pytest.raises(symbiosis.CheckpointError, match="missing shard"):
        Checkpoint(broken)


def test_checkpoint_lacking_a_tensor(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = shutil.copytree(tiny_checkpoint("llama"), tmp_path / "t")
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(symbiosis.CheckpointError, match="down_proj"):
        symbiosis.BaseExecutor.from_pretrained(broken)


def test_architecture_with_unknown_layer_type(tmp_path):
    """Mamba's mixer owns a 2-D parameter (A_log) and its conv1d a 3-D one: not linear layers. The
    executor serves the linear layers (the rest is the client's); a client is refused, naming
    every such module and the ``client_layers`` patterns that keep them (tests/test_more_architectures.py
    runs such models with them)."""
    config = AutoConfig.for_model(
        "mamba", vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2, intermediate_size=32
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "mamba")
    with symbiosis.BaseExecutor.from_pretrained(tmp_path / "mamba") as executor:
        assert "backbone.layers.1.mixer.in_proj" in executor.layer_specs()
        with pytest.raises(symbiosis.UnsupportedModuleError) as refused:
            symbiosis.load_client_model(tmp_path / "mamba", executor=executor)
    message = str(refused.value)
    assert message.startswith("4 module(s) hold a weight matrix") and "backbone.layers.0.mixer (MambaMixer" in message
    assert "nn.Linear and transformers Conv1D" in message and "client_layers=['*.conv1d', '*.mixer']" in message


def test_client_layers_must_exist_and_may_be_patterns(tiny_checkpoint):
    skeleton = build_skeleton(Checkpoint(tiny_checkpoint("llama")).config)
    with pytest.raises(symbiosis.CheckpointError, match="no_such_layer"):
        discover_base_layers(skeleton, ["no_such_layer"])
    with pytest.raises(symbiosis.CheckpointError, match=r"\*\.no_such_layer"):
        discover_base_layers(skeleton, ["*.no_such_layer"])
    served = discover_base_layers(skeleton, ["model.layers.*.mlp.down_proj", "lm_head"])
    assert set(discover_base_layers(skeleton)) - set(served) == {
        "model.layers.0.mlp.down_proj",
        "model.layers.1.mlp.down_proj",
        "lm_head",
    }
    assert set(discover_base_layers(skeleton, "lm_head")) == set(discover_base_layers(skeleton)) - {"lm_head"}
    # Keeping a module keeps its own tensors, not its layers': an attention block would keep nothing.
    with pytest.raises(symbiosis.CheckpointError, match=r"hold no weights of their own.*\*\.self_attn\.\*_proj"):
        discover_base_layers(skeleton, ["*.self_attn"])


def test_a_linear_subclass_with_a_forward_of_its_own_is_not_a_base_layer():
    """llama4's router is an nn.Linear whose forward returns its top-k too: served as a plain
    product it broke the model (``too many values to unpack``). FalconLinear spells nn.Linear's
    forward otherwise, and stays a base layer."""
    from transformers.models.falcon.modeling_falcon import FalconLinear

    from symbiosis.checkpoint import is_base_layer

    class Router(nn.Linear):
        def forward(self, x):
            logits = super().forward(x)
            return logits.topk(1), logits

    class Renamed(nn.Linear):
        pass

    assert not is_base_layer(Router(4, 4)) and not is_base_layer(nn.Embedding(4, 4))
    assert is_base_layer(Renamed(4, 4)) and is_base_layer(FalconLinear(4, 4)) and is_base_layer(nn.Linear(4, 4))


def test_skeleton_holds_no_weights(tiny_checkpoint):
    skeleton = build_skeleton(Checkpoint(tiny_checkpoint("llama")).config)
    assert all(p.is_meta for p in skeleton.parameters())
    assert not any(b.is_meta for b in skeleton.buffers())  # rotary inv_freq is computed for real


def test_a_shared_expert_as_wide_as_the_number_of_experts_is_not_taken_for_a_router():
    """Routers stay on the client without being named: modules beside the experts whose matrices
    have a row per expert, or the children of such a module (afmoe's router holds its gate). A
    shared expert's gate_proj and up_proj are children too, and with an intermediate size equal
    to the number of experts they were taken for routers (kept on the client: exact, but weights
    every client loaded; a helper's probe, /tmp/review29/p16_router_heuristic.py). A child counts
    only where everything its parent holds has a row per expert."""
    from symbiosis.checkpoint import expert_routers

    config = AutoConfig.for_model(
        "llama4_text",
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_local_experts=4,
        intermediate_size=4,
        intermediate_size_mlp=64,
        interleave_moe_layer_step=1,
        no_rope_layers=[1],
        layer_types=["full_attention"],
    )
    assert expert_routers(build_skeleton(config)) == {"model.layers.0.feed_forward.router"}
    afmoe = AutoConfig.for_model(
        "afmoe", vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=4, num_shared_experts=1,
        intermediate_size=64, num_dense_layers=0,
    )  # fmt: skip
    assert expert_routers(build_skeleton(afmoe)) == {"model.layers.0.mlp.router.gate"}
