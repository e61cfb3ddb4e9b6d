"""Fixtures of the API server tests: a tiny llama, LoRA adapters of different ranks and targets,
and the monolithic ``transformers`` + ``peft`` reference that every served token is checked against."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

# (rank, alpha, target modules): different ranks and different targets, so a mixed batch stacks
# adapters that touch different layers.
ADAPTER_SHAPES = {
    "qv4": (4, 8, ["q_proj", "v_proj"]),
    "attn8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp16": (16, 16, ["gate_proj", "up_proj", "down_proj"]),
    "od2": (2, 4, ["o_proj", "down_proj"]),
}


def make_lora_adapter(model_dir: Path, folder: Path, rank: int, alpha: int, targets: list[str], seed: int) -> Path:
    """A peft LoRA adapter with random A and B (B is not zero, so the adapter changes outputs)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
        get_peft_model(model, config).save_pretrained(folder)
    return folder


class Reference:
    """Greedy tokens of the monolithic model, with or without an adapter (cached)."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.model_dir = model_dir
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self._models: dict = {}
        self._cache: dict = {}

    def _model(self, adapter_dir: Path | None):
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        key = str(adapter_dir)
        if key not in self._models:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = AutoModelForCausalLM.from_pretrained(self.model_dir)
                if adapter_dir is not None:
                    model = PeftModel.from_pretrained(model, adapter_dir)
            self._models[key] = model.eval()
        return self._models[key]

    @torch.no_grad()
    def tokens(self, prompt: str, adapter_dir: Path | None, max_tokens: int, **generate_kwargs) -> list[int]:
        """Greedy tokens; ``generate_kwargs`` (e.g. ``repetition_penalty``, ``logits_processor``)
        go to ``generate`` as they are."""
        key = (prompt, str(adapter_dir), max_tokens, repr(sorted(generate_kwargs.items())))
        if key not in self._cache:
            ids = torch.tensor([self.tokenizer(prompt)["input_ids"]])
            output = self._model(adapter_dir).generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id or 0,
                **generate_kwargs,
            )
            self._cache[key] = output[0, ids.shape[1] :].tolist()
        return self._cache[key]

    def logprobs(self, prompt: str, adapter_dir: Path | None, generated: list[int]) -> torch.Tensor:
        """``[len(generated), vocab]``: the monolithic model's log-probabilities of each next token
        as it generated ``generated`` after ``prompt`` (one teacher-forced forward pass)."""
        prompt_ids = self.tokenizer(prompt)["input_ids"]
        return self.prompt_logprobs(prompt_ids + generated, adapter_dir)[len(prompt_ids) - 1 :]

    @torch.no_grad()
    def prompt_logprobs(self, prompt_ids: list[int], adapter_dir: Path | None) -> torch.Tensor:
        """``[len(prompt_ids) - 1, vocab]``: the monolithic model's log-probabilities at each prompt
        position of the token after it (what ``echo`` with ``logprobs`` reports)."""
        ids = torch.tensor([prompt_ids])
        logits = self._model(adapter_dir)(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()
        return torch.log_softmax(logits[:-1], -1)


@pytest.fixture(scope="session")
def api_model(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def lora_adapters(api_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_lora_adapter(api_model, root / name, rank, alpha, targets, seed)
        for seed, (name, (rank, alpha, targets)) in enumerate(ADAPTER_SHAPES.items())
    }


@pytest.fixture(scope="session")
def reference(api_model) -> Reference:
    return Reference(api_model)
