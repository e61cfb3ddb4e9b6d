"""Fixtures every transport test file shares."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import pytest

from .fakes import FakeExecutorService


@pytest.fixture
def sock_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="symb-", dir="/tmp")  # short: ipc paths are limited to ~100 chars
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def fake() -> Iterator[FakeExecutorService]:
    service = FakeExecutorService(threaded=True, hang_layers={"slow"})
    yield service
    service.close()
