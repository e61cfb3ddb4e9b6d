"""Which commands get the shared-host OpenMP setting, and that the CLI applies it before torch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from symbiosis.threads import (
    CLIENT_SPIN_COUNT,
    SHARED_HOST_POLICY,
    client_env,
    configure_for_command,
    cpu_priority_for_command,
    shares_host_with_executor,
)


@pytest.mark.parametrize(
    "argv, shared",
    [
        (["serve", "MODEL", "--bind", "ipc:///tmp/x.sock"], True),
        (["demo"], True),
        (["--debug", "demo"], True),
        (["finetune", "--executor", "ipc:///tmp/x.sock", "--model", "M"], True),
        (["generate", "--executor=tcp://127.0.0.1:7000"], True),
        (["finetune", "--embedded", "--model", "M"], False),
        (["api", "--model", "M", "--embedded", "--executor-bind", "ipc:///tmp/x.sock"], True),
        (["api", "--model", "M", "--embedded", "--executor-bind=ipc:///tmp/x.sock"], True),
        (["api", "--model", "M", "--embedded"], False),
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


@pytest.mark.parametrize(
    "argv, spin",
    [
        (["finetune", "--executor", "ipc:///tmp/x.sock", "--model", "M"], CLIENT_SPIN_COUNT),
        (["generate", "--executor=tcp://127.0.0.1:7000"], CLIENT_SPIN_COUNT),
        (["api", "--model", "M", "--executor", "ipc:///tmp/x.sock"], CLIENT_SPIN_COUNT),
        (["serve", "MODEL", "--bind", "ipc:///tmp/x.sock"], None),  # the executor sleeps at once
        (["api", "--model", "M", "--embedded", "--executor-bind", "ipc:///tmp/x.sock"], None),
        (["demo"], None),  # its executor process would inherit the spin
        (["finetune", "--embedded", "--model", "M"], None),
    ],
)
def test_clients_of_another_process_spin_briefly_and_executors_do_not(argv, spin, monkeypatch):
    for variable in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):  # set first: monkeypatch then restores what was there
        monkeypatch.setenv(variable, "")
        monkeypatch.delenv(variable)
    configure_for_command(argv)
    assert os.environ.get("GOMP_SPINCOUNT") == spin


def test_the_clients_spin_yields_to_the_users_settings():
    assert client_env({}) == {"OMP_WAIT_POLICY": SHARED_HOST_POLICY, "GOMP_SPINCOUNT": CLIENT_SPIN_COUNT}
    assert client_env({"GOMP_SPINCOUNT": "0"})["GOMP_SPINCOUNT"] == "0"
    # another wait policy is the user's whole choice: no spin count added to it
    assert client_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_the_command_line_does_not_import_torch_before_configuring():
    # libgomp reads OMP_WAIT_POLICY once, when torch loads: the CLI's own imports must not load it
    modules = "symbiosis.cli, symbiosis.cli_serve, symbiosis.cli_keys, symbiosis.threads"
    code = f"import sys, {modules}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ---- threads we start run with the process's torch thread count ------------------------------


def _openmp_threads_here():
    """``omp_get_max_threads`` of the OpenMP runtime torch loaded, read without torch (torch's
    own getter would first set the thread up, which is what is under test); None if not found."""
    import ctypes

    import torch  # noqa: F401  (loads the runtime)

    with open("/proc/self/maps") as maps:
        paths = [line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line]
    if not paths:
        return None
    return ctypes.CDLL(paths[0]).omp_get_max_threads


@pytest.fixture
def three_torch_threads():
    """The process set to 3 intra-op threads (not this 2-core host's default), restored after."""
    import torch

    getter = _openmp_threads_here()
    if getter is None:
        pytest.skip("no OpenMP runtime found in this process")
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield getter
    torch.set_num_threads(before)


def _in_a_thread(target):
    import threading

    seen = []
    thread = threading.Thread(target=lambda: seen.append(target()))
    thread.start()
    thread.join()
    return seen[0]


def test_a_thread_started_through_with_torch_threads_gets_the_starters_count(three_torch_threads):
    import threading

    from symbiosis.threads import with_torch_threads

    seen = []
    thread = threading.Thread(target=with_torch_threads(lambda: seen.append(three_torch_threads())))
    thread.start()
    thread.join()
    assert seen == [3]
    if _in_a_thread(three_torch_threads) == 3:
        pytest.skip("OpenMP's default is 3 threads here: a plain thread would pass too")


def test_the_servers_socket_thread_multiplies_with_the_processes_thread_count(
    three_torch_threads, tmp_path, monkeypatch
):
    """A lone client's products run in the server's socket thread (``ZmqServer``): with the
    process limited to some thread count, so are they (before, they ran on OpenMP's default)."""
    import torch

    from symbiosis.executor import engine
    from symbiosis.executor.executor import BaseExecutor
    from symbiosis.executor.scheduler import SchedulerConfig
    from symbiosis.executor.weights import BaseModelWeights, LayerWeights
    from symbiosis.transport.schemes import open_transport
    from symbiosis.vocabulary import LatencyClass, LayerSpec, Op

    counts = []
    real_apply_op = engine.apply_op

    def counting_apply_op(*args, **kwargs):
        counts.append(three_torch_threads())
        return real_apply_op(*args, **kwargs)

    monkeypatch.setattr(engine, "apply_op", counting_apply_op)
    spec = LayerSpec("q", 16, 16, has_bias=False)
    weights = BaseModelWeights({"q": spec}, {"q": LayerWeights(torch.randn(16, 16), None)}, "threads-test", "test")
    executor = BaseExecutor(weights, SchedulerConfig(policy="immediate"))
    try:
        address = executor.serve(f"ipc://{tmp_path}/executor.sock").address
        with open_transport(address) as transport:
            transport.call("q", Op.FORWARD, torch.randn(2, 16), LatencyClass.DECODE)
    finally:
        executor.close(drain=False)
    assert counts == [3]


# ---- CPU priority of fine-tuning jobs ---------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, priority",
    [
        (["finetune", "--executor", "ipc:///tmp/x.sock", "--model", "M"], "background"),
        (["finetune", "--executor=shm+ipc:///tmp/x.sock", "--cpu-priority", "auto"], "background"),
        (["finetune", "--executor", "ipc:///tmp/x.sock", "--cpu-priority", "normal"], "normal"),
        (["finetune", "--executor", "ipc:///tmp/x.sock", "--cpu-priority=normal"], "normal"),
        (["finetune", "--embedded", "--model", "M"], "normal"),
        (["generate", "--executor", "ipc:///tmp/x.sock"], "normal"),  # latency work
        (["generate", "--executor", "ipc:///tmp/x.sock", "--cpu-priority", "background"], "normal"),  # no such option
        (["api", "--executor", "ipc:///tmp/x.sock"], "normal"),
        (["serve", "M"], "normal"),
        (["finetune", "--executor", "ipc:///tmp/x.sock", "--cpu-priority", "bogus"], "normal"),  # typer rejects it
    ],
)
def test_fine_tuning_next_to_an_executor_runs_in_the_background(argv, priority):
    assert cpu_priority_for_command(argv) == priority


def test_configure_applies_the_background_class_to_finetune_only(background_priority_calls, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    configure_for_command(["api", "--executor", "ipc:///tmp/x.sock"])
    assert background_priority_calls == []
    configure_for_command(["finetune", "--executor", "ipc:///tmp/x.sock", "--model", "M"])
    assert background_priority_calls == ["background"]


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_the_background_class_is_the_oss_idle_class_and_threads_started_later_inherit_it():
    code = (
        "import os, threading\n"
        "from symbiosis.threads import enter_background_priority\n"
        "print(enter_background_priority())\n"
        "seen = []\n"
        "t = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0) == os.SCHED_IDLE))\n"
        "t.start(); t.join()\n"
        "print(os.sched_getscheduler(0) == os.SCHED_IDLE, seen[0])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["SCHED_IDLE", "True", "True"]


# ---- small forward passes of a client of an executor in another process ----------------------------


def _thread_recorder():
    """A module whose forward records the intra-op thread count it runs with (and can fail)."""
    import torch

    class Recorder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[int] = []

        def forward(self, input_ids=None, inputs_embeds=None, fail: bool = False):
            self.seen.append(torch.get_num_threads())
            if fail:
                raise RuntimeError("boom")
            return input_ids

    return Recorder()


def test_small_forward_passes_run_on_one_thread_and_the_count_comes_back(three_torch_threads):
    import torch

    from symbiosis.threads import one_thread_for_small_forwards

    model = _thread_recorder()
    one_thread_for_small_forwards(model, max_tokens=32)
    model(input_ids=torch.zeros(16, 1, dtype=torch.long))  # a decode step of 16 sequences
    model(torch.zeros(2, 16, dtype=torch.long))  # 32 tokens, positionally
    model(input_ids=torch.zeros(4, 16, dtype=torch.long))  # 64 tokens: a prefill keeps its threads
    model(inputs_embeds=torch.zeros(1, 8, 4))  # prompt tuning passes embeddings
    with pytest.raises(RuntimeError, match="boom"):
        model(input_ids=torch.zeros(1, 1, dtype=torch.long), fail=True)
    assert model.seen == [1, 1, 3, 1, 1]
    assert torch.get_num_threads() == 3  # restored, the failed pass included


def test_small_forward_bound_comes_from_the_environment(monkeypatch):
    from symbiosis.threads import SMALL_FORWARD_TOKENS, SMALL_FORWARD_TOKENS_VARIABLE, small_forward_tokens

    for value, expected in (("0", 0), ("128", 128), ("", SMALL_FORWARD_TOKENS), ("many", SMALL_FORWARD_TOKENS)):
        monkeypatch.setenv(SMALL_FORWARD_TOKENS_VARIABLE, value)
        assert small_forward_tokens() == expected
    monkeypatch.delenv(SMALL_FORWARD_TOKENS_VARIABLE)
    assert small_forward_tokens() == SMALL_FORWARD_TOKENS


@pytest.mark.slow  # starts an executor process (~9 s here)
def test_only_clients_of_another_process_get_it(tiny_checkpoint, tmp_path, three_torch_threads):
    """A client over ipc decodes on one thread; an in-process client keeps the process's threads."""
    import torch

    import symbiosis
    from tests.service_helpers import start_executor, stop

    path = tiny_checkpoint("llama")
    seen: dict[str, list[int]] = {}

    def record(name):
        def hook(module, args, kwargs):
            seen.setdefault(name, []).append(torch.get_num_threads())

        return hook

    executor = symbiosis.BaseExecutor.from_pretrained(path)
    process = start_executor(path, f"ipc://{tmp_path}/executor.sock")
    try:
        for name, target in (("inproc", executor), ("ipc", f"ipc://{tmp_path}/executor.sock")):
            model = symbiosis.load_client_model(path, executor=target)
            model.model.layers[0].register_forward_pre_hook(record(name), with_kwargs=True)
            with torch.no_grad():
                model(input_ids=torch.ones(4, 1, dtype=torch.long))  # decode-sized
                model(input_ids=torch.ones(4, 40, dtype=torch.long))  # prefill-sized
            model.symbiosis_transport.close()
    finally:
        stop(process)
        executor.close()
    assert seen == {"inproc": [3, 3], "ipc": [1, 3]}


def test_a_same_host_client_without_a_wait_policy_is_warned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from symbiosis import threads

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(threads, "_warned_spinning", False)
    assert not threads.warn_if_client_spins("tcp://10.1.2.3:7000")  # another machine: its cores are not ours
    assert not threads.warn_if_client_spins(None)  # in-process
    with pytest.warns(threads.SpinningClientWarning, match="OMP_WAIT_POLICY=PASSIVE"):
        assert threads.warn_if_client_spins("shm+ipc:///tmp/executor.sock")
    assert not threads.warn_if_client_spins("tcp://127.0.0.1:7000")  # once per process
    monkeypatch.setattr(threads, "_warned_spinning", False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "")  # any explicit choice, even libgomp's default, is the user's
    assert not threads.warn_if_client_spins("ipc:///tmp/executor.sock")
    monkeypatch.delenv("OMP_WAIT_POLICY")
    with pytest.warns(threads.SpinningClientWarning):
        assert threads.warn_if_client_spins("tcp://[::1]:7000")
