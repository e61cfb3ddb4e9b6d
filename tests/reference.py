"""Build a monolithic `transformers`+`peft` model and a split one with identical adapter weights.

Every reference test compares the two: same checkpoint, same PEFT config, same adapter values
(made non-trivial first, so a test that ignores an adapter or a bias fails).
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import peft
import torch
from transformers import AutoModelForCausalLM

import symbiosis

METHODS = ("lora", "ia3", "adalora", "loha", "lokr", "prefix", "prompt", "p_tuning")

# IA3 needs its feed-forward modules named (they scale the input instead of the output).
IA3_MODULES = {
    "llama": (["k_proj", "v_proj", "down_proj"], ["down_proj"]),
    "mistral": (["k_proj", "v_proj", "down_proj"], ["down_proj"]),
    "qwen2": (["k_proj", "v_proj", "down_proj"], ["down_proj"]),
    "gemma2": (["k_proj", "v_proj", "down_proj"], ["down_proj"]),
    "gpt2": (["c_attn", "mlp.c_proj"], ["mlp.c_proj"]),
    "gpt_bigcode": (["c_attn", "mlp.c_proj"], ["mlp.c_proj"]),
    "opt": (["k_proj", "v_proj", "fc2"], ["fc2"]),
    "phi3": (["qkv_proj", "down_proj"], ["down_proj"]),
    "falcon": (["query_key_value", "dense_4h_to_h"], ["dense_4h_to_h"]),
    "gpt_neox": (["query_key_value", "dense_4h_to_h"], ["dense_4h_to_h"]),
    "mixtral": (["k_proj", "v_proj"], []),  # as finetune's: its MLP is the experts, one tensor (no module)
}


def peft_config(method: str, arch: str) -> peft.PeftConfig:
    task = peft.TaskType.CAUSAL_LM
    if method == "lora":
        return peft.LoraConfig(task_type=task, r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    if method == "ia3":
        targets, feedforward = IA3_MODULES[arch]
        return peft.IA3Config(task_type=task, target_modules=targets, feedforward_modules=feedforward)
    if method == "adalora":
        return peft.AdaLoraConfig(
            task_type=task, init_r=4, target_r=2, total_step=20, target_modules="all-linear", lora_dropout=0.0
        )
    if method == "loha":
        return peft.LoHaConfig(task_type=task, r=4, alpha=8, target_modules="all-linear")
    if method == "lokr":
        return peft.LoKrConfig(task_type=task, r=4, alpha=8, target_modules="all-linear")
    if method == "prefix":
        return peft.PrefixTuningConfig(task_type=task, num_virtual_tokens=4)
    if method == "prompt":
        return peft.PromptTuningConfig(task_type=task, num_virtual_tokens=4)
    if method == "p_tuning":
        return peft.PromptEncoderConfig(task_type=task, num_virtual_tokens=4, encoder_hidden_size=32)
    raise ValueError(method)


def randomize_adapters(model: torch.nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """Give every trainable tensor a non-trivial value; return them by name."""
    generator = torch.Generator().manual_seed(seed)
    values = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                noise = torch.randn(param.shape, generator=generator, dtype=torch.float32) * 0.2
                param.add_(noise.to(device=param.device, dtype=param.dtype))
                values[name] = param.detach().clone()
    return values


def make_pair(path, executor, method: str | peft.PeftConfig, arch: str, **client_options):
    """(monolithic peft model, split peft model) with equal adapter weights, both in eval mode.
    ``method``: one of ``METHODS`` (its config for ``arch``: ``peft_config``), or a config.

    The monolithic model is on the split client's ``device`` (default cpu) *before* peft wraps
    it, as a user would load it: peft makes adapters on the device of the layer it wraps, and
    what it makes there is not always what moving a CPU-made adapter gives (AdaLoRA's ``ranknum``
    made on a GPU is a trainable parameter; moved there with ``.to``, it stays frozen)."""
    config = method if isinstance(method, peft.PeftConfig) else peft_config(method, arch)
    torch.manual_seed(0)  # peft's own adapter init draws from the global generator
    device = client_options.get("device", "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monolithic = AutoModelForCausalLM.from_pretrained(path).to(device)
        reference = peft.get_peft_model(monolithic, copy.deepcopy(config))
        split = peft.get_peft_model(
            symbiosis.load_client_model(path, executor=executor, **client_options), copy.deepcopy(config)
        )
    values = randomize_adapters(reference)
    missing = set(values) - {name for name, p in split.named_parameters() if p.requires_grad}
    assert not missing, f"split model lacks adapter parameters {sorted(missing)[:5]}"
    split.load_state_dict(values, strict=False)
    reference.eval()
    split.eval()
    return reference, split


@contextlib.contextmanager
def executor_at(path, remote: bool):
    """An executor of ``path`` as a client reaches it: itself, or the address of its tcp server."""
    with symbiosis.BaseExecutor.from_pretrained(path) as ex:
        if not remote:
            yield ex
            return
        server = ex.serve("tcp://127.0.0.1:0")
        try:
            yield server.address
        finally:
            server.close()


def adapter_grads(model) -> dict[str, torch.Tensor]:
    return {
        name: p.grad.detach().clone() for name, p in model.named_parameters() if p.requires_grad and p.grad is not None
    }


def loss_and_grads(model, input_ids: torch.Tensor):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), adapter_grads(model)


def close_client(model) -> None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.symbiosis_transport.close()


def assert_matches_reference(split_outputs, reference_outputs, *, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """``loss_and_grads`` of the split model equals the monolithic one's: logits, loss, and every
    adapter gradient (each non-zero in the reference, so the comparison could fail)."""
    logits, loss, grads = split_outputs
    ref_logits, ref_loss, ref_grads = reference_outputs
    torch.testing.assert_close(logits, ref_logits, rtol=rtol, atol=atol)
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol)
    assert ref_grads and set(grads) == set(ref_grads)
    for name, grad in ref_grads.items():
        assert grad.abs().sum() > 0, f"reference gradient of {name} is zero: the test could not fail"
        torch.testing.assert_close(grads[name], grad, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")
