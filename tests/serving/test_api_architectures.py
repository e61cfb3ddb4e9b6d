"""``symbiosis api`` on every architecture family the project makes checkpoints of: greedy tokens
of a LoRA adapter (peft's default target modules for the family, or every linear layer where peft
has no default, e.g. phi3's fused ``qkv_proj``/``gate_up_proj``) and of the base model equal
monolithic ``transformers`` + ``peft`` generating alone, also with two prompts of different
lengths prefilled together in chunks, one past the sliding window; and chat answers (template or
the plain transcript). The other API tests run on llama only.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

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
        # peft's default targets for the family, named (peft 0.21 finds none for mixtral by itself)
        defaults = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model.config.model_type)
        targets = list(defaults) if defaults else "all-linear"
        config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=targets)
        get_peft_model(model, config).save_pretrained(folder)
    return folder


def check_chunked_prefill(server, reference, adapter) -> None:
    """Two prompts of different lengths prefilled together in chunks of a few columns (so the
    short one's rows are all padding in the first chunks), the long one past the models'
    sliding window (half their context), over the adapter and the base: monolithic tokens."""
    engine = server.engine
    engine.options = dataclasses.replace(engine.options, prefill_chunk_tokens=16)  # 8 columns a chunk
    window = engine.options.max_echo_positions // 2  # the context (the server sets that bound to it)
    long_prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 40)
    long_prompt = reference.tokenizer.decode(reference.tokenizer(long_prompt)["input_ids"][: window + 16])
    prompts = [long_prompt, PROMPTS[1]]
    assert len(reference.tokenizer(long_prompt)["input_ids"]) > window
    gate, step = threading.Event(), engine._step
    engine._step = lambda: (gate.wait(), step())  # both wait, then are admitted as one group
    try:
        client = openai_client(server)
        for model, folder in [("ad", adapter), (server.served_model_name, None)]:
            with ThreadPoolExecutor(2) as pool:
                served = [pool.submit(greedy_tokens, client, model, prompt, NEW_TOKENS) for prompt in prompts]
                deadline = time.monotonic() + 30
                while engine.stats()["waiting"] < 2 and time.monotonic() < deadline:
                    time.sleep(0.005)
                gate.set()
                for prompt, tokens in zip(prompts, served):
                    assert tokens.result() == reference.tokens(prompt, folder, NEW_TOKENS), (
                        model,
                        "chunked",
                        prompt[:20],
                    )
            gate.clear()
    finally:
        gate.set()
        engine._step = step


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
        check_chunked_prefill(server, reference, adapter)
    finally:
        server.close()
