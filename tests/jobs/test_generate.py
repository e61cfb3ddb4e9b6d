"""Inference job: tokens stream as they are generated, adapters load by folder and by name, and
the split client's greedy output equals the monolithic model's."""

from __future__ import annotations

import io
import warnings

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from symbiosis.jobs.artifacts import save_adapter
from symbiosis.jobs.base import JobError
from symbiosis.jobs.client import ClientOptions
from symbiosis.jobs.generate import (
    GenerateOptions,
    SamplingOptions,
    TextWriterStreamer,
    adapter_names,
    generate,
    read_prompts,
)
from symbiosis.jobs.methods import MethodOptions, build_peft_config
from tests.reference import randomize_adapters


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory):
    """Two saved adapters (lora and ia3) with non-trivial weights, made on the monolithic model."""
    path = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("adapters")
    folders = []
    for seed, method in enumerate(("lora", "ia3")):
        model = AutoModelForCausalLM.from_pretrained(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft_model = peft.get_peft_model(model, build_peft_config(method, model, MethodOptions(rank=4)))
        randomize_adapters(peft_model, seed=seed)
        with torch.no_grad():  # large enough to change greedy tokens
            for p in peft_model.parameters():
                if p.requires_grad:
                    p.mul_(10)
        folders.append(save_adapter(peft_model, root / method))
    return folders


def test_streamer_writes_each_piece_as_it_comes(tiny_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    pieces: list[str] = []
    streamer = TextWriterStreamer(tokenizer, pieces.append)
    ids = tokenizer("héllo wörld ABC", add_special_tokens=False)["input_ids"]
    streamer.put(torch.tensor([[1, 2]]))  # the prompt is skipped
    for token in ids:
        streamer.put(torch.tensor([token]))
    streamer.end()
    assert "".join(pieces) == "héllo wörld ABC"
    assert len(pieces) >= 8 and all("\ufffd" not in p for p in pieces)


def test_generate_streams_and_matches_monolithic_greedy(tiny_checkpoint, adapters):
    path = tiny_checkpoint("llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = "The executor"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), adapters[0])
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    expected = reference.generate(input_ids=ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    expected_text = tokenizer.decode(expected[0, ids.shape[1] :], skip_special_tokens=True)

    out = io.StringIO()
    writes: list[str] = []

    class Recorder(io.StringIO):
        def write(self, s: str) -> int:
            writes.append(s)
            return out.write(s)

    options = GenerateOptions(
        model=path,
        client=ClientOptions(embedded=True),
        prompts=[prompt],
        adapters=[adapters[0]],
        sampling=SamplingOptions(max_new_tokens=12),
    )
    [completion] = generate(options, Recorder())
    assert completion.text == expected_text and completion.new_tokens == expected.shape[1] - ids.shape[1]
    assert out.getvalue() == f"{prompt}{expected_text}\n"
    assert len(writes) >= 4, f"text was not streamed piece by piece: {writes}"


def test_several_adapters_by_name_and_sampling_is_seeded(tiny_checkpoint, adapters, tmp_path):
    path = tiny_checkpoint("llama")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "ABC=", "adapter": "ia3"}\nplain line prompt\n')
    jobs = read_prompts(prompts)
    assert [j.adapter for j in jobs] == ["ia3", None]
    sampling = SamplingOptions(max_new_tokens=6, temperature=0.8, top_p=0.9, top_k=20, seed=3)
    options = GenerateOptions(
        model=path,
        client=ClientOptions(embedded=True),
        prompts_file=prompts,
        adapters=list(adapters),
        sampling=sampling,
    )
    out = io.StringIO()
    completions = generate(options, out)
    assert [(c.prompt, c.adapter) for c in completions] == [
        ("ABC=", "ia3"),
        ("plain line prompt", "lora"),
        ("plain line prompt", "ia3"),
    ]
    assert "[ia3] ABC=" in out.getvalue() and "[lora] plain line prompt" in out.getvalue()
    again = generate(options, io.StringIO())
    assert [c.text for c in again] == [c.text for c in completions]
    assert completions[1].text != completions[2].text, "the two adapters gave the same text: were both applied?"


def test_adapters_that_train_base_biases_each_run_as_themselves(tiny_checkpoint, tmp_path):
    """peft's ``bias="all"`` adapters change the base layers' biases, which every adapter of one
    peft model shares: loaded beside others (one model per peft type), the others' prompts ran
    with its biases, and a second such adapter failed in peft (a helper's probe). Each now gets a
    model of its own: every prompt's text is the one its adapter gives alone."""
    path = tiny_checkpoint("opt")  # (its base layers have biases)
    folders = []
    for seed, bias in enumerate(("all", "none", "all")):
        model = AutoModelForCausalLM.from_pretrained(path)
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], bias=bias)
        peft_model = peft.get_peft_model(model, config)
        randomize_adapters(peft_model, seed=seed)
        with torch.no_grad():
            for name, parameter in peft_model.named_parameters():
                if parameter.requires_grad:
                    parameter.mul_(10) if "lora_" in name else parameter.add_(0.5 * (seed + 1))
        folders.append(save_adapter(peft_model, tmp_path / f"{bias}{seed}"))

    def texts(adapters) -> list[str]:
        options = GenerateOptions(
            model=path,
            client=ClientOptions(embedded=True),
            prompts=["The executor"],
            adapters=adapters,
            sampling=SamplingOptions(max_new_tokens=8),
        )
        return [c.text for c in generate(options, io.StringIO())]

    alone = [texts([folder])[0] for folder in folders]
    assert len(set(alone)) == 3, "the adapters gave the same text: the test could not fail"
    assert texts(folders) == alone


def test_adapter_names_are_unique(tmp_path):
    assert adapter_names([tmp_path / "a" / "x", tmp_path / "b" / "x", tmp_path / "y"]) == ["x", "x_2", "y"]
    assert adapter_names([]) == []


def test_generate_needs_a_prompt(tiny_checkpoint):
    with pytest.raises(JobError, match="--prompt"):
        generate(GenerateOptions(model=tiny_checkpoint("llama"), client=ClientOptions(embedded=True)))


def test_an_empty_prompt_starts_from_bos(tiny_checkpoint, capsys, monkeypatch):
    """As ``symbiosis api`` does; the tiny llama's first greedy token after BOS is EOS (an empty
    line is its whole answer), so the check runs on gpt2, whose answer is not empty."""
    from tests.cli_helpers import run_cli

    path = tiny_checkpoint("gpt2")
    tokenizer = AutoTokenizer.from_pretrained(path)
    reference = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.tensor([[tokenizer.bos_token_id]])
    expected = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    expected_text = tokenizer.decode(expected[0, 1:], skip_special_tokens=True)
    assert expected_text.strip()
    args = ["generate", "--embedded", "--model", str(path), "--prompt", "", "--max-new-tokens", "5"]
    code, out, _ = run_cli(args, capsys, monkeypatch)
    assert code == 0 and out == f"{expected_text}\n"


def test_prompt_ids_of_an_empty_prompt_is_bos_even_when_its_id_is_0(tiny_checkpoint):
    from symbiosis.jobs.generate import prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    tokenizer.eos_token = "A"  # BOS keeps id 0, which `bos or eos` took for missing
    assert tokenizer.bos_token_id == 0 and tokenizer.eos_token_id != 0
    assert prompt_ids(tokenizer, "").tolist() == [[0]]
    tokenizer.bos_token = None
    assert prompt_ids(tokenizer, "").tolist() == [[tokenizer.eos_token_id]]


def test_a_failure_mid_stream_leaves_the_output_on_a_line_of_its_own(tiny_checkpoint, monkeypatch):
    """The error goes to stderr after what was streamed; before, it followed the partial tokens on
    the same terminal line."""
    import symbiosis.jobs.generate as generate_module
    from symbiosis.errors import ExecutorUnavailableError

    def fails_after_two_tokens(model, tokenizer, prompt, sampling, write):
        write(" two tokens")
        raise ExecutorUnavailableError("the executor went away")

    monkeypatch.setattr(generate_module, "generate_one", fails_after_two_tokens)
    out = io.StringIO()
    options = GenerateOptions(
        model=tiny_checkpoint("llama"), client=ClientOptions(embedded=True), prompts=["hi", "there"]
    )
    with pytest.raises(ExecutorUnavailableError):
        generate(options, out)
    assert out.getvalue() == "hi two tokens\n"
