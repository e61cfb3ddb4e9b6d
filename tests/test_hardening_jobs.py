"""Jobs never delete data they did not write (issue 10, finding 4).

``finetune --output X`` writes the adapter folder ``X`` and the run folder ``X.run/``. Each
holds a marker (``.symbiosis-output.json``); a folder without it is the user's: refused unless
empty, never cleared. Every refusal happens before the first training step.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import peft
import pytest
from transformers import AutoModelForCausalLM

from symbiosis.jobs.artifacts import MARKER, check_output_folder, save_adapter
from symbiosis.jobs.base import JobError
from symbiosis.jobs.client import ClientOptions
from symbiosis.jobs.finetune import FinetuneOptions, StepRecord, TrainOptions, finetune
from symbiosis.jobs.methods import MethodOptions, build_peft_config
from tests.cli_helpers import run_cli

NOTES = "my notes: not yours to delete\n"


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{c}=", "completion": c * 2}) + "\n" for c in "ABCDEF"))
    return path


def job(model: Path, data: Path, output: Path, **train) -> FinetuneOptions:
    return FinetuneOptions(
        model=model,
        data=data,
        output=output,
        client=ClientOptions(embedded=True),
        method_options=MethodOptions(rank=2, alpha=4),
        train=TrainOptions(**{"steps": 1, "batch_size": 2, **train}),
        progress=False,
    )


def refused_before_training(options: FinetuneOptions, match: str) -> None:
    steps: list[StepRecord] = []
    with pytest.raises(JobError, match=match):
        finetune(options, on_step=steps.append)
    assert not steps, "the output was checked only after training"


def test_output_that_is_a_regular_file_is_kept(tiny_checkpoint, tmp_path, data):
    output = tmp_path / "adapter"
    output.write_text(NOTES)
    refused_before_training(job(tiny_checkpoint("llama"), data, output), "not a folder")
    assert output.read_text() == NOTES


def test_adapter_looking_folder_with_foreign_files_is_kept(tiny_checkpoint, tmp_path, data):
    output = tmp_path / "adapter"
    output.mkdir()
    (output / "adapter_config.json").write_text("{}")
    (output / "notes.md").write_text(NOTES)
    refused_before_training(job(tiny_checkpoint("llama"), data, output), "did not write")
    assert sorted(p.name for p in output.iterdir()) == ["adapter_config.json", "notes.md"]


def test_non_empty_folder_is_refused_before_the_first_step(tiny_checkpoint, tmp_path, data):
    output = tmp_path / "adapter"
    output.mkdir()
    (output / "notes.md").write_text(NOTES)
    refused_before_training(job(tiny_checkpoint("llama"), data, output), "did not write")
    assert (output / "notes.md").read_text() == NOTES


def test_unrelated_run_folder_is_kept(tiny_checkpoint, tmp_path, data):
    output = tmp_path / "adapter"
    run_dir = tmp_path / "adapter.run"
    run_dir.mkdir()
    (run_dir / "notes.md").write_text(NOTES)
    refused_before_training(job(tiny_checkpoint("llama"), data, output), "not written by Symbiosis")
    assert (run_dir / "notes.md").read_text() == NOTES
    assert not output.exists()


def test_run_folder_that_is_a_file_is_kept(tiny_checkpoint, tmp_path, data):
    run_file = tmp_path / "adapter.run"
    run_file.write_text(NOTES)
    refused_before_training(job(tiny_checkpoint("llama"), data, tmp_path / "adapter"), "not a folder")
    assert run_file.read_text() == NOTES


def test_reruns_replace_only_what_the_job_wrote(tiny_checkpoint, tmp_path, data):
    """Our own folders are reused; a user's file in them survives a fresh run or blocks a save."""
    model, output, run_dir = tiny_checkpoint("llama"), tmp_path / "adapter", tmp_path / "adapter.run"
    finetune(job(model, data, output, steps=2, save_every=1))
    assert (output / MARKER).is_file() and (run_dir / MARKER).is_file()
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-0000001"]
    (run_dir / "notes.md").write_text(NOTES)
    (run_dir / "checkpoints" / "notes.md").write_text(NOTES)

    finetune(job(model, data, output, seed=1))  # a fresh run over our own adapter and run folder
    assert (run_dir / "notes.md").read_text() == NOTES
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["notes.md"], "stale checkpoint kept"
    assert len((run_dir / "log.jsonl").read_text().splitlines()) == 1

    (output / "notes.md").write_text(NOTES)  # the user adds a file to our adapter folder
    refused_before_training(job(model, data, output), r"did not write \(notes.md\)")
    assert (output / "notes.md").read_text() == NOTES and (output / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_empty_output_folder_is_used(tiny_checkpoint, tmp_path, data):
    output = tmp_path / "adapter"
    output.mkdir()
    finetune(job(tiny_checkpoint("llama"), data, output))
    assert (output / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_save_adapter_checks_its_output(tiny_checkpoint, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = peft.get_peft_model(model, build_peft_config("lora", model, MethodOptions(rank=2)))
    target = tmp_path / "adapter"
    target.write_text(NOTES)
    with pytest.raises(JobError, match="not a folder"):
        save_adapter(peft_model, target)
    assert target.read_text() == NOTES
    saved = save_adapter(peft_model, tmp_path / "fresh")
    marker = json.loads((saved / MARKER).read_text())
    assert marker["kind"] == "adapter" and "adapter_model.safetensors" in marker["files"]
    assert save_adapter(peft_model, saved) == saved  # our own folder: replaced


@pytest.mark.parametrize("case", ["symlink", "under_a_file", "dot", "read_only_parent", "other_user"])
def test_bad_output_paths(tmp_path, case):
    (tmp_path / "file").write_text(NOTES)
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "link")
    (tmp_path / "locked").mkdir(mode=0o500)
    (tmp_path / "theirs").mkdir()
    path, match = {
        "symlink": (tmp_path / "link", "symbolic link"),
        "under_a_file": (tmp_path / "file" / "adapter", "is not a folder"),
        "dot": (Path("."), "must name a folder"),
        "read_only_parent": (tmp_path / "locked" / "adapter", "not writable"),
        "other_user": (tmp_path / "theirs", "belongs to another user"),
    }[case]
    if case == "read_only_parent" and os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    if case == "other_user":
        if os.geteuid() != 0:
            pytest.skip("only root can give a folder to another user")
        os.chown(tmp_path / "theirs", 65534, 65534)
    with pytest.raises(JobError, match=match):
        check_output_folder(path)


@pytest.mark.slow
def test_cli_refuses_a_file_output_in_one_line(tiny_checkpoint, tmp_path, data, capsys, monkeypatch):
    output = tmp_path / "out"
    output.write_text(NOTES)
    args = [
        "finetune",
        "--model",
        str(tiny_checkpoint("llama")),
        "--data",
        str(data),
        "--output",
        str(output),
        "--steps",
        "1",
        "--embedded",
        "--no-progress",
    ]
    code, _, err = run_cli(args, capsys, monkeypatch)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "not a folder" in lines[0] and "Traceback" not in err
    assert output.read_text() == NOTES


def test_any_saved_adapter_names_its_base_model_by_absolute_path(tiny_checkpoint, tmp_path, monkeypatch):
    """save_adapter, which every job writes through (finetune, the demo), not only finetune: a base
    loaded by a relative path is recorded absolute, so the adapter finds it from anywhere."""
    checkpoint = tiny_checkpoint("llama")
    monkeypatch.chdir(checkpoint.parent)
    model = AutoModelForCausalLM.from_pretrained(checkpoint.name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = peft.get_peft_model(model, build_peft_config("lora", model, MethodOptions(rank=2)))
    assert peft_model.peft_config["default"].base_model_name_or_path == checkpoint.name  # as loaded
    folder = save_adapter(peft_model, tmp_path / "adapter")
    recorded = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert recorded == str(checkpoint.absolute())


def test_what_a_run_leaves_records_what_ran(tiny_checkpoint, tmp_path, data, monkeypatch):
    """The adapter names its base model by absolute path, training_options.json the real step count,
    and every file gets the umask's mode (safetensors wrote its weights 0600)."""
    checkpoint = tiny_checkpoint("llama")
    monkeypatch.chdir(checkpoint.parent)  # a relative --model, as a user types it
    options = job(Path(checkpoint.name), data, tmp_path / "adapter", steps=3, save_every=1)
    old = os.umask(0o022)
    try:
        finetune(options)
    finally:
        os.umask(old)
    output = tmp_path / "adapter"
    adapter_config = json.loads((output / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(checkpoint.absolute())
    assert f"base_model: {checkpoint.absolute()}" in (output / "README.md").read_text()
    recorded = json.loads((output / "training_options.json").read_text())
    assert recorded["method_options"]["total_steps"] == 3  # the run's, not MethodOptions' default 100
    checkpoints = tmp_path / "adapter.run" / "checkpoints"
    files = [*output.iterdir(), *(p for folder in checkpoints.iterdir() for p in folder.iterdir())]
    assert any(p.name == "adapter_model.safetensors" for p in files)
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in files}
    assert set(modes.values()) == {"0o644"}, modes
