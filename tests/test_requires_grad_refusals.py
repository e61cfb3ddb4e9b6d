"""``requires_grad_()`` on a split model is refused before anything changes, not halfway.

It set the flags one parameter at a time and was refused at the first base layer: the client's
tensors before it (the embeddings) were left trainable.
"""

from __future__ import annotations

import warnings

import peft
import pytest
import torch

import symbiosis


@pytest.fixture(scope="module")
def qwen2(tiny_checkpoint):
    return tiny_checkpoint("qwen2")  # qwen2's q/k/v have biases, served by the executor


@pytest.fixture(scope="module")
def executor(qwen2):
    with symbiosis.BaseExecutor.from_pretrained(qwen2) as ex:
        yield ex


@pytest.fixture
def model(qwen2, executor):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        split = symbiosis.load_client_model(qwen2, executor=executor)
    yield split
    split.symbiosis_transport.close()


def flags(module: torch.nn.Module) -> dict[str, bool]:
    return {name: p.requires_grad for name, p in module.named_parameters()}


def structure(module: torch.nn.Module) -> list[tuple[str, str]]:
    return [(name, type(m).__name__) for name, m in module.named_modules()]


def trainable(module: torch.nn.Module) -> set[str]:
    return {name for name, p in module.named_parameters() if p.requires_grad}


def test_requires_grad_on_a_frozen_split_model_is_refused_before_any_flag_changes(model):
    model.requires_grad_(False)  # (a no-op on the base-layer tensors: they are frozen already)
    assert not trainable(model)
    for module in (model, model.model, model.model.layers[0]):
        with pytest.raises(symbiosis.BaseWeightAccessError, match="'model.layers.0.self_attn.q_proj.weight' cannot be"):
            module.requires_grad_()
        assert not trainable(model)  # the embeddings, before the first base layer, were left trainable


def test_requires_grad_on_a_peft_model_of_a_split_model_is_refused_before_any_flag_changes(model):
    """peft's wrappers walk the split model's parameters themselves (``requires_grad_`` is not forwarded)."""
    split = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    before = flags(split)
    assert before["base_model.model.model.embed_tokens.weight"] is False
    for module in (split, split.base_model):
        with pytest.raises(symbiosis.BaseWeightAccessError, match="cannot be trained"):
            module.requires_grad_()
        assert flags(split) == before
    split.requires_grad_(False)
    assert not trainable(split)
