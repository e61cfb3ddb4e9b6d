"""The engine in a process of its own, beside the HTTP server's (``ApiOptions.engine_process``).

Why. In one process the HTTP server's event loop (an SSE write per token per stream, request
parsing) and the engine thread take turns on one interpreter lock, and every turn the loop takes
is a wait for the engine, which runs Python between its torch calls. Measured (2026-11-26, this
2-core host, the serving benchmark's 16 streams x 32 tokens, embedded executor, one torch
thread): the engine alone 545 tokens/s (median of 4 runs), behind the in-process HTTP server 464,
beside an HTTP server of the same load in another process 559. vLLM splits its API server and its
engine core the same way. With the executor in a third process (shm) on 2 cores the CPUs, not
the lock, are the limit: 408 alone, 368 with the in-process server, 359 beside one elsewhere.

Parent side, :class:`RemoteEngine`: what ``app.py`` uses of the engine (``submit_all`` and the
handle's ``cancel``, ``stats``, ``pool``, ``close``) and a ``probe`` of the executor. Child side,
``python -m symbiosis.serving.engine_process COMMANDS EVENTS PARENT_PID``: builds the split client, adapter
pool and engine exactly as the in-process server does (``server.build_engine``) and serves them.

Wire: two ZeroMQ ipc sockets in a folder only this user can open (commands parent -> child,
events and replies child -> parent), messages encoded with msgspec's msgpack: plain values only,
nothing is unpickled. The child sends one message per engine step with every sequence's new text
and the metrics hooks' calls of that step, so the parent's event loop wakes once per step.
The child exits when told to, or when its parent is gone.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import msgspec

from symbiosis.errors import ExecutorTimeoutError, ExecutorUnavailableError, SymbiosisError, error_from_code
from symbiosis.serving.engine import Delta, EngineHooks, Failure, GenerationRequest, Usage
from symbiosis.serving.engine_spawn import SpawnedEngine, spawn_engine_process
from symbiosis.serving.sampling import SamplingParams, TokenLogprobs

log = logging.getLogger("symbiosis.api")

READY_TIMEOUT_S = 600.0  # loading the model (and an embedded executor) in the child
# One command's answer. Most are asked from the HTTP server's event loop (a submit per request,
# an adapter lookup per request, /health's stats), which waits for them: short, so a wedged
# engine process stalls the streams for seconds, not a minute. An adapter load (from a worker
# thread) reads a folder, and may take longer.
CALL_TIMEOUT_S = 10.0
LOAD_TIMEOUT_S = 120.0
POLL_MS = 500  # how often a waiting side checks that the other is alive
STOP_WAIT_S = 10.0  # a stopping engine process's last events and exit; then it is killed

# Plain exceptions that cross as themselves; every SymbiosisError crosses by its ``code``
# (``errors.ERRORS_BY_CODE``, where the serving errors register too).
_BUILTIN_ERRORS: dict[str, type[Exception]] = {"value_error": ValueError, "runtime_error": RuntimeError}

_encoder = msgspec.msgpack.Encoder(enc_hook=str)  # Paths as strings
_decoder = msgspec.msgpack.Decoder()


def _error_of(exc: BaseException) -> list[str]:
    """[code, message]: a SymbiosisError's code; "value_error" for another ValueError; anything
    else is a bug there and a RuntimeError here (a 500, as in-process)."""
    if isinstance(exc, SymbiosisError):
        code = exc.code
    else:
        code = "value_error" if isinstance(exc, ValueError) else "runtime_error"
    return [code, str(exc) or type(exc).__name__]


def _raise(error: list[str]) -> None:
    code, message = error
    builtin = _BUILTIN_ERRORS.get(code)
    raise builtin(message) if builtin is not None else error_from_code(code, message)


def _event_payload(event: Delta | Failure) -> list:
    if isinstance(event, Failure):
        return ["failure", event.status, event.message, event.kind]
    usage = None if event.usage is None else [event.usage.prompt_tokens, event.usage.completion_tokens]
    return [
        "delta",
        event.text,
        list(event.token_ids),
        event.finish_reason,
        usage,
        _logprobs_payload(event.logprobs),
        _logprobs_payload(event.prompt_logprobs),
    ]


def _logprobs_payload(entries: tuple[TokenLogprobs, ...]) -> list:
    return [[e.token, e.logprob, [list(pair) for pair in e.top]] for e in entries]


def _logprobs_of(payload: list) -> tuple[TokenLogprobs, ...]:
    return tuple(TokenLogprobs(token, logprob, tuple(map(tuple, top))) for token, logprob, top in payload)


def _event_of(payload: list) -> Delta | Failure:
    if payload[0] == "failure":
        return Failure(payload[1], payload[2], payload[3])
    _, text, token_ids, finish_reason, usage, logprobs, prompt = payload
    usage = None if usage is None else Usage(*usage)
    return Delta(text, tuple(token_ids), finish_reason, usage, _logprobs_of(logprobs), _logprobs_of(prompt))


# ---- parent side ------------------------------------------------------------------------------------


class _RemoteHandle:
    def __init__(self, engine: RemoteEngine, sequence_id: int) -> None:
        self._engine = engine
        self._id = sequence_id

    def cancel(self) -> None:
        # A cancelled sequence ends without a last event (as in-process): forget its sink now.
        if self._engine._sinks.pop(self._id, None) is not None:
            try:
                self._engine._send({"op": "cancel", "id": self._id})
            except SymbiosisError:
                pass  # the engine process is gone: nothing runs there to cancel


class RemotePool:
    """The adapter pool's queries and updates, answered by the engine process."""

    def __init__(self, engine: RemoteEngine) -> None:
        self._engine = engine

    def names(self) -> list[str]:
        return self._engine._call("names")

    def path_of(self, name: str) -> Path:
        return Path(self._engine._call("path_of", name=name))

    def load(self, name: str, path: Path) -> None:
        self._engine._call("load", LOAD_TIMEOUT_S, name=name, path=str(path))

    def unload(self, name: str) -> None:
        self._engine._call("unload", name=name)

    @property
    def loaded_count(self) -> int:
        return self._engine.stats()["adapters_loaded"]

    @property
    def loads(self) -> int:
        return self._engine.stats()["adapter_loads"]


class RemoteEngine:
    """Starts the engine process and stands for its engine in this one (see module doc)."""

    def __init__(self, options, hooks: EngineHooks, spawned: SpawnedEngine | None = None) -> None:
        """``spawned``: an engine process started earlier (``engine_spawn``), adopted; else one is
        started now."""
        import torch
        import zmq

        spawned = spawned or spawn_engine_process()
        self.hooks = hooks
        self._folder = spawned.folder
        self._context = zmq.Context()
        self._commands = self._context.socket(zmq.PUSH)
        self._events = self._context.socket(zmq.PULL)
        for sock in (self._commands, self._events):
            sock.setsockopt(zmq.LINGER, 0)
        self._process = spawned.process
        self._send_lock = threading.Lock()
        self._sinks: dict[int, Any] = {}
        self._pending: dict[int, list] = {}  # call id -> [threading.Event, reply]
        self._ids = itertools.count(1)
        self._dead: str | None = None  # why the engine process is gone
        self._closed = False
        self._stop_receiving = False
        try:
            self._commands.bind(spawned.commands)
            self._events.bind(spawned.events)
            self._wait_connected()
            self._send({"op": "config", "options": _options_to_wire(options), "torch_threads": torch.get_num_threads()})
            ready = self._wait_ready()
        except BaseException:
            self._stop_process(wait_s=1.0)
            self._close_sockets()
            raise
        self.max_context: int = ready["max_context"]
        self.pool = RemotePool(self)
        self._receiver = threading.Thread(target=self._receive, name="symbiosis-api-engine-link", daemon=True)
        self._receiver.start()

    # ---- what app.py uses -------------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> _RemoteHandle:
        return self.submit_all([request])[0]

    def submit_all(self, requests: list[GenerationRequest]) -> list[_RemoteHandle]:
        """One request's sequences, queued together or refused together there (``GenerationEngine.submit_all``),
        in one round trip."""
        sequence_ids = [next(self._ids) for _ in requests]
        sequences, prompts, prompt_index = [], [], {}
        for sequence_id, request in zip(sequence_ids, requests):
            self._sinks[sequence_id] = request.sink
            # The n choices of a prompt share its ids (``app.submit_all``): sent once, not n times.
            index = prompt_index.setdefault(id(request.prompt_ids), len(prompts))
            if index == len(prompts):
                prompts.append(list(request.prompt_ids))
            sequences.append(
                {
                    "id": sequence_id,
                    "prompt": index,
                    "adapter": request.adapter,
                    "params": msgspec.to_builtins(request.params),
                }
            )
        answered = False
        try:
            reply = self._ask("submit", prompts=prompts, sequences=sequences)
            answered = True
            if reply.get("error") is not None:
                _raise(reply["error"])
        except BaseException:
            for sequence_id in sequence_ids:
                self._sinks.pop(sequence_id, None)
                if answered:
                    continue  # refused whole there (429, 400): nothing of it queued to cancel
                try:  # a submit that got no answer may still run there: commands arrive in order
                    self._send({"op": "cancel", "id": sequence_id})
                except SymbiosisError:
                    pass
            raise
        return [_RemoteHandle(self, sequence_id) for sequence_id in sequence_ids]

    def stats(self) -> dict:
        return self._call("stats")

    def probe(self) -> None:
        self._call("probe")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._send({"op": "stop"})
        except SymbiosisError:
            pass
        self._dead = self._dead or "the server is shutting down"  # later calls fail at once
        # The engine process ends its sequences with a 503 and says "stopped" before it tears
        # down (its executor, torch: seconds on a loaded host); the receiver delivers those 503s
        # and ends there, so the streams end now, not once the process has exited.
        deadline = time.monotonic() + STOP_WAIT_S
        self._receiver.join(timeout=STOP_WAIT_S)
        self._stop_process(wait_s=max(0.5, deadline - time.monotonic()))
        self._stop_receiving = True
        self._receiver.join(timeout=5)  # it sees _stop_receiving within POLL_MS
        self._close_sockets(events=not self._receiver.is_alive())
        self._fail_everything(Failure(503, "the server is shutting down", "service_unavailable"))

    # ---- mechanism ------------------------------------------------------------------------------------

    def _send(self, message: dict) -> None:
        if self._dead is not None and message.get("op") != "stop":
            raise ExecutorUnavailableError(f"the engine process is gone: {self._dead}")
        import zmq

        try:
            with self._send_lock:
                if self._commands.closed:
                    raise zmq.ZMQError(msg="closed")
                # Never blocks: with no engine process at the other end a send would wait for good.
                self._commands.send(_encoder.encode(message), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # zmq.Again: not connected (gone) or thousands of commands behind
            raise ExecutorUnavailableError(f"the engine process does not take commands: {exc}") from None

    def _call(self, op: str, timeout_s: float = CALL_TIMEOUT_S, **fields) -> Any:
        """``op``'s value from the engine process, or its error raised here."""
        reply = self._ask(op, timeout_s, **fields)
        if reply.get("error") is not None:
            _raise(reply["error"])
        return reply.get("value")

    def _ask(self, op: str, timeout_s: float = CALL_TIMEOUT_S, **fields) -> dict:
        """The engine process's reply to ``op`` (its value or its error); raises when none comes."""
        call_id = next(self._ids)
        done = threading.Event()
        self._pending[call_id] = [done, None]
        try:
            self._send({"op": op, "call": call_id, **fields})
            if not done.wait(timeout_s):
                raise ExecutorTimeoutError(f"the engine process did not answer {op!r} within {timeout_s:g} s")
            reply = self._pending[call_id][1]
        finally:
            self._pending.pop(call_id, None)
        if reply is None:
            raise ExecutorUnavailableError(f"the engine process is gone: {self._dead}")
        return reply

    def _wait_connected(self) -> None:
        import zmq

        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._commands.poll(POLL_MS, zmq.POLLOUT):
            if self._process.poll() is not None:
                raise ExecutorUnavailableError(
                    f"the engine process exited with status {self._process.returncode} while starting (see its log)"
                )
            if time.monotonic() > deadline:
                raise ExecutorTimeoutError(f"the engine process did not connect within {READY_TIMEOUT_S:g} s")

    def _wait_ready(self) -> dict:
        import zmq

        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._events.poll(POLL_MS, zmq.POLLIN):
                message = _decoder.decode(self._events.recv())
                if message.get("op") == "ready":
                    return message
                if message.get("op") == "failed":
                    _raise(message["error"])
            elif self._process.poll() is not None:
                raise ExecutorUnavailableError(
                    f"the engine process exited with status {self._process.returncode} while starting (see its log)"
                )
        raise ExecutorTimeoutError(f"the engine process was not ready within {READY_TIMEOUT_S:g} s")

    def _receive(self) -> None:
        import zmq

        while not self._stop_receiving:
            try:
                if not self._events.poll(POLL_MS, zmq.POLLIN):
                    if self._process.poll() is not None:
                        if not self._closed:
                            self._give_up(f"it exited with status {self._process.returncode}")
                        return  # closing: ``close`` ends what is left with its own 503
                    continue
                message = _decoder.decode(self._events.recv())
                op = message.get("op")
                if op == "stopped":
                    if self._closed:  # told to stop: its last events came before this
                        return
                    continue  # its loop ended on its own (a bug there): its exit is what tells
                if op == "reply":
                    pending = self._pending.get(message["call"])
                    if pending is not None:
                        pending[1] = message
                        pending[0].set()
                elif op == "events":
                    self._deliver(message)
            except zmq.ZMQError:
                return  # closed
            except Exception:  # noqa: BLE001 (a message we cannot read: nothing after it can be trusted)
                log.exception("bad message from the engine process; stopping it")
                self._process.kill()
                self._give_up("it sent a message the server could not read")
                return

    def _give_up(self, why: str) -> None:
        self._dead = why
        self._fail_everything(
            Failure(503, f"the engine process is gone ({why}); restart the server", "service_unavailable")
        )

    def _deliver(self, message: dict) -> None:
        # Hooks first, as in-process (the metrics count a token before its client sees it).
        for name, args in message["hooks"]:
            if name in _HOOKS:
                getattr(self.hooks, name)(*args)
        for sequence_id, payload in message["items"]:
            event = _event_of(payload)
            sink = self._sinks.get(sequence_id)
            if sink is None:
                continue
            if isinstance(event, Failure) or event.finish_reason is not None:
                self._sinks.pop(sequence_id, None)
            _safely(sink, event)

    def _fail_everything(self, failure: Failure) -> None:
        for call_id in list(self._pending):
            pending = self._pending.get(call_id)
            if pending is not None:
                pending[0].set()  # reply None: "gone"
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            _safely(sink, failure)

    def _stop_process(self, wait_s: float = 10.0) -> None:
        try:
            self._process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def _close_sockets(self, events: bool = True) -> None:
        """Close under the send lock (a late sender gets "gone", not a closed socket); the events
        socket only once the receiver thread is done with it (else it is left to the process)."""
        with self._send_lock:
            self._commands.close()
        if events:
            self._events.close()
            self._context.term()
        shutil.rmtree(self._folder, ignore_errors=True)


def _safely(sink, event) -> None:
    try:
        sink(event)
    except Exception:  # noqa: BLE001 (e.g. its event loop closed: the other sequences still get theirs)
        log.exception("could not deliver an event to a sequence")


_HOOKS = ("queue_changed", "first_token", "inter_token", "finished")


def _options_to_wire(options) -> dict:
    # What the child builds from (``server.build_engine``); the API keys stay here.
    return msgspec.to_builtins(dataclasses.replace(options, api_keys={}), enc_hook=str)


def _options_from_wire(wire: dict):
    from symbiosis.serving.server import ApiOptions

    return msgspec.convert(wire, ApiOptions, dec_hook=lambda kind, value: kind(value))  # Path(str)


# ---- child side ------------------------------------------------------------------------------------


class _Outbox(EngineHooks):
    """Collects the engine's events and hook calls; sends them as one message when the engine
    reports its queue (after every step, and when a request is queued)."""

    def __init__(self, send) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._items: list = []
        self._hooks: list = []

    def sink_for(self, sequence_id: int):
        def sink(event: Delta | Failure) -> None:
            with self._lock:
                self._items.append([sequence_id, _event_payload(event)])

        return sink

    def flush(self) -> None:
        with self._lock:  # swap and send as one: batches leave in the order they were made
            if not self._items and not self._hooks:
                return
            items, hooks, self._items, self._hooks = self._items, self._hooks, [], []
            self._send({"op": "events", "items": items, "hooks": hooks})

    def queue_changed(self, running: int, waiting: int, cache_bytes: int, adapters_loaded: int) -> None:
        with self._lock:
            self._hooks.append(["queue_changed", [running, waiting, cache_bytes, adapters_loaded]])
        self.flush()

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self._hooks.append(["first_token", [seconds]])

    def inter_token(self, seconds: float) -> None:
        with self._lock:
            self._hooks.append(["inter_token", [seconds]])

    def finished(self, seconds: float, prompt_tokens: int, completion_tokens: int, reason: str) -> None:
        with self._lock:
            self._hooks.append(["finished", [seconds, prompt_tokens, completion_tokens, reason]])


def serve(commands_address: str, events_address: str, parent: int) -> None:
    """The child: build the engine from the first message, then answer commands until told to stop."""
    import torch
    import zmq

    from symbiosis.heap import freeze_startup_heap
    from symbiosis.jobs.client import load_tokenizer
    from symbiosis.serving.server import build_engine, executor_target

    freeze_startup_heap(collect=False)  # the modules just imported (see heap.py)

    # Ctrl+C, or a stop signal to the whole process group, reaches the parent too, which finishes
    # what it serves and then stops us: going first would fail its last requests.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    context = zmq.Context()
    commands = context.socket(zmq.PULL)
    events = context.socket(zmq.PUSH)
    for sock in (commands, events):
        sock.setsockopt(zmq.LINGER, 1000)
    events.setsockopt(zmq.SNDTIMEO, 10_000)  # a parent that stopped reading: fail, do not hang
    commands.connect(commands_address)
    events.connect(events_address)
    send_lock = threading.Lock()

    def send(message: dict) -> None:
        with send_lock:
            if events.closed:
                raise zmq.ZMQError(msg="closed")
            events.send(_encoder.encode(message))

    def next_message() -> dict | None:
        while not commands.poll(POLL_MS, zmq.POLLIN):
            if os.getppid() != parent:
                return None  # the parent is gone
        return _decoder.decode(commands.recv())

    first = next_message()
    if first is None or first.get("op") != "config":
        return
    torch.set_num_threads(first["torch_threads"])
    target = parts = None
    outbox = _Outbox(send)
    try:
        options = _options_from_wire(first["options"])
        target = executor_target(options)
        parts = build_engine(options, target, None, load_tokenizer(options.model), outbox)
    except Exception as exc:  # noqa: BLE001 (reported to the parent, which raises it)
        send({"op": "failed", "error": _error_of(exc)})
        if target is not None:
            target.close()
        return
    engine, pool = parts.engine, parts.engine.pool
    freeze_startup_heap()  # what this process keeps while it serves: no collection walks it again
    send({"op": "ready", "max_context": parts.max_context})

    def answer(message: dict, work) -> None:
        try:
            reply = {"op": "reply", "call": message["call"], "value": work(), "error": None}
        except Exception as exc:  # noqa: BLE001 (any failure is the caller's answer)
            error = _error_of(exc)
            if error[0] == "runtime_error":  # not one of ours: a bug, logged here
                traceback.print_exc(file=sys.stderr)
            reply = {"op": "reply", "call": message["call"], "value": None, "error": error}
        try:
            send(reply)
        except zmq.ZMQError:
            pass  # closing

    def submit(message: dict) -> None:
        prompts = message["prompts"]  # each sequence names its prompt by index (``RemoteEngine.submit_all``)
        requests = [
            GenerationRequest(
                list(prompts[sequence["prompt"]]),
                sequence["adapter"],
                msgspec.convert(sequence["params"], SamplingParams),
                outbox.sink_for(sequence["id"]),
            )
            for sequence in message["sequences"]
        ]
        if len(handles) >= 64:  # forget finished sequences (their cancel is a no-op anyway)
            for sequence_id in [i for i, h in handles.items() if h.done]:
                del handles[sequence_id]
        queued = engine.submit_all(requests)
        handles.update(zip((sequence["id"] for sequence in message["sequences"]), queued))

    handles: dict[int, Any] = {}
    quick = {
        "submit": submit,
        "stats": lambda message: engine.stats(),
        "names": lambda message: pool.names(),
        "path_of": lambda message: str(pool.path_of(message["name"])),
        "unload": lambda message: pool.unload(message["name"]),
    }
    slow = {  # may take a while: answered from a thread of their own, so requests keep flowing
        "load": lambda message: pool.load(message["name"], Path(message["path"])) and None,
        "probe": lambda message: parts.probe(),
    }
    try:
        while True:
            message = next_message()
            if message is None or message.get("op") == "stop":
                break
            op = message.get("op")
            if op == "cancel":
                handle = handles.pop(message.get("id"), None)
                if handle is not None:
                    handle.cancel()
            elif op in quick:
                answer(message, functools.partial(quick[op], message))
            elif op in slow:
                work = functools.partial(slow[op], message)
                threading.Thread(target=answer, args=(message, work), daemon=True).start()
    finally:
        engine.close()  # what was in flight ends with a 503 "the server is shutting down"
        outbox.flush()
        if os.getppid() == parent:  # (a send to a parent that is gone waits out SNDTIMEO)
            try:
                send({"op": "stopped"})  # the parent ends its streams now, not when we have exited
            except zmq.ZMQError:
                pass
        target.close()
        with send_lock:  # a load or probe thread still answering gets "closed", not a crash
            events.close()
        commands.close()
        context.term()


if __name__ == "__main__":
    from symbiosis import heap

    heap.own_this_process()
    try:
        serve(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    finally:
        heap.skip_exit_collection()
