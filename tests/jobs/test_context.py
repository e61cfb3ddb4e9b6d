"""Prompts and training text longer than the model's context: refused (generate) or cut (finetune).

Past its last position a learned-position model (GPT-2) failed with an ``IndexError`` and a
rotary one (LLaMA) ran on silently; the tiny presets have 256 positions.
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from symbiosis.jobs.base import JobError
from symbiosis.jobs.context import context_length, read_context_length
from symbiosis.jobs.generate import PromptJob, SamplingOptions, check_context
from tests.cli_helpers import assert_one_line_error, run_cli

LONG = "cat dog " * 200  # ~800 tokens


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"max_position_embeddings": 4096, "n_positions": 1}, 4096),  # the first field named wins
        ({"n_positions": 1024, "n_ctx": 1024}, 1024),  # GPT-2
        ({"seq_length": 2048}, 2048),
        ({"text_config": {"max_position_embeddings": 8192}}, 8192),  # a multimodal checkpoint
        ({"max_position_embeddings": 0}, None),
        ({"max_position_embeddings": True}, None),
        ({}, None),
    ],
)
def test_context_length_of_a_config(config, expected):
    assert context_length(config) == expected


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_checkpoints_name_their_context(tiny_checkpoint, arch):
    assert read_context_length(tiny_checkpoint(arch)) == 256


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_generate_refuses_a_prompt_longer_than_the_context(tiny_checkpoint, arch, capsys, monkeypatch):
    args = ["generate", "--embedded", "--model", str(tiny_checkpoint(arch)), "--prompt", LONG]
    code, out, err = run_cli(args, capsys, monkeypatch)
    assert code == 2 and out == ""
    assert_one_line_error(code, err, "maximum context length is 256 tokens", "--max-new-tokens")


def test_generate_refuses_new_tokens_past_the_context(tiny_checkpoint, capsys, monkeypatch):
    args = ["generate", "--embedded", "--model", str(tiny_checkpoint("llama")), "--prompt", "hi"]
    code, _, err = run_cli([*args, "--max-new-tokens", "300"], capsys, monkeypatch)
    assert code == 2
    assert_one_line_error(code, err, "256 tokens", "300 new tokens")


def test_context_check_counts_prompt_new_and_virtual_tokens(tiny_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    prompt = "A" * 10  # one token per letter: the tokenizer never merges two upper-case letters
    assert len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) == 10
    jobs = [PromptJob("short"), PromptJob(prompt, adapter="prefix")]
    check_context(jobs, tokenizer, 20, SamplingOptions(max_new_tokens=6), {"prefix": 4, "lora": 0})  # 10+6+4
    with pytest.raises(JobError, match=r"prompt 2: .* 10 prompt tokens \+ 7 new tokens .* \+ 4 virtual tokens"):
        check_context(jobs, tokenizer, 20, SamplingOptions(max_new_tokens=7), {"prefix": 4, "lora": 0})
    # An empty prompt is one token (BOS), as generate feeds it.
    check_context([PromptJob("")], tokenizer, 4, SamplingOptions(max_new_tokens=3), {None: 0})
    with pytest.raises(JobError, match="1 prompt tokens"):
        check_context([PromptJob("")], tokenizer, 3, SamplingOptions(max_new_tokens=3), {None: 0})


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_finetune_cuts_text_to_the_context(tiny_checkpoint, arch, tmp_path, capsys, monkeypatch):
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"text": "cat dog " * 300}) + "\n" for _ in range(2)))
    output = tmp_path / "out"
    args = ["finetune", "--embedded", "--model", str(tiny_checkpoint(arch)), "--data", str(data)]
    code, out, err = run_cli([*args, "--output", str(output), "--steps", "1", "--no-progress"], capsys, monkeypatch)
    assert code == 0, err
    assert "saved lora adapter" in out
    assert "note: --seq-len 512 is more than the 256-token context" in err and "2 example(s) reached it" in err
    log = json.loads((output / "log.jsonl").read_text().splitlines()[0])
    assert log["tokens"] == 2 * 256
    recorded = json.loads((output / "training_options.json").read_text())
    assert recorded["train"]["seq_len"] == 256


def test_a_run_cut_to_the_context_resumes_with_the_flags_it_recorded(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """training_options.json records --seq-len cut to the context, and so does a checkpoint: a
    resume with the recorded value and one with the value first given both continue. (Before, the
    checkpoint kept the value as given, and a resume with the recorded one was refused as options
    that differ.)"""
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"text": "cat dog " * 300}) + "\n" for _ in range(2)))
    output = tmp_path / "out"
    args = ["finetune", "--embedded", "--model", str(tiny_checkpoint("llama")), "--data", str(data)]
    args += ["--output", str(output), "--steps", "3", "--save-every", "1", "--no-progress"]
    code, _, err = run_cli([*args, "--seq-len", "512"], capsys, monkeypatch)
    assert code == 0, err
    recorded = json.loads((output / "training_options.json").read_text())["train"]["seq_len"]
    for seq_len in (str(recorded), "512"):
        code, out, err = run_cli([*args, "--seq-len", seq_len, "--resume"], capsys, monkeypatch)
        assert code == 0, err
        assert "options differ" not in err


def test_finetune_within_the_context_says_nothing(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    data = tmp_path / "short.jsonl"
    data.write_text('{"text": "cat dog"}\n')
    args = ["finetune", "--embedded", "--model", str(tiny_checkpoint("llama")), "--data", str(data)]
    code, _, err = run_cli(
        [*args, "--output", str(tmp_path / "out"), "--steps", "1", "--no-progress"], capsys, monkeypatch
    )
    assert code == 0 and "note:" not in err
