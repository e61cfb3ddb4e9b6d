"""What the pinned libraries must do for our exactness tests to mean anything.

Every feature is compared with monolithic ``transformers`` + ``peft``; a regression *there* makes
both sides wrong alike and every comparison pass. Found so: with transformers 5.24 and peft 0.21.2,
prefix tuning's ``generate`` ignored the prefix (transformers passed its own ``cache`` and dropped
the ``past_key_values`` peft adds), so the adapter had no effect on generated tokens, monolithic
and split alike. pyproject.toml bounds transformers below 5.24 for it; this test says when a
newer pair works again.
"""

from __future__ import annotations

import torch
from peft import PrefixTuningConfig, get_peft_model
from transformers import AutoModelForCausalLM

from symbiosis.modelzoo import preset_config


def test_prefix_tuning_generation_uses_its_prefix() -> None:
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(preset_config("llama", "tiny")).eval()
    ids = torch.randint(3, 120, (1, 6))
    greedy = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}  # 8 tokens, even past an eos
    with torch.no_grad():
        plain = base.generate(ids, **greedy)
        model = get_peft_model(base, PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)).eval()
        for parameter in model.prompt_encoder.parameters():  # a prefix far from zero: it must show
            parameter.copy_(torch.randn_like(parameter) * 5)
        prefixed = model.generate(input_ids=ids, **greedy)
        with model.disable_adapter():
            assert torch.equal(model.generate(input_ids=ids, **greedy), plain)
    assert not torch.equal(prefixed, plain), "prefix tuning's generate ignored the prefix"
