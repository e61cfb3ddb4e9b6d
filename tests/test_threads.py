"""Which commands get the shared-host OpenMP setting, and that the CLI applies it before torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from symbiosis.threads import SHARED_HOST_POLICY, configure_for_command, shares_host_with_executor


@pytest.mark.parametrize(
    "argv, shared",
    [
        (["serve", "MODEL", "--bind", "ipc:///tmp/x.sock"], True),
        (["demo"], True),
        (["--debug", "demo"], True),
        (["finetune", "--executor", "ipc:///tmp/x.sock", "--model", "M"], True),
        (["generate", "--executor=tcp://127.0.0.1:7000"], True),
        (["finetune", "--embedded", "--model", "M"], False),
        (["make-model", "--output", "x"], False),
        ([], False),
    ],
)
def test_shared_host_commands(argv, shared):
    assert shares_host_with_executor(argv) is shared


def test_an_explicit_policy_wins(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert configure_for_command(["serve", "M"]) == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert configure_for_command(["serve", "M"]) == SHARED_HOST_POLICY


def test_the_command_line_does_not_import_torch_before_configuring():
    # libgomp reads OMP_WAIT_POLICY once, when torch loads: the CLI's own imports must not load it
    modules = "symbiosis.cli, symbiosis.cli_serve, symbiosis.cli_keys, symbiosis.threads"
    code = f"import sys, {modules}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
