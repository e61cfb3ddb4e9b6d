"""The OpenAI-compatible server, driven by the official ``openai`` client, against monolithic peft.

Every greedy completion is compared token for token (``return_token_ids``) with
``transformers`` + ``peft`` generating alone from the same checkpoint and adapter.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from symbiosis.errors import ExecutorUnavailableError, SymbiosisError
from symbiosis.jobs.client import ClientOptions
from symbiosis.serving import lora as lora_module
from symbiosis.serving.logprobs import LogprobFormatter
from symbiosis.serving.server import SHUTDOWN_GRACE_S, ApiConfigError, ApiOptions, ApiServer, served_name_of
from tests.serving.conftest import make_lora_adapter

PROMPTS = ["The quick brown fox", "Hello there, my friend", "a", "Once upon a time in a land far away", "0 1 2 3"]
MAX_TOKENS = 12


def start_server(model: Path, client: ClientOptions | None = None, **options) -> ApiServer:
    server = ApiServer(ApiOptions(model=model, client=client or ClientOptions(embedded=True), port=0, **options))
    server.start()
    return server


def openai_client(server: ApiServer, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def post(url: str, body: dict, key: str | None = None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def greedy_tokens(client: openai.OpenAI, model: str, prompt: str, max_tokens: int = MAX_TOKENS) -> list[int]:
    response = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"return_token_ids": True}
    )
    return response.choices[0].token_ids


def check_concurrent_greedy(server: ApiServer, adapters: dict[str, Path], reference) -> None:
    """16+ concurrent requests over every adapter and the base: tokens equal monolithic peft's."""
    client = openai_client(server)
    models = [*adapters, server.served_model_name]
    jobs = [(model, prompt) for prompt in PROMPTS for model in models][:20]
    with ThreadPoolExecutor(len(jobs)) as pool:
        served = list(pool.map(lambda job: greedy_tokens(client, *job), jobs))
    for (model, prompt), tokens in zip(jobs, served):
        expected = reference.tokens(prompt, adapters.get(model), MAX_TOKENS)
        assert tokens == expected, f"{model} on {prompt!r}"
    assert server.engine.stats()["peak_running"] > 1, "requests were not batched together"


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties (on the tokens generated after ``prompt_len``), so
    that monolithic ``generate`` can be the reference for them (``transformers`` has no such processor)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for row in range(scores.shape[0]):
            ids, counts = torch.unique(input_ids[row, self.prompt_len :], return_counts=True)
            if len(ids):
                scores[row, ids] -= self.frequency * counts.to(scores.dtype) + self.presence
        return scores


class AddBias(LogitsProcessor):
    """OpenAI's ``logit_bias`` for the monolithic reference."""

    def __init__(self, bias: dict[int, float]) -> None:
        self.bias = bias

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for token, value in self.bias.items():
            scores[:, token] += value
        return scores


def check_penalties(server: ApiServer, adapters: dict[str, Path], reference) -> None:
    """Greedy tokens under vLLM's ``repetition_penalty`` and ``min_tokens``, and OpenAI's
    presence/frequency penalties and ``logit_bias``, asked concurrently with plain requests (each
    row of a batch keeps its own), equal monolithic ``generate`` with the same processing; and
    each changes the tokens (the test could fail)."""
    client = openai_client(server)
    prompt, max_tokens = PROMPTS[3], 24
    prompt_len = len(reference.tokenizer(prompt)["input_ids"])
    plain = reference.tokens(prompt, adapters["attn8"], max_tokens)  # the cases below name its tokens
    bias = {plain[0]: -100.0, plain[2]: 4.0}
    eos = reference.tokenizer.eos_token_id
    cases = [  # (request fields, generate() arguments)
        ({}, {}),
        ({"extra_body": {"repetition_penalty": 1.5}}, {"repetition_penalty": 1.5}),
        (
            {"presence_penalty": 0.5, "frequency_penalty": 1.5},
            {"logits_processor": LogitsProcessorList([OpenAIPenalties(prompt_len, 0.5, 1.5)])},
        ),
        (
            {"logit_bias": {str(k): v for k, v in bias.items()}},
            {"logits_processor": LogitsProcessorList([AddBias(bias)])},
        ),
        (  # plain[1] ends the sequence, but not before 4 tokens
            {"extra_body": {"stop_token_ids": [plain[1]], "min_tokens": 4}},
            {"eos_token_id": [plain[1], eos], "min_new_tokens": 4},
        ),
    ]
    jobs = [(model, case) for model in ("attn8", server.served_model_name) for case in range(len(cases))]

    def ask(job):
        model, case = job
        fields = cases[case][0]
        extra = {"return_token_ids": True, **fields.get("extra_body", {})}
        rest = {k: v for k, v in fields.items() if k != "extra_body"}
        return client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra, **rest
        ).choices[0]

    with ThreadPoolExecutor(len(jobs)) as pool:
        served = dict(zip(jobs, pool.map(ask, jobs)))
    for (model, case), choice in served.items():
        expected = reference.tokens(prompt, adapters.get(model), max_tokens, **cases[case][1])
        assert choice.token_ids == expected, f"{model}, case {case}"
        if case and model == "attn8":
            assert choice.token_ids != served[model, 0].token_ids, f"{model}: case {case} changed nothing"


def check_echo(server: ApiServer, adapters: dict[str, Path], reference) -> None:
    """``echo`` with ``logprobs``, the way evaluation harnesses score text (``max_tokens`` 0 or 1,
    concurrent, over adapters): the prompt's log-probabilities are the monolithic model's, the
    first token's null; the echoed text and the completion's tokens are those without echo."""
    client = openai_client(server)
    tokenizer = reference.tokenizer
    text_of = LogprobFormatter(tokenizer).text
    jobs = [(model, prompt) for model in ("attn8", "od2", server.served_model_name) for prompt in PROMPTS[:4]]

    def score(job):
        model, prompt = job
        return client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=2).choices[0]

    with ThreadPoolExecutor(len(jobs)) as pool:
        scored = list(pool.map(score, jobs))
    for (model, prompt), choice in zip(jobs, scored):
        prompt_ids = tokenizer(prompt)["input_ids"]
        expected = reference.prompt_logprobs(prompt_ids, adapters.get(model))
        logprobs = choice.logprobs
        assert choice.text == prompt and choice.finish_reason == "length"
        assert logprobs.tokens == [text_of(t) for t in prompt_ids]
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        chosen = expected[torch.arange(len(prompt_ids) - 1), torch.tensor(prompt_ids[1:], dtype=torch.long)]
        torch.testing.assert_close(torch.tensor(logprobs.token_logprobs[1:]), chosen, atol=1e-4, rtol=0)
        for step, alternatives in enumerate(logprobs.top_logprobs[1:]):
            values, ids = torch.topk(expected[step], 2)
            wanted = {}
            for token, value in zip(ids.tolist(), values.tolist()):
                wanted.setdefault(text_of(token), value)
            wanted.setdefault(text_of(prompt_ids[step + 1]), float(chosen[step]))  # the prompt's own token
            assert set(alternatives) == set(wanted)
            assert all(abs(alternatives[t] - wanted[t]) < 1e-4 for t in wanted)
    # lm-eval's loglikelihood requests: token ids as a list of prompts, echo, one new token; each
    # prompt's log-probabilities are the monolithic model's.
    batch = [tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    scored = client.completions.create(model="od2", prompt=batch, max_tokens=1, temperature=0, logprobs=1, echo=True)
    assert len(scored.choices) == len(batch)
    for choice, ids in zip(scored.choices, batch):
        assert choice.text.startswith(tokenizer.decode(ids))
        expected = reference.prompt_logprobs(ids, adapters["od2"])
        chosen = expected[torch.arange(len(ids) - 1), torch.tensor(ids[1:], dtype=torch.long)]
        served = torch.tensor(choice.logprobs.token_logprobs[1 : len(ids)])
        torch.testing.assert_close(served, chosen, atol=1e-4, rtol=0)
        assert len(choice.logprobs.token_logprobs) == len(ids) + 1  # and the one new token
    # The completion part of an echoed request is what the same request without echo gives.
    prompt_ids = tokenizer(PROMPTS[3])["input_ids"]
    plain = client.completions.create(model="attn8", prompt=prompt_ids, max_tokens=3, temperature=0, logprobs=1)
    echoed = client.completions.create(
        model="attn8", prompt=prompt_ids, max_tokens=3, temperature=0, logprobs=1, echo=True
    )
    assert echoed.choices[0].text == tokenizer.decode(prompt_ids) + plain.choices[0].text
    assert echoed.choices[0].logprobs.tokens == [text_of(t) for t in prompt_ids] + plain.choices[0].logprobs.tokens
    torch.testing.assert_close(
        torch.tensor(echoed.choices[0].logprobs.token_logprobs[len(prompt_ids) :]),
        torch.tensor(plain.choices[0].logprobs.token_logprobs),
        atol=1e-5,
        rtol=0,
    )
    assert echoed.usage.prompt_tokens == len(prompt_ids) and echoed.usage.completion_tokens == 3
    # Streamed, the prompt comes first, in the first chunk.
    chunks = list(
        client.completions.create(
            model="attn8", prompt=prompt_ids, max_tokens=3, temperature=0, logprobs=1, echo=True, stream=True
        )
    )
    parts = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.text for p in parts) == echoed.choices[0].text
    assert [t for p in parts if p.logprobs for t in p.logprobs.tokens] == echoed.choices[0].logprobs.tokens
    assert [o for p in parts if p.logprobs for o in p.logprobs.text_offset] == echoed.choices[0].logprobs.text_offset
    # Echo without logprobs: the text only; max_tokens 0 without echo is refused.
    bare = client.completions.create(model="attn8", prompt=PROMPTS[0], max_tokens=2, temperature=0, echo=True)
    assert bare.choices[0].text.startswith(PROMPTS[0]) and bare.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as zero:
        client.completions.create(model="attn8", prompt=PROMPTS[0], max_tokens=0)
    assert "echo" in zero.value.body["message"]


def check_logprobs(server: ApiServer, adapters: dict[str, Path], reference) -> None:
    """Completion and chat log-probabilities, streamed or not, of concurrent requests over adapters:
    the chosen tokens' and the top alternatives' equal the monolithic model's (teacher-forced)."""
    client = openai_client(server)
    top = 3
    jobs = [(model, prompt) for model in ("qv4", "mlp16", server.served_model_name) for prompt in PROMPTS[:3]]

    def ask(job):
        model, prompt = job
        return client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            logprobs=top,
            extra_body={"return_token_ids": True},
        ).choices[0]

    with ThreadPoolExecutor(len(jobs)) as pool:
        choices = list(pool.map(ask, jobs))
    tokenizer = reference.tokenizer
    text_of = LogprobFormatter(tokenizer).text
    for (model, prompt), choice in zip(jobs, choices):
        generated, logprobs = choice.token_ids, choice.logprobs
        expected = reference.logprobs(prompt, adapters.get(model), generated)
        chosen = expected[torch.arange(len(generated)), torch.tensor(generated)]
        # The served logits come from the split model and the multi-adapter layout (its scaling
        # is applied one rounding step earlier, lora.py): equal to ~1e-6, not bit for bit.
        torch.testing.assert_close(torch.tensor(logprobs.token_logprobs), chosen, atol=1e-4, rtol=0)
        assert logprobs.tokens == [text_of(t) for t in generated]
        assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(generated))]
        if choice.finish_reason == "length":  # no end-of-sequence token among them
            assert "".join(logprobs.tokens) == choice.text
        for step, alternatives in enumerate(logprobs.top_logprobs):
            values, ids = torch.topk(expected[step], top)
            wanted = {}
            for token, value in zip(ids.tolist(), values.tolist()):
                wanted.setdefault(text_of(token), value)  # texts may repeat: the likelier one
            assert set(alternatives) == set(wanted), f"{model} step {step}"
            for text, value in alternatives.items():
                assert abs(value - wanted[text]) < 1e-4
    # Streaming gives the same entries, chunk by chunk, with offsets that go on across chunks.
    whole = choices[0]
    chunks = list(
        client.completions.create(
            model=jobs[0][0], prompt=jobs[0][1], max_tokens=8, temperature=0, logprobs=top, stream=True
        )
    )
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == whole.logprobs.tokens
    assert [o for p in parts for o in p.text_offset] == whole.logprobs.text_offset
    streamed = torch.tensor([v for p in parts for v in p.token_logprobs])
    # This one ran alone, ``whole`` in a batch of nine: other products, equal to ~1e-7.
    torch.testing.assert_close(streamed, torch.tensor(whole.logprobs.token_logprobs), atol=1e-5, rtol=0)
    # Chat: logprobs with top_logprobs, non-streaming and streaming.
    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(
        model="attn8", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    if chat.choices[0].finish_reason == "length":  # the tokens' bytes, joined, are the text
        joined = b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace")
        assert joined == chat.choices[0].message.content
    for entry in content:
        assert entry.token == bytes(entry.bytes).decode("utf-8", errors="replace")
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob  # greedy
    stream = client.chat.completions.create(
        model="attn8",
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    torch.testing.assert_close(
        torch.tensor([e.logprob for e in streamed]), torch.tensor([e.logprob for e in content]), atol=1e-5, rtol=0
    )
    plain = client.chat.completions.create(model="attn8", messages=messages, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None


@pytest.fixture(scope="module")
def server(api_model, lora_adapters):
    server = start_server(api_model, adapters=lora_adapters, max_loaded_adapters=3)
    yield server
    server.close()


def test_concurrent_greedy_completions_over_mixed_adapters_equal_monolithic_peft(server, lora_adapters, reference):
    check_concurrent_greedy(server, lora_adapters, reference)
    # 4 adapters through a pool of 3: one was loaded again after eviction, and nothing broke.
    assert server.pool.loaded_count <= 3


def test_the_server_runs_on_httptools_and_uvloop(server):
    # Dependencies of ours: each streamed token is a write on this event loop, beside the engine
    # thread, and h11 + asyncio cost several times more per write (see ApiServer._config).
    config = server._uvicorn.config
    assert config.http_protocol_class.__name__ == "HttpToolsProtocol"
    assert config.get_loop_factory().__module__.startswith("uvloop")


def test_gathered_adapter_layout_gives_the_same_tokens(server, lora_adapters, reference, monkeypatch):
    # The four test adapters are few enough to be stacked; force the layout used for many adapters.
    monkeypatch.setattr(lora_module, "GATHER_ABOVE_RANK_RATIO", 0)
    check_concurrent_greedy(server, lora_adapters, reference)


def test_one_decode_step_sends_one_request_per_base_layer_for_all_rows(server, monkeypatch):
    calls = server.model.symbiosis_transport.service.stats()["layers"]
    before = {layer: counters["requests"] for layer, counters in calls.items()}
    rows_before = {layer: counters["rows"] for layer, counters in calls.items()}
    client, engine = openai_client(server), server.engine
    gate, step = threading.Event(), engine._step
    monkeypatch.setattr(engine, "_step", lambda: (gate.wait(30), step()))  # the four are admitted together
    with ThreadPoolExecutor(4) as pool:
        models = ["qv4", "attn8", "mlp16", server.served_model_name]  # 3 adapters (the pool's size) and the base
        answers = pool.map(lambda model: greedy_tokens(client, model, "Hello", 8), models)
        deadline = time.monotonic() + 30
        while engine.stats()["waiting"] < 4:
            assert time.monotonic() < deadline, engine.stats()
            time.sleep(0.005)
        gate.set()
        assert [len(tokens) for tokens in answers] == [8] * 4
    after = server.model.symbiosis_transport.service.stats()["layers"]
    layer = "model.layers.0.self_attn.q_proj"
    requests = after[layer]["requests"] - before[layer]
    rows = after[layer]["rows"] - rows_before[layer]
    # 4 sequences x 8 tokens, admitted together: one prefill and 7 decode steps, each one request
    # for the four rows (a request per sequence would be 32).
    prefill_rows = rows - 7 * 4
    assert requests == 8 and prefill_rows > 0 and prefill_rows % 4 == 0, (requests, rows)


def test_an_embedded_executor_is_warmed_up_so_the_first_requests_run_no_form_trial(api_model, monkeypatch):
    """``symbiosis api --embedded`` times its executor's forms of 1-8 row products before serving
    (``BaseExecutor.warm_up`` from ``build_engine``), as ``symbiosis serve`` does: otherwise each
    new (shape, row count) of the first requests is timed on the engine's thread while every
    stream waits. Without the warm-up (the control), the same request runs trials."""
    from symbiosis.executor import matmul_forms, runner
    from symbiosis.executor.executor import BaseExecutor

    real_warm_up = BaseExecutor.warm_up
    for warm in (False, True):
        forms = matmul_forms.MatmulForms(enabled=True)
        monkeypatch.setattr(matmul_forms, "MATMUL_FORMS", forms)
        monkeypatch.setattr(runner, "MATMUL_FORMS", forms)
        monkeypatch.setattr(forms, "_trial", lambda weight, bias, rows, packed=None: matmul_forms.Form.WEIGHT_BY_ROWS)
        monkeypatch.setattr(BaseExecutor, "warm_up", real_warm_up if warm else lambda self, *args, **kwargs: 0)
        server = start_server(api_model)
        try:
            ready = forms.trials
            # Two choices decode together: 2-row products, which the engine's own start (its
            # 1-row forward measuring the KV cache) did not time.
            openai_client(server).completions.create(
                model=served_name_of(server.options), prompt="a", max_tokens=4, n=2, temperature=0
            )
            if warm:
                assert ready > 0 and forms.trials == ready
            else:
                assert forms.trials > ready, (ready, forms.trials)
        finally:
            server.close()


def test_streaming_gives_the_same_text_as_non_streaming(server):
    client = openai_client(server)
    for model in ("attn8", server.served_model_name):
        whole = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=20, temperature=0)
        chunks = list(
            client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=20, temperature=0, stream=True)
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
        assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_logprobs_are_those_of_monolithic_peft(server, lora_adapters, reference):
    check_logprobs(server, lora_adapters, reference)


def test_echo_scores_prompts_with_the_monolithic_models_logprobs(server, lora_adapters, reference):
    check_echo(server, lora_adapters, reference)


def test_echoing_prefills_keep_every_positions_logits_within_their_bound(server, monkeypatch, lora_adapters, reference):
    """A prefill with an echoing prompt keeps every position's logits of every row, so it takes
    prompts while rows x columns stays within ``max_echo_positions``: echoing prompts (an
    evaluation harness's scored prompts) prefill together, with plain ones too, and never past
    the bound; plain prompts alone still prefill together. (Before: each echoing prompt
    prefilled alone, and a batch of them one at a time.) Batched and left-padded, with other
    rows beside them, the prompts' log-probabilities and the greedy tokens are still the
    monolithic model's."""
    prefills = []
    start_prefill = server.engine._start_prefill

    def recording(joiners):
        prefills.append([(s.request.params.prompt_logprobs is not None, len(s.request.prompt_ids)) for s in joiners])
        return start_prefill(joiners)

    monkeypatch.setattr(server.engine, "_start_prefill", recording)
    longest = max(len(server.engine.tokenizer(p)["input_ids"]) for p in PROMPTS)
    bound = 3 * longest  # room for three prompts of the longest kind
    monkeypatch.setattr(server.engine, "options", dataclasses.replace(server.engine.options, max_echo_positions=bound))
    _slow_steps(server, monkeypatch, 0.05)  # let requests pile up, so prefills have several joiners
    client = openai_client(server)

    def ask(i):
        echo = i % 2 == 0
        return client.completions.create(
            model="qv4",
            prompt=PROMPTS[i % 5],
            max_tokens=2,
            temperature=0,
            echo=echo,
            logprobs=1 if echo else None,
            extra_body={"return_token_ids": True},
        )

    asked = [*range(12), *range(1, 12, 2), *range(0, 12, 2)]
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(ask, range(12)))  # echoing and plain requests interleaved
        answers += list(pool.map(ask, range(1, 12, 2)))  # plain ones only
        answers += list(pool.map(ask, range(0, 12, 2)))  # echoing ones only
    adapter = lora_adapters["qv4"]
    for i, answer in zip(asked, answers):
        prompt = PROMPTS[i % 5]
        choice = answer.choices[0]
        assert choice.token_ids == reference.tokens(prompt, adapter, 2)
        if i % 2 == 0:
            ids = reference.tokenizer(prompt)["input_ids"]
            expected = reference.prompt_logprobs(ids, adapter)
            chosen = expected[torch.arange(len(ids) - 1), torch.tensor(ids[1:], dtype=torch.long)]
            served = torch.tensor(choice.logprobs.token_logprobs[1 : len(ids)])
            torch.testing.assert_close(served, chosen, atol=1e-4, rtol=0)
    echoing = [p for p in prefills if any(echo for echo, _ in p)]
    assert echoing, "no echoing prompt was served"
    assert all(len(p) * max(n for _, n in p) <= bound for p in echoing if len(p) > 1), prefills
    assert any(sum(echo for echo, _ in p) > 1 for p in echoing), (
        f"echoing prompts no longer prefill together: {prefills}"
    )
    assert any(len(p) > 1 for p in prefills if not any(echo for echo, _ in p)), (
        "plain prompts no longer prefill together"
    )


def test_penalties_give_the_tokens_of_monolithic_peft_with_the_same_penalties(server, lora_adapters, reference):
    check_penalties(server, lora_adapters, reference)


def test_chat_completions_with_and_without_streaming(server):
    client = openai_client(server)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(model="mlp16", messages=messages, max_tokens=10, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 10 or whole.choices[0].finish_reason == "stop"
    chunks = list(
        client.chat.completions.create(model="mlp16", messages=messages, max_tokens=10, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content


def test_sampling_with_a_seed_is_repeatable_and_stop_strings_cut_the_text(server):
    client = openai_client(server)
    kwargs = {
        "model": "qv4",
        "prompt": "abc",
        "max_tokens": 16,
        "temperature": 0.9,
        "top_p": 0.9,
        "seed": 7,
        "extra_body": {"top_k": 50},
    }
    first, second = (client.completions.create(**kwargs).choices[0].text for _ in range(2))
    assert first == second
    # n choices with a seed draw from seed, seed + 1, ... (vLLM's rule): not n copies of one sample,
    # and each is the one a request of n=1 with its seed gets.
    several = [c.text for c in client.completions.create(**kwargs, n=3).choices]
    assert several[0] == first and len(set(several)) == 3
    assert several[1] == client.completions.create(**{**kwargs, "seed": 8}).choices[0].text
    whole = client.completions.create(model="qv4", prompt="abc", max_tokens=16, temperature=0).choices[0].text
    stop = whole[3:5]
    if stop:
        cut = client.completions.create(model="qv4", prompt="abc", max_tokens=16, temperature=0, stop=[stop])
        assert cut.choices[0].text == whole[: whole.find(stop)] and cut.choices[0].finish_reason == "stop"
        # With min_tokens, a stop string that ends before that many tokens is passed over (vLLM's rule).
        held = client.completions.create(
            model="qv4", prompt="abc", max_tokens=16, temperature=0, stop=[stop], extra_body={"min_tokens": 16}
        )
        assert held.choices[0].text == whole and held.usage.completion_tokens == 16


def test_tokenize_and_detokenize_as_vllm_does(server, reference):
    tokenizer = reference.tokenizer
    status, body = post(server.url + "/tokenize", {"model": "qv4", "prompt": PROMPTS[3]})
    answer = json.loads(body)
    assert status == 200 and answer["tokens"] == tokenizer(PROMPTS[3])["input_ids"]
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == 256
    bare = json.loads(post(server.url + "/tokenize", {"model": "qv4", "prompt": "a b", "add_special_tokens": False})[1])
    assert bare["tokens"] == tokenizer("a b", add_special_tokens=False)["input_ids"]
    # Chat messages count what a chat completion's prompt costs.
    messages = [{"role": "user", "content": "hello there"}]
    counted = json.loads(post(server.url + "/tokenize", {"model": "qv4", "messages": messages})[1])["count"]
    chat = openai_client(server).chat.completions.create(model="qv4", messages=messages, max_tokens=1)
    assert counted == chat.usage.prompt_tokens
    status, body = post(server.url + "/detokenize", {"model": "qv4", "tokens": answer["tokens"]})
    assert status == 200 and json.loads(body)["prompt"] == tokenizer.decode(answer["tokens"])
    assert post(server.url + "/detokenize", {"model": "qv4", "tokens": [10**9]})[0] == 400
    assert post(server.url + "/tokenize", {"model": "qv4"})[0] == 400  # neither prompt nor messages
    assert post(server.url + "/tokenize", {"model": "nope", "prompt": "x"})[0] == 404


def test_models_lists_the_base_and_every_adapter_with_its_parent(server, lora_adapters):
    listed = {m.id: m for m in openai_client(server).models.list().data}
    assert set(listed) == {server.served_model_name, *lora_adapters}
    assert all(listed[name].model_extra["parent"] == server.served_model_name for name in lora_adapters)
    # ``models.retrieve`` (GET /v1/models/{id}) answers what the list says, and 404 as a request would.
    client = openai_client(server)
    for name in [server.served_model_name, *lora_adapters]:
        assert client.models.retrieve(name).model_dump() == listed[name].model_dump()
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-adapter")


def test_errors_use_openai_bodies_and_status_codes(server):
    client = openai_client(server)
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-adapter", prompt="x")
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="qv4", prompt="x", temperature=7)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="qv4", prompt="x", max_tokens=10_000)
    assert "maximum context length is 256" in long.value.body["message"]
    with pytest.raises(openai.BadRequestError) as unsupported:
        client.completions.create(model="qv4", prompt="x", suffix="y")
    assert "suffix" in unsupported.value.body["message"]
    with pytest.raises(openai.BadRequestError) as out_of_range:
        client.completions.create(model="qv4", prompt="x", frequency_penalty=3.0)
    assert out_of_range.value.body["param"] == "frequency_penalty"
    with pytest.raises(openai.BadRequestError) as too_many:
        client.completions.create(model="qv4", prompt="x", logprobs=21)
    assert too_many.value.body["param"] == "logprobs"
    for fields, param in [  # named in the body's param too (before, these named none)
        ({"extra_body": {"response_format": {"type": "json_object"}}}, "response_format"),
        ({"extra_body": {"tools": [{"type": "function", "function": {"name": "f"}}]}}, "tools"),
        ({"extra_body": {"tool_choice": "auto"}}, "tool_choice"),
        ({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
    ]:
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="qv4", prompt="x", **fields)
        assert refused.value.body["param"] == param and "supported" in refused.value.body["message"], fields
    for fields, named in [
        ({"extra_body": {"response_format": {"type": "json_object"}}}, "response_format"),
        ({"extra_body": {"tools": [{"type": "function", "function": {"name": "f"}}]}}, "tools"),
        ({"extra_body": {"best_of": 3}}, "best_of"),
        ({"logit_bias": {"99999": 1.0}}, "logit_bias"),
        ({"logit_bias": {"3": 200.0}}, "logit_bias"),
        ({"max_tokens": 2, "extra_body": {"min_tokens": 5}}, "min_tokens"),
    ]:
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="qv4", prompt="x", **fields)
        assert named in refused.value.body["message"], fields
    with pytest.raises(openai.BadRequestError) as alone:
        client.chat.completions.create(model="qv4", messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    assert "top_logprobs" in alone.value.body["message"]
    status, body = post(server.url + "/v1/completions", {"prompt": "x"})
    assert status == 400 and json.loads(body)["error"]["param"] == "model"
    status, body = get(server.url + "/v1/nothing-here")
    assert status == 404 and "error" in json.loads(body)


def test_metrics_use_the_names_dashboards_chart(server):
    greedy_tokens(openai_client(server), "qv4", "metrics", 3)
    status, text = get(server.url + "/metrics")
    assert status == 200
    for name in (
        "symbiosis:num_requests_running",
        "symbiosis:num_requests_waiting",
        "symbiosis:time_to_first_token_seconds",
        "symbiosis:inter_token_latency_seconds",
        "symbiosis:e2e_request_latency_seconds",
        "symbiosis:generation_tokens_total",
        "symbiosis:prompt_tokens_total",
        "symbiosis:lora_adapters_loaded",
    ):
        assert name in text, name
    status, body = get(server.url + "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_long_prefills_run_in_chunks_between_decode_steps_and_give_the_same_tokens(
    api_model, lora_adapters, reference, monkeypatch
):
    """A prefill of more rows than ``prefill_chunk_tokens`` runs a chunk of columns per step,
    the running streams decoding between chunks: no forward carries more rows than a chunk (so
    on an executor shared with fine-tuning jobs its base-layer requests stay latency work), a
    long prompt stops the others for a chunk, not for its whole prefill, and the tokens and the
    echoed prompts' log-probabilities are still the monolithic model's."""
    chunk = 4
    server = start_server(api_model, adapters=lora_adapters, prefill_chunk_tokens=chunk)
    try:
        engine = server.engine
        steps: list[tuple[str, int]] = []  # ("chunk", rows) or ("decode", rows), in order
        prefill_chunk, decode = engine._prefill_chunk, engine._decode

        def recording_chunk(prefill):
            columns = min(prefill.chunk_columns, prefill.columns - prefill.done_columns)
            steps.append(("chunk", len(prefill.joiners) * columns))
            prefill_chunk(prefill)

        def recording_decode():
            steps.append(("decode", len(engine._running)))
            decode()

        monkeypatch.setattr(engine, "_prefill_chunk", recording_chunk)
        monkeypatch.setattr(engine, "_decode", recording_decode)
        check_concurrent_greedy(server, lora_adapters, reference)
        check_echo(server, lora_adapters, reference)
        chunks = [rows for kind, rows in steps if kind == "chunk"]
        # At most a chunk's rows, or one column of more prompts than that admitted together.
        assert max(chunks) <= max(chunk, engine.options.max_batch_size), "a prefill forward was not split"
        assert len(chunks) > 2 * len(PROMPTS), "prompts were not prefilled in chunks"

        # One stream decoding while a long prompt prefills: it gets tokens between the chunks.
        _slow_steps(server, monkeypatch, 0.01)
        client = openai_client(server)
        stream = client.completions.create(
            model="attn8", prompt="go on", max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(stream))
        steps.clear()
        long_prompt = " ".join(PROMPTS)
        assert len(reference.tokenizer(long_prompt)["input_ids"]) > 3 * chunk
        expected = reference.tokens(long_prompt, lora_adapters["mlp16"], 3)
        assert greedy_tokens(client, "mlp16", long_prompt, 3) == expected
        stream.close()
        chunk_steps = [i for i, step in enumerate(steps) if step[0] == "chunk"]
        assert len(chunk_steps) > 3 and all(steps[i][1] <= chunk for i in chunk_steps), steps
        between = [step for step in steps[chunk_steps[0] : chunk_steps[-1]] if step[0] == "decode"]
        assert len(between) == len(chunk_steps) - 1 and all(rows == 1 for _, rows in between), steps

        # A lone long prompt's cache is what it needs (prompt + tokens to come), not a multiple.
        deadline = time.monotonic() + 10
        while engine.stats()["running"] and time.monotonic() < deadline:
            time.sleep(0.02)
        lone_prompt = " ".join(PROMPTS * 2)  # many more columns than a chunk and the tokens to come
        to_come = 40  # steps of >= 10 ms each: still running when the cache is read, on a slow host too
        lone = client.completions.create(
            model="attn8",
            prompt=lone_prompt,
            max_tokens=to_come,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(lone))
        needed = (len(reference.tokenizer(lone_prompt)["input_ids"]) + to_come) * engine.bytes_per_token
        assert 0 < engine.stats()["kv_cache_bytes"] <= needed
        lone.close()
    finally:
        server.close()


def _slow_steps(server: ApiServer, monkeypatch, seconds: float) -> None:
    step = server.engine._step

    def slow_step():
        time.sleep(seconds)
        step()

    monkeypatch.setattr(server.engine, "_step", slow_step)


def test_a_client_that_goes_away_mid_stream_frees_its_sequence(api_model, monkeypatch):
    server = start_server(api_model)
    try:
        _slow_steps(server, monkeypatch, 0.02)
        client = openai_client(server)
        stream = client.completions.create(
            model=server.served_model_name,
            prompt="go on",
            max_tokens=200,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))
        assert server.engine.stats()["running"] == 1 and server.engine.stats()["kv_cache_bytes"] > 0
        stream.close()
        deadline = time.monotonic() + 10
        while server.engine.stats()["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = server.engine.stats()
        assert stats["running"] == 0 and stats["kv_cache_bytes"] == 0
        assert 'symbiosis:request_success_total{finished_reason="abort"} 1.0' in get(server.url + "/metrics")[1]
    finally:
        server.close()


def _stream_tokens(server: ApiServer, max_tokens: int):
    """A greedy stream of ``max_tokens`` (no EOS) from the base model; its first chunk already read."""
    stream = openai_client(server).completions.create(
        model=server.served_model_name,
        prompt="go on",
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks)
    return chunks


def _close_in_background(server: ApiServer) -> tuple[threading.Thread, list[float]]:
    took: list[float] = []

    def close() -> None:
        began = time.monotonic()
        server.close()
        took.append(time.monotonic() - began)

    thread = threading.Thread(target=close)
    thread.start()
    return thread, took


def _stream_ended_by_shutdown(server: ApiServer, max_tokens: int) -> float:
    """Close ``server`` while a stream of ``max_tokens`` runs: the stream must end with the 503
    error event (the openai client raises it); returns how long ``close()`` took."""
    chunks = _stream_tokens(server, max_tokens)
    closing, took = _close_in_background(server)
    with pytest.raises(openai.APIError, match="the server is shutting down"):
        for _ in chunks:
            pass
    closing.join(timeout=60)
    assert took, "close() did not return"
    return took[0]


def test_stopping_ends_requests_in_flight_with_503_at_once(api_model, monkeypatch):
    """uvicorn used to wait 5 s for streams that could not finish, then cut them (no error, no
    [DONE]) and log a traceback. Now the engine ends them: the stream's last event is the 503."""
    server = start_server(api_model)
    try:
        _slow_steps(server, monkeypatch, 0.02)  # 200 tokens: 4 s or more
        assert _stream_ended_by_shutdown(server, 200) < SHUTDOWN_GRACE_S
    finally:
        server.close()


def test_a_shutdown_timeout_lets_requests_in_flight_finish(api_model, monkeypatch):
    server = start_server(api_model, shutdown_timeout_s=30.0)
    try:
        _slow_steps(server, monkeypatch, 0.02)
        chunks = _stream_tokens(server, 20)
        closing, took = _close_in_background(server)
        finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices]
        assert finish[-1] == "length"  # it ran to its end after the server was told to stop
        closing.join(timeout=60)
        assert took and took[0] < 30.0, took
    finally:
        server.close()
    # and one that cannot finish in time ends with the 503 when the time is up
    server = start_server(api_model, shutdown_timeout_s=0.5)
    try:
        _slow_steps(server, monkeypatch, 0.02)
        assert 0.5 <= _stream_ended_by_shutdown(server, 200) < 0.5 + SHUTDOWN_GRACE_S
    finally:
        server.close()


def test_the_queue_is_reported_in_the_order_it_was_counted(api_model):
    """The engine's loop and the thread that submits both report the queue (running + waiting) to
    the hooks (the gauges, and the count the shutdown line prints). The loop's count after a first
    prefill could reach them after the counts of the submits that followed it, and stay until the
    next step: a SIGTERM then printed "2 sequence(s) in flight" of 16 (a CI run of 01d1339). Here
    the loop is held between its first count and its report until a second request is queued (a
    request's choices are queued together)."""
    server = start_server(api_model)
    try:
        engine, metrics = server.engine, server.metrics
        loop = engine._thread
        counted = threading.Event()
        reports: list[int | None] = []  # running + waiting per report; None when a sequence finished
        real_stats, real_submit = engine.stats, engine.submit_all
        real_queue_changed, real_finished = metrics.queue_changed, metrics.finished

        def stats():
            result = real_stats()
            if threading.current_thread() is loop and result["running"] and not counted.is_set():
                counted.set()
                time.sleep(0.3)  # counted, not yet reported: the other request is submitted now
            return result

        submitted = []

        def submit(requests):
            if submitted:  # the first request goes at once, the other once the loop has counted it
                assert counted.wait(10), "the loop never counted the first request"
            submitted.append(requests)
            return real_submit(requests)

        def queue_changed(running, waiting, *rest):
            reports.append(running + waiting)
            real_queue_changed(running, waiting, *rest)

        def finished(*args):
            reports.append(None)
            real_finished(*args)

        engine.stats, engine.submit_all = stats, submit
        metrics.queue_changed, metrics.finished = queue_changed, finished
        body = {"model": served_name_of(server.options), "prompt": "hi", "max_tokens": 8, "ignore_eos": True}
        with ThreadPoolExecutor(2) as pool:  # 1 choice and 3: one of them is counted before the other is queued
            statuses = list(pool.map(lambda n: post(server.url + "/v1/completions", {**body, "n": n})[0], [1, 3]))
        assert statuses == [200, 200] and counted.is_set() and len(submitted) == 2
        before_finish = reports[: reports.index(None)]
        assert max(before_finish) == 4
        assert before_finish == sorted(before_finish), before_finish  # before: [1, 2, 3, 4, 1, ...]
    finally:
        server.close()


def test_prefill_chunks_are_no_larger_than_what_the_executor_serves_as_latency_work(
    api_model, lora_adapters, reference, tmp_path, monkeypatch
):
    """An executor whose latency work is smaller than ``--prefill-chunk-tokens``
    (``decode_share_rows``) says so in its Welcome, and the server's chunks follow it, in-process
    and over the wire: a bigger chunk would wait behind fine-tuning jobs there."""
    import symbiosis

    executor = symbiosis.BaseExecutor.from_pretrained(api_model, decode_share_rows=8)
    address = f"ipc://{tmp_path}/share.sock"
    served = executor.serve(address)
    try:
        for server in (
            start_server(api_model, ClientOptions(executor=address), adapters=lora_adapters),
            ApiServer(ApiOptions(model=api_model, client=ClientOptions(embedded=True), port=0), executor=executor),
        ):
            try:
                server.start()
                engine = server.engine
                assert engine.options.prefill_chunk_tokens == 256 and engine.chunk_tokens() == 8
                rows: list[int] = []
                prefill_chunk = engine._prefill_chunk

                def recording(prefill, prefill_chunk=prefill_chunk, rows=rows):
                    rows.append(
                        len(prefill.joiners) * min(prefill.chunk_columns, prefill.columns - prefill.done_columns)
                    )
                    prefill_chunk(prefill)

                monkeypatch.setattr(engine, "_prefill_chunk", recording)
                prompt = " ".join(PROMPTS)
                model = "attn8" if "attn8" in server.pool.names() else server.served_model_name
                expected = reference.tokens(prompt, lora_adapters.get(model), 4)
                assert greedy_tokens(openai_client(server), model, prompt, 4) == expected
                assert len(rows) > 2 and max(rows) <= 8, rows
            finally:
                server.close()
    finally:
        served.close()


def test_a_short_prompt_is_not_held_behind_a_long_prompts_chunks(api_model, reference, monkeypatch):
    """A request that arrives while a long prompt prefills in chunks is admitted as a prefill
    group of its own and gets its first token long before the long prompt's (the step's chunk
    comes from the group with the least left), while the long one still advances every other step."""
    server = start_server(api_model, prefill_chunk_tokens=2)
    try:
        engine = server.engine
        _slow_steps(server, monkeypatch, 0.01)
        chunks: list[int] = []  # the prompt length of the group each step's chunk came from
        finished: list[int] = []  # the prompt length of each group whose prefill ended
        prefill_chunk, finish_prefill = engine._prefill_chunk, engine._finish_prefill

        def recording_chunk(prefill):
            chunks.append(prefill.columns)
            prefill_chunk(prefill)

        def recording_finish(prefill, logits):
            finished.append(prefill.columns)
            finish_prefill(prefill, logits)

        monkeypatch.setattr(engine, "_prefill_chunk", recording_chunk)
        monkeypatch.setattr(engine, "_finish_prefill", recording_finish)
        client = openai_client(server)
        model = server.served_model_name
        long_prompt, short_prompt = " ".join(PROMPTS * 4), PROMPTS[0]
        long_columns = len(reference.tokenizer(long_prompt)["input_ids"])
        short_columns = len(reference.tokenizer(short_prompt)["input_ids"])
        with ThreadPoolExecutor(1) as pool:
            long = pool.submit(greedy_tokens, client, model, long_prompt, 3)
            deadline = time.monotonic() + 10
            while not chunks and time.monotonic() < deadline:
                time.sleep(0.005)
            assert greedy_tokens(client, model, short_prompt, 3) == reference.tokens(short_prompt, None, 3)
            assert not long.done(), "the long prompt's prefill ended first"
            assert long.result() == reference.tokens(long_prompt, None, 3)
        assert finished == [short_columns, long_columns]
        assert short_columns > 2  # so the short prompt has chunks of its own to interleave
        first, last = chunks.index(short_columns), len(chunks) - 1 - chunks[::-1].index(short_columns)
        assert long_columns in chunks[first:last], "the long prompt stood still meanwhile"
        assert chunks.count(long_columns) == -(-long_columns // 2)  # each of its chunks ran once
    finally:
        server.close()


def test_a_failure_while_admitting_answers_500_and_the_server_goes_on(api_model, monkeypatch):
    """Sequences taken from the queue but not yet in a prefill group are answered when building
    the group fails (a bug): a 500 for them, and the next request is served."""
    server = start_server(api_model)
    try:
        start_prefill = server.engine._start_prefill
        failures = iter([RuntimeError("a slip in our code")])

        def failing_once(joiners):
            failure = next(failures, None)
            if failure is not None:
                raise failure
            return start_prefill(joiners)

        monkeypatch.setattr(server.engine, "_start_prefill", failing_once)
        body = {"model": server.served_model_name, "prompt": "hi", "max_tokens": 2}
        status, text = post(server.url + "/v1/completions", body)
        assert status == 500 and "internal error" in text
        status, _ = post(server.url + "/v1/completions", body)
        assert status == 200 and server.engine.stats()["running"] == 0
    finally:
        server.close()


def test_a_client_that_goes_away_during_a_chunked_prefill_stops_it(api_model, monkeypatch):
    """A prompt still being prefilled, a chunk a step, counts as running; when its only client
    goes away (before its first token: the stream has not begun) the rest of its chunks are not
    run and nothing of it is left. (Before: a streamed request was not cancelled until its first
    token, so it was prefilled for nobody.)"""
    server = start_server(api_model, prefill_chunk_tokens=1)  # one column a step
    try:
        _slow_steps(server, monkeypatch, 0.02)
        chunks = []
        prefill_chunk = server.engine._prefill_chunk
        monkeypatch.setattr(server.engine, "_prefill_chunk", lambda prefill: (chunks.append(1), prefill_chunk(prefill)))
        prompt = " ".join(PROMPTS * 3)
        columns = len(server.tokenizer(prompt)["input_ids"])
        body = json.dumps({"model": server.served_model_name, "prompt": prompt, "max_tokens": 5, "stream": True})
        # A raw connection: the openai client returns only once the response starts (the first token).
        connection = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
        connection.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        deadline = time.monotonic() + 10
        while not chunks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.engine.stats()["running"] == 1 and server.engine._prefills
        connection.close()  # gone before its first token
        while server.engine.stats()["running"] and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = server.engine.stats()
        assert stats["running"] == 0 and stats["kv_cache_bytes"] == 0 and not server.engine._prefills
        assert len(chunks) < columns, "the whole prompt was prefilled for nobody"
        assert 'symbiosis:request_success_total{finished_reason="abort"} 1.0' in get(server.url + "/metrics")[1]
    finally:
        server.close()


def test_a_full_server_answers_429_with_retry_after(api_model, monkeypatch):
    """The sequences running or waiting are bounded by ``max_concurrent_requests``: with the engine
    held, a request of n=2 fills a server of 2 (one runs, one waits), and the next request gets 429
    with Retry-After and queues nothing. (``test_api_requests.py`` has the other rules.)"""
    server = start_server(api_model, max_concurrent_requests=2, max_batch_size=1)
    try:
        gate = threading.Event()
        step = server.engine._step
        monkeypatch.setattr(server.engine, "_step", lambda: (gate.wait(), step()))
        client = openai_client(server)
        model = server.served_model_name
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(client.completions.create, model=model, prompt="first", max_tokens=4, n=2)
            deadline = time.monotonic() + 10
            while server.engine.stats()["waiting"] < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            try:
                status, body = post(server.url + "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 2})
                with pytest.raises(openai.RateLimitError) as limited:
                    greedy_tokens(client, model, "b", 2)
                assert server.engine.stats()["waiting"] == 2  # nothing of the refused requests was queued
            finally:
                gate.set()
            assert len(first.result(timeout=30).choices) == 2
        assert status == 429 and json.loads(body)["error"]["type"] == "rate_limit_error"
        assert limited.value.response.headers["retry-after"] == "1"
    finally:
        server.close()


def test_a_key_limited_to_one_adapter_gets_404_for_the_others(api_model, lora_adapters):
    keys = {"admin-key-000": None, "tenant-a-key": frozenset({"qv4"})}
    server = start_server(api_model, adapters=lora_adapters, api_keys=keys)
    try:
        tenant = openai_client(server, "tenant-a-key")
        assert len(greedy_tokens(tenant, "qv4", "hi", 3)) == 3
        with pytest.raises(openai.NotFoundError) as hidden:
            greedy_tokens(tenant, "attn8", "hi", 3)
        with pytest.raises(openai.NotFoundError) as missing:
            greedy_tokens(tenant, "no-such-adapter", "hi", 3)
        assert hidden.value.body["message"].replace("attn8", "X") == missing.value.body["message"].replace(
            "no-such-adapter", "X"
        )
        assert {m.id for m in tenant.models.list().data} == {server.served_model_name, "qv4"}
        assert tenant.models.retrieve("qv4").id == "qv4"
        with pytest.raises(openai.NotFoundError):
            tenant.models.retrieve("attn8")  # a model the key may not use is as missing as one that is
        tokenize = server.url + "/tokenize"
        assert post(tokenize, {"model": "qv4", "prompt": "hi"}, "tenant-a-key")[0] == 200
        assert post(tokenize, {"model": "attn8", "prompt": "hi"}, "tenant-a-key")[0] == 404
        assert post(tokenize, {"model": "qv4", "prompt": "hi"})[0] == 401
        with pytest.raises(openai.AuthenticationError):
            greedy_tokens(openai_client(server, "wrong-key-123"), "qv4", "hi", 3)
        assert len(greedy_tokens(openai_client(server, "admin-key-000"), "attn8", "hi", 3)) == 3
    finally:
        server.close()


def test_adapters_load_replace_and_unload_while_serving(api_model, tmp_path, reference):
    server = start_server(
        api_model, allow_adapter_updates=True, api_keys={"admin-key-000": None, "tenant-key-1": frozenset()}
    )
    try:
        client = openai_client(server, "admin-key-000")
        first = make_lora_adapter(api_model, tmp_path / "v1", 4, 8, ["q_proj", "v_proj"], seed=11)
        second = make_lora_adapter(api_model, tmp_path / "v2", 8, 8, ["up_proj"], seed=12)
        load = server.url + "/v1/load_lora_adapter"
        assert post(load, {"lora_name": "live", "lora_path": str(first)}, "admin-key-000")[0] == 200
        assert greedy_tokens(client, "live", PROMPTS[0]) == reference.tokens(PROMPTS[0], first, MAX_TOKENS)
        assert post(load, {"lora_name": "live", "lora_path": str(second)}, "admin-key-000")[0] == 200
        assert greedy_tokens(client, "live", PROMPTS[0]) == reference.tokens(PROMPTS[0], second, MAX_TOKENS)
        assert post(load, {"lora_name": "live", "lora_path": str(tmp_path)}, "admin-key-000")[0] == 400
        assert post(load, {"lora_name": "x", "lora_path": str(first)}, "tenant-key-1")[0] == 403
        assert post(server.url + "/v1/unload_lora_adapter", {"lora_name": "live"}, "admin-key-000")[0] == 200
        with pytest.raises(openai.NotFoundError):
            greedy_tokens(client, "live", PROMPTS[0])
    finally:
        server.close()


def test_adapter_updates_are_off_unless_asked(server):
    assert post(server.url + "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/tmp"})[0] == 404


def test_a_replaced_adapter_never_changes_mid_sequence(api_model, tmp_path, reference, monkeypatch):
    first = make_lora_adapter(api_model, tmp_path / "v1", 4, 8, ["q_proj", "v_proj"], seed=21)
    second = make_lora_adapter(api_model, tmp_path / "v2", 4, 8, ["q_proj", "v_proj"], seed=22)
    server = start_server(api_model, adapters={"live": first}, allow_adapter_updates=True)
    try:
        _slow_steps(server, monkeypatch, 0.01)
        client = openai_client(server)
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(greedy_tokens, client, "live", PROMPTS[3], 30)
            while server.engine.stats()["running"] < 1:
                time.sleep(0.005)
            assert post(server.url + "/v1/load_lora_adapter", {"lora_name": "live", "lora_path": str(second)})[0] == 200
            assert running.result(timeout=60) == reference.tokens(PROMPTS[3], first, 30)
        assert greedy_tokens(client, "live", PROMPTS[3], 30) == reference.tokens(PROMPTS[3], second, 30)
    finally:
        server.close()


def test_adapter_dir_serves_folders_added_later(api_model, tmp_path, reference):
    server = start_server(api_model, adapter_dir=tmp_path, max_loaded_adapters=2)
    try:
        client = openai_client(server)
        assert {m.id for m in client.models.list().data} == {server.served_model_name}
        made = {
            f"d{i}": make_lora_adapter(api_model, tmp_path / f"d{i}", 2 + i, 4, ["v_proj"], seed=30 + i)
            for i in range(3)
        }
        for name, folder in made.items():
            assert greedy_tokens(client, name, "x y") == reference.tokens("x y", folder, MAX_TOKENS)
        assert server.pool.loaded_count == 2 and server.pool.loads == 3
    finally:
        server.close()


def test_adapters_of_another_model_are_refused_at_startup_and_not_listed(api_model, tiny_checkpoint, tmp_path):
    """An ``--adapter`` made for another model stops the server at startup with one error naming
    it and the model it was made for (before: "serving ... and 1 adapters", then a 400 saying
    its modules were "not a base layer the server can adapt" on the first request naming it).
    Under ``--adapter-dir``, /v1/models lists only the folders that fit (before: every LoRA
    config, weights or not), and a request naming another gets a 400 that names the adapter,
    not the server's folder."""
    gpt2 = make_lora_adapter(tiny_checkpoint("gpt2"), tmp_path / "dir" / "gpt2", 4, 8, ["c_attn"], seed=41)
    make_lora_adapter(api_model, tmp_path / "dir" / "fits", 4, 8, ["q_proj"], seed=42)
    (tmp_path / "dir" / "no-weights").mkdir()
    (tmp_path / "dir" / "no-weights" / "adapter_config.json").write_text((gpt2 / "adapter_config.json").read_text())
    with pytest.raises(SymbiosisError) as refused:
        start_server(api_model, adapters={"foreign": gpt2})
    message = str(refused.value)
    assert "adapter 'foreign' does not fit this model (it was made for 'gpt2-tiny-seed0')" in message, message
    assert "which this model does not have" in message and str(gpt2) in message  # the operator sees the folder
    server = start_server(api_model, adapter_dir=tmp_path / "dir")
    try:
        assert {m.id for m in openai_client(server).models.list().data} == {server.served_model_name, "fits"}
        for name, reason in [("gpt2", "does not fit this model"), ("no-weights", "has no adapter_model.safetensors")]:
            status, body = post(server.url + "/v1/completions", {"model": name, "prompt": "x", "max_tokens": 1})
            error = json.loads(body)["error"]
            assert status == 400 and error["message"].startswith(f"adapter {name!r} ") and reason in error["message"]
            assert str(tmp_path) not in error["message"]
    finally:
        server.close()


@pytest.fixture(scope="module")
def remote_executor(api_model, tmp_path_factory):
    from tests.service_helpers import start_executor, stop

    address = f"ipc://{tmp_path_factory.mktemp('api-executor')}/executor.sock"
    process = start_executor(api_model, address)
    yield address, process
    stop(process)


@pytest.mark.slow
def test_a_server_on_a_remote_executor_serves_the_same_tokens(api_model, lora_adapters, reference, remote_executor):
    address, _ = remote_executor
    server = start_server(api_model, ClientOptions(executor=address), adapters=lora_adapters)
    try:
        check_concurrent_greedy(server, lora_adapters, reference)
        client = openai_client(server)
        whole = client.completions.create(model="od2", prompt=PROMPTS[0], max_tokens=16, temperature=0)
        chunks = client.completions.create(model="od2", prompt=PROMPTS[0], max_tokens=16, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
        chat = client.chat.completions.create(model="qv4", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        assert chat.usage.completion_tokens <= 5
        check_logprobs(server, lora_adapters, reference)
        check_echo(server, lora_adapters, reference)
        check_penalties(server, lora_adapters, reference)
    finally:
        server.close()
    chunked = start_server(api_model, ClientOptions(executor=address), adapters=lora_adapters, prefill_chunk_tokens=4)
    try:  # prompts prefilled a few rows a step, over the same transport
        check_concurrent_greedy(chunked, lora_adapters, reference)
        check_echo(chunked, lora_adapters, reference)
    finally:
        chunked.close()


@pytest.mark.slow
@pytest.mark.parametrize("engine_process", [False, True], ids=["engine-thread", "engine-process"])
def test_an_unreachable_executor_answers_503(api_model, tmp_path, engine_process):
    from tests.service_helpers import start_executor, stop

    address = f"ipc://{tmp_path}/executor.sock"
    process = start_executor(api_model, address)
    server = start_server(api_model, ClientOptions(executor=address, timeout_s=3.0), engine_process=engine_process)
    try:
        assert get(server.url + "/health")[0] == 200
        stop(process)
        status, body = get(server.url + "/health")
        assert status == 503 and "executor" in json.loads(body)["reason"]
        with pytest.raises(openai.InternalServerError) as down:
            greedy_tokens(openai_client(server), server.served_model_name, "hi", 3)
        assert down.value.status_code == 503
        # Not where the executor is: the server's business, not its HTTP clients' (the log says it).
        assert str(tmp_path) not in body and str(tmp_path) not in str(down.value.body)
        # Known down: the engine probes in the background, and requests and /health answer 503 at
        # once with Retry-After (each request spent a connection timeout finding out before).
        began = time.monotonic()
        with pytest.raises(openai.InternalServerError) as again:
            greedy_tokens(openai_client(server), server.served_model_name, "hi", 3)
        status, body = get(server.url + "/health")
        assert again.value.status_code == 503 and again.value.response.headers.get("retry-after")
        assert status == 503 and "probing" in json.loads(body)["reason"] and str(tmp_path) not in body
        assert time.monotonic() - began < 2.8  # before: each request spent the call's 3 s timeout and more
        process = start_executor(api_model, address)  # the executor is stateless: serving resumes
        deadline = time.monotonic() + 30
        while get(server.url + "/health")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(greedy_tokens(openai_client(server), server.served_model_name, "hi", 3)) == 3
    finally:
        server.close()
        stop(process)


@pytest.mark.slow
def test_a_fine_tuning_job_publishes_its_adapter_to_the_running_server(api_model, remote_executor, reference, tmp_path):
    from symbiosis.jobs.finetune import FinetuneOptions, TrainOptions, finetune
    from symbiosis.jobs.publish import PublishOptions

    address, _ = remote_executor
    server = start_server(api_model, ClientOptions(executor=address), allow_adapter_updates=True)
    try:
        data = tmp_path / "train.jsonl"
        data.write_text("".join(json.dumps({"text": f"sample {i}: the cat sat on mat {i}"}) + "\n" for i in range(24)))
        client = openai_client(server)
        served_mid_run = []

        def on_step(record) -> None:
            if record.step == 2:  # published at step 2: the next request uses those weights
                served_mid_run.append(greedy_tokens(client, "live", PROMPTS[0]))

        options = FinetuneOptions(
            model=api_model,
            data=data,
            output=tmp_path / "live",
            client=ClientOptions(executor=address),
            train=TrainOptions(steps=4, batch_size=2, seq_len=16, eval_fraction=0.0, lr=5e-2),
            progress=False,
            publish=PublishOptions(server.url, "live", every=2),
        )
        finetune(options, on_step=on_step)
        step2 = tmp_path / "live.run" / "published" / "step-2"
        assert served_mid_run == [reference.tokens(PROMPTS[0], step2, MAX_TOKENS)]
        final = greedy_tokens(client, "live", PROMPTS[0])
        assert final == reference.tokens(PROMPTS[0], tmp_path / "live", MAX_TOKENS)
        assert final != served_mid_run[0]  # training moved the adapter, and the server followed
    finally:
        server.close()


@pytest.mark.parametrize(
    "engine_process", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["engine-thread", "engine-process"]
)
def test_an_embedded_executor_shared_with_a_fine_tuning_job(
    api_model, lora_adapters, reference, tmp_path, engine_process
):
    """``--embedded --executor-bind ADDRESS``: the server calls its executor in-process while a
    fine-tuning job in another client connects to ADDRESS (over shared memory here) and trains on
    the same base, publishing its adapter to the server; every token served, before and after,
    is the monolithic model's."""
    from symbiosis.jobs.finetune import FinetuneOptions, TrainOptions, finetune
    from symbiosis.jobs.publish import PublishOptions

    address = f"ipc://{tmp_path}/shared.sock"
    server = start_server(
        api_model,
        adapters={"qv4": lora_adapters["qv4"]},
        allow_adapter_updates=True,
        executor_bind=(address,),
        engine_process=engine_process,
    )
    try:
        if not engine_process:  # the jobs' bulk products run on a background thread, as in `symbiosis serve`
            assert server.target.executor.scheduler_config.bulk_lane == "background"
        client = openai_client(server)
        assert greedy_tokens(client, "qv4", PROMPTS[1]) == reference.tokens(
            PROMPTS[1], lora_adapters["qv4"], MAX_TOKENS
        )
        data = tmp_path / "train.jsonl"
        data.write_text("".join(json.dumps({"text": f"sample {i}: the dog ran to {i}"}) + "\n" for i in range(16)))
        options = FinetuneOptions(
            model=api_model,
            data=data,
            output=tmp_path / "live",
            client=ClientOptions(executor=f"shm+{address}"),
            train=TrainOptions(steps=2, batch_size=2, seq_len=16, eval_fraction=0.0, lr=5e-2),
            progress=False,
            publish=PublishOptions(server.url, "live", every=2),
        )
        finetune(options)
        assert greedy_tokens(client, "live", PROMPTS[0]) == reference.tokens(PROMPTS[0], tmp_path / "live", MAX_TOKENS)
        assert greedy_tokens(client, "qv4", PROMPTS[1]) == reference.tokens(
            PROMPTS[1], lora_adapters["qv4"], MAX_TOKENS
        )
    finally:
        server.close()
    from symbiosis.transport.schemes import open_transport

    with pytest.raises(ExecutorUnavailableError):  # closing the server stopped the shared executor too
        open_transport(address, connect_timeout_s=1.0)


def test_the_port_is_bound_while_the_model_loads_and_refuses_connections_until_serving(api_model):
    """Bound first (a taken port fails before the load), listening only once serving: a TCP probe
    or a client connecting meanwhile is refused, not left hanging as if the server were ready."""
    server = ApiServer(ApiOptions(model=api_model, client=ClientOptions(embedded=True), port=0))
    try:
        port = server._socket.getsockname()[1]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        with socket.create_server(("127.0.0.1", 0)) as taken, pytest.raises(ApiConfigError, match="in use"):
            ApiServer(ApiOptions(model=api_model, client=ClientOptions(embedded=True), port=taken.getsockname()[1]))
        server.start()
        assert get(f"http://127.0.0.1:{port}/health")[0] == 200
    finally:
        server.close()


def test_executor_bind_needs_an_embedded_executor_and_a_local_address(api_model):
    with pytest.raises(ApiConfigError, match="--executor-bind shares an --embedded executor"):
        ApiServer(
            ApiOptions(model=api_model, client=ClientOptions(executor="ipc:///nowhere"), executor_bind=("ipc:///x",))
        )
    for address in ("tcp://0.0.0.0:0", "ipc://@symbiosis-test", "inproc://x"):  # refused before anything loads
        with pytest.raises(ApiConfigError, match=f"--executor-bind {address}"):
            ApiServer(ApiOptions(model=api_model, client=ClientOptions(embedded=True), executor_bind=(address,)))


@pytest.mark.slow
def test_the_command_line_serves_until_sigterm_and_ends_streams_in_flight(api_model, lora_adapters):
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "symbiosis",
        "api",
        "--model",
        str(api_model),
        "--embedded",
        "--port",
        str(port),
        "--adapter",
        f"qv4={lora_adapters['qv4']}",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        # Startup loads torch, transformers and the model in a fresh process: at a load average of
        # 9 (a niced run beside benchmarks) that took over 120 s once, so the wait is generous and
        # a server that never gets healthy fails with its own output, not "connection refused".
        deadline, healthy = time.monotonic() + 300, False
        while not healthy and time.monotonic() < deadline and process.poll() is None:
            try:
                healthy = get(url + "/health")[0] == 200
            except OSError:
                time.sleep(0.2)
        if not healthy:
            process.kill()
            out, err = process.communicate(timeout=30)
            pytest.fail(f"symbiosis api never answered /health 200 (exit {process.returncode}): {err[-2000:]}")
        # Greedy: a sampled answer may end early on the end-of-sequence token.
        status, body = post(
            url + "/v1/completions", {"model": "qv4", "prompt": "hi", "max_tokens": 3, "temperature": 0}
        )
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 3
        # A stream in flight (16 choices to the context's end: hundreds of steps) when SIGTERM comes
        # ends with the 503 and [DONE] well before uvicorn's own wait would have cut it, and the
        # process exits without a traceback (before: ~9 s, a cut stream, a traceback). The stream's
        # end is what is timed: the exit after it (the engine process's and torch's teardown) takes
        # seconds more on a loaded host, and uvicorn says so if its wait ran out.
        import http.client

        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        stream_body = {"model": "qv4", "prompt": "hi", "max_tokens": 250, "n": 16, "stream": True, "ignore_eos": True}
        connection.request("POST", "/v1/completions", json.dumps(stream_body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200
        assert response.readline().startswith(b"data: {")
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        events = [line.strip() for line in response if line.startswith(b"data: ")]
        stream_ended_after = time.monotonic() - signalled
        out, err = process.communicate(timeout=60)
        assert events[-1] == b"data: [DONE]"
        assert json.loads(events[-2][6:])["error"] == {
            "message": "the server is shutting down",
            "type": "service_unavailable",
            "code": 503,
        }
        assert stream_ended_after < SHUTDOWN_GRACE_S / 2, stream_ended_after
        assert "timeout graceful shutdown exceeded" not in err
        assert process.returncode == 0, err[-2000:]
        assert f"{url}/v1" in out and "Traceback" not in err and "16 sequence(s) in flight end now with 503" in err
        assert " and 1 adapter with OpenAI's API" in out, out  # before: "and 1 adapters"
    finally:
        if process.poll() is None:
            process.kill()
