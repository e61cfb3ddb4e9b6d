"""Tests for symbiosis.modelzoo: the random checkpoints every reference test stands on."""

from __future__ import annotations

import json
import os
import pathlib
import stat
from collections.abc import Callable

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from symbiosis import modelzoo
from symbiosis.errors import OutputExistsError
from symbiosis.modelzoo import (
    ARCHS,
    MARKER_FILE,
    PRESETS,
    SPECIAL_TOKEN,
    TOKENIZER_VOCAB_SIZE,
    make_model,
    make_tokenizer,
    preset_config,
)
from tests.cli_helpers import assert_one_line_error, run_cli

Checkpoint = Callable[[str], pathlib.Path]

ROUND_TRIP_TEXTS = [
    "",
    "Hello, world!",
    "The executor batches 4096 tokens from 17 clients in 3.25 ms.",
    "  leading spaces, trailing tabs\t\n\nand blank lines\n",
    "def f(x):\n    return x ** 2  # squares\n",
    "Café naïve résumé — Größe 5 µm; русский, 日本語, emoji 🚀✓ and <|not special|>",
]
PROMPT = "One quick model sends a batch to the executor."


def _logits(path: pathlib.Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return model(**tokenizer(PROMPT, return_tensors="pt")).logits


def _meta_param_count(arch: str, preset: str) -> int:
    with torch.device("meta"):  # shapes only: no memory, no init
        model = AutoModelForCausalLM.from_config(preset_config(arch, preset, TOKENIZER_VOCAB_SIZE))
    return sum(p.numel() for p in model.parameters())  # tied weights counted once


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_loads_cleanly_and_generates(arch: str, tiny_checkpoint: Checkpoint) -> None:
    path = tiny_checkpoint(arch)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER_FILE):
        assert (path / name).is_file(), name
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert model.config.model_type == arch
    assert type(model).__name__ == model.config.architectures[0]

    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == TOKENIZER_VOCAB_SIZE == model.config.vocab_size
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer)
    assert tokenizer.eos_token == tokenizer.pad_token == tokenizer.bos_token == SPECIAL_TOKEN
    assert model.config.eos_token_id == model.config.pad_token_id == tokenizer.eos_token_id

    tokenizer.padding_side = "left"
    batch = tokenizer([PROMPT, "Hi"], return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert out.shape == (2, batch["input_ids"].shape[1] + 4)
    assert int(out.max()) < len(tokenizer)


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_round_trips(arch: str, tiny_checkpoint: Checkpoint) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint(arch))
    for text in ROUND_TRIP_TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text
    # The special token in text is one id (it is what generation stops on).
    assert tokenizer("a" + SPECIAL_TOKEN)["input_ids"][-1] == tokenizer.eos_token_id


@pytest.mark.parametrize("arch", ARCHS)
def test_weights_are_a_function_of_the_seed(arch: str, tiny_checkpoint: Checkpoint, tmp_path: pathlib.Path) -> None:
    reference = tiny_checkpoint(arch)
    again = make_model(arch, "tiny", tmp_path / "again", seed=0)
    other = make_model(arch, "tiny", tmp_path / "other", seed=1)

    want, got = load_file(reference / "model.safetensors"), load_file(again / "model.safetensors")
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key
    logits = _logits(reference)
    assert torch.equal(logits, _logits(again))
    assert logits.std() > 0.05  # not a degenerate (near-constant) model
    assert not torch.allclose(logits, _logits(other))


@pytest.mark.parametrize("arch", ARCHS)
def test_biases_and_norm_scales_are_not_at_their_init(arch: str, tiny_checkpoint: Checkpoint) -> None:
    # A split model that dropped a bias or a norm must not match the reference by luck.
    weights = load_file(tiny_checkpoint(arch) / "model.safetensors")
    vectors = {k: v for k, v in weights.items() if v.dim() == 1}
    assert vectors, "every architecture has norms"
    for key, value in vectors.items():
        assert not torch.all(value == 0) and not torch.all(value == 1), key
        assert value.std() > 0.01, key


def test_make_model_reuses_a_matching_folder(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "ckpt"
    assert make_model("llama", "tiny", out, seed=3) == out.absolute()
    before = (out / "model.safetensors").stat().st_mtime_ns

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("rebuilt a checkpoint that was already there")

    with monkeypatch.context() as patch:
        patch.setattr(modelzoo, "build_random_model", fail)
        assert make_model("llama", "tiny", str(out), seed=3) == out.absolute()
    assert (out / "model.safetensors").stat().st_mtime_ns == before

    # Another recipe replaces the folder; no staging folders are left next to it.
    make_model("llama", "tiny", out, seed=4)
    assert json.loads((out / MARKER_FILE).read_text())["seed"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_make_model_refuses_to_clobber_a_foreign_folder(tmp_path: pathlib.Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        make_model("gpt2", "tiny", tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    ("call", "supported"),
    [
        (lambda out: make_model("bert", "tiny", out), ARCHS),
        (lambda out: make_model("llama", "huge", out), PRESETS),
        (lambda out: preset_config("bert", "tiny", 1024), ARCHS),
        (lambda out: preset_config("llama", "huge", 1024), PRESETS),
    ],
    ids=["make_model-arch", "make_model-preset", "preset_config-arch", "preset_config-preset"],
)
def test_unknown_arch_or_preset_names_the_supported_ones(
    call: Callable[[pathlib.Path], object], supported: tuple[str, ...], tmp_path: pathlib.Path
) -> None:
    with pytest.raises(ValueError) as excinfo:
        call(tmp_path / "out")
    assert all(name in str(excinfo.value) for name in supported), excinfo.value
    assert not (tmp_path / "out").exists()


def test_preset_sizes_without_materializing() -> None:
    assert 90e6 <= _meta_param_count("llama", "base") <= 160e6
    assert 10e6 <= _meta_param_count("llama", "small") <= 20e6
    assert _meta_param_count("llama", "tiny") < 1e6


def test_tie_override_and_dtype(tmp_path: pathlib.Path) -> None:
    path = make_model("llama", "tiny", tmp_path / "tied", tie_word_embeddings=True, dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert model.dtype == torch.bfloat16
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    assert preset_config("llama", "tiny", 1024).tie_word_embeddings is False
    assert preset_config("gpt2", "tiny", 1024).tie_word_embeddings is True


def test_make_model_leaves_the_global_rng_alone(tmp_path: pathlib.Path) -> None:
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    make_model("opt", "tiny", tmp_path / "opt", seed=0)
    assert torch.equal(torch.rand(4), expected)


def test_tokenizer_is_deterministic_and_learned_merges(tmp_path: pathlib.Path) -> None:
    first = make_tokenizer(tmp_path / "a")
    make_tokenizer(tmp_path / "b")
    saved = [(tmp_path / name / "tokenizer.json").read_bytes() for name in ("a", "b")]
    assert saved[0] == saved[1]
    assert len(first) == TOKENIZER_VOCAB_SIZE
    text = "The frozen model computes a careful answer for every client in the batch."
    assert len(first(text)["input_ids"]) < len(text.encode()) / 3  # BPE merges, not bytes
    batch = first(["a", "a longer sentence"], padding=True, return_tensors="pt")
    assert batch["input_ids"].shape == batch["attention_mask"].shape
    assert batch["attention_mask"][0].sum() < batch["attention_mask"][1].sum()


@pytest.mark.parametrize("kind", ["file", "link-to-file", "link-to-folder"])
def test_make_model_refuses_what_is_not_a_folder(kind: str, tmp_path: pathlib.Path) -> None:
    # A file (or a link) named as --output was deleted and replaced by a checkpoint folder.
    (tmp_path / "target.txt").write_text("important\n")
    (tmp_path / "folder").mkdir()
    output = tmp_path / "out"
    if kind == "file":
        output.write_text("important\n")
    else:
        output.symlink_to(tmp_path / ("target.txt" if kind == "link-to-file" else "folder"))
    with pytest.raises(OutputExistsError):
        make_model("llama", "tiny", output)
    assert (tmp_path / "target.txt").read_text() == "important\n"
    assert output.is_symlink() == (kind != "file") and output.exists()
    assert kind != "file" or output.read_text() == "important\n"
    assert not list((tmp_path / "folder").iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "out", "target.txt"]  # no staging left


def test_make_model_cli_errors_are_one_line(tmp_path: pathlib.Path, capsys, monkeypatch) -> None:
    precious = tmp_path / "precious.txt"
    precious.write_text("important\n")
    code, _, err = run_cli(["make-model", "--output", str(precious)], capsys, monkeypatch)
    assert code == 2
    assert_one_line_error(code, err, str(precious), "not a folder")
    assert precious.read_text() == "important\n"
    # An output that cannot be written (under a file; /proc/foo for a user): the cause, not a traceback.
    code, _, err = run_cli(["make-model", "--output", str(precious / "ckpt")], capsys, monkeypatch)
    assert code == 2
    assert_one_line_error(code, err, "cannot write a checkpoint", str(precious / "ckpt"))


def test_make_model_cli_says_what_it_kept_or_replaced(tmp_path: pathlib.Path, capsys, monkeypatch) -> None:
    """Before, a folder holding another recipe was replaced without a word."""
    output = tmp_path / "ckpt"
    said = [
        run_cli(["make-model", "--output", str(output), *extra], capsys, monkeypatch)
        for extra in ([], [], ["--seed", "3"])
    ]
    assert [code for code, _, _ in said] == [0, 0, 0]
    assert said[0][1].strip() == f"wrote llama/tiny checkpoint to {output}"
    assert said[1][1].strip() == f"{output} already holds the llama/tiny checkpoint of seed 0; left as it was"
    assert said[2][1].strip() == f"wrote llama/tiny checkpoint to {output} (replacing the llama/tiny one of seed 0)"


def test_checkpoint_files_get_the_umask_mode(tmp_path: pathlib.Path) -> None:
    # safetensors wrote model.safetensors 0600 while config.json and the tokenizer got 0644.
    old = os.umask(0o027)
    try:
        path = make_model("gpt2", "tiny", tmp_path / "ckpt")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in path.iterdir()}
    assert modes["model.safetensors"] == 0o640, modes
    assert set(modes.values()) == {0o640}, modes
