"""``symbiosis api``: build the split client, adapter pool, engine and app, and serve them (uvicorn).

The server is one client of the executor: an embedded one, or one at an address shared with
fine-tuning jobs and other servers. :class:`ApiServer` is what the CLI, the demo and the tests
start; ``start()`` runs uvicorn on a background thread, ``run()`` in the foreground.

Stopping (SIGINT/SIGTERM, or ``close()``), as vLLM's ``--shutdown-timeout`` does: uvicorn stops
taking connections at once; requests in flight get ``ApiOptions.shutdown_timeout_s`` to finish
(default 0), then the engine ends the rest with a 503 ("the server is shutting down") -- a
stream's last event is that error, then ``data: [DONE]`` -- and the process exits. Before, uvicorn
waited its own 5 s for streams that could not finish, then cancelled them: the client got a stream
cut mid-way, the log a traceback, and the process took ~9 s to exit.
"""

from __future__ import annotations

import math
import socket
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import torch

from symbiosis.errors import ERRORS_BY_CODE, ConfigurationError, SymbiosisError
from symbiosis.jobs.client import ClientOptions, ExecutorTarget, load_tokenizer
from symbiosis.serving.adapters import AdapterPool, check_adapter_name
from symbiosis.serving.app import ApiConfig, ApiState, create_app
from symbiosis.serving.engine import EngineOptions, GenerationEngine
from symbiosis.serving.lora import AdapterContext, check_lora_adapter, install_multi_lora, load_lora_adapter
from symbiosis.serving.metrics import ServingMetrics
from symbiosis.transport.schemes import is_loopback_host
from symbiosis.vocabulary import LatencyClass, Op


class ApiConfigError(SymbiosisError):
    """A bad ``symbiosis api`` option (keys file, adapter spec, host)."""

    code = "api_config"


ERRORS_BY_CODE[ApiConfigError.code] = ApiConfigError  # raised in the engine process too (engine_process.py)


@dataclass
class ApiOptions:
    model: Path
    client: ClientOptions
    adapters: dict[str, Path] = field(default_factory=dict)
    adapter_dir: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_keys: dict[str, frozenset[str] | None] = field(default_factory=dict)
    max_concurrent_requests: int = 256
    max_batch_size: int = 32
    max_loaded_adapters: int = 64
    kv_cache_mb: int = 2048
    # Rows of one prefill forward; longer prefills run in chunks (``EngineOptions``). 0: never split.
    prefill_chunk_tokens: int = 256
    allow_adapter_updates: bool = False
    allow_non_loopback: bool = False
    # The engine (split client, adapters, KV caches) in a process of its own, beside the HTTP
    # server's (``engine_process.py``): False keeps it on a thread of this process.
    engine_process: bool = False
    # With an embedded executor: also serve it to other clients (fine-tuning jobs, other servers)
    # at these loopback/ipc addresses, so they share the base while the server calls it in-process.
    executor_bind: tuple[str, ...] = ()
    # Once told to stop: how long requests in flight may still run before they end with a 503 (0:
    # at once). See the module doc.
    shutdown_timeout_s: float = 0.0


#: How long uvicorn waits for connections beyond ``shutdown_timeout_s`` (the engine has ended every
#: request by then; this covers writing their last events) before it cancels what is left.
SHUTDOWN_GRACE_S = 5.0


def parse_adapter_specs(specs: list[str]) -> dict[str, Path]:
    """``NAME=DIR`` strings → {name: folder}."""
    adapters: dict[str, Path] = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not folder:
            raise ApiConfigError(f"--adapter {spec!r}: expected NAME=DIR")
        try:
            check_adapter_name(name)
        except ValueError as exc:
            raise ApiConfigError(f"--adapter {spec!r}: {exc}") from None
        if name in adapters:
            raise ApiConfigError(f"--adapter name {name!r} given twice")
        adapters[name] = Path(folder)
    return adapters


def read_api_keys(keys: list[str], keys_file: Path | None) -> dict[str, frozenset[str] | None]:
    """``--api-key`` values (any adapter) plus ``--api-keys FILE`` lines ``KEY [ADAPTER ...]``."""
    result: dict[str, frozenset[str] | None] = {key: None for key in keys}
    if keys_file is not None:
        try:
            lines = Path(keys_file).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ApiConfigError(f"cannot read --api-keys {str(keys_file)!r}: {exc.strerror or exc}") from None
        for line in lines:
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            result[words[0]] = frozenset(words[1:]) if len(words) > 1 else None
    for key in result:
        if len(key) < 8:
            raise ApiConfigError("API keys must be at least 8 characters")
    return result


def _max_context(model, tokenizer) -> int:
    """The model's context (``jobs.context.context_length``, as ``symbiosis generate`` reads it),
    else the tokenizer's, else 2048."""
    from symbiosis.jobs.context import context_length

    value = context_length(model.config.to_dict())
    if value is not None:
        return value
    value = getattr(tokenizer, "model_max_length", None)
    return value if isinstance(value, int) and 0 < value < 1 << 24 else 2048


def _uvicorn_server(config, on_exit):
    """uvicorn's Server, except that SIGINT/SIGTERM end ``serve()`` cleanly instead of being
    re-raised after shutdown (uvicorn's default kills the process before our cleanup runs), and
    call ``on_exit(forced)`` (``forced``: a second signal, uvicorn stops without waiting)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            forced = self.should_exit  # uvicorn: the second signal forces the exit
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()
            on_exit(forced)

    return Server(config)


def served_name_of(options: ApiOptions) -> str:
    """The base model's name in requests and /v1/models."""
    return options.served_model_name or Path(options.model).resolve().name


@dataclass
class EngineParts:
    """What serves generations: the split client model, its engine (which holds the adapter
    pool), the model's context length, and a probe of the executor."""

    model: object
    engine: GenerationEngine
    max_context: int
    probe: object  # () -> None; raises if the executor cannot answer


def build_engine(options: ApiOptions, target, executor, tokenizer, hooks) -> EngineParts:
    """The split client (of ``target``'s executor, or of ``executor`` when given: a
    ``BaseExecutor`` or an address), its multi-LoRA layers, adapter pool and engine.

    An embedded executor made for this server times its forms of decode-sized products first, as
    ``symbiosis serve`` does (``BaseExecutor.warm_up``): on first use each (weight shape, row
    count) was timed on the engine's thread, ~80 ms on the ~105M llama here, while every stream
    of that step waited. Here, not in the engine's thread: the forms are kept per torch thread
    count, which that thread takes from this one (``threads.with_torch_threads``)."""
    if executor is None and target.executor is not None:
        target.executor.warm_up(say=print)  # stdout, with the "serving ..." line: stderr is for errors
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if executor is None:
            model = target.client("symbiosis-api")
        else:
            import symbiosis

            model = symbiosis.load_client_model(
                options.model, executor=executor, client_id="symbiosis-api", timeout_s=options.client.timeout_s
            )
    output = model.get_output_embeddings()
    output_names = {name for name, module in model.named_modules() if module is output}
    context = AdapterContext()
    modules = frozenset(name for name, _ in model.named_modules() if name)
    shapes = install_multi_lora(model, context, output_names)
    # The model's modules an adapter may not target (embeddings, the output layer, norms...): an
    # adapter of a module in neither set was made for another model, and says so.
    others = modules - shapes.keys()
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    served_name = served_name_of(options)

    def load(name: str, path: Path):
        return load_lora_adapter(name, path, shapes, dtype=dtype, device=device, other_modules=others)

    def check(name: str, path: Path) -> None:
        check_lora_adapter(name, path, shapes, others)

    pool = AdapterPool(
        load,
        check=check,
        adapters=options.adapters,
        adapter_dir=options.adapter_dir,
        max_loaded=options.max_loaded_adapters,
        reserved_names=(served_name,),
    )
    batch = min(options.max_batch_size, options.max_concurrent_requests)
    max_context = _max_context(model, tokenizer)
    engine_options = EngineOptions(
        max_batch_size=batch,
        max_sequences=options.max_concurrent_requests,
        kv_cache_bytes=options.kv_cache_mb << 20,
        max_echo_positions=max_context,
        prefill_chunk_tokens=options.prefill_chunk_tokens,
    )

    def probe() -> None:
        """One empty request to the executor: raises if it cannot answer."""
        transport = model.symbiosis_transport
        spec = next(iter(transport.layer_specs().values()))
        transport.call(spec.layer_id, Op.FORWARD, torch.zeros((0, spec.in_features)), LatencyClass.DECODE)

    if options.executor_bind:  # before the engine's thread starts: a failed bind leaves nothing running
        share_embedded_executor(target, options.executor_bind)
    transport = model.symbiosis_transport
    engine = GenerationEngine(
        model,
        tokenizer,
        pool,
        context,
        engine_options,
        hooks,
        executor_probe=probe,
        latency_rows=lambda: getattr(transport, "latency_rows", None),
    )
    return EngineParts(model, engine, max_context, probe)


def executor_target(options: ApiOptions) -> ExecutorTarget:
    """Where the server's client gets its base layers (``--executor`` or ``--embedded``).

    An embedded executor shared with other processes (``--executor-bind``) on a CPU runs their
    bulk products (fine-tuning) on a background thread of its own at the OS's idle priority, as
    ``symbiosis serve`` does (``resolve_bulk_lane``): with the default in-process lane, the
    serving benchmark's co-serving phase measured a p95 inter-token latency of x5.5 of inference
    alone beside 2 fine-tuning jobs (2026-11-28)."""
    from symbiosis.executor.executor import parse_device
    from symbiosis.executor.scheduler_config import SchedulerConfig, resolve_bulk_lane

    config = None
    if options.executor_bind and options.client.embedded:
        device_type = parse_device(options.client.device).type
        config = resolve_bulk_lane(SchedulerConfig(), device_type, own_process=True)
    return ExecutorTarget(options.model, options.client, scheduler_config=config)


def check_executor_bind(addresses) -> None:
    """Refuse, before anything loads, an ``--executor-bind`` address other processes of other
    users or hosts could reach without a key: non-loopback tcp, abstract ipc (no file
    permissions), inproc (not reachable from another process at all)."""
    from symbiosis.transport.security import check_abstract_ipc
    from symbiosis.transport.zmq_server import check_bind_address

    for address in addresses:
        try:
            if address.startswith("inproc://"):
                raise ConfigurationError("inproc:// is not reachable from other processes; use ipc:///PATH")
            check_abstract_ipc(address, None)
            check_bind_address(address, allow_non_loopback=False)
        except SymbiosisError as exc:
            raise ApiConfigError(f"--executor-bind {address}: {exc}") from None


def share_embedded_executor(target, addresses) -> None:
    """Serve ``target``'s embedded executor at ``addresses`` too (``--executor-bind``): other
    clients share the base with the server, which keeps calling it in-process. Loopback and ipc
    only: an executor open to the network belongs behind ``symbiosis serve --curve-secret-key``.
    The servers stop with the executor (``target.close()``)."""
    for address in addresses:
        try:
            target.executor.serve(address, allow_non_loopback=False)
        except SymbiosisError as exc:
            raise ApiConfigError(f"--executor-bind {address}: {exc}") from None


class ApiServer:
    """Everything ``symbiosis api`` runs; ``start()`` (background) or ``run()`` (foreground)."""

    def __init__(self, options: ApiOptions, executor=None, spawned_engine=None) -> None:
        """``executor``: a ``BaseExecutor`` (or address) to use instead of ``options.client``'s
        executor/embedded choice (the demo shares its own executor this way). ``spawned_engine``:
        with ``options.engine_process``, an engine process started earlier to adopt
        (``engine_spawn``; ``symbiosis api`` starts it before importing this module). It is the
        caller's to discard if this raises."""
        self._spawned_engine = spawned_engine
        if not is_loopback_host(options.host) and not options.allow_non_loopback:
            raise ApiConfigError(
                f"--host {options.host} is not loopback; pass --allow-non-loopback (and --api-key) to expose the API"
            )
        if options.max_concurrent_requests < 1 or options.max_batch_size < 1:
            raise ApiConfigError("--max-concurrent-requests and --max-batch-size must be at least 1")
        if options.prefill_chunk_tokens < 0:
            raise ApiConfigError("--prefill-chunk-tokens must be 0 (never split a prefill) or more")
        if not options.shutdown_timeout_s >= 0 or math.isinf(options.shutdown_timeout_s):
            raise ApiConfigError("--shutdown-timeout must be 0 (end requests in flight at once) or more seconds")
        if options.executor_bind and (executor is not None or not options.client.embedded):
            raise ApiConfigError(
                "--executor-bind shares an --embedded executor; with --executor ADDRESS the jobs connect to that "
                "executor themselves"
            )
        check_executor_bind(options.executor_bind)
        self.options = options
        self._shared_executor = executor
        self.in_engine_process = options.engine_process and executor is None
        if spawned_engine is not None and not self.in_engine_process:
            raise ApiConfigError("spawned_engine is for an engine process (engine_process=True, no executor)")
        # Bound before anything loads (as vLLM does): a taken port fails now, not after the model
        # is read, and the port is ours while it loads. It listens once serving starts: until
        # then a connection is refused, not left hanging (a TCP probe must not read "ready").
        self._socket: socket.socket | None = self._bind()
        self.target = None
        self.engine = None
        try:
            # In engine-process mode the child makes the executor connection (or embedded executor).
            self.target = executor_target(options) if executor is None and not self.in_engine_process else None
            self._build(options)
        except BaseException:
            if self.engine is not None:
                self.engine.close()
            self._close_client()
            self._close_socket()
            raise
        self._uvicorn = None
        self._thread: threading.Thread | None = None
        self._stopping_lock = threading.Lock()
        self._stopper: threading.Thread | None = None  # ends the requests in flight (``_begin_stopping``)
        self._end_now = threading.Event()  # stop waiting for requests in flight

    def _build(self, options: ApiOptions) -> None:
        self.tokenizer = load_tokenizer(options.model)
        served_name = served_name_of(options)
        self.metrics = ServingMetrics(served_name)
        if self.in_engine_process:
            from symbiosis.serving.engine_process import RemoteEngine

            self.engine = RemoteEngine(options, self.metrics, self._spawned_engine)
            self.model = None  # it lives in the engine process
            max_context, probe = self.engine.max_context, self.engine.probe
        else:
            parts = build_engine(options, self.target, self._shared_executor, self.tokenizer, self.metrics)
            self.model, self.engine = parts.model, parts.engine
            max_context, probe = parts.max_context, parts.probe
        self.pool = self.engine.pool
        config = ApiConfig(
            served_model_name=served_name,
            max_context=max_context,
            api_keys=options.api_keys,
            allow_adapter_updates=options.allow_adapter_updates,
        )
        self.app = create_app(ApiState(self.engine, self.tokenizer, config, self.metrics, probe))
        self.served_model_name = served_name

    # ---- running -------------------------------------------------------------------------------------

    def _config(self):
        import uvicorn

        # http/loop "auto": httptools and uvloop (dependencies of ours) when they import, else h11
        # and asyncio. Every streamed token is an SSE write in this process, next to the engine
        # thread: with h11 and asyncio they cost ~8-10% of the tokens/s of 16 streams, with
        # httptools and uvloop ~2-4% (2026-11-25, /v1/completions under the serving benchmark's load).
        return uvicorn.Config(
            self.app,
            host=self.options.host,
            port=self.options.port,
            http="auto",
            loop="auto",
            log_level="warning",
            # The engine ends every request in flight after shutdown_timeout_s (``_begin_stopping``).
            timeout_graceful_shutdown=math.ceil(self.options.shutdown_timeout_s + SHUTDOWN_GRACE_S),
            lifespan="off",
        )

    @property
    def url(self) -> str:
        server = self._uvicorn
        if server is None or not server.started:
            raise RuntimeError("the server is not running")
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"  # an IPv6 address in brackets

    def _bind(self) -> socket.socket:
        """The server's socket, bound here so a taken port is a clear error, not uvicorn's exit."""
        host, port = self.options.host, self.options.port
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as create_server: TIME_WAIT is free
            sock.bind((host, port))
        except (OSError, OverflowError) as exc:  # taken, not ours, or no port at all (socket's OverflowError)
            sock.close()
            raise ApiConfigError(f"cannot listen on {host}:{port}: {getattr(exc, 'strerror', None) or exc}") from None
        sock.set_inheritable(True)
        return sock

    def _take_socket(self) -> socket.socket:
        """The socket for uvicorn, listening; uvicorn closes it when it stops (a new one if taken before)."""
        sock, self._socket = self._socket, None
        sock = sock if sock is not None else self._bind()
        try:
            sock.listen(2048)
        except OSError as exc:  # another program bound it too meanwhile (SO_REUSEADDR), and listened first
            sock.close()
            host, port = self.options.host, self.options.port
            raise ApiConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        return sock

    def _close_socket(self) -> None:
        sock, self._socket = self._socket, None
        if sock is not None:
            sock.close()

    def start(self, timeout_s: float = 30.0) -> str:
        """Serve on a background thread; returns the base URL once it accepts connections."""
        import uvicorn

        self._uvicorn = uvicorn.Server(self._config())
        sockets = [self._take_socket()]
        self._thread = threading.Thread(
            target=self._uvicorn.run, kwargs={"sockets": sockets}, name="symbiosis-api-http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ApiConfigError(f"the API server did not start on {self.options.host}:{self.options.port}")
            time.sleep(0.01)
        return self.url

    def run(self, on_ready=None) -> None:
        """Serve in this thread until SIGINT/SIGTERM; ``on_ready(url)`` once listening."""
        import asyncio

        def on_exit(forced: bool) -> None:
            in_flight = self.metrics.sequences_in_flight
            if not forced and in_flight:
                timeout = self.options.shutdown_timeout_s
                print(
                    f"stopping: {in_flight} sequence(s) in flight "
                    + (
                        f"have up to {timeout:g} s to finish, then end with 503 (Ctrl-C again to stop at once)"
                        if timeout
                        else "end now with 503 (--shutdown-timeout SECONDS lets them finish)"
                    ),
                    file=sys.stderr,
                    flush=True,
                )
            self._begin_stopping(forced)

        self._uvicorn = _uvicorn_server(self._config(), on_exit)

        async def serve() -> None:
            task = asyncio.create_task(self._uvicorn.serve(sockets=sockets))
            while not self._uvicorn.started and not task.done():
                await asyncio.sleep(0.01)
            if self._uvicorn.started and on_ready is not None:
                on_ready(self.url)
            await task

        try:
            sockets = [self._take_socket()]
            # uvloop when installed, as uvicorn's own ``run`` picks it (see ``_config``).
            with asyncio.Runner(loop_factory=self._uvicorn.config.get_loop_factory()) as runner:
                runner.run(serve())
        finally:
            self.close()

    def _begin_stopping(self, at_once: bool = False) -> None:
        """uvicorn stops taking connections: give the requests in flight ``shutdown_timeout_s``
        (none ``at_once``), then end what is left with a 503 so their responses complete and
        uvicorn's wait for them ends. On a thread of its own: called from a signal handler."""

        def end_requests_in_flight() -> None:
            self._end_now.wait(self.options.shutdown_timeout_s)
            if self.engine is not None:
                self.engine.close()  # every sequence left ends with 503 "the server is shutting down"

        if at_once:
            self._end_now.set()
        with self._stopping_lock:
            if self._stopper is None:
                self._stopper = threading.Thread(
                    target=end_requests_in_flight, name="symbiosis-api-stopping", daemon=True
                )
                self._stopper.start()

    def close(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            if self._thread is not None:  # ``start()``: run() stops on a signal (``_begin_stopping`` there)
                self._begin_stopping()
        if self._thread is not None:
            self._thread.join(timeout=self.options.shutdown_timeout_s + SHUTDOWN_GRACE_S + 5)
            self._thread = None
        self._begin_stopping(at_once=True)  # uvicorn is done (or never ran): end the engine now
        assert self._stopper is not None
        self._stopper.join()  # the one engine.close(), there
        self._close_client()
        self._close_socket()  # never served

    def _close_client(self) -> None:
        if self.target is not None:
            self.target.close()
        elif getattr(self, "model", None) is not None:
            self.model.symbiosis_transport.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
