"""``symbiosis api`` with its engine in a process of its own (``ApiOptions.engine_process``, the
command line's default): the same answers as the in-process engine, through the official
``openai`` client, and the boundary's own duties (cancellation, errors, a lost engine process)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from symbiosis.errors import ConfigurationError, ExecutorUnavailableError, MissingFileError, SymbiosisError
from symbiosis.serving.adapters import AdapterPoolFullError, UnknownAdapterError
from symbiosis.serving.engine import GenerationRequest, RequestTooLargeError, ServerOverloadedError
from symbiosis.serving.engine_process import _error_of, _raise
from symbiosis.serving.sampling import SamplingParams
from tests.serving.conftest import make_lora_adapter
from tests.serving.test_api import (
    MAX_TOKENS,
    PROMPTS,
    check_concurrent_greedy,
    check_echo,
    check_logprobs,
    check_penalties,
    get,
    greedy_tokens,
    openai_client,
    post,
)
from tests.serving.test_api import start_server as start_api_server


def start_server(model, **options):
    return start_api_server(model, engine_process=True, **options)


@pytest.fixture(scope="module")
def server(api_model, lora_adapters):
    server = start_server(api_model, adapters=lora_adapters, max_loaded_adapters=3, allow_adapter_updates=True)
    yield server
    server.close()


def test_the_engine_runs_in_another_process(server):
    assert server.model is None and server.engine._process.poll() is None


def test_concurrent_greedy_completions_equal_monolithic_peft(server, lora_adapters, reference):
    check_concurrent_greedy(server, lora_adapters, reference)
    assert server.pool.loaded_count <= 3


def test_logprobs_echo_and_penalties_cross_the_process_boundary(server, lora_adapters, reference):
    check_logprobs(server, lora_adapters, reference)
    check_echo(server, lora_adapters, reference)
    check_penalties(server, lora_adapters, reference)


def test_streaming_chat_models_and_errors(server, lora_adapters):
    client = openai_client(server)
    whole = client.completions.create(model="attn8", prompt=PROMPTS[1], max_tokens=20, temperature=0)
    chunks = list(
        client.completions.create(model="attn8", prompt=PROMPTS[1], max_tokens=20, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    chat = client.chat.completions.create(model="qv4", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert chat.usage.completion_tokens <= 5
    assert {m.id for m in client.models.list().data} == {server.served_model_name, *lora_adapters}
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-adapter", prompt="x")
    assert missing.value.body["code"] == "model_not_found"


def test_metrics_come_from_the_engine_process(server):
    greedy_tokens(openai_client(server), "qv4", "metrics", 3)
    status, text = get(server.url + "/metrics")
    generated = [line for line in text.splitlines() if line.startswith("symbiosis:generation_tokens_total")]
    assert status == 200 and generated and float(generated[0].split()[-1]) >= 3
    status, body = get(server.url + "/health")
    assert status == 200 and json.loads(body)["status"] == "ok" and json.loads(body)["steps"] > 0


def test_a_cancelled_sequence_is_freed_in_the_engine_process(server):
    def aborted() -> float:
        lines = get(server.url + "/metrics")[1].splitlines()
        found = [line for line in lines if line.startswith('symbiosis:request_success_total{finished_reason="abort"}')]
        return float(found[0].split()[-1]) if found else 0.0

    before = aborted()
    events = []
    params = SamplingParams(max_tokens=250, temperature=0.0, ignore_eos=True)
    handle = server.engine.submit(GenerationRequest([1], None, params, events.append))
    handle.cancel()  # long before 250 steps: the child reads commands in order
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = server.engine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0 and aborted() == before + 1:
            break
        time.sleep(0.05)
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_cache_bytes"] == 0
    assert aborted() == before + 1
    assert len(events) < 250 and not any(getattr(e, "finish_reason", None) for e in events)


def test_adapters_load_replace_and_unload_in_the_engine_process(server, api_model, tmp_path, reference):
    client = openai_client(server)
    first = make_lora_adapter(api_model, tmp_path / "v1", 4, 8, ["q_proj", "v_proj"], seed=31)
    second = make_lora_adapter(api_model, tmp_path / "v2", 8, 8, ["up_proj"], seed=32)
    load = server.url + "/v1/load_lora_adapter"
    assert post(load, {"lora_name": "live", "lora_path": str(first)})[0] == 200
    assert greedy_tokens(client, "live", PROMPTS[0]) == reference.tokens(PROMPTS[0], first, MAX_TOKENS)
    assert post(load, {"lora_name": "live", "lora_path": str(second)})[0] == 200
    assert greedy_tokens(client, "live", PROMPTS[0]) == reference.tokens(PROMPTS[0], second, MAX_TOKENS)
    status, body = post(load, {"lora_name": "live", "lora_path": str(tmp_path)})
    assert status == 400 and json.loads(body)["error"]["param"] == "lora_path"
    assert post(server.url + "/v1/unload_lora_adapter", {"lora_name": "live"})[0] == 200
    assert post(server.url + "/v1/unload_lora_adapter", {"lora_name": "live"})[0] == 404
    with pytest.raises(openai.NotFoundError):
        greedy_tokens(client, "live", PROMPTS[0])


@pytest.mark.parametrize(
    "error",
    [
        UnknownAdapterError("gone"),
        ServerOverloadedError("full"),
        RequestTooLargeError("big"),
        ConfigurationError("bad name"),
        ExecutorUnavailableError("down"),
        AdapterPoolFullError("all in use"),
        ValueError("bad value"),
    ],
)
def test_errors_cross_the_boundary_as_their_own_type(error):
    with pytest.raises(type(error), match=str(error)) as raised:
        _raise(_error_of(error))
    assert type(raised.value) is type(error)


def test_other_errors_cross_as_their_nearest_known_kind():
    with pytest.raises(SymbiosisError, match="nope") as raised:  # a SymbiosisError not registered
        _raise(_error_of(MissingFileError("nope")))
    assert type(raised.value) is SymbiosisError
    with pytest.raises(RuntimeError, match="'k'"):  # a bug there is a 500 here, not a 400
        _raise(_error_of(KeyError("k")))


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["ipc", "shm+ipc"])
def test_an_engine_process_on_a_remote_executor_serves_the_same_tokens(
    api_model, lora_adapters, reference, tmp_path, scheme
):
    from symbiosis.jobs.client import ClientOptions
    from tests.service_helpers import start_executor, stop

    address = f"ipc://{tmp_path}/executor.sock"
    executor = start_executor(api_model, address)
    try:
        target = address if scheme == "ipc" else f"shm+{address}"
        server = start_api_server(
            api_model, ClientOptions(executor=target), adapters=lora_adapters, engine_process=True
        )
        try:
            check_concurrent_greedy(server, lora_adapters, reference)
        finally:
            server.close()
    finally:
        stop(executor)


@pytest.mark.slow
def test_a_lost_engine_process_answers_503_and_closes_cleanly(api_model):
    server = start_server(api_model)
    try:
        assert len(greedy_tokens(openai_client(server), server.served_model_name, "hi", 3)) == 3
        server.engine._process.kill()
        server.engine._process.wait()
        deadline = time.monotonic() + 10
        while server.engine._dead is None and time.monotonic() < deadline:
            time.sleep(0.05)
        status, body = get(server.url + "/health")
        assert status == 503 and "executor" in json.loads(body)["reason"]
        with pytest.raises(openai.InternalServerError) as down:
            greedy_tokens(openai_client(server), server.served_model_name, "hi", 3)
        assert down.value.status_code == 503
        with pytest.raises(ExecutorUnavailableError):
            server.engine.stats()
    finally:
        server.close()
    assert server.engine._process.returncode is not None


@pytest.mark.slow
def test_a_stopping_engine_process_ends_its_streams_before_it_tears_down(api_model):
    # The child ends what is in flight with a 503 and says so before it closes its executor and
    # exits (seconds on a loaded host): the streams end then. Before, the parent delivered its
    # own 503s only once the child had exited (~2 s here, past uvicorn's grace under load).
    from symbiosis.serving.engine import Failure

    server = start_server(api_model)
    engine = server.engine
    events: list = []
    delivered_when_stopping: list[bool] = []
    stop_process = engine._stop_process

    def stop_process_noting_what_was_delivered(*args, **kwargs):
        delivered_when_stopping.append(any(isinstance(e, Failure) for e in events))
        stop_process(*args, **kwargs)

    engine._stop_process = stop_process_noting_what_was_delivered
    try:
        params = SamplingParams(max_tokens=250, temperature=0.0, ignore_eos=True)
        first = threading.Event()  # closed as the first token comes: a faster host still has most to run
        engine.submit(GenerationRequest([1], None, params, lambda event: (events.append(event), first.set())))
        assert first.wait(30) and not isinstance(events[0], Failure)
    finally:
        server.close()
    assert delivered_when_stopping == [True]
    assert [e.message for e in events if isinstance(e, Failure)] == ["the server is shutting down"]
    assert engine._process.returncode == 0


@pytest.mark.slow
def test_a_stopped_message_the_server_did_not_ask_for_does_not_blind_it_to_a_lost_engine(api_model):
    # "stopped" ends the receiver only while the server closes; else (the child's loop ended on its
    # own) the receiver goes on, so that the engine process's exit is still seen and answered.
    import msgspec
    import zmq

    server = start_server(api_model)
    try:
        context = zmq.Context()
        intruder = context.socket(zmq.PUSH)
        intruder.connect(f"ipc://{server.engine._folder}/events")
        intruder.send(msgspec.msgpack.encode({"op": "stopped"}))
        intruder.close(linger=1000)
        context.term()
        assert len(greedy_tokens(openai_client(server), server.served_model_name, "hi", 3)) == 3  # still served
        server.engine._process.kill()
        server.engine._process.wait()
        deadline = time.monotonic() + 10
        while server.engine._dead is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.engine._dead is not None and "exited" in server.engine._dead
    finally:
        server.close()


@pytest.mark.slow
def test_a_bad_option_fails_at_start_with_the_childs_error(api_model, tmp_path):
    with pytest.raises(UnknownAdapterError, match="is not a folder"):
        start_server(api_model, adapter_dir=tmp_path / "missing")


def test_many_concurrent_streams_all_finish(server):
    client = openai_client(server)

    def stream(i: int) -> str:
        chunks = client.completions.create(model="od2", prompt=f"n{i}", max_tokens=6, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with ThreadPoolExecutor(24) as pool:
        texts = list(pool.map(stream, range(24)))
    assert len(texts) == 24
    assert server.engine.stats()["running"] == 0


@pytest.mark.slow
def test_an_unreadable_message_from_the_engine_side_fails_requests_with_503_not_a_hang(api_model):
    import zmq

    server = start_server(api_model)
    try:
        folder = server.engine._folder
        context = zmq.Context()
        intruder = context.socket(zmq.PUSH)
        intruder.connect(f"ipc://{folder}/events")
        intruder.send(b"\xc1 not msgpack")  # 0xc1 is never valid msgpack
        deadline = time.monotonic() + 10
        while server.engine._dead is None and time.monotonic() < deadline:
            time.sleep(0.05)
        intruder.close(linger=0)
        context.term()
        assert server.engine._dead is not None
        with pytest.raises(openai.InternalServerError) as down:
            greedy_tokens(openai_client(server), server.served_model_name, "hi", 3)
        assert down.value.status_code == 503
    finally:
        server.close()
    assert server.engine._process.returncode is not None


def _engine_processes_of(parent_pid: int) -> list[int]:
    """Engine processes started by ``parent_pid`` (the last argument of their command line) still alive."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        except OSError:
            continue
        if b"symbiosis.serving.engine_process" in argv and argv[-1] == str(parent_pid).encode():
            found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc")
def test_a_refused_start_leaves_no_engine_process_behind(api_model, tmp_path):
    """``symbiosis api`` starts its engine process first thing (engine_spawn.py), before it has
    read its options: a start refused after that stops the process it started."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "symbiosis", "api", "--model", str(api_model), "--embedded"]
    log = tmp_path / "api.log"  # a file, not a pipe: the engine process would hold a pipe open
    with log.open("w") as output:
        process = subprocess.Popen(
            [*command, "--host", "0.0.0.0", "--port", "0"], stdout=output, stderr=subprocess.STDOUT
        )
        process.wait(timeout=120)
    assert process.returncode == 2 and "--allow-non-loopback" in log.read_text(), log.read_text()
    assert _engine_processes_of(process.pid) == []


def test_an_engine_process_started_earlier_is_adopted_only_by_an_engine_process_server(api_model):
    """``ApiServer(spawned_engine=...)`` without an engine process of its own is refused before it
    builds anything (the caller, who started it, discards it), rather than left running."""
    from symbiosis.jobs.client import ClientOptions
    from symbiosis.serving.server import ApiConfigError, ApiOptions, ApiServer

    options = ApiOptions(model=api_model, client=ClientOptions(embedded=True), port=0, engine_process=False)
    with pytest.raises(ApiConfigError, match="spawned_engine is for an engine process"):
        ApiServer(options, spawned_engine=object())
