"""The OpenAI-compatible HTTP API (FastAPI): completions, chat, models, adapters, health, metrics.

This module turns HTTP into :class:`GenerationRequest`s and engine events back into OpenAI JSON
or SSE chunks; it holds no model code. Errors always use OpenAI's error body; an unexpected
exception is logged and answered with a 500 that carries no traceback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from symbiosis.errors import ExecutorTimeoutError, ExecutorUnavailableError, SymbiosisError
from symbiosis.jobs.client import start_token_id
from symbiosis.serving.adapters import UnknownAdapterError
from symbiosis.serving.engine import (
    EXECUTOR_UNAVAILABLE,
    Delta,
    Failure,
    GenerationEngine,
    GenerationRequest,
    RequestTooLargeError,
    ServerOverloadedError,
    TooManySequencesError,
    Usage,
)
from symbiosis.serving.logprobs import LogprobFormatter
from symbiosis.serving.metrics import ServingMetrics
from symbiosis.serving.sampling import SamplingParams
from symbiosis.serving.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadAdapterRequest,
    SamplingFields,
    TokenizeRequest,
    UnloadAdapterRequest,
)

log = logging.getLogger("symbiosis.api")


class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class _AnswerUnexpectedErrors:
    """ASGI middleware: an exception no handler took becomes OpenAI's 500 body *here*, and the
    connection stays open. Why not ``exception_handler(Exception)`` alone: Starlette runs that one
    in its outermost middleware, which sends the 500 and then re-raises, and uvicorn then closes
    the connection, so the client's next request on it (the ``openai`` package keeps connections
    alive) fails with a reset. An error after the response began (a stream) still propagates:
    closing the connection is then the only way to tell the client."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception:
            if started:
                raise
            log.exception("unexpected error while answering a request")
            await _internal_error().response()(scope, receive, send)


def _internal_error() -> ApiError:
    return ApiError(500, "internal server error; see the server log", "internal_error")


_last_unavailable: list[str] = [""]


def log_unavailable(detail: str) -> None:
    """Log why the executor cannot answer, once per distinct reason (an outage fails every request)."""
    if detail != _last_unavailable[0]:
        _last_unavailable[0] = detail
        log.warning("executor unavailable: %s", detail)


#: ``top_k`` beyond this is sent as this: the same (no cut, larger than any vocabulary), and it
#: fits the engine process's wire, whose integers are 64-bit.
TOP_K_CAP = 2**31 - 1


def _not_found(model: str) -> ApiError:
    # The same answer for a missing adapter and one the key may not use (tenants cannot probe).
    return ApiError(
        404, f"The model `{model}` does not exist.", "not_found_error", param="model", code="model_not_found"
    )


@dataclass
class ApiConfig:
    served_model_name: str
    max_context: int
    # API key -> adapter names it may use (None: all). Empty dict: no authentication.
    api_keys: dict[str, frozenset[str] | None] = field(default_factory=dict)
    allow_adapter_updates: bool = False
    retry_after_s: int = 1
    default_completion_tokens: int = 16  # OpenAI's default for /v1/completions


@dataclass
class ApiState:
    engine: GenerationEngine
    tokenizer: Any
    config: ApiConfig
    metrics: ServingMetrics
    health_probe: Any  # () -> None, raises if the executor cannot answer
    created: int = field(default_factory=lambda: int(time.time()))


# ---- one generation: events from the engine thread into asyncio -----------------------------------


class _Mailbox:
    """Events from the engine thread into the event loop, one wake-up per burst.

    A decode step produces one event per running sequence; waking the loop once per event
    (``call_soon_threadsafe`` each) costs the loop a wake-up and the engine a GIL hand-off per
    token. Events posted while a drain is pending ride along with it.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: deque[tuple[asyncio.Queue, Any]] = deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, queue: asyncio.Queue, item: Any) -> None:
        with self._lock:
            self._items.append((queue, item))
            if self._scheduled:
                return
            self._scheduled = True
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, deque()
            self._scheduled = False
        for queue, item in items:
            queue.put_nowait(item)


class _Choices:
    """The choices of one API request: submitted sequences and their events, in one queue."""

    def __init__(self, mailbox: _Mailbox) -> None:
        self.mailbox = mailbox
        self.queue: asyncio.Queue[tuple[int, Delta | Failure]] = asyncio.Queue()
        self.handles: list = []
        self.open = 0
        self.client_gone: asyncio.Future | None = None  # ``watch``: done when the client went away

    def sink_for(self, index: int):
        def sink(event: Delta | Failure) -> None:
            self.mailbox.post(self.queue, (index, event))

        return sink

    def ready(self) -> list[tuple[int, Delta | Failure]]:
        """Events already queued (without waiting)."""
        events = []
        while not self.queue.empty():
            index, event = self.queue.get_nowait()
            if isinstance(event, Failure) or event.finish_reason is not None:
                self.open -= 1
            events.append((index, event))
        return events

    async def next(self) -> tuple[int, Delta | Failure]:
        index, event = await self.queue.get()
        if isinstance(event, Failure) or event.finish_reason is not None:
            self.open -= 1
        return index, event

    def cancel(self) -> None:
        for handle in self.handles:
            handle.cancel()

    def watch(self, request: Request) -> asyncio.Future:
        """A task that ends when the request's client goes away (its ``http.disconnect``), started
        on the first call: Starlette's own ``listen_for_disconnect`` pattern, one task a request."""
        if self.client_gone is None:
            self.client_gone = asyncio.ensure_future(_client_goes_away(request))
        return self.client_gone

    def gone(self) -> bool:
        """Whether the watch saw the client go away (a watch that failed counts: its connection
        cannot be read, so nobody reads the answer either)."""
        watch = self.client_gone
        if watch is None or not watch.done() or watch.cancelled():
            return False
        if watch.exception() is not None:  # retrieved, or asyncio logs it as never retrieved
            log.debug("the disconnect watch failed: %r", watch.exception())
        return True

    def stop_watching(self) -> bool:
        """Stop the watch (a streamed answer's response listens itself, and two readers of one
        connection's messages would race); whether the client had gone away meanwhile."""
        gone = self.gone()
        if self.client_gone is not None and not self.client_gone.done():
            self.client_gone.cancel()
        return gone


async def _client_goes_away(request: Request) -> None:
    """Returns once the ASGI server says the client disconnected (the body was read before: the
    next message is that one)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _failure_error(failure: Failure) -> ApiError:
    headers = {"Retry-After": "1"} if failure.status in (429, 503) else None
    return ApiError(failure.status, failure.message, failure.kind, headers=headers)


# ---- the app ---------------------------------------------------------------------------------------


def create_app(state: ApiState) -> FastAPI:
    app = FastAPI(title="Symbiosis OpenAI-compatible API", docs_url=None, redoc_url=None)
    config, engine = state.config, state.engine
    mailboxes: dict[asyncio.AbstractEventLoop, _Mailbox] = {}
    logprob_format = LogprobFormatter(state.tokenizer)

    def mailbox() -> _Mailbox:
        loop = asyncio.get_running_loop()
        if loop not in mailboxes:
            mailboxes[loop] = _Mailbox(loop)
        return mailboxes[loop]

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError):
        return _invalid_request(exc.errors()[0] if exc.errors() else {}).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, str(exc.detail), kind).response()

    @app.exception_handler(ExecutorUnavailableError)
    @app.exception_handler(ExecutorTimeoutError)
    async def _unavailable(_request: Request, exc: Exception):
        # The executor or the engine process (``engine_process.py``) cannot answer: try again later.
        # The detail names the executor's address, the server's business, not its clients': logged.
        log_unavailable(str(exc))
        return ApiError(
            503, EXECUTOR_UNAVAILABLE, "service_unavailable", headers={"Retry-After": str(config.retry_after_s)}
        ).response()

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception):  # what ``_AnswerUnexpectedErrors`` let through
        log.exception("unexpected error while answering a request")
        return _internal_error().response()

    app.add_middleware(_AnswerUnexpectedErrors)

    def allowed_adapters(request: Request) -> frozenset[str] | None:
        """Adapters the caller may use (None: all); 401 if keys are required and this one is wrong."""
        if not config.api_keys:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer":
            for key, scope in config.api_keys.items():
                if hmac.compare_digest(token.strip().encode(), key.encode()):
                    return scope
        raise ApiError(401, "Incorrect or missing API key (send 'Authorization: Bearer KEY').", code="invalid_api_key")

    def require_admin(request: Request) -> None:
        if allowed_adapters(request) is not None:
            raise ApiError(403, "this API key may not load or unload adapters", "permission_error")

    def resolve_adapter(model: str, scope: frozenset[str] | None) -> str | None:
        """The adapter a request names (None: the base model); 404 if missing or not the key's."""
        if model == config.served_model_name:
            return None
        if scope is not None and model not in scope:
            raise _not_found(model)
        try:
            engine.pool.path_of(model)
        except UnknownAdapterError:
            raise _not_found(model) from None
        return model

    # ---- models ------------------------------------------------------------------------------------

    def model_card(name: str, parent: str | None) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": state.created,
            "owned_by": "symbiosis",
            "root": name,
            "parent": parent,
            "max_model_len": config.max_context,
        }

    @app.get("/v1/models")
    async def list_models(request: Request):
        scope = allowed_adapters(request)
        names = [n for n in engine.pool.names() if scope is None or n in scope]
        base = model_card(config.served_model_name, None)
        return {"object": "list", "data": [base, *(model_card(name, config.served_model_name) for name in names)]}

    @app.get("/v1/models/{model:path}")  # ``client.models.retrieve``; ``path``: adapter names may hold a '/'
    async def retrieve_model(model: str, request: Request):
        adapter = resolve_adapter(model, allowed_adapters(request))  # 404 as for a request naming it
        return model_card(model, None if adapter is None else config.served_model_name)

    # ---- generation ----------------------------------------------------------------------------------

    def check_vocabulary(ids, param: str) -> None:
        if any(t < 0 or t >= len(state.tokenizer) for t in ids):
            raise ApiError(
                400, f"{param}: token ids out of the vocabulary (0 to {len(state.tokenizer) - 1})", param=param
            )

    def prompt_token_ids(body: CompletionRequest) -> list[list[int]]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
            token_lists = [prompt] if isinstance(prompt[0], int) else prompt  # one prompt's ids, or several
            for ids in token_lists:
                check_vocabulary(ids, "prompt")
            return [list(ids) for ids in token_lists]
        texts = [prompt] if isinstance(prompt, str) else prompt
        return [_encode(state.tokenizer, text, add_special_tokens=True) for text in texts]

    def prompt_texts(body: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """What ``echo`` puts before each prompt's completions: the prompt as given, or decoded."""
        if isinstance(body.prompt, str):
            return [body.prompt]
        if isinstance(body.prompt[0], str):
            return list(body.prompt)
        return [state.tokenizer.decode(ids) for ids in prompts]  # token ids: their text

    def chat_token_ids(body: ChatCompletionRequest | TokenizeRequest, generation_prompt: bool = True) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        tokenizer = state.tokenizer
        if getattr(tokenizer, "chat_template", None):
            try:
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
            except Exception as exc:  # noqa: BLE001 (a template may raise anything for messages it rejects, e.g. role order)
                raise ApiError(400, f"messages: the chat template refused them: {exc}", param="messages") from None
            return _encode(tokenizer, text, add_special_tokens=False)
        # No chat template: a plain transcript the model continues as the assistant.
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant:" if generation_prompt else "")
        return _encode(tokenizer, text, add_special_tokens=True)

    def sampling_params(body: SamplingFields, prompt_len: int, default_tokens: int | None) -> SamplingParams:
        room = config.max_context - prompt_len
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        if max_tokens is None:
            max_tokens = min(default_tokens, room) if default_tokens is not None else room
        echo = getattr(body, "echo", False)
        check_vocabulary(body.logit_bias or (), "logit_bias")
        check_vocabulary(body.stop_token_ids or (), "stop_token_ids")
        if max_tokens < (0 if echo else 1) or prompt_len + max_tokens > config.max_context:
            raise ApiError(
                400,
                f"This model's maximum context length is {config.max_context} tokens. However, you requested "
                f"{prompt_len + max(max_tokens, 1)} tokens ({prompt_len} in the prompt, {max(max_tokens, 1)} in the "
                "completion). Please reduce the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        if body.min_tokens > max_tokens:
            message = f"min_tokens: {body.min_tokens} is more than max_tokens, {max_tokens}"
            raise ApiError(400, message, param="min_tokens")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=min(max(body.top_k, 0), TOP_K_CAP),  # a cut at or past the vocabulary's size keeps all of it
            seed=body.seed,
            stop=tuple(body.stop or ()),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logprobs=body.wanted_logprobs(),
            prompt_logprobs=body.wanted_logprobs() if echo else None,
            logit_bias=tuple(sorted((body.logit_bias or {}).items())),
            min_p=body.min_p,
            min_tokens=body.min_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
        )

    def submit_all(prompts: list[list[int]], adapter: str | None, body: SamplingFields, default_tokens) -> _Choices:
        """The request's choices (``n`` a prompt), queued together or refused together (``engine.submit_all``)."""
        choices = _Choices(mailbox())
        requests = []
        for ids in prompts:
            param = sampling_params(body, len(ids), default_tokens)
            for copy in range(body.n):
                # With a seed, the n choices of a prompt draw from seed, seed + 1, ... (as vLLM
                # does): each is reproducible, and they are not n copies of one sample.
                if copy and param.seed is not None:
                    param = dataclasses.replace(param, seed=param.seed + 1)
                requests.append(GenerationRequest(ids, adapter, param, choices.sink_for(len(requests))))
        try:
            choices.handles = engine.submit_all(requests)
        except ServerOverloadedError as exc:
            raise ApiError(
                429, str(exc), "rate_limit_error", headers={"Retry-After": str(config.retry_after_s)}
            ) from None
        except TooManySequencesError as exc:  # never fits, however long the client waits: not a 429
            raise ApiError(400, str(exc), param="n") from None
        except RequestTooLargeError as exc:
            raise ApiError(400, str(exc), param="max_tokens") from None
        choices.open = len(requests)
        return choices

    async def next_while_connected(choices: _Choices, request: Request) -> tuple[int, Delta | Failure]:
        """The next event, or ``ApiError`` 499 once the client went away (the caller cancels the
        choices on any raise).

        Whether events flow or not: a prompt may wait in the queue or prefill for long before its
        first token, and a non-streamed request's events may flow for its whole generation
        (before, the check ran only after half a second without one, so an abandoned request ran
        to its end). Event-driven (``_Choices.watch``): it was a look every 0.25 s, so an
        abandoned request ran on for up to that long, and every wait for an event while none was
        queued cost a timer."""
        gone = choices.watch(request)
        if choices.gone():
            raise ApiError(499, "client closed the request")
        if not choices.queue.empty():  # a burst of a step's events: no task per event
            return await choices.next()
        event = asyncio.ensure_future(choices.next())
        try:
            await asyncio.wait((event, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not event.done():
                event.cancel()  # (a queue's get gives up its place without losing an item)
        if event.done() and not event.cancelled():
            return event.result()
        choices.gone()  # (reads a failed watch's exception)
        raise ApiError(499, "client closed the request")

    async def collect(choices: _Choices, request: Request) -> list[dict]:
        """Every choice's full text, or the first failure as an ApiError; cancels on disconnect."""
        texts: dict[int, list[str]] = {}
        tokens: dict[int, list[int]] = {}
        logprobs: dict[int, list] = {}
        prompt_logprobs: dict[int, tuple] = {}
        finish: dict[int, tuple[str, Any]] = {}
        try:
            while choices.open > 0:
                index, event = await next_while_connected(choices, request)
                if isinstance(event, Failure):
                    raise _failure_error(event)
                texts.setdefault(index, []).append(event.text)
                tokens.setdefault(index, []).extend(event.token_ids)
                logprobs.setdefault(index, []).extend(event.logprobs)
                if event.prompt_logprobs:
                    prompt_logprobs[index] = event.prompt_logprobs
                if event.finish_reason is not None:
                    finish[index] = (event.finish_reason, event.usage)
        except BaseException:
            choices.cancel()
            raise
        finally:
            choices.stop_watching()
        return [
            {
                "index": i,
                "text": "".join(texts.get(i, [])),
                "token_ids": tokens.get(i, []),
                "logprobs": logprobs.get(i, []),
                "prompt_logprobs": prompt_logprobs.get(i, ()),
                "finish_reason": finish[i][0],
                "usage": finish[i][1],
            }
            for i in sorted(finish)
        ]

    async def stream(
        choices: _Choices, request: Request, make_chunk, finish_chunks, include_usage: bool, n: int
    ) -> StreamingResponse:
        """Server-sent events of ``make_chunk(index, event)`` payloads, ending with ``data: [DONE]``
        (with ``include_usage``, after ``finish_chunks(usage)``; ``n`` choices a prompt, see ``_usage``).

        The first event is awaited before answering, so an error before the first token is a
        proper HTTP error; a client that goes away before it cancels its choices (before, they
        were prefilled and generated a token for nobody). Events that are ready together go out
        in one write.
        """
        try:
            first = await next_while_connected(choices, request)
            if choices.stop_watching():  # the response listens from here: it would not hear this one
                raise ApiError(499, "client closed the request")
        except BaseException:
            choices.cancel()
            choices.stop_watching()
            raise
        if isinstance(first[1], Failure):
            choices.cancel()
            raise _failure_error(first[1])

        async def events() -> AsyncIterator[bytes]:
            usages: list[tuple[int, Usage]] = []  # (choice, its usage) as each choice ends
            batch = [first]
            try:
                while batch:
                    out = []
                    for index, event in batch:
                        if isinstance(event, Failure):
                            error = _failure_error(event)
                            out.append(
                                _sse({"error": {"message": error.message, "type": error.kind, "code": error.status}})
                            )
                            choices.open = 0
                            break
                        out.extend(_sse(chunk) for chunk in make_chunk(index, event))
                        if event.usage is not None:
                            usages.append((index, event.usage))
                    if out:
                        yield b"".join(out)
                    if choices.open <= 0:
                        break
                    batch = [await choices.next()] + choices.ready()
                if include_usage:
                    yield _sse(finish_chunks(_usage(usages, n)))
                yield b"data: [DONE]\n\n"
            finally:
                choices.cancel()  # a client that went away frees its sequences at the next step

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        adapter = resolve_adapter(body.model, allowed_adapters(request))
        prompts = prompt_token_ids(body)
        choices = submit_all(prompts, adapter, body, config.default_completion_tokens)
        response_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def envelope(choice_list: list[dict], **extra) -> dict:
            return {
                "id": response_id,
                "object": "text_completion",
                "created": created,
                "model": body.model,
                "choices": choice_list,
                **extra,
            }

        wants_logprobs = body.logprobs is not None
        echoed_texts = prompt_texts(body, prompts) if body.echo else []

        def text_and_logprobs(index: int, text: str, entries, prompt_entries, offset: int) -> tuple[str, Any, int]:
            """A choice's text and ``logprobs`` (from ``offset``), led by its prompt's when echoing
            (``prompt_entries`` is not None: the choice's first event or its whole result)."""
            first_prompt_token = None
            if prompt_entries is not None:
                text = echoed_texts[index // body.n] + text
                entries = [*prompt_entries, *entries]
                first_prompt_token = prompts[index // body.n][0]
            if not wants_logprobs:
                return text, None, offset
            logprobs, offset = logprob_format.completion(entries, offset, first_prompt_token)
            return text, logprobs, offset

        if body.stream:
            offsets: dict[int, int] = {}  # where each choice's next token starts in its text

            def make_chunk(index: int, event: Delta):
                first = body.echo and index not in offsets
                wanted = event.text or event.finish_reason or body.return_token_ids or first
                if wanted or (wants_logprobs and event.token_ids):
                    prompt_entries = event.prompt_logprobs if first else None
                    text, logprobs, offsets[index] = text_and_logprobs(
                        index, event.text, event.logprobs, prompt_entries, offsets.get(index, 0)
                    )
                    choice = {
                        "index": index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": event.finish_reason,
                    }
                    if body.return_token_ids:
                        choice["token_ids"] = list(event.token_ids)
                    yield envelope([choice])

            return await stream(
                choices,
                request,
                make_chunk,
                lambda usage: envelope([], usage=usage),
                body.include_usage_in_stream,
                body.n,
            )
        results = await collect(choices, request)
        usage = _usage([(r["index"], r["usage"]) for r in results], body.n)
        out = []
        for r in results:
            prompt_entries = r["prompt_logprobs"] if body.echo else None
            text, logprobs, _ = text_and_logprobs(r["index"], r["text"], r["logprobs"], prompt_entries, 0)
            choice = {"index": r["index"], "text": text, "logprobs": logprobs, "finish_reason": r["finish_reason"]}
            if body.return_token_ids:
                choice.update(token_ids=r["token_ids"], prompt_token_ids=prompts[r["index"] // body.n])
            out.append(choice)
        return envelope(out, usage=usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        adapter = resolve_adapter(body.model, allowed_adapters(request))
        prompt = chat_token_ids(body)
        choices = submit_all([prompt], adapter, body, None)
        response_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def envelope(choice_list: list[dict], kind: str, **extra) -> dict:
            return {
                "id": response_id,
                "object": kind,
                "created": created,
                "model": body.model,
                "choices": choice_list,
                **extra,
            }

        wants_logprobs = body.wanted_logprobs() is not None
        if body.stream:
            started: set[int] = set()

            def make_chunk(index: int, event: Delta):
                if index not in started:
                    started.add(index)
                    delta = {"role": "assistant", "content": ""}
                    yield envelope(
                        [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}],
                        "chat.completion.chunk",
                    )
                if event.text or (wants_logprobs and event.logprobs):
                    delta = {"content": event.text}
                    logprobs = logprob_format.chat(event.logprobs) if wants_logprobs else None
                    yield envelope(
                        [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}],
                        "chat.completion.chunk",
                    )
                if event.finish_reason:
                    yield envelope(
                        [{"index": index, "delta": {}, "logprobs": None, "finish_reason": event.finish_reason}],
                        "chat.completion.chunk",
                    )

            return await stream(
                choices,
                request,
                make_chunk,
                lambda usage: envelope([], "chat.completion.chunk", usage=usage),
                body.include_usage_in_stream,
                body.n,
            )
        results = await collect(choices, request)
        return envelope(
            [
                {
                    "index": r["index"],
                    "message": {"role": "assistant", "content": r["text"]},
                    "logprobs": logprob_format.chat(r["logprobs"]) if wants_logprobs else None,
                    "finish_reason": r["finish_reason"],
                }
                for r in results
            ],
            "chat.completion",
            usage=_usage([(r["index"], r["usage"]) for r in results], body.n),
        )

    # ---- tokenizer (vLLM's extras: what a prompt costs, before sending it) ------------------------------

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        resolve_adapter(body.model, allowed_adapters(request))  # a model the key may use, as for generation
        if body.messages is not None:
            tokens = chat_token_ids(body, body.add_generation_prompt)
        else:
            tokens = _encode(state.tokenizer, body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": config.max_context, "tokens": tokens, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request):
        resolve_adapter(body.model, allowed_adapters(request))
        check_vocabulary(body.tokens, "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    # ---- adapters -------------------------------------------------------------------------------------

    if config.allow_adapter_updates:

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadAdapterRequest, request: Request):
            require_admin(request)
            try:
                await asyncio.to_thread(engine.pool.load, body.lora_name, body.lora_path)
            except (ExecutorUnavailableError, ExecutorTimeoutError):
                raise  # 503 (the engine process cannot answer), not the adapter's fault
            except ValueError as exc:
                raise ApiError(400, str(exc), param="lora_name") from None
            except SymbiosisError as exc:
                raise ApiError(400, str(exc), param="lora_path") from None
            return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadAdapterRequest, request: Request):
            require_admin(request)
            try:
                engine.pool.unload(body.lora_name)
            except UnknownAdapterError:
                raise _not_found(body.lora_name) from None
            return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    # ---- health and metrics -----------------------------------------------------------------------------

    probe_lock = asyncio.Lock()

    @app.get("/health")
    async def health():
        try:  # short: an engine process that cannot answer is the probe's to report
            known = await asyncio.wait_for(asyncio.to_thread(engine.stats), timeout=1.0)
        except Exception:  # noqa: BLE001 (including the timeout)
            known = {"executor_ok": True}
        if not known["executor_ok"]:  # the engine found it down and probes it until it is back: no wait here
            log_unavailable(known.get("executor_error") or "unavailable")
            reason = "executor: unavailable (probing until it answers; the server log says why)"
            return JSONResponse(
                {"status": "unavailable", "reason": reason},
                status_code=503,
                headers={"Retry-After": str(config.retry_after_s)},
            )
        async with probe_lock:  # one probe at a time, however many pollers
            try:
                await asyncio.wait_for(asyncio.to_thread(state.health_probe), timeout=3.0)
            except Exception as exc:  # noqa: BLE001 (any failure means: not ready)
                log_unavailable(str(exc) or type(exc).__name__)
                reason = "executor: did not answer the probe (the server log says why)"
                return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return {"status": "ok", **engine.stats()}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    return app


def _invalid_request(error: dict) -> ApiError:
    """A 400 for pydantic's (or FastAPI's) first validation ``error``, naming the field at fault."""
    context = error.get("ctx") or {}
    if error.get("type") == "json_invalid":
        # FastAPI puts the character's position where a field's name goes: it is no field.
        at = next((part for part in error.get("loc", ()) if isinstance(part, int)), None)
        where = f" at character {at}" if at is not None else ""
        return ApiError(400, f"the body is not valid JSON: {context.get('error', 'decode error')}{where}")
    location = [str(part) for part in error.get("loc", ()) if part != "body"]
    param = ".".join(location) or context.get("param")  # a request-level check names its field in ctx
    message = error.get("msg", "invalid request")
    # Our validators' ValueError/AssertionError come wrapped ("Value error, max_tokens: ..."): a
    # client reads the message alone, as OpenAI words it.
    for prefix in _PYDANTIC_PREFIXES:
        if message.startswith(prefix):
            message = message[len(prefix) :]
            break
    named = not param or message.startswith(f"{param}:")  # "stop: up to 8 ...", not "stop: stop: up to 8 ..."
    return ApiError(400, message if named else f"{param}: {message}", param=param)


#: What pydantic puts before the message of a ValueError or AssertionError a validator raised.
_PYDANTIC_PREFIXES = ("Value error, ", "Assertion failed, ")


def _usage(usages: list[tuple[int, Usage]], n: int) -> dict:
    """OpenAI's ``usage`` of a request from its choices' (index, usage), streamed or not. The ``n``
    choices of a prompt (indices ``k * n`` to ``k * n + n - 1``) share its prompt tokens: counted
    once a prompt, as OpenAI and vLLM do (a stream used to count them once a choice)."""
    prompt = sum(usage.prompt_tokens for index, usage in usages if index % n == 0)
    completion = sum(usage.completion_tokens for _, usage in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _encode(tokenizer, text: str, *, add_special_tokens: bool) -> list[int]:
    # verbose=False: a prompt over the context length is refused with a 400 naming both lengths, not
    # logged by the tokenizer as well
    ids = tokenizer(text, add_special_tokens=add_special_tokens, verbose=False)["input_ids"]
    return list(ids) if ids else [start_token_id(tokenizer)]  # an empty prompt, as generate's


def _sse(payload: dict) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"
