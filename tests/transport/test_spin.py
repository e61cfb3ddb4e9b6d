"""Same-host waits check before they sleep (``transport/spin.py``): bounded, and a reply that comes
after the spin is still received (asleep, as before); the bound is read from the environment."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from symbiosis import protocol as P
from symbiosis.transport import lane as L
from symbiosis.transport import spin


def test_try_for_returns_the_first_result_and_gives_up_after_its_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _fake_clock(monkeypatch, yield_s=1e-4)  # a fake clock: a busy host must not lose a yield here
    answers = iter([None, None, 7])
    assert spin.try_for(lambda: next(answers), 1.0) == 7

    calls = []
    started = clock.now
    assert spin.try_for(lambda: calls.append(1), 0.002) is None
    assert len(calls) in (20, 21) and clock.now - started == pytest.approx(0.002, abs=2e-4)  # float steps

    assert spin.try_for(lambda: pytest.fail("a zero budget never tries"), 0.0) is None


def test_a_side_spins_only_while_its_recent_waits_are_short() -> None:
    waits = spin.RecentWaits(limit_s=0.001, spin_s=0.002)
    assert waits.spin_budget_s() == 0.002  # nothing seen yet: try
    for _ in range(3):
        waits.observe(0.010)  # replies queued behind other clients' work
    assert waits.spin_budget_s() == 0.0
    for _ in range(20):
        waits.observe(0.0002)  # decode-sized again
    assert waits.spin_budget_s() == 0.002
    waits.observe(1e9)  # the first gap after an idle spell counts as LONGEST_WAIT_S, not forever
    assert waits.mean_s <= spin.LONGEST_WAIT_S
    for _ in range(40):
        waits.observe(0.0002)
    assert waits.spin_budget_s() == 0.002


def test_the_executors_spin_stops_at_its_budget_and_at_a_held_batch() -> None:
    gaps = spin.RecentWaits(limit_s=0.0005, spin_s=0.002)
    assert spin.spin_window_s(gaps, 0.0005, 0.1) == pytest.approx(0.0015)  # the rest of its 2 ms
    assert spin.spin_window_s(gaps, 0.0005, 0.0003) == pytest.approx(0.0003)  # a held batch is due
    assert spin.spin_window_s(gaps, 0.003, 0.1) <= 0  # spun long enough: sleep
    gaps.observe(1.0)  # a client that computes long between calls
    assert spin.spin_window_s(gaps, 0.0, 0.1) <= 0


@pytest.mark.parametrize(
    ("value", "expected_s"),
    [("0", 0.0), ("500", 500e-6), ("", spin.DEFAULT_SPIN_US * 1e-6), ("fast", spin.DEFAULT_SPIN_US * 1e-6)],
)
def test_the_bound_comes_from_the_environment(value: str, expected_s: float) -> None:
    code = "from symbiosis.transport import spin; print(repr(spin.SPIN_S))"
    out = subprocess.run(
        [sys.executable, "-c", code], env={**_env(), spin.SPIN_VARIABLE: value}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) == pytest.approx(expected_s)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != spin.SPIN_VARIABLE}


@pytest.mark.parametrize("delay_s", [0.0, 0.05])  # within the spin, and well after it (asleep)
@pytest.mark.parametrize("into", [True, False])
def test_a_lane_call_gets_its_reply_whenever_it_comes(delay_s: float, into: bool) -> None:
    executor_end, client_end, max_message_bytes = L.make_pair()
    executor_end.setblocking(True)
    lane = L.ClientLane(client_end, max_message_bytes)
    expected = torch.randn(2, 8)

    def executor() -> None:
        assert executor_end.recv(1 << 20)  # the request
        time.sleep(delay_s)
        executor_end.sendmsg(L.frame(P.encode(P.Reply(5, True, "float32", [2, 8])), P.tensor_payload(expected)))

    answering = threading.Thread(target=executor)
    answering.start()
    try:
        result = torch.empty(2, 8)
        target = memoryview(result.numpy()).cast("B") if into else None
        reply, payload = lane.exchange(b"request", None, 5, result.nbytes, 5.0, target)
        answering.join()
        assert reply.request_id == 5
        got = result if payload is None else P.tensor_from_payload(payload, "float32", [2, 8])
        assert torch.equal(got, expected)
    finally:
        lane.release()
        executor_end.close()


class _FakeClock:
    """``time.perf_counter`` and ``os.sched_yield`` for ``spin``: each yield takes ``yield_s``."""

    def __init__(self, yield_s: float) -> None:
        self.now = 100.0
        self.yield_s = yield_s
        self.yields = 0

    def perf_counter(self) -> float:
        return self.now

    def sched_yield(self) -> None:
        self.yields += 1
        self.now += self.yield_s


def _fake_clock(monkeypatch: pytest.MonkeyPatch, yield_s: float) -> _FakeClock:
    clock = _FakeClock(yield_s)
    monkeypatch.setattr(spin, "_clock", clock.perf_counter)
    monkeypatch.setattr(spin, "_yield_core", clock.sched_yield)
    monkeypatch.setattr(spin, "_core_losses", spin.CoreLosses())
    return clock


def test_yields_that_keep_losing_the_core_to_background_work_make_waits_sleep_for_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = _fake_clock(monkeypatch, yield_s=2 * spin.STOLEN_YIELD_S)  # a background task kept the core
    attempts = []
    assert spin.try_for(lambda: attempts.append(1), 1.0) is None  # gave up once losses came in a row
    assert len(attempts) == spin.LOSSES_FOR_CALM and clock.yields == spin.LOSSES_FOR_CALM
    # Calm: the next waits sleep at once (their wake-up preempts the background task) ...
    clock.now += spin.CALM_S / 2
    assert spin.try_for(lambda: pytest.fail("no spinning while calm"), 1.0) is None
    # ... and once the spell is over, waits spin again.
    clock.now += spin.CALM_S
    clock.yield_s = 1e-6
    answers = iter([None, None, "reply"])
    assert spin.try_for(lambda: next(answers), 1.0) == "reply"


def test_a_lone_lost_yield_is_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _fake_clock(monkeypatch, yield_s=2 * spin.STOLEN_YIELD_S)
    for _ in range(5):  # one loss now and then (the hypervisor, a kernel thread), far apart
        answers = iter([None, "reply"])
        assert spin.try_for(lambda answers=answers: next(answers), 1.0) == "reply"
        clock.now += 2 * spin.LOSS_WINDOW_S
    assert clock.yields == 5 and spin._core_losses.calm_until == 0.0


def test_short_yields_keep_a_wait_spinning(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _fake_clock(monkeypatch, yield_s=spin.STOLEN_YIELD_S / 4)  # a peer's worker ran briefly
    answers = iter([None] * 50 + ["reply"])
    assert spin.try_for(lambda: next(answers), 1.0) == "reply"
    assert clock.yields == 50 and spin._core_losses.calm_until == 0.0


def test_losses_that_keep_coming_lengthen_the_spell_and_a_lone_one_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _fake_clock(monkeypatch, yield_s=2 * spin.STOLEN_YIELD_S)
    spells = []
    for _ in range(8):  # background work that lasts: the core is lost again right after each spell
        assert spin.try_for(lambda: None, 10.0) is None
        spells.append(spin._core_losses.calm_until - clock.now)
        clock.now = spin._core_losses.calm_until
    assert spells[0] == pytest.approx(spin.CALM_S)
    assert spells[1] == pytest.approx(2 * spin.CALM_S)
    assert spells[-1] == pytest.approx(spin.LONGEST_CALM_S)
    clock.now += 60.0  # losses long after: the shortest spell again
    assert spin.try_for(lambda: None, 10.0) is None
    assert spin._core_losses.calm_until - clock.now == pytest.approx(spin.CALM_S)
