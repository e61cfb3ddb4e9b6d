"""``symbiosis api`` on every architecture family the project makes checkpoints of: greedy tokens
of a LoRA adapter (peft's default target modules for the family, or every linear layer where peft
has no default, e.g. phi3's fused ``qkv_proj``/``gate_up_proj``) and of the base model equal
monolithic ``transformers`` + ``peft`` generating alone, also with prompts prefilled in chunks,
and chat answers (template or the plain transcript). The other API tests run on llama only.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from symbiosis.modelzoo import ARCHS
from tests.serving.conftest import Reference
from tests.serving.test_api import greedy_tokens, openai_client, start_server

PROMPTS = ["The quick brown fox", "Hello"]
NEW_TOKENS = 8


def lora_adapter(model_dir, folder):
    from peft import LoraConfig, get_peft_model
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        known = model.config.model_type in TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
        config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=None if known else "all-linear")
        get_peft_model(model, config).save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_serves_the_tokens_of_monolithic_peft(arch, tiny_checkpoint, tmp_path):
    model_dir = tiny_checkpoint(arch)
    adapter = lora_adapter(model_dir, tmp_path / "adapter")
    reference = Reference(model_dir)
    server = start_server(model_dir, adapters={"ad": adapter})
    try:
        client = openai_client(server)
        for prompt in PROMPTS:
            for model, folder in [("ad", adapter), (server.served_model_name, None)]:
                served = greedy_tokens(client, model, prompt, NEW_TOKENS)
                assert served == reference.tokens(prompt, folder, NEW_TOKENS), (arch, model, prompt)
        chat = client.chat.completions.create(model="ad", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert chat.usage.completion_tokens >= 1
        # Prompts prefilled a column or two a step (chunked prefill), sliding windows and all.
        server.engine.options = dataclasses.replace(server.engine.options, prefill_chunk_tokens=2)
        long_prompt = " ".join(PROMPTS * 3)
        for model, folder in [("ad", adapter), (server.served_model_name, None)]:
            served = greedy_tokens(client, model, long_prompt, NEW_TOKENS)
            assert served == reference.tokens(long_prompt, folder, NEW_TOKENS), (arch, model, "chunked")
    finally:
        server.close()
