"""The executor as a service: an executor process, client processes, every ZeroMQ transport.
Each remote client matches its monolithic reference; a restarted executor is invisible to a
training run."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

import symbiosis
from symbiosis.executor.process import ExecutorProcess
from tests.reference import close_client, make_pair
from tests.service_helpers import compare_client, loopback_address, start_executor, stop


@pytest.mark.slow
@pytest.mark.parametrize("all_bulk", [False, True], ids=["as-sent", "all-bulk"])
def test_client_processes_match_monolithic(tiny_checkpoint, tmp_path, all_bulk):
    """One executor process listening on tcp and ipc; a client process per transport. ``all-bulk``:
    ``--decode-share-rows 0`` makes every request bulk work, so every product runs on the
    server's background bulk threads (its default lane; one per core, side by side) -- exact over
    every transport there too."""
    path = tiny_checkpoint("qwen2")
    tcp, ipc = loopback_address("tcp", tmp_path), loopback_address("ipc", tmp_path)
    extra = ["--decode-share-rows", "0"] if all_bulk else []
    executor = ExecutorProcess(path, [tcp, ipc], extra_args=extra, metrics=True)
    clients_by_method = {"lora": tcp, "ia3": ipc, "prefix": f"shm+{ipc}", "loha": f"dist+{tcp}"}
    try:
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        together = ctx.Barrier(len(clients_by_method))  # all connected while any computes: none alone
        clients = [
            ctx.Process(target=compare_client, args=(str(path), address, method, "qwen2", results, together))
            for method, address in clients_by_method.items()
        ]
        for c in clients:
            c.start()
        outcomes = [results.get(timeout=180) for _ in clients]
        for c in clients:
            c.join(timeout=30)
        ran_by = executor.stats()["batches_run_by"]
    finally:
        stop(executor)
    assert {o[0] for o in outcomes} == set(clients_by_method)
    for method, ok, error in outcomes:
        assert ok and isinstance(error, float) and error < 1e-4, (method, clients_by_method[method], error)
    if all_bulk:  # every client computes while all four are connected: never alone, all bulk thread's
        assert ran_by["bulk_thread"] > 0 and ran_by["driver"] == 0 and ran_by["alone"] == 0, ran_by


def _train(model, steps, on_step=None):
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    g = torch.Generator().manual_seed(5)
    for step in range(steps):
        ids = torch.randint(3, 300, (2, 8), generator=g)
        if on_step:
            on_step(step)
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.slow
def test_training_survives_an_executor_restart(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama")
    with symbiosis.BaseExecutor.from_pretrained(path) as local:
        _, uninterrupted_model = make_pair(path, local, "lora", "llama")
        uninterrupted = _train(uninterrupted_model, steps=6)
        close_client(uninterrupted_model)

    address = loopback_address("tcp", tmp_path)
    executors = [start_executor(path, address)]
    restarted = threading.Event()
    restarted_at: list[float] = []

    def kill_and_restart():
        os.kill(executors[0].pid, signal.SIGKILL)  # mid-step: requests are in flight
        executors[0].wait()
        executors.append(start_executor(path, address))
        restarted_at.append(time.monotonic())
        restarted.set()

    def on_step(step):
        if step == 3:  # five calls into the next step, whatever the speed: never after the last one
            armed.append(5)

    armed: list[int] = []

    try:
        _, remote = make_pair(path, address, "lora", "llama")
        transport = remote.get_base_model().symbiosis_transport
        transport.connect_timeout_s = 60.0
        real_call = transport.call

        def call(*args, **kwargs):
            if armed:
                armed[0] -= 1
                if armed[0] == 0:
                    armed.clear()
                    threading.Thread(target=kill_and_restart).start()  # races this call: in flight or refused
            return real_call(*args, **kwargs)

        transport.call = call
        resumed = _train(remote, steps=6, on_step=on_step)
        finished_at = time.monotonic()
        close_client(remote)
        assert restarted.wait(timeout=60)
        assert restarted_at[0] < finished_at, "training ended before the executor came back: nothing was retried"
    finally:
        for e in executors:
            stop(e)
    # Close, not equal: the resumed run's base products come from another process (rows decoded at
    # another alignment, so MKL may sum in another order: ulp-level differences), and six SGD steps
    # carry them along; a lost, doubled or stale step moves the adapters by a whole update,
    # lr·|grad| ≈ 4e-4 (median), 400 times atol.
    for name, value in uninterrupted.items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_serve_drains_and_exits_cleanly_on_sigterm(tiny_checkpoint, tmp_path):
    executor = start_executor(tiny_checkpoint("llama"), loopback_address("ipc", tmp_path))
    ready_file = executor.ready_file
    assert ready_file.exists()
    executor.signal(signal.SIGTERM)
    assert executor.wait(timeout_s=60) == 0
    assert "stopped" in executor.output()
    assert not ready_file.exists(), "a stopped executor must not leave a ready file that says it serves"


@pytest.mark.slow
def test_serve_refuses_a_public_bind_without_consent(tiny_checkpoint):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "symbiosis", "serve", str(tiny_checkpoint("llama")), "--bind", "tcp://0.0.0.0:0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "loopback" in (result.stdout + result.stderr).lower()
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_hostile_peer_cannot_disturb_a_real_executor(tiny_checkpoint, tmp_path):
    """Garbage, a pickle, a wrong shape, an unknown layer and a huge declared tensor, sent to a
    real `symbiosis serve` process while a good client decodes: typed errors for the peer, exact
    results for the client, and the executor keeps serving."""
    import pickle

    from symbiosis import protocol as P
    from tests.transport.test_conformance import RawPeer, request

    path = tiny_checkpoint("llama")
    address = loopback_address("tcp", tmp_path)
    executor = start_executor(path, address)
    try:
        reference = AutoModelForCausalLM.from_pretrained(path)
        client = symbiosis.load_client_model(path, executor=address)
        ids = torch.tensor([[5, 6, 7, 8, 9]])
        with torch.no_grad():
            expected = reference(ids).logits
        done, outcomes = threading.Event(), []

        def decode_loop():
            while not done.is_set():
                with torch.no_grad():
                    outcomes.append(torch.allclose(client(ids).logits, expected, rtol=1e-4, atol=1e-5))

        worker = threading.Thread(target=decode_loop)
        worker.start()
        raw = RawPeer(address)
        try:
            raw.hello()
            q = "model.layers.0.self_attn.q_proj"
            cases = [
                ([b"\xc1 garbage"], ("protocol",)),
                ([pickle.dumps({"evil": os.system})], ("protocol",)),
                ([request(3, q, [2, 63]), bytes(2 * 63 * 4)], ("shape",)),
                ([request(4, "model.no_such_layer", [2, 64]), bytes(2 * 64 * 4)], ("unknown_layer",)),
                ([request(5, q, [10**12, 64]), bytes(64)], ("protocol", "shape")),
                ([request(6, q, [2, 64]), pickle.dumps(torch.randn(2, 64))], ("shape",)),
            ]
            for frames, codes in cases:
                raw.send(*frames)
                reply, _ = raw.recv()
                assert isinstance(reply, P.Reply) and not reply.ok and reply.error_code in codes, reply
        finally:
            raw.close()
            time.sleep(0.3)
            done.set()
            worker.join(timeout=60)
        assert outcomes and all(outcomes)
        with torch.no_grad():  # still serving after the peer left
            torch.testing.assert_close(client(ids).logits, expected, rtol=1e-4, atol=1e-5)
        client.symbiosis_transport.close()
    finally:
        stop(executor)
