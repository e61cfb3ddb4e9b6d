"""How ``symbiosis.cli.main`` reports failures: a user's mistake in one line, a bug with its traceback.

Only ``SymbiosisError`` (and click's usage errors) become a one-line ``error: ...`` with exit code 2;
any other exception is a bug in symbiosis, so its traceback is shown with a line asking for a bug
report (exit code 1), with or without ``--debug``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from symbiosis import cli
from symbiosis.errors import ConfigurationError, SymbiosisError
from tests.cli_helpers import assert_one_line_error, run_cli


def assert_bug_report(code: int, err: str, exception_line: str) -> None:
    assert code == 1, err
    assert "Traceback (most recent call last)" in err
    assert exception_line in err, err
    assert err.rstrip().splitlines()[-1] == cli.BUG_REPORT_LINE
    assert "please report this bug" in cli.BUG_REPORT_LINE
    assert not err.startswith("error: ")


def generate_args(model, *extra: str) -> list[str]:
    return ["generate", "--model", str(model), "--embedded", "--prompt", "hi", "--max-new-tokens", "1", *extra]


@pytest.mark.parametrize("bug", [ValueError("a slip in our code"), RuntimeError("a slip in our code"), KeyError("x")])
def test_internal_bug_prints_traceback_and_report_line(bug, tiny_checkpoint, capsys, monkeypatch):
    import symbiosis.jobs.generate

    def broken(options):
        raise bug

    monkeypatch.setattr(symbiosis.jobs.generate, "generate", broken)
    code, _, err = run_cli(generate_args(tiny_checkpoint("llama")), capsys, monkeypatch)
    assert_bug_report(code, err, f"{type(bug).__name__}: {bug}")


def test_internal_bug_with_debug_flag_is_reported_the_same_way(tiny_checkpoint, capsys, monkeypatch):
    import symbiosis.jobs.generate

    def broken(options):
        raise ValueError("a slip in our code")

    monkeypatch.setattr(symbiosis.jobs.generate, "generate", broken)
    code, _, err = run_cli([*generate_args(tiny_checkpoint("llama")), "--debug"], capsys, monkeypatch)
    assert_bug_report(code, err, "ValueError: a slip in our code")


def test_typed_error_is_one_line_and_debug_shows_its_traceback(tiny_checkpoint, capsys, monkeypatch):
    import symbiosis.jobs.generate

    def refuses(options):
        raise ConfigurationError("the user's mistake, named")

    monkeypatch.setattr(symbiosis.jobs.generate, "generate", refuses)
    code, _, err = run_cli(generate_args(tiny_checkpoint("llama")), capsys, monkeypatch)
    assert_one_line_error(code, err, "the user's mistake, named")
    assert code == 2
    monkeypatch.setattr("sys.argv", ["symbiosis", *generate_args(tiny_checkpoint("llama")), "--debug"])
    with pytest.raises(ConfigurationError, match="the user's mistake"):
        cli.main()


def test_version_and_short_help(capsys, monkeypatch):
    from importlib.metadata import version

    code, out, _ = run_cli(["--version"], capsys, monkeypatch)
    assert code == 0 and out.strip() == f"symbiosis {version('symbiosis')}"
    code, out, _ = run_cli(["-h"], capsys, monkeypatch)
    assert code == 0 and "--debug" in out and "--version" in out and "finetune" in out
    code, out, _ = run_cli(["generate", "-h"], capsys, monkeypatch)
    assert code == 0 and "--max-new-tokens" in out


def test_usage_error_is_clicks_message_not_a_bug_report(capsys, monkeypatch):
    code, _, err = run_cli(["generate", "--no-such-flag"], capsys, monkeypatch)
    assert code == 2 and "No such option" in err and "Traceback" not in err and cli.BUG_REPORT_LINE not in err


@pytest.mark.parametrize(
    "args",
    [
        ["api", "--embedded", "--model", "{model}", "--port", "70000"],
        ["api", "--embedded", "--model", "{model}", "--port", "-1"],
        ["serve", "{model}", "--metrics-port", "70000"],
    ],
)
def test_a_port_out_of_range_is_a_usage_error_not_a_bug_report(args, tiny_checkpoint, capsys, monkeypatch):
    """Before: socket's OverflowError after the model had loaded, reported as a bug in symbiosis."""
    args = [arg.replace("{model}", str(tiny_checkpoint("llama"))) for arg in args]
    code, _, err = run_cli(args, capsys, monkeypatch)
    flag = next(arg for arg in args if arg.endswith("port"))
    assert code == 2 and f"Invalid value for '{flag}'" in err, err
    assert "Traceback" not in err and cli.BUG_REPORT_LINE not in err


def test_a_port_out_of_range_from_python_is_a_typed_error(tiny_checkpoint):
    from symbiosis.errors import SymbiosisError
    from symbiosis.executor.metrics import MetricsServer

    with pytest.raises(SymbiosisError, match="70000"):
        MetricsServer(None, 70000)


# ---- user errors that used to surface as bare ValueError/FileExistsError/RuntimeError -------------


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--executor", "udp://127.0.0.1:1"], ("udp://127.0.0.1:1", "tcp://")),
        (["--executor", "shm+tcp://127.0.0.1:1"], ("shm+tcp://",)),
        (["--embedded", "--device", "gpu"], ("device", "gpu")),
        (["--embedded", "--dtype", "float64"], ("float64", "float32")),
    ],
)
def test_bad_client_flags_are_one_line(args, needles, tiny_checkpoint, capsys, monkeypatch):
    command = ["generate", "--model", str(tiny_checkpoint("llama")), "--prompt", "hi", "--connect-timeout", "1", *args]
    code, _, err = run_cli(command, capsys, monkeypatch)
    assert_one_line_error(code, err, *needles)


def test_unknown_target_module_is_one_line(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello"}\n')
    args = [
        "finetune",
        "--embedded",
        "--model",
        str(tiny_checkpoint("llama")),
        "--data",
        str(data),
        "--output",
        str(tmp_path / "out"),
        "--target-modules",
        "no_such_proj",
        "--steps",
        "1",
        "--no-progress",
    ]
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert_one_line_error(code, err, "no_such_proj")


@pytest.mark.slow
def test_key_name_and_existing_keys_are_one_line(tmp_path, capsys, monkeypatch):
    code, _, err = run_cli(["keys", "--output", str(tmp_path), "--name", ".hidden"], capsys, monkeypatch)
    assert_one_line_error(code, err, ".hidden", "plain file name")
    assert run_cli(["keys", "--output", str(tmp_path), "--name", "a"], capsys, monkeypatch)[0] == 0
    code, _, err = run_cli(["keys", "--output", str(tmp_path), "--name", "a"], capsys, monkeypatch)
    assert_one_line_error(code, err, "a.key", "exists")


def test_configuration_errors_keep_their_builtin_types():
    """Code that caught the builtin the old code raised still catches the typed error."""
    from symbiosis.errors import MissingFileError, OutputExistsError, UnsafeBindError
    from symbiosis.executor.scheduler_config import SchedulerConfig
    from symbiosis.transport.schemes import transport_class
    from symbiosis.transport.zmq_server import check_bind_address

    with pytest.raises(ValueError) as caught:
        SchedulerConfig(max_wait_ms=-1)
    assert isinstance(caught.value, ConfigurationError)
    with pytest.raises(ValueError) as caught:
        transport_class("udp://x")
    assert isinstance(caught.value, ConfigurationError)
    with pytest.raises(ValueError) as caught:
        check_bind_address("tcp://0.0.0.0:7000", allow_non_loopback=False)
    assert isinstance(caught.value, UnsafeBindError)
    assert issubclass(MissingFileError, FileNotFoundError) and issubclass(OutputExistsError, FileExistsError)
    assert all(issubclass(cls, SymbiosisError) for cls in (ConfigurationError, MissingFileError, OutputExistsError))


@pytest.mark.parametrize("verb", ["serve", "serve-metrics", "api"])
def test_a_taken_port_is_refused_before_the_model_loads(verb, tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """Before, the bind came after the model was read and its products timed: minutes for a large one."""
    import socket

    import symbiosis.executor.executor as executor_module
    import symbiosis.serving.server as server_module

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(executor_module.BaseExecutor, "from_pretrained", no_loading)
    monkeypatch.setattr(server_module, "executor_target", no_loading)
    model = str(tiny_checkpoint("llama"))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        args, needles = {
            "serve": (["serve", model, "--bind", f"tcp://127.0.0.1:{port}"], (f"tcp://127.0.0.1:{port}", "in use")),
            "serve-metrics": (
                ["serve", model, "--bind", f"ipc://{tmp_path}/ok.sock", "--metrics-port", str(port)],
                (f"--metrics-port {port}", "in use"),
            ),
            "api": (
                ["api", "--embedded", "--model", model, "--port", str(port), "--no-engine-process"],
                (f"127.0.0.1:{port}", "in use"),
            ),
        }[verb]
        code, _, err = run_cli(args, capsys, monkeypatch)
    assert_one_line_error(code, err, *needles)


@pytest.mark.slow
def test_serve_on_a_taken_port_is_one_line(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["serve", str(tiny_checkpoint("llama")), "--bind", f"tcp://127.0.0.1:{port}"]
        code, _, err = run_cli(args, capsys, monkeypatch)
        assert_one_line_error(code, err, f"tcp://127.0.0.1:{port}", "in use")
        args = [
            "serve",
            str(tiny_checkpoint("llama")),
            "--bind",
            f"ipc://{tmp_path}/ok.sock",
            "--metrics-port",
            str(port),
        ]
        code, _, err = run_cli(args, capsys, monkeypatch)
        assert_one_line_error(code, err, "metrics", str(port))
    args = ["serve", str(tiny_checkpoint("llama")), "--bind", f"ipc://{tmp_path}/no/such/folder.sock"]
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert_one_line_error(code, err, "no/such/folder.sock")
    args = ["serve", str(tiny_checkpoint("llama")), "--ready-file", str(tmp_path / "nope" / "ready.json")]
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert_one_line_error(code, err, "--ready-file", "does not exist")


def test_help_of_every_verb_loads_no_torch_peft_or_transformers():
    # `symbiosis --help` and `symbiosis serve --help` took ~10 s when every verb's module imported
    # peft and torch at load time for its option dataclasses; a verb imports them when it runs.
    probe = (
        "import sys\n"
        "from symbiosis.cli import _register_optional_commands\n"
        "_register_optional_commands()\n"
        "print(sorted(m for m in ('torch', 'peft', 'transformers') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_help_of_every_verb_shows_every_flag_whole_in_80_columns():
    """``VERB --help`` in an 80-column terminal or a pipe names every flag in full. (typer's rich
    panels cut long names there: ``--max-concurrent…``, ``--prefill-chunk-…``; the help is
    click's plain layout now.)"""
    import typer
    from typer.testing import CliRunner

    cli._register_optional_commands()
    group = typer.main.get_command(cli.app)
    runner = CliRunner()
    for name, command in group.commands.items():
        result = runner.invoke(cli.app, [name, "--help"], terminal_width=80)
        assert result.exit_code == 0, result.output
        for param in command.params:
            for flag in [*param.opts, *param.secondary_opts]:
                if flag.startswith("--"):
                    assert flag in result.output, (name, flag)


def test_make_model_help_lists_every_architecture_it_makes():
    """Before, it left out gpt_neox."""
    from typer.testing import CliRunner

    from symbiosis import cli
    from symbiosis.modelzoo import ARCHS

    result = CliRunner().invoke(cli.app, ["make-model", "--help"], terminal_width=80)
    assert result.exit_code == 0, result.output
    words = result.output.replace(",", " ").replace(".", " ").split()
    assert [arch for arch in ARCHS if arch not in words] == []
    assert cli.MAKE_MODEL_ARCHS == ARCHS  # the help's copy of the list (the CLI may not import modelzoo)
