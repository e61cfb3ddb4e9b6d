"""Run the ``symbiosis`` command in-process, as a user would from a shell."""

from __future__ import annotations

import sys

from symbiosis import cli


def run_cli(args: list[str], capsys, monkeypatch) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``symbiosis ARGS`` (``main`` catches typed errors)."""
    monkeypatch.setattr(sys, "argv", ["symbiosis", *args])
    capsys.readouterr()
    try:
        cli.main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err
