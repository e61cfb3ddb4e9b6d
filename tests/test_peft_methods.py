"""Every other PEFT method peft registers, on a split model: exact, or refused saying why.

``tests/test_split_reference.py`` covers the common methods on every family and transport. This
file covers the rest of peft's registry in-process, on llama (no biases) and opt (biases, a tied
lm_head): methods that adapt a base layer through its product match the monolithic model
(logits, loss, adapter gradients), HRA and ShiRA too (their ``F.linear(x, W·H, b)`` and
``F.linear(x, W + Δ, b)`` are computed from the layer's product), and DEFT (its init's ``rightᵀ·W``
is the executor's backward product); methods that must read a base
weight (an SVD of it, its largest entries, ``W ⊙ Δ``) raise ``BaseWeightAccessError`` instead of
computing on a placeholder. Elsewhere: adaption prompt, trainable tokens and BOFT on biases in
``test_client_model.py``; X-LoRA (it loads saved adapters) and AdaMSS (scikit-learn) untested.
"""

from __future__ import annotations

import copy
import warnings

import peft
import pytest
import torch
from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING
from peft.utils import PeftType
from transformers import AutoModelForCausalLM

import symbiosis
from tests.reference import assert_matches_reference, close_client, randomize_adapters

pytestmark = pytest.mark.slow

ARCHS = ("llama", "opt")
ALL = "all-linear"
QV = ["q_proj", "v_proj"]

#: method (peft's PeftType, lowercase) -> its options. Dropout 0 where a method has one: both models draw alike
#: only in eval mode, and these run in eval mode anyway.
EXACT = {
    "beft": dict(target_modules=ALL),
    "boft": dict(boft_block_size=4, boft_n_butterfly_factor=1, target_modules=ALL),
    "c3a": dict(block_size=16, target_modules=ALL),
    "deft": dict(r=4, target_modules=ALL),  # (its init: rightᵀ·W, the executor's backward product)
    "cartridge": dict(num_virtual_tokens=4),
    # (token type 4: the "output" tokens CPT's loss counts)
    "cpt": dict(cpt_token_ids=[5, 6, 7, 9], cpt_mask=[1, 1, 1, 1], cpt_tokens_type_mask=[1, 2, 3, 4]),
    "fourierft": dict(n_frequency=100, target_modules=ALL),
    "gralora": dict(r=4, alpha=8, gralora_k=2, target_modules=ALL),
    "hra": dict(r=4, target_modules=ALL),  # (its forward: F.linear(x, W·H, b), from the layer's product)
    "lily": dict(r=4, stride_A=1, num_B=2, target_modules=QV),
    "miss": dict(r=8, target_modules=ALL),
    "multitask_prompt_tuning": dict(num_virtual_tokens=4, num_tasks=1, num_ranks=1),
    "oft": dict(r=0, oft_block_size=8, target_modules=ALL),
    "poly": dict(r=4, n_tasks=1, n_skills=2, target_modules=QV),
    "pvera": dict(r=8, target_modules=ALL),
    "randlora": dict(r=4, target_modules=ALL),
    "road": dict(variant="road_1", group_size=8, target_modules=ALL),
    "shadow": dict(r=4, shadow_num_hidden_layers=1),
    "shira": dict(r=4, target_modules=ALL, random_seed=0),  # (F.linear(x, W + Δ, b), likewise)
    "unilora": dict(r=4, theta_d_length=64, target_modules=ALL),
    "vblora": dict(r=4, num_vectors=32, vector_length=16, topk=2, target_modules=ALL),
    "vera": dict(r=8, target_modules=ALL),
    "waveft": dict(n_frequency=100, target_modules=ALL),
}
#: Methods that read a base weight: at init (an SVD, a norm, the largest entries, ``W`` itself)
#: or in every forward (HiRA's ``W ⊙ Δ``; PEANuT's activation of ``Wᵀ·A``, with a gradient for ``A``).
REFUSED = {
    "delora": dict(r=4, target_modules=ALL),
    "frod": dict(target_modules=ALL, progressbar=False),
    "hira": dict(r=4, target_modules=ALL),
    "osf": dict(effective_rank=4, target_modules=ALL),
    "peanut": dict(r=4, target_modules=ALL),
    "psoft": dict(r=4, target_modules=ALL),
    "supertuning": dict(target_modules=ALL),
    "tinylora": dict(r=2, u=8, target_modules=ALL),
}
#: Methods whose forward takes the task of each sequence.
TASK_IDS = {"multitask_prompt_tuning", "poly"}


def config_of(table: dict, method: str) -> peft.PeftConfig:
    kind = PEFT_TYPE_TO_CONFIG_MAPPING[PeftType[method.upper()]]
    return kind(task_type=peft.TaskType.CAUSAL_LM, **copy.deepcopy(table[method]))


@pytest.fixture(scope="module")
def executors(tiny_checkpoint):
    made = {arch: symbiosis.BaseExecutor.from_pretrained(tiny_checkpoint(arch)) for arch in ARCHS}
    yield made
    for executor in made.values():
        executor.close()


def outputs(model, method: str):
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    extra = {"task_ids": torch.tensor([0])} if method in TASK_IDS else {}
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, **extra)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    generated = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, **extra)
    return (out.logits.detach(), out.loss.detach(), grads), generated


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", EXACT)
def test_methods_that_adapt_through_the_product_match_the_monolithic_model(method, arch, tiny_checkpoint, executors):
    path = tiny_checkpoint(arch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        reference = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path), config_of(EXACT, method))
        values = randomize_adapters(reference)
        torch.manual_seed(0)
        split = peft.get_peft_model(
            symbiosis.load_client_model(path, executor=executors[arch]), config_of(EXACT, method)
        )
    try:
        trainable = {name for name, p in split.named_parameters() if p.requires_grad}
        assert set(values) <= trainable, sorted(set(values) - trainable)[:5]
        # Some methods' frozen state (random projections, CPT's token ids) is drawn from the global
        # generator in their own order: taken from the reference too, with the adapter values.
        state = split.state_dict()
        split.load_state_dict({k: v for k, v in reference.state_dict().items() if k in state}, strict=False)
        reference.eval()
        split.eval()
        expected, expected_tokens = outputs(reference, method)
        got, tokens = outputs(split, method)
        assert_matches_reference(got, expected, rtol=1e-4, atol=1e-5)
        assert torch.equal(tokens, expected_tokens)
    finally:
        close_client(split)


@pytest.mark.parametrize("method", REFUSED)
def test_methods_that_read_base_weights_are_refused_saying_so(method, tiny_checkpoint, executors):
    path = tiny_checkpoint("llama")
    split = symbiosis.load_client_model(path, executor=executors["llama"])
    try:
        with warnings.catch_warnings(), pytest.raises(symbiosis.BaseWeightAccessError, match="base executor"):
            warnings.simplefilter("ignore")
            model = peft.get_peft_model(split, config_of(REFUSED, method))
            outputs(model, method)  # those that build without W read it in their forward
    finally:
        split.symbiosis_transport.close()
