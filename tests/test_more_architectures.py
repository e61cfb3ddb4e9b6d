"""Architectures beyond the modelzoo's ten families, from tiny ``transformers`` configs.

``tests/test_split_reference.py`` covers the ten families of ``symbiosis make-model`` with every
PEFT method and transport. This file checks that the split is not tied to them: a sample of the
other dense causal LMs (a helper's sweep on 2026-12-07 found all 31 it tried exact; this keeps
six, each with something of its own: ALiBi, a parallel block, a sliding window, tied embeddings),
models with modules that own weight matrices but are not linear layers (state-space and
recurrent mixers): refused with the ``client_layers`` that keep them, then exact with those; and
mixture-of-experts models whose experts the executor serves, one base layer per expert (llama4's
too, not the standard experts module, its router an ``nn.Linear`` with a forward of its own).
"""

from __future__ import annotations

import warnings

import peft
import pytest
import torch
from transformers import AutoConfig

import symbiosis
from symbiosis.client.experts import ExpertWeights
from symbiosis.modelzoo import build_random_model
from tests.reference import assert_matches_reference, close_client, executor_at, loss_and_grads, make_pair

pytestmark = pytest.mark.slow

BASE = dict(  # (the modelzoo's "tiny" preset, in transformers' common field names)
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)
SLIDING = dict(sliding_window=128, layer_types=["sliding_attention", "full_attention"])
DENSE = {
    "qwen3": dict(head_dim=16),
    "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window_pattern=2, **SLIDING),
    "bloom": dict(n_head=4, n_layer=2),  # ALiBi, fused query_key_value
    "mpt": dict(d_model=64, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=256),
    "gptj": dict(n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=256, rotary_dim=8),  # parallel block
    "cohere2": dict(SLIDING),  # parallel block, tied embeddings
}
#: model type -> (its options, the client_layers its refusal suggests and its forward needs, LoRA targets)
KEPT_MODULES = {
    "mamba": (
        dict(state_size=8, expand=2, conv_kernel=4, time_step_rank=8, use_mambapy=False),
        # (dt_proj too: Mamba's forward multiplies by dt_proj.weight itself)
        ["*.conv1d", "*.mixer", "*.dt_proj"],
        ["in_proj", "x_proj"],  # (peft refuses out_proj on Mamba)
    ),
    "falcon_h1": (
        dict(
            head_dim=16,
            mamba_d_ssm=64,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=1,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=1,
            mamba_chunk_size=32,
        ),
        ["*.conv1d"],
        ["q_proj", "v_proj"],
    ),
    "recurrent_gemma": (
        dict(lru_width=64, attention_window_size=128, head_dim=16, block_types=["recurrent", "attention"]),
        ["*.conv_1d", "*.rg_lru"],
        ["q_proj", "v_proj", "linear_x"],
    ),
}
#: model type -> (its options, client_layers, LoRA targets or LoraConfig fields): experts served by the executor
#: (``client/experts.py``), the routers beside them on the client without being named.
TOP2_OF_4 = dict(num_local_experts=4, num_experts_per_tok=2)
SERVED_EXPERTS = {
    "mixtral": (TOP2_OF_4, [], "all-linear"),
    "qwen2_moe": (  # a shared expert (plain linear layers) and its gate beside the routed experts
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64),
        [],
        "all-linear",
    ),
    "deepseek_v3": (  # multi-head latent attention; a router with a score-correction bias
        dict(
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            first_k_dense_replace=1,  # (its first layer's MLP dense)
            n_group=1,
            topk_group=1,
            kv_lora_rank=16,
            q_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            head_dim=8,
        ),
        [],
        ["q_b_proj", "kv_b_proj", "o_proj"],
    ),
    "gpt_oss": (  # experts stored transposed ([experts, in, out], ``x @ W[e]``), with per-expert biases
        dict(TOP2_OF_4, head_dim=16, layer_types=["sliding_attention", "full_attention"], sliding_window=128),
        [],
        ["q_proj", "v_proj"],
    ),
    "afmoe": (  # its router holds its gate, an nn.Linear: on the client (peft's all-linear adapts it)
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1, head_dim=16),
        [],
        "all-linear",
    ),
    "deepseek_v4": (  # its checkpoint mapping renames ".norm." too broadly (model.norm kept as transformers keeps it)
        dict(
            TOP2_OF_4,
            n_routed_experts=4,
            moe_intermediate_size=32,
            head_dim=16,
            qk_rope_head_dim=8,
            q_lora_rank=32,
            index_topk=4,
            index_head_dim=16,
            index_n_heads=2,
            o_lora_rank=16,
            o_groups=2,
        ),
        ["*.attn_hc", "*.compressor", "*.ffn_hc", "*.hc_head", "*.o_a_proj"],
        ["q_a_proj", "q_b_proj"],
    ),
    "llama4_text": (  # not the standard experts: every expert given every row (zeros where not chosen)
        dict(
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=1,
            intermediate_size_mlp=128,
            interleave_moe_layer_step=1,
            attention_chunk_size=128,
            no_rope_layers=[1, 0],
            layer_types=["chunked_attention", "full_attention"],
        ),
        [],
        dict(  # (peft's all-linear would wrap the router, whose forward returns a tuple)
            target_modules=["q_proj", "v_proj"],
            target_parameters=["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"],
        ),
    ),
    "jamba": (  # a Mamba hybrid: its mixers kept on the client, its experts served
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            expert_layer_period=1,
            expert_layer_offset=0,
            attn_layer_period=2,
            attn_layer_offset=1,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank=8,
            use_mamba_kernels=False,
        ),
        ["*.conv1d", "*.mamba", "*.dt_proj"],
        ["q_proj", "v_proj"],
    ),
}
IDS = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])


def checkpoint(tmp_path, model_type: str, options: dict) -> str:
    """A random checkpoint as ``symbiosis make-model`` makes them (norms and biases perturbed, so a
    dropped one shows), of the modelzoo's tiny size (``BASE``) in this architecture."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.for_model(model_type, **{**BASE, **options})
        build_random_model(config).save_pretrained(tmp_path / model_type)
    return str(tmp_path / model_type)


def assert_same_greedy_tokens(split, reference) -> None:
    expected = reference.generate(input_ids=IDS, max_new_tokens=6, do_sample=False)
    assert torch.equal(split.generate(input_ids=IDS, max_new_tokens=6, do_sample=False), expected)


@pytest.mark.parametrize("model_type", DENSE)
def test_dense_architectures_match_the_monolithic_model(model_type, tmp_path):
    path = checkpoint(tmp_path, model_type, DENSE[model_type])
    with symbiosis.BaseExecutor.from_pretrained(path) as executor:
        reference, split = make_pair(path, executor, "lora", model_type)
        try:
            assert_matches_reference(loss_and_grads(split, IDS), loss_and_grads(reference, IDS))
            assert_same_greedy_tokens(split, reference)
        finally:
            close_client(split)


@pytest.mark.parametrize("remote", [False, True], ids=["inproc", "tcp"])
@pytest.mark.parametrize("model_type", KEPT_MODULES)
def test_models_are_refused_with_the_client_layers_that_keep_their_other_modules_then_match(
    model_type, remote, tmp_path
):
    """The executor serves their linear layers; a client without ``client_layers`` was refused
    at the executor already, with a hint it could not follow (neither side took client_layers
    for a module that is not a linear layer). Now the client is refused naming every such module
    and the patterns that keep them, and with those it matches the monolithic model."""
    options, kept, targets = KEPT_MODULES[model_type]
    path = checkpoint(tmp_path, model_type, options)
    with executor_at(path, remote) as executor:
        with pytest.raises(symbiosis.UnsupportedModuleError) as refused:
            symbiosis.load_client_model(path, executor=executor)
        suggested = [pattern for pattern in kept if pattern != "*.dt_proj"]
        assert f"client_layers={sorted(suggested)}" in str(refused.value)
        config = peft.LoraConfig(r=4, target_modules=targets, lora_dropout=0.0)
        reference, split = make_pair(path, executor, config, model_type, client_layers=kept)
        try:
            assert_matches_reference(loss_and_grads(split, IDS), loss_and_grads(reference, IDS))
            assert_same_greedy_tokens(split, reference)
        finally:
            close_client(split)


@pytest.mark.parametrize(
    ("model_type", "remote"),
    [(model_type, False) for model_type in SERVED_EXPERTS]
    + [("mixtral", True), ("gpt_oss", True), ("llama4_text", True)],
    ids=lambda value: {False: "inproc", True: "tcp"}.get(value, value) if isinstance(value, bool) else value,
)
def test_moe_models_are_served_with_their_experts_on_the_executor_and_match(model_type, remote, tmp_path):
    """Their experts were refused (one 3-D tensor in transformers 5, one matrix per expert in the
    checkpoint: the selective loader did not join them), and keeping them on the client would
    load most of the model into every client. Now the executor serves each expert's matrix as a
    base layer; the client holds none of them and matches the monolithic model."""
    options, kept, targets = SERVED_EXPERTS[model_type]
    path = checkpoint(tmp_path, model_type, options)
    with executor_at(path, remote) as executor:
        targets = targets if isinstance(targets, dict) else dict(target_modules=targets)
        config = peft.LoraConfig(r=4, lora_dropout=0.0, **targets)
        reference, split = make_pair(path, executor, config, model_type, client_layers=kept)
        try:
            assert_matches_reference(loss_and_grads(split, IDS), loss_and_grads(reference, IDS))
            assert_same_greedy_tokens(split, reference)
            experts = {name for name, p in reference.named_parameters() if p.dim() == 3 and ".experts." in name}
            assert experts, "the model has no experts to serve"
            held = [p for name, p in split.named_parameters() if p.dim() == 3 and ".experts." in name]
            assert len(held) == len(experts) and all(isinstance(p, ExpertWeights) for p in held)  # (no data)
            base = reference.get_base_model().num_parameters()
            assert split.get_base_model().num_parameters() == base  # (each expert counted where it is served)
            split.state_dict(), split.float()  # (each sets the experts aside a moment: back in their places)
            in_experts = [
                [name for name, _ in model.named_parameters() if ".experts." in name] for model in (split, reference)
            ]
            assert in_experts[0] == in_experts[1]  # (gpt_oss: biases between the experts tensors)
        finally:
            close_client(split)
