"""Shared pytest fixtures.

Tiny random checkpoints are made once per session (or once ever, if `SYMBIOSIS_TEST_CACHE` names
a folder to keep them in), because nearly every reference test loads one.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable

import pytest

from symbiosis import threads
from symbiosis.modelzoo import make_model


@pytest.fixture(autouse=True)
def background_priority_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``symbiosis.cli.main`` run in-process (``finetune --executor ...``) would move the test
    process, and every process it starts later, to the background CPU class for good: record the
    call instead. Tests that check the real thing run it in a child process."""
    calls: list[str] = []
    monkeypatch.setattr(threads, "enter_background_priority", lambda: calls.append("background") or "recorded")
    return calls


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], pathlib.Path]:
    """Returns a function arch -> Path of a tiny random checkpoint (seed 0, made once per session)."""
    cache = os.environ.get("SYMBIOSIS_TEST_CACHE")
    root = pathlib.Path(cache) if cache else tmp_path_factory.mktemp("checkpoints")
    made: dict[str, pathlib.Path] = {}

    def get(arch: str) -> pathlib.Path:
        if arch not in made:
            # make_model returns an existing folder with the same recipe untouched.
            made[arch] = make_model(arch, "tiny", root / f"{arch}-tiny-seed0", seed=0)
        return made[arch]

    return get
