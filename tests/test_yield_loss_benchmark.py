"""``benchmarks/yield_loss.py`` times its ping-pong and ends its child processes."""

from __future__ import annotations

import os

import pytest

from benchmarks import yield_loss
from symbiosis.transport import spin


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the benchmark forks")
@pytest.mark.parametrize("variant", yield_loss.VARIANTS)
def test_round_trips_are_timed_and_the_children_end(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spin, "STOLEN_YIELD_S", spin.STOLEN_YIELD_S)  # the benchmark sets it per variant
    monkeypatch.setattr(spin, "_core_losses", spin._core_losses)
    times = yield_loss.round_trips(variant, hogs=1, work_s=20e-6, calls=50, warmup=5)
    assert len(times) == 50
    assert all(t >= 2 * 20e-6 for t in times)  # each side's work at least
    # Returning at all means it reaped every child: it waits for each, and the peer ends only
    # when the parent closes its end.
