"""The ``symbiosis`` command line. Each verb is a thin shell over a library function."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Annotated

import typer

from symbiosis.errors import SymbiosisError
from symbiosis.jobs.interrupts import JobInterrupted

app = typer.Typer(
    name="symbiosis",
    help="Share one frozen base LLM among many fine-tuning and inference jobs (split execution).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"symbiosis {version('symbiosis')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            typer.echo("symbiosis (not installed: no version recorded)")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool,
        typer.Option("--version", help="Print the installed version and exit.", callback=_print_version, is_eager=True),
    ] = False,
    # ``main`` takes --debug out of the arguments wherever it stands (after a verb too); declared
    # here so that --help lists it.
    debug: Annotated[
        bool, typer.Option("--debug", help="Show the traceback of any error instead of a one-line message.")
    ] = False,
) -> None:
    """Share one frozen base LLM among many fine-tuning and inference jobs (split execution).

    Add --debug anywhere (before or after the verb) to see a traceback instead of a one-line error.
    """


#: What ``make-model --arch`` takes: ``modelzoo.ARCHS``, spelled out because importing modelzoo loads
#: torch and transformers, which ``--help`` must not (tests/test_cli_main.py checks they agree).
MAKE_MODEL_ARCHS = (
    "llama",
    "mistral",
    "qwen2",
    "gemma2",
    "gpt2",
    "gpt_bigcode",
    "opt",
    "phi3",
    "falcon",
    "gpt_neox",
    "mixtral",
)


@app.command("make-model")
def make_model_command(
    output: Annotated[Path, typer.Option(help="Folder to write the checkpoint into (created if missing).")],
    arch: Annotated[
        str,
        typer.Option(help=f"transformers architecture: {', '.join(MAKE_MODEL_ARCHS)}."),
    ] = "llama",
    preset: Annotated[str, typer.Option(help="Size: tiny (tests), small (~15M params), base (~120M params).")] = "tiny",
    seed: Annotated[int, typer.Option(help="Random seed of the weights.")] = 0,
) -> None:
    """Write a random-weight checkpoint of a real architecture, with a trained byte-level BPE tokenizer."""
    import json

    from symbiosis.modelzoo import MARKER_FILE, holds, make_model

    if holds(output, arch, preset, seed=seed):
        typer.echo(f"{output.absolute()} already holds the {arch}/{preset} checkpoint of seed {seed}; left as it was")
        return
    try:  # what make_model will replace: the user reads that it went
        before = json.loads((output / MARKER_FILE).read_text())
        replaced = f" (replacing the {before.get('arch')}/{before.get('preset')} one of seed {before.get('seed')})"
    except (OSError, ValueError, AttributeError):  # none there (or not a recipe)
        replaced = ""
    path = make_model(arch, preset, output, seed=seed)
    typer.echo(f"wrote {arch}/{preset} checkpoint to {path}{replaced}")


def _register_optional_commands() -> None:
    """Verbs that live in their own modules register themselves here."""
    import importlib

    for module in (
        "symbiosis.cli_serve",
        "symbiosis.cli_jobs",
        "symbiosis.cli_api",
        "symbiosis.cli_bench",
        "symbiosis.cli_keys",
    ):
        try:
            importlib.import_module(module).register(app)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise


BUG_REPORT_LINE = (
    "This is a bug in symbiosis, not a problem with your input: please report this bug on the project's "
    "issue tracker, with the traceback above and the command you ran."
)


def run() -> None:
    """The ``symbiosis`` command (and ``python -m symbiosis``): ``main()`` in a process of its own,
    whose serving verbs freeze their startup heap and which skips the interpreter's last
    collection at exit (``symbiosis/heap.py``: ~1 s for a process that loaded a model). ``main()``
    itself leaves the caller's heap alone (tests run it in-process)."""
    from symbiosis import heap

    heap.own_this_process()
    try:
        main()
    finally:
        heap.skip_exit_collection()


def _keyboard_interrupt_behind(exc: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt that ``exc`` was raised from or while handling, if any."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def main() -> None:
    """Run the CLI. Errors the user can fix (``SymbiosisError``: a bad flag value, a missing file,
    an unreachable executor) print one line and exit 2; click's usage errors print their usage
    message (exit 2). Anything else is a bug: it prints its traceback and a line asking for a bug
    report, and exits 1. ``--debug`` shows the traceback of every error."""
    from symbiosis.threads import configure_for_command

    configure_for_command(sys.argv[1:])  # before any verb imports torch (see threads.py)
    _register_optional_commands()
    debug = "--debug" in sys.argv
    if debug:
        sys.argv.remove("--debug")
    try:
        app()
    except JobInterrupted as exc:  # Ctrl-C that a job took at a step boundary: it says what it kept
        if debug:
            raise
        typer.echo(f"interrupted: {exc}", err=True)
        raise SystemExit(130) from None
    except SymbiosisError as exc:
        if debug:
            raise
        typer.echo(f"error: {exc}", err=True)
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # one outside a command (typer takes those inside: below)
        if debug:
            raise
        typer.echo("interrupted", err=True)
        raise SystemExit(130) from None
    except SystemExit as exc:
        # typer turns a KeyboardInterrupt inside a command into a silent exit 130 (typer/core.py);
        # a user who pressed Ctrl-C should still read that the command stopped, and --debug where.
        interrupt = _keyboard_interrupt_behind(exc)
        if interrupt is None:
            raise
        if debug:
            raise interrupt from None
        typer.echo("interrupted", err=True)
        raise SystemExit(130) from None
    except Exception:  # with or without --debug: the traceback is what a bug report needs
        traceback.print_exc()
        typer.echo(BUG_REPORT_LINE, err=True)
        raise SystemExit(1) from None
