"""Bad input exits non-zero with a one-line message and no traceback (unless --debug).

Most cases run ``symbiosis.cli.main`` in-process (the real entry point, with its error handling)
to keep the suite fast; one runs the installed command in a subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import symbiosis
from tests.cli_helpers import assert_one_line_error, run_cli


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{c}=", "completion": c}) + "\n" for c in "ABCDEF"))
    return path


def finetune_args(model, data, output, *extra) -> list[str]:
    return [
        "finetune",
        "--model",
        str(model),
        "--data",
        str(data),
        "--output",
        str(output),
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--no-progress",
        *extra,
    ]


def test_missing_model_folder(tmp_path, data, capsys, monkeypatch):
    code, _, err = run_cli(finetune_args(tmp_path / "nope", data, tmp_path / "out", "--embedded"), capsys, monkeypatch)
    assert_one_line_error(code, err, "nope", "does not exist")


def test_malformed_jsonl_line_names_line_number(tiny_checkpoint, tmp_path, data, capsys, monkeypatch):
    data.write_text(data.read_text() + '{"prompt": "A=", "completion": \n')
    code, _, err = run_cli(
        finetune_args(tiny_checkpoint("llama"), data, tmp_path / "out", "--embedded"), capsys, monkeypatch
    )
    assert_one_line_error(code, err, "data.jsonl:7", "not valid JSON")


def test_unknown_peft_method_lists_supported(tiny_checkpoint, tmp_path, data, capsys, monkeypatch):
    args = finetune_args(tiny_checkpoint("llama"), data, tmp_path / "out", "--embedded", "--method", "dora-xl")
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert_one_line_error(code, err, "dora-xl", "lora, ia3, adalora, loha, lokr, prefix, prompt, p_tuning")


def test_unreachable_executor_fails_within_timeout(tiny_checkpoint, tmp_path, data, capsys, monkeypatch):
    address = f"ipc://{tmp_path}/nobody.sock"
    started = time.monotonic()
    args = finetune_args(
        tiny_checkpoint("llama"), data, tmp_path / "out", "--executor", address, "--connect-timeout", "1"
    )
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert time.monotonic() - started < 15
    assert_one_line_error(code, err, address)
    assert not (tmp_path / "out").exists()


def test_executor_of_another_model(tiny_checkpoint, tmp_path, data, capsys, monkeypatch):
    with symbiosis.BaseExecutor.from_pretrained(tiny_checkpoint("qwen2")) as executor:
        server = executor.serve(f"ipc://{tmp_path}/qwen.sock")
        args = ["generate", "--model", str(tiny_checkpoint("llama")), "--executor", server.address, "--prompt", "hi"]
        code, _, err = run_cli(args, capsys, monkeypatch)
    assert_one_line_error(code, err)
    assert "fingerprint" in err or "serves" in err


def test_full_disk_leaves_no_adapter(tiny_checkpoint, tmp_path, data, capsys, monkeypatch):
    import errno

    import peft.peft_model

    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(peft.peft_model, "safe_save_file", full_disk)
    output = tmp_path / "out"
    code, _, err = run_cli(finetune_args(tiny_checkpoint("llama"), data, output, "--embedded"), capsys, monkeypatch)
    assert_one_line_error(code, err, "No space left on device", str(output))
    assert not output.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")], "temporary folder left behind"


def test_full_disk_keeps_the_previous_adapter(tiny_checkpoint, tmp_path, data, capsys, monkeypatch):
    output = tmp_path / "out"
    code, out, _ = run_cli(finetune_args(tiny_checkpoint("llama"), data, output, "--embedded"), capsys, monkeypatch)
    assert code == 0 and "saved lora adapter" in out
    before = (output / "adapter_model.safetensors").read_bytes()

    import peft.peft_model

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(peft.peft_model, "safe_save_file", full_disk)
    code, _, err = run_cli(
        finetune_args(tiny_checkpoint("llama"), data, output, "--embedded", "--seed", "1"), capsys, monkeypatch
    )
    assert_one_line_error(code, err, "No space left on device")
    assert (output / "adapter_model.safetensors").read_bytes() == before


def test_neither_executor_nor_embedded(tiny_checkpoint, tmp_path, data, capsys, monkeypatch):
    code, _, err = run_cli(finetune_args(tiny_checkpoint("llama"), data, tmp_path / "out"), capsys, monkeypatch)
    assert_one_line_error(code, err, "--executor", "--embedded")


@pytest.mark.slow
def test_installed_command_and_debug_flag(tmp_path):
    args = [
        sys.executable,
        "-m",
        "symbiosis",
        "finetune",
        "--embedded",
        "--model",
        str(tmp_path / "missing"),
        "--data",
        str(tmp_path / "d.jsonl"),
        "--output",
        str(tmp_path / "o"),
    ]
    (tmp_path / "d.jsonl").write_text('{"text": "hello"}\n')
    plain = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 2 and plain.stderr.strip().count("\n") == 0 and "does not exist" in plain.stderr
    debug = subprocess.run([*args, "--debug"], capture_output=True, text=True, timeout=120)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "CheckpointError" in debug.stderr


def test_every_flag_has_help():
    import typer

    from symbiosis.cli_jobs import register

    app = typer.Typer()
    register(app)
    group = typer.main.get_command(app)
    for name in ("finetune", "generate", "demo"):
        command = group.commands[name]
        assert command.help, f"{name} has no help"
        for param in command.params:
            assert getattr(param, "help", None), f"{name} {param.opts} has no help text"


@pytest.mark.parametrize(
    ("config", "needles"),
    [
        ({"r": "x"}, ["'r' must be a number", '"x"']),
        ({"lora_dropout": "x"}, ["'lora_dropout' must be a number"]),
        ({"target_modules": 5}, ["'target_modules' must be a list of strings or a string or null", "got 5"]),
        ({"use_dora": "yes"}, ["'use_dora' must be true or false"]),
        ({"r": 2.5}, ["wrong type"]),  # a number, but not one torch can size a layer with
    ],
)
def test_bad_peft_config_values_name_the_file(tiny_checkpoint, tmp_path, data, config, needles, capsys, monkeypatch):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(config))
    args = finetune_args(tiny_checkpoint("llama"), data, tmp_path / "out", "--embedded", "--peft-config", str(path))
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 2
    assert_one_line_error(code, err, f"--peft-config {str(path)!r}", *needles)
    assert not (tmp_path / "out").exists()


def test_good_peft_config_values_pass_the_type_check(tiny_checkpoint, tmp_path, data, capsys, monkeypatch):
    # Numbers are not told apart (lora_alpha is annotated int, peft's defaults put floats in it) and
    # a Literal field takes any string of its kind ("pissa_niter_4" matches a pattern, not a value).
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"r": 2, "lora_alpha": 0.5, "target_modules": ["q_proj"], "bias": "none"}))
    args = finetune_args(tiny_checkpoint("llama"), data, tmp_path / "out", "--embedded", "--peft-config", str(path))
    code, out, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (2, 0.5, ["q_proj"])


def test_connect_timeout_help_says_it_bounds_a_restart(capsys, monkeypatch):
    code, out, _ = run_cli(["finetune", "--help"], capsys, monkeypatch)
    assert code == 0
    assert "restarting executor" in " ".join(out.split())


def test_lost_executor_during_a_job_suggests_connect_timeout(tiny_checkpoint, tmp_path, data):
    from symbiosis.errors import ExecutorUnavailableError
    from symbiosis.jobs.client import ClientOptions
    from symbiosis.jobs.finetune import FinetuneOptions, TrainOptions, finetune

    with symbiosis.BaseExecutor.from_pretrained(tiny_checkpoint("llama")) as executor:
        server = executor.serve(f"ipc://{tmp_path}/executor.sock")
        options = FinetuneOptions(
            model=tiny_checkpoint("llama"),
            data=data,
            output=tmp_path / "out",
            client=ClientOptions(executor=server.address, connect_timeout_s=1.0),
            train=TrainOptions(steps=3, batch_size=2),
            progress=False,
        )

        def stop_the_executor(record) -> None:
            if record.step == 1:
                server.close()  # and it never comes back

        started = time.monotonic()
        with pytest.raises(ExecutorUnavailableError, match=r"within --connect-timeout \(1s\): raise --connect-timeout"):
            finetune(options, on_step=stop_the_executor)
        assert time.monotonic() - started < 30
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--lr-schedule", "steep"], "--lr-schedule must be one of"),
        (["--rank", "0"], "--rank must be >= 1, got 0"),
    ],
)
def test_bad_training_values_name_their_flag(extra, needle, tiny_checkpoint, tmp_path, data, capsys, monkeypatch):
    """Before: the Python field (``batch_size must be >= 1``), which a command-line user never typed."""
    args = finetune_args(tiny_checkpoint("llama"), data, tmp_path / "out", "--embedded")
    code, _, err = run_cli([*args, *extra], capsys, monkeypatch)  # a flag given twice: the last one counts
    assert_one_line_error(code, err, needle)


def test_bad_sampling_values_are_each_named(tiny_checkpoint, capsys, monkeypatch):
    args = ["generate", "--embedded", "--model", str(tiny_checkpoint("llama")), "--prompt", "hi"]
    code, _, err = run_cli([*args, "--top-p", "2", "--top-k", "-1"], capsys, monkeypatch)
    assert_one_line_error(code, err, "--top-p must be in (0, 1], got 2.0", "--top-k must be >= 0, got -1")
    assert "--temperature" not in err


# ---- Ctrl-C ------------------------------------------------------------------------------------------


def test_ctrl_c_in_a_command_says_it_was_interrupted(capsys, monkeypatch, tmp_path):
    """typer turns a KeyboardInterrupt inside a command into a silent exit 130; the user reads
    that the command stopped (before: nothing at all)."""
    import symbiosis.jobs.generate as generate_module

    def interrupted(options):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate_module, "generate", interrupted)
    code, _, err = run_cli(["generate", "--embedded", "--model", str(tmp_path), "--prompt", "hi"], capsys, monkeypatch)
    assert code == 130 and err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err


def test_ctrl_c_in_finetune_saves_the_step_it_finished_and_says_how_to_resume(
    tiny_checkpoint, tmp_path, data, capsys, monkeypatch
):
    """The first Ctrl-C lets the step in progress finish, saves a checkpoint there and names it;
    ``--resume`` goes on from it (test_finetune.py checks that a resumed run is exact)."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell's Ctrl-C, whatever the runner set
    try:
        _interrupt_and_resume(tiny_checkpoint, tmp_path, data, capsys, monkeypatch)
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt_and_resume(tiny_checkpoint, tmp_path, data, capsys, monkeypatch):
    import os
    import signal

    from symbiosis.jobs.finetune import FinetuneRun

    one_step = FinetuneRun._one_step

    def ctrl_c_in_step_2(run):
        if run.step == 1:
            os.kill(os.getpid(), signal.SIGINT)  # lands in the step, before its products
        return one_step(run)

    monkeypatch.setattr(FinetuneRun, "_one_step", ctrl_c_in_step_2)
    args = finetune_args(tiny_checkpoint("llama"), data, tmp_path / "out", "--embedded")
    args[args.index("--steps") + 1] = "5"
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 130, err
    checkpoint = tmp_path / "out.run" / "checkpoints" / "step-0000002"
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted: stopped after step 2 of 5;") and str(checkpoint) in last and "--resume" in last
    assert "Traceback" not in err and checkpoint.is_dir() and not (tmp_path / "out").exists()

    monkeypatch.setattr(FinetuneRun, "_one_step", one_step)
    code, _, err = run_cli([*args, "--resume"], capsys, monkeypatch)
    assert code == 0, err
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    logged = [json.loads(line)["step"] for line in (tmp_path / "out.run" / "log.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4, 5]


def test_a_second_ctrl_c_stops_finetune_at_once(tiny_checkpoint, tmp_path, data, capsys, monkeypatch):
    """A step that does not end (an executor gone quiet) must not hold the user: the second
    Ctrl-C is Python's own again."""
    import os
    import signal

    from symbiosis.jobs.finetune import FinetuneRun

    one_step = FinetuneRun._one_step

    def ctrl_c_twice_in_step_2(run):
        if run.step == 1:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return one_step(run)

    monkeypatch.setattr(FinetuneRun, "_one_step", ctrl_c_twice_in_step_2)
    args = finetune_args(tiny_checkpoint("llama"), data, tmp_path / "out", "--embedded")
    args[args.index("--steps") + 1] = "5"
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code, _, err = run_cli(args, capsys, monkeypatch)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 130 and err.strip().splitlines()[-1] == "interrupted", err
    assert not (tmp_path / "out.run" / "checkpoints").exists()  # stopped inside step 2: nothing whole to save
    assert signal.getsignal(signal.SIGINT) is previous
