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


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    """A user error: a non-zero exit and one line ``error: ...`` naming each of ``needles``, no traceback."""
    assert code != 0
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got:\n{err}"
    assert lines[0].startswith("error: ") and "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
