"""Continuous batching: one thread decodes every running sequence together, step after step.

Each step (1) drops cancelled sequences, (2) admits waiting ones while the batch has room (rows,
KV-cache bytes, adapter pool) and prefills them together, (3) runs one decode forward over all
running sequences — so each base layer gets one request carrying every running row — and
(4) hands each sequence its new text and retires finished ones, freeing their cache rows.

Long prefills go in chunks (``EngineOptions.prefill_chunk_tokens`` rows a forward, like vLLM's
chunked prefill), one chunk per step, the running sequences decoding between chunks; requests that
arrive meanwhile are admitted as a prefill group of their own, and a step's chunk comes from the
group with the least left, or from the oldest every other step when several are under way (a short
prompt is not held behind a long one's chunks, and a long one still advances). Two reasons.
On an executor shared with fine-tuning jobs, a base-layer request of more rows than the
executor's ``decode_share_rows`` is bulk work, served at the jobs' background priority and
shared with them: a 512-token prompt's time to first token was x2.1-2.2 of alone beside 2 jobs
over shm and x3.4 on a shared embedded executor (2026-11-28, before chunks); a chunk of at most
that many rows is latency work. And a long prompt no longer stops every running stream for its
whole prefill, only for a chunk's.
Rows mix adapters freely (``lora.RowAdapters``); the KV cache is one left-padded batch
(``kvcache.PaddedBatch``).

The engine knows nothing of HTTP: requests come in as :class:`GenerationRequest` with a ``sink``
called (from the engine thread) with :class:`Delta` and :class:`Failure` events.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from symbiosis.errors import ERRORS_BY_CODE, ExecutorTimeoutError, ExecutorUnavailableError, SymbiosisError
from symbiosis.serving.adapters import AdapterPool, UnknownAdapterError
from symbiosis.serving.detokenize import IncrementalText
from symbiosis.serving.kvcache import PaddedBatch, left_pad, roomy_cache
from symbiosis.serving.lora import AdapterContext, LoraAdapter, RowAdapters
from symbiosis.serving.sampling import (
    RowSampler,
    SamplingParams,
    TokenLogprobs,
    choose_tokens,
    prompt_logprobs,
    rows_logprobs,
)
from symbiosis.threads import with_torch_threads

log = logging.getLogger("symbiosis.api")

#: What an HTTP client is told when the executor cannot answer; not why: the detail names the
#: executor's address, the server's business, and the server log says it.
EXECUTOR_UNAVAILABLE = "the base executor is unavailable; try again later (the server log says why)"

#: While the executor is down, how often the engine probes it (``GenerationEngine._wait_for_executor``).
PROBE_EVERY_S = 1.0


class ServerOverloadedError(SymbiosisError):
    """The waiting queue is full; try again later (HTTP 429)."""

    code = "server_overloaded"


class RequestTooLargeError(SymbiosisError):
    """One request needs more than the server can ever give it (HTTP 400)."""

    code = "request_too_large"


class TooManySequencesError(RequestTooLargeError):
    """One request has more sequences (prompts x n) than the server takes at once (HTTP 400, on ``n``)."""

    code = "too_many_sequences"


# They cross from the API server's engine process (``engine_process.py``) to its HTTP side.
ERRORS_BY_CODE.update({cls.code: cls for cls in (ServerOverloadedError, RequestTooLargeError, TooManySequencesError)})


@dataclass(frozen=True)
class EngineOptions:
    max_batch_size: int = 32  # running sequences decoded together
    # Sequences running, prefilling or waiting at once (``--max-concurrent-requests``); a request
    # whose sequences would take more gets 429, one that has more itself 400 (``submit_all``).
    max_sequences: int = 256
    kv_cache_bytes: int = 2 << 30  # cap on the padded KV cache of the running batch
    max_prefill_tokens: int = 4096  # padded prompt tokens of the prompts admitted together
    # Rows (prompts x padded columns) of one prefill forward: a longer prefill runs in chunks of
    # columns, one per step (module doc). 0: one forward, however long. The default is the
    # executor's default ``decode_share_rows``: each chunk's base-layer requests are latency work.
    prefill_chunk_tokens: int = 256
    # A prefill with an echoing prompt keeps the logits of every position ([rows, columns,
    # vocab]) of every row: at most this many rows x columns (by default one full-context prompt's).
    max_echo_positions: int = 2048


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Delta:
    """New final text of a sequence; ``finish_reason`` ("stop", "length", "abort") on the last one.
    ``logprobs``: one per token of ``token_ids`` when the request asked for them, else empty;
    ``prompt_logprobs``: on a sequence's first event, one per prompt token after the first when
    the request asked for them (``SamplingParams.prompt_logprobs``), else empty."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass(frozen=True)
class Failure:
    """The sequence ended with an error; ``status`` is the HTTP status it maps to."""

    status: int
    message: str
    kind: str  # OpenAI error type, e.g. "service_unavailable"


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    adapter: str | None
    params: SamplingParams
    sink: Callable[[Delta | Failure], None]


@dataclass
class _Sequence:
    id: int
    request: GenerationRequest
    text: IncrementalText
    sampler: RowSampler
    arrived: float
    adapter: LoraAdapter | None = None
    output_ids: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    last_token_at: float | None = None
    cancelled: bool = False
    done: bool = False
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # computed at prefill, sent with the first event

    def take_prompt_logprobs(self) -> tuple[TokenLogprobs, ...]:
        taken, self.prompt_logprobs = self.prompt_logprobs, ()
        return taken

    @property
    def reserved_tokens(self) -> int:
        return len(self.request.prompt_ids) + self.request.params.max_tokens

    @property
    def remaining_tokens(self) -> int:
        return self.request.params.max_tokens - len(self.output_ids)


@dataclass
class _Prefill:
    """Admitted sequences whose prompts are being prefilled, a chunk of columns per step."""

    joiners: list[_Sequence]
    ids: torch.Tensor  # [rows, columns] left-padded prompts
    mask: torch.Tensor
    positions: torch.Tensor
    cache: object  # their own cache, merged into the running batch's after the last chunk
    adapters: RowAdapters
    echoing: list[bool]
    chunk_columns: int
    done_columns: int = 0
    echo_logits: torch.Tensor | None = None  # [rows, columns, vocab], every position's, when echoing

    @property
    def columns(self) -> int:
        return int(self.ids.shape[1])


class SequenceHandle:
    """What ``submit`` returns: cancel the sequence (a client went away)."""

    def __init__(self, engine: GenerationEngine, sequence: _Sequence) -> None:
        self._engine = engine
        self._sequence = sequence

    def cancel(self) -> None:
        self._engine._cancel(self._sequence)

    @property
    def done(self) -> bool:
        return self._sequence.done


class EngineHooks:
    """What the engine reports (the metrics module implements it); no-ops by default."""

    def queue_changed(self, running: int, waiting: int, cache_bytes: int, adapters_loaded: int) -> None: ...

    def first_token(self, seconds: float) -> None: ...

    def inter_token(self, seconds: float) -> None: ...

    def finished(self, seconds: float, prompt_tokens: int, completion_tokens: int, reason: str) -> None: ...


class GenerationEngine:
    """The continuous-batching loop over one split client model (see module doc)."""

    def __init__(
        self,
        model,
        tokenizer,
        pool: AdapterPool,
        adapter_context: AdapterContext,
        options: EngineOptions = EngineOptions(),
        hooks: EngineHooks | None = None,
        executor_probe: Callable[[], None] | None = None,
        latency_rows: Callable[[], int | None] | None = None,
    ) -> None:
        """``executor_probe``: one empty request to the executor, raising if it cannot answer.
        With it, an engine that lost its executor refuses new requests at once (503) and probes
        every ``PROBE_EVERY_S`` until the executor answers again (see ``_wait_for_executor``);
        without it, each request finds out for itself. ``latency_rows``: the executor's bound on a
        latency-work request (``BaseExecutor.latency_rows``, a remote executor's Welcome), asked at
        each prefill: chunks are no larger, whatever ``prefill_chunk_tokens`` says."""
        self.model = model
        self.latency_rows = latency_rows
        self.executor_probe = executor_probe
        self.tokenizer = tokenizer
        self.pool = pool
        self.context = adapter_context
        self.options = options
        self.hooks = hooks or EngineHooks()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.eos_ids = _eos_ids(model, tokenizer)
        self.device = next(model.parameters()).device
        parameters = inspect.signature(model.forward).parameters
        self._accepts_logits_to_keep = "logits_to_keep" in parameters
        # transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns, and goes in 5.40).
        self._cache_keyword = "cache" if "cache" in parameters else "past_key_values"
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        # Admitted sequences not yet in the batch, as prefill groups (oldest first) while their
        # chunks run. Replaced, never mutated, and under ``_cond``: ``stats`` reads it from other threads.
        self._prefills: list[_Prefill] = []
        self._oldest_turn = False  # whose chunk the next step runs when several groups are under way
        self._batch: PaddedBatch | None = None
        self._rows: RowAdapters | None = None  # adapters of the running rows, while they last
        self._stopping = False
        # The loop and a submitting thread both report the queue: a count taken before another's
        # must not reach the hooks after it (see ``_report_queue``).
        self._report_lock = threading.Lock()
        self.steps = 0
        self.peak_running = 0  # most sequences decoded together so far
        self.executor_ok = True
        self.last_error: str | None = None
        self.bytes_per_token = self._measure_cache_bytes_per_token()
        self._thread = threading.Thread(target=with_torch_threads(self._loop), name="symbiosis-api-engine", daemon=True)
        self._thread.start()

    # ---- API side (any thread) --------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> SequenceHandle:
        """Queue one sequence (``submit_all`` of one)."""
        return self.submit_all([request])[0]

    def submit_all(self, requests: list[GenerationRequest]) -> list[SequenceHandle]:
        """Queue the sequences of one API request (its prompts x ``n``) together, or none of them.

        ``RequestTooLargeError`` if they can never run (``TooManySequencesError``: more than
        ``max_sequences``; or one's KV cache over the cap); ``ServerOverloadedError`` if the
        sequences running, prefilling and waiting leave no room for them now. All or nothing: a
        request half queued would hold sequences whose siblings were refused (its client gets
        the error, not their text), and each part counted as waiting against the rest of it."""
        limit = self.options.max_sequences
        if len(requests) > limit:
            raise TooManySequencesError(
                f"this request has {len(requests)} sequences (prompts x n); the server runs or queues at most "
                f"{limit} at once. Send fewer prompts or a smaller n"
            )
        for request in requests:
            self._check_cache_room(request)
        now = time.monotonic()
        sequences = [self._sequence_of(request, now) for request in requests]
        with self._cond:
            if self._stopping:
                raise ServerOverloadedError("the server is shutting down")
            if not self.executor_ok and self.executor_probe is not None:  # the loop probes until it is back
                raise ExecutorUnavailableError(EXECUTOR_UNAVAILABLE)  # (the log has said why)
            in_flight = self._running_count() + len(self._waiting)
            if in_flight + len(sequences) > limit:
                raise ServerOverloadedError(
                    f"{in_flight} sequences are running or waiting and this request adds {len(sequences)}; "
                    f"the server takes {limit} at once. Try again later"
                )
            self._waiting.extend(sequences)
            self._cond.notify_all()
        self._report_queue()
        return [SequenceHandle(self, sequence) for sequence in sequences]

    def _check_cache_room(self, request: GenerationRequest) -> None:
        needed = len(request.prompt_ids) + request.params.max_tokens
        if needed * self.bytes_per_token > self.options.kv_cache_bytes:
            raise RequestTooLargeError(
                f"prompt + max_tokens = {needed} tokens need {needed * self.bytes_per_token >> 20} MiB of KV cache; "
                f"the server's cap is {self.options.kv_cache_bytes >> 20} MiB"
            )

    def _sequence_of(self, request: GenerationRequest, arrived: float) -> _Sequence:
        params = request.params
        return _Sequence(
            id=next(self._ids),
            request=request,
            text=IncrementalText(self.tokenizer, params.stop, params.min_tokens, params.include_stop_str_in_output),
            sampler=RowSampler(params, tuple(request.prompt_ids), frozenset(self.eos_ids)),
            arrived=arrived,
        )

    def _cancel(self, sequence: _Sequence) -> None:
        with self._cond:
            sequence.cancelled = True
            self._cond.notify_all()

    @property
    def _admitting(self) -> list[_Sequence]:
        """Sequences being prefilled (admitted, not yet in the running batch)."""
        return [sequence for prefill in self._prefills for sequence in prefill.joiners]

    def _running_count(self) -> int:
        """Sequences running, those being prefilled included (vLLM's way); under ``_cond``."""
        return len(self._running) + sum(len(prefill.joiners) for prefill in self._prefills)

    def stats(self) -> dict:
        with self._cond:
            return {
                "running": self._running_count(),
                "waiting": len(self._waiting),
                "kv_cache_bytes": self._batch.cache_bytes() if self._batch is not None else 0,
                "steps": self.steps,
                "peak_running": self.peak_running,
                "adapters_loaded": self.pool.loaded_count,
                "adapter_loads": self.pool.loads,
                "adapter_load_seconds": self.pool.load_seconds,
                "executor_ok": self.executor_ok,
                "executor_error": None if self.executor_ok else self.last_error,
            }

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        for sequence in [*self._waiting, *self._admitting, *self._running]:
            self._fail(sequence, Failure(503, "the server is shutting down", "service_unavailable"))

    # ---- the loop (engine thread) ------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._running and not self._prefills:
                    self._cond.wait()
                if self._stopping:
                    return
            try:
                self._step()
            except (ExecutorUnavailableError, ExecutorTimeoutError) as exc:
                log.warning("the base executor is unavailable: %s", exc)  # (its address: not for HTTP clients)
                failure = Failure(503, EXECUTOR_UNAVAILABLE, "service_unavailable")
                self._fail_all(failure)  # the batch's cache is unusable: its sequences end
                with self._cond:
                    self.last_error = str(exc)
                    self.executor_ok = self.executor_probe is not None  # without a probe: down until a step succeeds
                # A lost connection is down for sure; a timeout may be a slow but live executor,
                # which answers an empty probe at once: then the queue goes on.
                lost = isinstance(exc, ExecutorUnavailableError)
                if self.executor_probe is not None and (lost or not self._probe()):
                    self._wait_for_executor(failure)
            except Exception:  # noqa: BLE001 (a bug: log it, fail who was affected, keep serving the others)
                traceback.print_exc(file=sys.stderr)
                self._fail_all(Failure(500, "internal error while generating; see the server log", "internal_error"))
            self._report_queue()

    def _wait_for_executor(self, failure: Failure) -> None:
        """The executor is down (a lost connection, or a timeout and a failed probe): refuse new
        requests at once (``submit``: 503) and end the queued ones (they would wait for as long as
        it is down, and each would spend a connection timeout finding out), then probe every
        ``PROBE_EVERY_S`` until it answers or the engine stops. The executor keeps no state
        between calls, so serving resumes as soon as a probe gets through (a restarted
        ``symbiosis serve`` on the same address, a network back)."""
        with self._cond:
            self.executor_ok = False
            waiting, self._waiting = list(self._waiting), deque()
        for sequence in waiting:
            self._fail(sequence, failure)
        self._report_queue()
        while not self._probe():
            with self._cond:
                if self._stopping:
                    return
                self._cond.wait(PROBE_EVERY_S)
        with self._cond:
            self.executor_ok = True

    def _probe(self) -> bool:
        """Whether the executor answers an empty request. The probe runs on a thread of its own:
        it may block for a connection timeout, and ``close`` must not wait for it (False when the
        engine stops meanwhile)."""
        outcome: dict[str, BaseException | None] = {}

        def probe() -> None:
            try:
                self.executor_probe()
                outcome["error"] = None
            except Exception as exc:  # noqa: BLE001 (any failure means: still down)
                outcome["error"] = exc
            with self._cond:
                self._cond.notify_all()

        threading.Thread(target=probe, name="symbiosis-api-probe", daemon=True).start()
        with self._cond:
            while "error" not in outcome and not self._stopping:
                self._cond.wait()
            if "error" not in outcome:  # stopping
                return False
            error = outcome["error"]
            if error is not None:
                self.last_error = str(error) or type(error).__name__
            return error is None

    @torch.no_grad()
    def _step(self) -> None:
        self._drop_cancelled()
        joiners = self._admit()
        if joiners:
            try:
                prefill = self._start_prefill(joiners)
            except BaseException:  # not yet in a group, which ``_fail_all`` would end: end them here
                for sequence in joiners:
                    self._fail(
                        sequence, Failure(500, "internal error while admitting; see the server log", "internal_error")
                    )
                raise
            with self._cond:
                self._prefills = [*self._prefills, prefill]
        if self._prefills:
            self._prefill_chunk(self._next_prefill())
        if self._running:
            self._decode()
        self.steps += 1
        self.executor_ok = True

    def _next_prefill(self) -> _Prefill:
        """The group whose chunk runs this step: the one with the fewest columns left, or, every
        other step while several are under way, the oldest (so that arrivals of short prompts
        cannot hold a long one back for good)."""
        self._oldest_turn = not self._oldest_turn and len(self._prefills) > 1
        if self._oldest_turn:
            return self._prefills[0]
        return min(self._prefills, key=lambda prefill: prefill.columns - prefill.done_columns)

    def _drop_cancelled(self) -> None:
        with self._cond:
            for sequence in [s for s in self._waiting if s.cancelled]:
                self._waiting.remove(sequence)
                self._finish(sequence, "abort", emit=False)
        for prefill in [p for p in self._prefills if all(s.cancelled for s in p.joiners)]:
            for sequence in prefill.joiners:  # nobody waits for the rest of their prefill
                self._finish(sequence, "abort", emit=False)
            with self._cond:
                self._prefills = [p for p in self._prefills if p is not prefill]
        if any(s.cancelled for s in self._running):
            for sequence in self._running:
                if sequence.cancelled:
                    self._finish(sequence, "abort", emit=False)
            self._retire_done()

    def _admit(self) -> list[_Sequence]:
        """Waiting sequences (in arrival order) that fit the batch now."""
        joiners: list[_Sequence] = []
        while True:
            with self._cond:
                if not self._waiting:
                    break
                candidate = self._waiting[0]
                # A prompt whose log-probabilities are wanted (echo) makes its prefill keep the
                # logits of every position of every row ([rows, columns, vocab]): such a prefill
                # takes prompts while rows x columns stays within max_echo_positions (one
                # full-context prompt's, by default), so an evaluation harness's batch of short
                # scored prompts prefills together and the tensor stays bounded; a prefill without
                # one keeps only each row's last position.
                if joiners and any(map(_echoes, [candidate, *joiners])) and not self._echo_fits(joiners + [candidate]):
                    break
                if not self._fits(joiners + [candidate]) or (
                    candidate.request.adapter is not None and not self.pool.can_acquire(candidate.request.adapter)
                ):
                    break
                self._waiting.popleft()
            try:
                if candidate.request.adapter is not None:
                    candidate.adapter = self.pool.acquire(candidate.request.adapter)
            except UnknownAdapterError as exc:  # unloaded while the request waited
                self._fail(candidate, Failure(404, str(exc), "not_found_error"))
                continue
            except SymbiosisError as exc:  # a folder that cannot be read as a LoRA adapter
                self._fail(candidate, Failure(400, str(exc), "invalid_request_error"))
                continue
            joiners.append(candidate)
        return joiners

    def _echo_fits(self, joiners: list[_Sequence]) -> bool:
        columns = max(len(s.request.prompt_ids) for s in joiners)
        return len(joiners) * columns <= self.options.max_echo_positions

    def _fits(self, joiners: list[_Sequence]) -> bool:
        """Whether ``joiners`` fit beside the running sequences and those still prefilling."""
        admitting = self._admitting
        rows = len(self._running) + len(admitting) + len(joiners)
        if rows > self.options.max_batch_size:
            return False
        if (
            len(joiners) > 1
            and len(joiners) * max(len(s.request.prompt_ids) for s in joiners) > self.options.max_prefill_tokens
        ):
            return False
        everyone = self._running + admitting + joiners
        # The running batch gains a column every step until these prefills end: at most one step
        # per chunk of each group still prefilling and of the joiners' (one chunk a step).
        steps = sum(-(-(p.columns - p.done_columns) // p.chunk_columns) for p in self._prefills)
        steps += -(-max(len(s.request.prompt_ids) for s in joiners) // self._chunk_columns(joiners))
        columns = max(
            [self._batch.columns + steps if self._batch is not None else 0]
            + [len(s.request.prompt_ids) for s in admitting + joiners]
        )
        peak = rows * (columns + max(s.remaining_tokens for s in everyone)) * self.bytes_per_token
        return rows == 1 or peak <= self.options.kv_cache_bytes

    def _forward(
        self, input_ids, mask, positions, cache, rows: RowAdapters, last_only: bool, every_position: bool = False
    ) -> torch.Tensor:
        """The logits ``[rows, vocab]`` of the last position, or ``[rows, columns, vocab]`` of
        every position with ``every_position`` (a prompt's log-probabilities)."""
        self.context.rows = rows
        try:
            keep_one = last_only and not every_position and self._accepts_logits_to_keep
            kwargs = {"logits_to_keep": 1} if keep_one else {}
            output = self.model(
                input_ids=input_ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
                use_cache=True,
                **{self._cache_keyword: cache},
                **kwargs,
            )
        finally:
            self.context.rows = None
        return output.logits.float() if every_position else output.logits[:, -1].float()

    def _start_prefill(self, joiners: list[_Sequence]) -> _Prefill:
        ids, mask, positions = left_pad([s.request.prompt_ids for s in joiners], self.pad_id)
        chunk_columns = self._chunk_columns(joiners)
        # The first chunk allocates the cache with room for the later chunks and the tokens to come:
        # sized for the first chunk alone it would double at each chunk that outgrew it.
        room = ids.shape[1] - min(chunk_columns, ids.shape[1]) + max(s.remaining_tokens for s in joiners)
        return _Prefill(
            joiners=joiners,
            ids=ids,
            mask=mask,
            positions=positions,
            cache=roomy_cache(room),
            adapters=RowAdapters([s.adapter for s in joiners]),
            echoing=[_echoes(s) for s in joiners],
            chunk_columns=chunk_columns,
        )

    def _chunk_columns(self, joiners: list[_Sequence]) -> int:
        """Columns of one chunk of these prompts' prefill: at least one (a chunk then holds more
        rows than ``prefill_chunk_tokens`` only when more prompts than that were admitted together)."""
        chunk = self.chunk_tokens()
        if chunk <= 0:
            return max(len(s.request.prompt_ids) for s in joiners)
        return max(1, chunk // len(joiners))

    def chunk_tokens(self) -> int:
        """Rows of one prefill chunk (0: no chunks): the option, or the executor's latency bound
        when smaller (a chunk above it would be bulk work there, behind fine-tuning jobs)."""
        chunk = self.options.prefill_chunk_tokens
        bound = self.latency_rows() if self.latency_rows is not None else None
        return min(chunk, bound) if chunk > 0 and bound else chunk

    def _prefill_chunk(self, prefill: _Prefill) -> None:
        """The next chunk of ``prefill``'s columns; after the last, the joiners' first tokens and
        their place in the running batch."""
        start = prefill.done_columns
        end = min(prefill.columns, start + prefill.chunk_columns)
        last = end == prefill.columns
        echoing = any(prefill.echoing)
        logits = self._forward(
            prefill.ids[:, start:end],
            prefill.mask[:, :end],  # the cache's columns and this chunk's
            prefill.positions[:, start:end],
            prefill.cache,
            prefill.adapters,
            last_only=True,
            every_position=echoing,
        )
        prefill.done_columns = end
        if echoing:  # every position's logits, filled in place (a list joined at the end would peak at twice)
            if prefill.echo_logits is None:
                prefill.echo_logits = logits.new_empty((logits.shape[0], prefill.columns, logits.shape[-1]))
            prefill.echo_logits[:, start:end] = logits
        if last:
            self._finish_prefill(prefill, prefill.echo_logits if echoing else logits)

    def _finish_prefill(self, prefill: _Prefill, logits: torch.Tensor) -> None:
        joiners = prefill.joiners
        if any(prefill.echoing):
            for row, sequence in enumerate(joiners):
                if prefill.echoing[row]:
                    prompt = sequence.request.prompt_ids  # left-padded: its positions are the last ones
                    sequence.prompt_logprobs = prompt_logprobs(
                        logits[row, -len(prompt) :], prompt, sequence.request.params.prompt_logprobs
                    )
            logits = logits[:, -1].clone()  # not a view: the full tensor goes now
        batch = PaddedBatch(prefill.cache, prefill.mask, prefill.mask.sum(-1))
        if self._batch is not None:
            batch = self._batch.merge(batch, max(s.remaining_tokens for s in self._running + joiners))
        self._batch = batch
        with self._cond:
            self._running.extend(joiners)
            self._prefills = [p for p in self._prefills if p is not prefill]
            self.peak_running = max(self.peak_running, len(self._running))
        self._rows = None
        self._append_all(joiners, logits)
        self._retire_done()
        # The batch grew; and an engine in its own process sends the first tokens now rather
        # than after this step's decode forward (``engine_process._Outbox``): TTFT p50 210 -> 178 ms, 16 streams.
        self._report_queue()

    def _decode(self) -> None:
        running = self._running
        batch = self._batch
        last = torch.tensor([[s.output_ids[-1]] for s in running], dtype=torch.long)
        mask = torch.cat([batch.mask, batch.mask.new_ones((batch.rows, 1))], dim=1)
        if self._rows is None:
            self._rows = RowAdapters([s.adapter for s in running])
        logits = self._forward(last, mask, batch.positions[:, None], batch.cache, self._rows, last_only=False)
        batch.mask, batch.positions = mask, batch.positions + 1
        self._append_all(running, logits)
        self._retire_done()

    def _append_all(self, sequences: list[_Sequence], logits: torch.Tensor) -> None:
        """Each sequence's next token from its row of ``logits``, with its log-probabilities if asked."""
        failures: dict[int, Exception] = {}
        tokens = choose_tokens(logits, [s.sampler for s in sequences], failures)
        for row, exc in failures.items():  # a bug one request's sampling found ends that request only
            traceback.print_exception(exc, file=sys.stderr)
            self._fail(
                sequences[row], Failure(500, "internal error while sampling; see the server log", "internal_error")
            )
        asking = [
            row for row, s in enumerate(sequences) if s.request.params.logprobs is not None and row not in failures
        ]
        found = {}
        if asking:  # one log-softmax and one top-k for every row that asks
            tops = [sequences[row].request.params.logprobs for row in asking]
            found = dict(zip(asking, rows_logprobs(logits[asking], [tokens[row] for row in asking], tops)))
        for row, (sequence, token) in enumerate(zip(sequences, tokens)):
            if sequence.done:  # failed above
                continue
            if sequence.request.params.max_tokens == 0:  # only the prompt's log-probabilities were wanted
                self._finish(sequence, "length")
                continue
            self._append(sequence, token, (found[row],) if row in found else ())

    def _append(self, sequence: _Sequence, token: int, logprobs: tuple[TokenLogprobs, ...] = ()) -> None:
        now = time.monotonic()
        if sequence.first_token_at is None:
            sequence.first_token_at = now
            self.hooks.first_token(now - sequence.arrived)
        else:
            self.hooks.inter_token(now - sequence.last_token_at)
        sequence.last_token_at = now
        sequence.output_ids.append(token)
        params = sequence.request.params
        if token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos):
            self._finish(sequence, "stop", token=token, logprobs=logprobs)
            return
        delta = sequence.text.add(token)
        if sequence.text.stopped:
            self._finish(sequence, "stop", token=token, delta=delta, logprobs=logprobs)
        elif len(sequence.output_ids) >= params.max_tokens:
            self._finish(sequence, "length", token=token, delta=delta, logprobs=logprobs)
        else:  # every token gets an event (token counts); the API skips empty text in streams
            sequence.request.sink(
                Delta(delta, (token,), logprobs=logprobs, prompt_logprobs=sequence.take_prompt_logprobs())
            )

    def _finish(
        self,
        sequence: _Sequence,
        reason: str,
        *,
        token: int | None = None,
        delta: str = "",
        emit: bool = True,
        logprobs: tuple[TokenLogprobs, ...] = (),
    ) -> None:
        if sequence.done:
            return
        sequence.done = True
        if sequence.adapter is not None:
            self.pool.release(sequence.adapter)
        usage = Usage(len(sequence.request.prompt_ids), len(sequence.output_ids))
        self.hooks.finished(time.monotonic() - sequence.arrived, usage.prompt_tokens, usage.completion_tokens, reason)
        if emit:
            text = delta + sequence.text.finish()
            tokens = (token,) if token is not None else ()
            sequence.request.sink(Delta(text, tokens, reason, usage, logprobs, sequence.take_prompt_logprobs()))

    def _fail(self, sequence: _Sequence, failure: Failure) -> None:
        if sequence.done:
            return
        sequence.done = True
        if sequence.adapter is not None:
            self.pool.release(sequence.adapter)
        sequence.request.sink(failure)

    def _fail_all(self, failure: Failure) -> None:
        """After a failed forward the batch's cache is unusable: end every admitted sequence."""
        for sequence in [*self._admitting, *self._running]:
            self._fail(sequence, failure)
        with self._cond:
            self._running, self._prefills = [], []
        self._batch, self._rows = None, None

    def _retire_done(self) -> None:
        keep = [i for i, s in enumerate(self._running) if not s.done]
        if len(keep) == len(self._running):
            return
        with self._cond:
            self._running = [self._running[i] for i in keep]
        if keep:
            self._batch = self._batch.select(keep, max(s.remaining_tokens for s in self._running))
        else:
            self._batch = None
        self._rows = None

    def _report_queue(self) -> None:
        # Counted and reported under one lock, so reports arrive in the order they were counted:
        # without it the loop's count after a first prefill (1 running, 1 waiting) could land after
        # the submits that followed, and stay until the next step -- a SIGTERM then printed
        # "2 sequence(s) in flight" of 16, and /metrics showed the stale gauges.
        with self._report_lock:
            stats = self.stats()
            self.hooks.queue_changed(
                stats["running"], stats["waiting"], stats["kv_cache_bytes"], stats["adapters_loaded"]
            )

    def _measure_cache_bytes_per_token(self) -> int:
        """KV-cache bytes one token takes, from a one-token forward (also checks the cache type)."""
        cache = roomy_cache(0)
        ids = torch.tensor([[self.pad_id]], dtype=torch.long)
        with torch.no_grad():
            self._forward(ids, torch.ones_like(ids), torch.zeros_like(ids), cache, RowAdapters([None]), last_only=True)
        return max(1, PaddedBatch(cache, torch.ones_like(ids), torch.zeros(1, dtype=torch.long)).cache_bytes())


def _echoes(sequence: _Sequence) -> bool:
    return sequence.request.params.prompt_logprobs is not None


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    return ids
