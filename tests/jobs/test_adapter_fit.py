"""An adapter made for another base model is refused in one line naming the model it was made for.

peft's own failures were tracebacks: no module to adapt (another architecture), a ``size
mismatch`` in ``load_state_dict`` (another size), or, for a prefix, a shape error in the first
forward. ``finetune --resume`` on another model or rank failed in ``copy_``.
"""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import peft
import pytest
from transformers import AutoModelForCausalLM

from symbiosis.errors import CheckpointError
from symbiosis.jobs.artifacts import save_adapter
from symbiosis.jobs.base import JobError
from symbiosis.jobs.client import ClientOptions
from symbiosis.jobs.finetune import FinetuneOptions, TrainOptions, finetune
from symbiosis.jobs.generate import GenerateOptions, SamplingOptions, generate
from symbiosis.jobs.methods import MethodOptions, build_peft_config
from symbiosis.modelzoo import make_tokenizer, preset_config
from tests.cli_helpers import assert_one_line_error, run_cli


@pytest.fixture(scope="module")
def deeper_llama(tmp_path_factory) -> Path:
    """A llama of another size than the tiny preset: one more layer, a wider MLP."""
    folder = tmp_path_factory.mktemp("deeper-llama")
    config = preset_config("llama", "tiny")
    config.num_hidden_layers, config.intermediate_size = 3, 96
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    make_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def llama_adapters(tiny_checkpoint, tmp_path_factory) -> dict[str, Path]:
    """A lora and a prefix adapter made on the tiny llama, recording where it lives."""
    base = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("llama-adapters")
    folders = {}
    for method in ("lora", "prefix"):
        model = AutoModelForCausalLM.from_pretrained(base)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft_model = peft.get_peft_model(model, build_peft_config(method, model, MethodOptions(rank=2)))
        folders[method] = save_adapter(peft_model, root / method)
    return folders


def generate_with(model: Path, adapter: Path) -> GenerateOptions:
    return GenerateOptions(
        model=model,
        client=ClientOptions(embedded=True),
        prompts=["hi"],
        adapters=[adapter],
        sampling=SamplingOptions(max_new_tokens=2),
    )


def test_adapter_of_another_architecture(tiny_checkpoint, llama_adapters, capsys, monkeypatch):
    gpt2 = tiny_checkpoint("gpt2")
    args = ["generate", "--embedded", "--model", str(gpt2), "--adapter", str(llama_adapters["lora"]), "--prompt", "hi"]
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 2
    made_for = json.loads((llama_adapters["lora"] / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert made_for
    assert_one_line_error(code, err, "does not fit", str(gpt2), made_for, "none of the modules")


@pytest.mark.parametrize(
    ("method", "needle"),
    [("lora", "tensor shapes differ"), ("prefix", "num_layers 2 (this model: 3)")],
)
def test_adapter_of_another_size(deeper_llama, llama_adapters, method, needle):
    with pytest.raises(CheckpointError, match="does not fit") as caught:
        generate(generate_with(deeper_llama, llama_adapters[method]))
    assert needle in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("change", ["missing", "raises"])
def test_the_size_check_steps_aside_when_peft_changes_its_private_sizing(
    tiny_checkpoint, llama_adapters, monkeypatch, change
):
    """The prefix check borrows peft's private ``_prepare_prompt_learning_config``. Without it, or
    when it fails in a way this code does not know (a peft that reads another field), a fitting
    adapter still loads and generates."""
    import peft.utils

    def reads_another_field(*_):
        raise AttributeError("'namespace' object has no attribute 'a_new_field'")

    if change == "missing":
        monkeypatch.delattr(peft.utils, "_prepare_prompt_learning_config")
    else:
        monkeypatch.setattr(peft.utils, "_prepare_prompt_learning_config", reads_another_field)
    [completion] = generate(generate_with(tiny_checkpoint("llama"), llama_adapters["prefix"]), io.StringIO())
    assert completion.new_tokens >= 1


def test_prompt_tuning_needs_only_the_embedding_width(tiny_checkpoint, tmp_path):
    # A soft prompt is a row of input embeddings: another depth or head count still runs it, so the
    # check must not refuse what peft would run (gpt2 tiny: 4 heads like llama, other modules).
    base = tiny_checkpoint("llama")
    model = AutoModelForCausalLM.from_pretrained(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = peft.get_peft_model(model, build_peft_config("prompt", model, MethodOptions()))
    folder = save_adapter(peft_model, tmp_path / "prompt")
    config = json.loads((folder / "adapter_config.json").read_text())
    config["num_layers"] = 7  # as if made on a deeper model of the same width
    (folder / "adapter_config.json").write_text(json.dumps(config))
    [completion] = generate(generate_with(base, folder), io.StringIO())
    assert completion.new_tokens >= 1


def test_resume_with_another_adapter_shape(tiny_checkpoint, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{c}=", "completion": c}) + "\n" for c in "ABCD"))

    def options(rank: int, resume: bool) -> FinetuneOptions:
        return FinetuneOptions(
            model=tiny_checkpoint("llama"),
            data=data,
            output=tmp_path / "out",
            client=ClientOptions(embedded=True),
            method_options=MethodOptions(rank=rank),
            train=TrainOptions(steps=2, batch_size=2, save_every=1),
            resume=resume,
            progress=False,
        )

    finetune(options(rank=4, resume=False))
    with pytest.raises(JobError, match=r"does not match this model.*\[4, 64\] in the checkpoint, \[2, 64\] now"):
        finetune(options(rank=2, resume=True))
