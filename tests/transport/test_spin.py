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


def test_try_for_returns_the_first_result_and_gives_up_after_its_budget() -> None:
    answers = iter([None, None, 7])
    assert spin.try_for(lambda: next(answers), 1.0) == 7

    calls = []
    started = time.perf_counter()
    assert spin.try_for(lambda: calls.append(1), 0.002) is None
    assert len(calls) >= 1 and time.perf_counter() - started < 0.5

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
