"""Every ``SchedulerConfig`` field is an option of ``symbiosis serve``, with help text, and reaches the config."""

from __future__ import annotations

import dataclasses

import typer
from typer.testing import CliRunner

from symbiosis import cli_serve
from symbiosis.cli_scheduler import with_scheduler_options
from symbiosis.executor.scheduler import SchedulerConfig

FIELDS = [f.name for f in dataclasses.fields(SchedulerConfig)]


def test_serve_has_an_option_with_help_for_every_scheduler_field():
    app = typer.Typer()
    cli_serve.register(app)
    app.command("other")(lambda: None)  # two commands: get_command gives a group
    serve = typer.main.get_command(app).commands["serve"]
    options = {p.name: p for p in serve.params if p.param_type_name == "option"}
    assert all(p.help for p in options.values())
    for name in FIELDS:
        assert name in options, f"serve has no --{name.replace('_', '-')}"
        assert options[name].help and options[name].help == SchedulerConfig.help_texts()[name]
    assert "--decode-slo-ms" in options["decode_slo_ms"].opts


def _recording_app(seen: list) -> typer.Typer:
    app = typer.Typer()

    @app.command()
    @with_scheduler_options
    def run(name: str = "x", scheduler_config: SchedulerConfig | None = None) -> None:
        seen.append((name, scheduler_config))

    return app


def test_options_become_one_validated_config():
    seen: list = []
    result = CliRunner().invoke(
        _recording_app(seen),
        [
            "--name",
            "y",
            "--decode-slo-ms",
            "40",
            "--wait-rule",
            "convoy",
            "--row-budget",
            "512",
            "--policy",
            "lockstep",
        ],
    )
    assert result.exit_code == 0, result.output
    name, config = seen[0]
    assert name == "y"
    assert config == SchedulerConfig(decode_slo_ms=40.0, wait_rule="convoy", row_budget=512, policy="lockstep")
    # Defaults when nothing is given: the dataclass's own.
    CliRunner().invoke(_recording_app(seen), [])
    assert seen[1][1] == SchedulerConfig()


def test_a_bad_value_is_a_usage_error_naming_the_field():
    result = CliRunner().invoke(_recording_app([]), ["--min-chunk-rows", "0"])
    assert result.exit_code == 2 and "min_chunk_rows" in result.output
    result = CliRunner().invoke(_recording_app([]), ["--wait-rule", "sometimes"])
    assert result.exit_code == 2 and "sometimes" in result.output
