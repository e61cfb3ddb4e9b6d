"""``python -m benchmarks.startup``: start-up and exit of ``symbiosis serve`` and ``symbiosis api``."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_startup_quick_times_both_commands_with_and_without_the_frozen_heap(tmp_path):
    from benchmarks import startup

    result = startup.main(["--quick", "--output", str(tmp_path / "out"), "--cache", str(tmp_path / "cache")])

    written = json.loads((tmp_path / "out" / "startup.json").read_text())
    assert written["summary"] == result["summary"]
    assert set(written["summary"]) == {f"{c}/{f}" for c in ("serve", "api") for f in ("ready_s", "exit_s")}
    for variant in ("current", "no-freeze"):
        for command in ("serve", "api"):
            (run,) = written["runs"][variant][command]  # --quick: one round
            assert run["ready_s"] > 0 and run["exit_s"] > 0
    with pytest.raises(SystemExit, match="holds no symbiosis package"):
        startup.main(["--quick", "--baseline", str(tmp_path), "--cache", str(tmp_path / "cache")])
