"""The split model equals the monolithic `transformers`+`peft` model: logits, loss, adapter
gradients and greedy tokens, for every architecture family × every PEFT method peft supports."""

from __future__ import annotations

import warnings

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

import symbiosis
from symbiosis.modelzoo import ARCHS
from tests.reference import METHODS, assert_matches_reference, close_client, loss_and_grads, make_pair, peft_config

TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def executors(tiny_checkpoint):
    made = {}

    def get(arch):
        if arch not in made:
            made[arch] = symbiosis.BaseExecutor.from_pretrained(tiny_checkpoint(arch))
        return made[arch]

    yield get
    for executor in made.values():
        executor.close()


def _peft_supports(path, method, arch) -> str | None:
    """Why peft itself cannot apply ``method`` to ``arch`` (then there is nothing to compare), or None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path), peft_config(method, arch))
            ids = torch.tensor([[1, 2, 3]])
            model(input_ids=ids, labels=ids).loss.backward()
            model.generate(input_ids=ids, max_new_tokens=2, do_sample=False)
    except Exception as exc:  # peft/transformers' own limitation, not ours
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ARCHS)
def test_split_matches_monolithic(arch, method, tiny_checkpoint, executors):
    path = tiny_checkpoint(arch)
    reason = _peft_supports(path, method, arch)
    if reason:
        pytest.skip(f"peft does not support {method} on {arch}: {reason[:200]}")
    reference, split = make_pair(path, executors(arch), method, arch)
    try:
        input_ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(1))
        assert_matches_reference(loss_and_grads(split, input_ids), loss_and_grads(reference, input_ids), **TOL)

        prompt = input_ids[:1, :5]
        with torch.no_grad():
            ref_tokens = reference.generate(input_ids=prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False)
            tokens = split.generate(input_ids=prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False)
        assert tokens.shape[-1] == prompt.shape[-1] + 20
        assert torch.equal(tokens, ref_tokens)
    finally:
        close_client(split)
