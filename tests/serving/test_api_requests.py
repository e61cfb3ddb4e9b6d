"""What a request gets from the OpenAI-compatible server beyond its tokens: cancellation when its
client goes away, usage, admission (429 and 400 by sequences), refused fields and bad bodies.

Most tests run twice, with the engine on a thread of the server's process and in a process of its
own (``engine_process``): admission and cancellation cross that boundary.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from symbiosis.serving.server import ApiServer
from tests.serving.test_api import _slow_steps, get, openai_client, post, start_server

MAX_CONCURRENT = 32  # --max-concurrent-requests of the servers here
BATCH = 8  # --max-batch-size: a quarter of them run, the others wait


@pytest.fixture(scope="module", params=[False, True], ids=["engine-thread", "engine-process"])
def server(request, api_model):
    server = start_server(
        api_model, engine_process=request.param, max_concurrent_requests=MAX_CONCURRENT, max_batch_size=BATCH
    )
    yield server
    server.close()


def metric(server: ApiServer, line_start: str) -> float:
    """The sum of the /metrics samples whose line starts with ``line_start``."""
    lines = get(server.url + "/metrics")[1].splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(line_start))


ABORTED = 'symbiosis:request_success_total{finished_reason="abort"}'
GENERATED = "symbiosis:generation_tokens_total"


def wait_idle(server: ApiServer, timeout_s: float = 30.0) -> dict:
    """The engine's stats once nothing runs or waits (or at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = server.engine.stats()
        if stats["running"] + stats["waiting"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


# ---- a client that goes away -------------------------------------------------------------------------


def test_a_non_streamed_request_is_cancelled_soon_after_its_client_goes_away(server, monkeypatch):
    """A non-streamed request's client goes away once its first batch runs: its sequences end
    within a step or so. (Before, the disconnect was looked for only after half a second without an
    event; while tokens flowed it never was, so all its sequences ran their 240 tokens for nobody.)
    Four batches' worth of sequences, and the client leaves as the engine starts them, not after a
    set time: a host many times faster than this one still has most of the work left to cancel."""
    if not server.in_engine_process:
        _slow_steps(server, monkeypatch, 0.02)  # the engine process's own pace is like it
    wait_idle(server)
    aborted, generated = metric(server, ABORTED), metric(server, GENERATED)
    prompts, n = ["Once upon a time", "Far away"], MAX_CONCURRENT // 2  # n is at most 16
    sequences = len(prompts) * n
    body = {
        "model": server.served_model_name,
        "prompt": prompts,
        "max_tokens": 240,
        "n": n,
        "temperature": 1,
        "ignore_eos": True,
    }
    address = urllib.parse.urlsplit(server.url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    deadline = time.monotonic() + 30
    while not server.engine.stats()["running"]:
        assert time.monotonic() < deadline, server.engine.stats()
        time.sleep(0.002)
    connection.close()  # without reading the answer: the client is gone
    gone_at = time.monotonic()
    stats = wait_idle(server, timeout_s=3.0)
    assert stats["running"] + stats["waiting"] == 0, f"still {stats} {time.monotonic() - gone_at:.1f} s after"
    deadline = time.monotonic() + 5  # the engine process's metrics come with its next message
    while metric(server, ABORTED) < aborted + sequences and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, ABORTED) == aborted + sequences
    assert metric(server, GENERATED) - generated < sequences * 240 / 2


def test_a_waiting_request_leaves_the_queue_as_its_client_goes_away(api_model, monkeypatch):
    """A request waiting for the batch has no events flowing; its client times out and the server
    drops it as the disconnect comes. (Before, it looked every 0.25 s from the request's start, so
    a client that left at 0.3 s was heard at 0.5 s.)"""
    server = start_server(api_model, max_batch_size=1)
    try:
        _slow_steps(server, monkeypatch, 0.02)
        busy = openai_client(server).completions.create(
            model=server.served_model_name, prompt="go on", max_tokens=240, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(busy))
        impatient = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=0.3)
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(model=server.served_model_name, prompt="wait", max_tokens=2)
        gone_at = time.monotonic()
        while server.engine.stats()["waiting"] and time.monotonic() < gone_at + 5:
            time.sleep(0.005)
        heard_s = time.monotonic() - gone_at
        assert server.engine.stats()["waiting"] == 0 and server.engine.stats()["running"] == 1
        assert heard_s < 0.15, f"the waiting request left the queue {heard_s:.3f} s after its client"
        busy.close()
    finally:
        server.close()


# ---- usage ------------------------------------------------------------------------------------------


def test_a_streams_usage_counts_each_prompts_tokens_once_as_a_whole_answer_does(server):
    """The ``n`` choices of a prompt share its tokens: ``usage.prompt_tokens`` counts them once a
    prompt (OpenAI's and vLLM's rule), streamed or not. (Before, a stream counted them once a
    choice: 33 prompt tokens for an 11-token prompt with n=3.)"""
    client, model = openai_client(server), server.served_model_name
    greedy = {"model": model, "max_tokens": 3, "temperature": 0, "extra_body": {"ignore_eos": True}}
    include_usage = {"stream": True, "stream_options": {"include_usage": True}}
    prompt_tokens = {
        text: json.loads(post(server.url + "/tokenize", {"model": model, "prompt": text})[1])["count"]
        for text in ("Once upon a time", "hi")
    }
    for prompt, n in [("Once upon a time", 3), (["Once upon a time", "hi"], 2)]:
        whole = client.completions.create(prompt=prompt, n=n, **greedy).usage
        streamed = list(client.completions.create(prompt=prompt, n=n, **greedy, **include_usage))[-1].usage
        texts = [prompt] if isinstance(prompt, str) else prompt
        assert whole.prompt_tokens == sum(prompt_tokens[text] for text in texts)
        assert whole.completion_tokens == len(texts) * n * 3
        assert streamed.model_dump() == whole.model_dump()
    messages = [{"role": "user", "content": "Once upon a time"}]
    whole = client.chat.completions.create(messages=messages, n=3, **greedy).usage
    streamed = list(client.chat.completions.create(messages=messages, n=3, **greedy, **include_usage))[-1].usage
    counted = json.loads(post(server.url + "/tokenize", {"model": model, "messages": messages})[1])["count"]
    assert whole.prompt_tokens == counted and whole.completion_tokens == 9
    assert streamed.model_dump() == whole.model_dump()


# ---- admission ------------------------------------------------------------------------------------


def test_admission_counts_the_sequences_running_and_waiting_against_max_concurrent_requests(server):
    """``--max-concurrent-requests`` bounds the sequences running or waiting: a request whose
    sequences (prompts x n) fit beside them is taken, whole, however many wait for the batch; one
    that does not fit now gets 429 and queues nothing; one that can never fit gets 400 on ``n``.
    (Before, the check was "waiting < max-concurrent - max-batch" per choice, as each was queued:
    a request of 32 sequences on an idle server of 32, batch 8, got 429 "24 requests are already waiting".)"""
    client, model = openai_client(server), server.served_model_name
    half = MAX_CONCURRENT // 2
    wait_idle(server)
    whole = client.completions.create(model=model, prompt=["x", "y"], max_tokens=2, n=half, temperature=0)
    assert len(whole.choices) == MAX_CONCURRENT
    with ThreadPoolExecutor(2) as pool:  # two requests of half the limit each, at once
        halves = [pool.submit(client.completions.create, model=model, prompt=p, max_tokens=2, n=half) for p in "ab"]
        assert [len(request.result(timeout=60).choices) for request in halves] == [half, half]

    for prompts, n in [(["x", "y", "z"], 11), (["w", "x", "y", "z"], 16)]:  # more sequences than ever fit
        with pytest.raises(openai.BadRequestError) as never:
            client.completions.create(model=model, prompt=prompts, max_tokens=2, n=n)
        assert never.value.body["param"] == "n" and f"at most {MAX_CONCURRENT}" in never.value.body["message"]

    # A batch running: a request of more than the rest is refused whole (429, nothing of it
    # queued); one of the rest is taken, and waits for the batch.
    busy = client.completions.create(
        model=model, prompt="go on", max_tokens=200, n=BATCH, stream=True, extra_body={"ignore_eos": True}
    )
    try:
        next(iter(busy))
        rest, three = MAX_CONCURRENT - BATCH, ["x", "y", "z"]
        with pytest.raises(openai.RateLimitError) as full:
            client.completions.create(model=model, prompt=three, max_tokens=2, n=rest // 3 + 1)
        assert full.value.response.headers["retry-after"] == "1"
        assert full.value.body["type"] == "rate_limit_error"
        stats = server.engine.stats()
        assert stats["running"] + stats["waiting"] == BATCH, stats
        with ThreadPoolExecutor(1) as pool:
            fits = pool.submit(client.completions.create, model=model, prompt=three, max_tokens=2, n=rest // 3)
            deadline = time.monotonic() + 30
            while sum(map(server.engine.stats().get, ("running", "waiting"))) < MAX_CONCURRENT:
                assert time.monotonic() < deadline, server.engine.stats()
                time.sleep(0.02)
            busy.close()  # the batch frees: the waiting request runs
            assert len(fits.result(timeout=60).choices) == rest
    finally:
        busy.close()
    assert wait_idle(server)["running"] == 0


def test_a_request_refused_whole_in_the_engine_process_sends_it_no_cancels(server, monkeypatch):
    """A request the engine process refuses (400 on ``n`` here) queued nothing there: the parent
    sent it a cancel for every one of the request's sequences all the same."""
    if not server.in_engine_process:
        pytest.skip("the engine runs in the server's process")
    sent = []
    send = server.engine._send
    monkeypatch.setattr(server.engine, "_send", lambda message: (sent.append(message.get("op")), send(message))[1])
    with pytest.raises(openai.BadRequestError):
        openai_client(server).completions.create(
            model=server.served_model_name, prompt=["x", "y", "z"], max_tokens=2, n=16
        )  # 48 sequences where 32 fit: refused there, whole (``TooManySequencesError``)
    assert sent == ["submit"], sent


def test_the_engine_process_gets_each_prompt_once_whatever_n(server, monkeypatch):
    """The ``n`` choices of a prompt share its tokens: the submit carried them once a choice. Each
    choice still answers its own prompt: greedy, as the prompt asked alone does."""
    if not server.in_engine_process:
        pytest.skip("the engine runs in the server's process")
    client, texts = openai_client(server), ["Once upon a time", "hi"]
    alone = [
        client.completions.create(model=server.served_model_name, prompt=text, max_tokens=4, temperature=0)
        .choices[0]
        .text
        for text in texts
    ]
    submits = []
    send = server.engine._send
    monkeypatch.setattr(
        server.engine,
        "_send",
        lambda message: (submits.append(message) if message.get("op") == "submit" else None, send(message))[1],
    )
    whole = client.completions.create(model=server.served_model_name, prompt=texts, max_tokens=4, n=3, temperature=0)
    assert [choice.text for choice in sorted(whole.choices, key=lambda c: c.index)] == [alone[0]] * 3 + [alone[1]] * 3
    (submit,) = submits
    assert len(submit["prompts"]) == 2 and [s["prompt"] for s in submit["sequences"]] == [0, 0, 0, 1, 1, 1]
    assert [len(p) for p in submit["prompts"]] == [len(server.tokenizer(t).input_ids) for t in texts]


# ---- refused and accepted fields ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "field",
    [
        {"guided_json": {"type": "object"}},
        {"guided_choice": ["yes", "no"]},
        {"guided_regex": "a+"},
        {"guided_grammar": "root ::= 'a'"},
        {"structured_outputs": {"choice": ["yes", "no"]}},
        {"use_beam_search": True},
        {"prompt_logprobs": 1},
        {"allowed_token_ids": [5, 6]},
        {"skip_special_tokens": False},
        {"add_special_tokens": False},
    ],
    ids=lambda field: next(iter(field)),
)
def test_vllm_fields_that_would_change_the_output_are_refused_by_name(server, field):
    """A field of vLLM's the server does not implement gets a 400 naming it, never a 200 with
    output that ignored it (before: 200 and unconstrained text for each of these)."""
    (name,) = field
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client(server).completions.create(
            model=server.served_model_name, prompt="x", max_tokens=2, extra_body=field
        )
    assert refused.value.body["param"] == name and refused.value.body["message"].startswith(f"{name}: ")


def test_chat_refuses_vllms_chat_extras_and_both_take_fields_that_change_nothing(server):
    client, model = openai_client(server), server.served_model_name
    messages = [{"role": "user", "content": "hi"}]
    for field in ({"echo": True}, {"guided_choice": ["a"]}, {"chat_template_kwargs": {"enable_thinking": False}}):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=model, messages=messages, max_tokens=2, extra_body=field)
        assert refused.value.body["param"] == next(iter(field))
    # OpenAI's fields that change nothing generated, and vLLM's extras at their "off" values.
    harmless = {"user": "u-1", "metadata": {"team": "a"}, "store": False, "service_tier": "auto"}
    off = {"use_beam_search": False, "guided_json": None, "skip_special_tokens": True, "length_penalty": 1.0}
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=2, **harmless, extra_body={**off, "echo": False}
    )
    assert chat.usage.completion_tokens <= 2
    completion = client.completions.create(
        model=model, prompt="x", max_tokens=2, user="u-1", extra_body={**off, "bad_words": []}
    )
    assert completion.usage.completion_tokens <= 2


def test_include_stop_str_in_output_keeps_the_stop_string(server):
    """vLLM's ``include_stop_str_in_output``: the text ends with the stop string that ended it,
    streamed or not (before, the field was ignored: the stop string was cut)."""
    client, model = openai_client(server), server.served_model_name
    greedy = {"model": model, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    whole = client.completions.create(**greedy, extra_body={"ignore_eos": True}).choices[0].text
    pairs = (whole[i : i + 2] for i in range(1, len(whole) - 1))
    stop = next(pair for pair in pairs if pair.isprintable() and "\ufffd" not in pair)
    keep = {"ignore_eos": True, "include_stop_str_in_output": True}
    cut = client.completions.create(**greedy, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    kept = client.completions.create(**greedy, stop=[stop], extra_body=keep).choices[0]
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert kept.text == cut.text + stop and whole.startswith(kept.text)
    chunks = client.completions.create(**greedy, stop=[stop], stream=True, extra_body=keep)
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == kept.text


def test_a_body_that_is_not_json_is_a_400_naming_no_field(server):
    request = urllib.request.Request(
        server.url + "/v1/completions", b'{"model": "x", "prompt": ', headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as bad:
        urllib.request.urlopen(request, timeout=30)
    error = json.loads(bad.value.read())["error"]
    assert bad.value.code == 400 and error["param"] is None  # before: "param": "25"
    assert "not valid JSON" in error["message"] and "at character 25" in error["message"]


def test_error_messages_carry_no_pydantic_prefix(server):
    """A validator's message reaches the client as it is written, in OpenAI's body with its
    ``param`` (before: "Value error, max_tokens: 0 needs echo ..." and "prompt: Value error, ...")."""
    from symbiosis.serving.app import _invalid_request

    model = server.served_model_name
    no_echo = "max_tokens: 0 needs echo (a completion of no tokens echoes its prompt)"
    for fields, message, param in [
        ({"prompt": "x", "max_tokens": 0}, no_echo, None),
        ({"prompt": [], "max_tokens": 1}, "prompt: must not be an empty list or hold one", "prompt"),
        ({"prompt": "x", "stop": [""]}, "stop: up to 8 non-empty strings of at most 256 characters", "stop"),
    ]:
        status, body = post(server.url + "/v1/completions", {"model": model, **fields})
        assert status == 400 and json.loads(body)["error"] == {
            "message": message,
            "type": "invalid_request_error",
            "param": param,
            "code": None,
        }, body
    assertion = {"type": "assertion_error", "loc": ("body", "n"), "msg": "Assertion failed, n is too large"}
    assert _invalid_request(assertion).message == "n: n is too large"


def test_only_an_assistant_message_may_come_without_content(server):
    model = server.served_model_name
    for first in ({"role": "user", "content": None}, {"role": "system", "content": None}, {"role": "user"}):
        messages = [first, {"role": "user", "content": "hi"}]
        status, body = post(server.url + "/v1/chat/completions", {"model": model, "messages": messages})
        assert status == 400 and json.loads(body)["error"]["param"] == "messages.0.content", body
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None},  # an answer that called tools (OpenAI's null)
        {"role": "user", "content": "?"},
    ]
    status, body = post(server.url + "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 2})
    assert status == 200, body


# ---- the server's own address -------------------------------------------------------------------------


def test_an_ipv6_servers_url_puts_the_address_in_brackets(api_model):
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    server = start_server(api_model, host="::1")
    try:
        assert server.url.startswith("http://[::1]:")  # what `symbiosis api` prints; before, http://::1:PORT
        assert {m.id for m in openai_client(server).models.list().data} == {server.served_model_name}
    finally:
        server.close()
