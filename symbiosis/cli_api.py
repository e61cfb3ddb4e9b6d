"""``symbiosis api``: an OpenAI-compatible server for the base model and its LoRA adapters."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from symbiosis.cli_jobs import (
    ConnectTimeoutOpt,
    DeviceOpt,
    DtypeOpt,
    EmbeddedOpt,
    ExecutorOpt,
    ModelOpt,
    QuantizationOpt,
    TimeoutOpt,
    count_of,
)
from symbiosis.jobs.client import ClientOptions


def api_command(
    model: ModelOpt,
    executor: ExecutorOpt = None,
    embedded: EmbeddedOpt = False,
    adapter: Annotated[
        list[str] | None,
        typer.Option(
            "--adapter", help="A LoRA adapter to serve, as NAME=DIR (repeatable); requests name it in `model`."
        ),
    ] = None,
    adapter_dir: Annotated[
        Path | None,
        typer.Option(
            help="Serve every adapter folder under DIR by its folder name; folders added later are found on first use."
        ),
    ] = None,
    host: Annotated[
        str, typer.Option(help="Address to listen on. Loopback unless --allow-non-loopback.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0: any free port).", min=0, max=65535)] = 8000,
    served_model_name: Annotated[
        str | None,
        typer.Option(help="The base model's name in `model` and /v1/models (default: the model folder's name)."),
    ] = None,
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            "--api-key", help="Require 'Authorization: Bearer KEY' (repeatable); these keys may use every adapter."
        ),
    ] = None,
    api_keys: Annotated[
        Path | None,
        typer.Option(
            help=(
                "File of keys, one per line: 'KEY' (every adapter) or 'KEY ADAPTER...' (only those adapters; others "
                "answer 404). '#' starts a comment."
            )
        ),
    ] = None,
    max_concurrent_requests: Annotated[
        int, typer.Option(help="Sequences running or waiting at once; more get 429 with Retry-After.")
    ] = 256,
    max_batch_size: Annotated[int, typer.Option(help="Sequences decoded together in one step (the rest wait).")] = 32,
    max_loaded_adapters: Annotated[
        int, typer.Option(help="LoRA adapters held in memory (LRU); others are read from disk on first use.")
    ] = 64,
    kv_cache_mb: Annotated[
        int, typer.Option(help="Cap on the running batch's KV cache, in MiB; requests wait while it is full.")
    ] = 2048,
    prefill_chunk_tokens: Annotated[
        int,
        typer.Option(
            help=(
                "Rows (prompts x tokens) of one prefill forward. Longer prefills run in chunks, one per step, the "
                "running streams decoding between them; each chunk stays latency work on an executor shared with "
                "fine-tuning jobs (at most its --decode-share-rows, 256 by default), where a bigger prefill waits "
                "behind the jobs. 0: one forward, however long."
            )
        ),
    ] = 256,
    allow_adapter_updates: Annotated[
        bool,
        typer.Option(
            "--allow-adapter-updates",
            help=(
                "Enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (keys limited to some adapters may "
                "not use them)."
            ),
        ),
    ] = False,
    allow_non_loopback: Annotated[
        bool, typer.Option("--allow-non-loopback", help="Allow --host other than loopback (use with --api-key).")
    ] = False,
    engine_process: Annotated[
        bool,
        typer.Option(
            "--engine-process/--no-engine-process",
            help=(
                "Run the engine (split client, adapters, KV caches, an --embedded executor) in a process of its own "
                "beside the HTTP server's, as vLLM does: they stop taking turns on one interpreter lock (x1.12 "
                "tokens/s embedded on 2 cores; the same over shm, where the cores are the limit)."
            ),
        ),
    ] = True,
    executor_bind: Annotated[
        list[str] | None,
        typer.Option(
            "--executor-bind",
            help=(
                "With --embedded: also serve the embedded executor to other clients at ADDRESS (tcp://127.0.0.1:PORT "
                "or ipc:///PATH; same-host clients may connect with shm+ipc://PATH), repeatable. Fine-tuning jobs "
                "(`symbiosis finetune --executor ADDRESS --publish-to URL`) then share the base while the server "
                "calls it in-process, faster than `--executor` over shm when the host is small. Loopback tcp or an "
                "ipc socket file only, and unauthenticated: every local user who can reach it may call the base "
                "layers (for keys, run `symbiosis serve --curve-secret-key` and `api --executor` instead)."
            ),
        ),
    ] = None,
    shutdown_timeout: Annotated[
        float,
        typer.Option(
            help=(
                "Seconds that requests in flight may still run once the server is told to stop (SIGINT/SIGTERM); "
                "then they end with a 503 (a stream's last event is the error, then [DONE]). 0: at once. A second "
                "Ctrl-C stops at once whatever this says."
            )
        ),
    ] = 0.0,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "float32",
    timeout: TimeoutOpt = 60.0,
    connect_timeout: ConnectTimeoutOpt = 10.0,
    quantization: QuantizationOpt = None,
) -> None:
    """Serve the base model and its LoRA adapters with OpenAI's API (/v1/completions, /v1/chat/completions).

    One split client decodes every request together (continuous batching), so each base layer
    gets one request carrying all running sequences' rows; requests for different adapters share
    a batch. Point the `openai` client at http://HOST:PORT/v1. Ready when GET /health answers 200.
    """
    from symbiosis.serving.engine_spawn import spawn_engine_process

    # First thing: the engine process's imports run beside this process's own (engine_spawn.py).
    spawned = spawn_engine_process() if engine_process else None
    try:
        from symbiosis.heap import freeze_startup_heap
        from symbiosis.serving.server import ApiOptions, ApiServer, parse_adapter_specs, read_api_keys

        freeze_startup_heap(collect=False)  # the modules just imported (see heap.py)
        options = ApiOptions(
            model=model,
            client=ClientOptions(
                executor=executor,
                embedded=embedded,
                device=device,
                dtype=dtype,
                timeout_s=timeout,
                connect_timeout_s=connect_timeout,
                quantization=quantization,
            ),
            adapters=parse_adapter_specs(adapter or []),
            adapter_dir=adapter_dir,
            host=host,
            port=port,
            served_model_name=served_model_name,
            api_keys=read_api_keys(api_key or [], api_keys),
            max_concurrent_requests=max_concurrent_requests,
            max_batch_size=max_batch_size,
            max_loaded_adapters=max_loaded_adapters,
            kv_cache_mb=kv_cache_mb,
            prefill_chunk_tokens=prefill_chunk_tokens,
            allow_adapter_updates=allow_adapter_updates,
            allow_non_loopback=allow_non_loopback,
            engine_process=engine_process,
            executor_bind=tuple(executor_bind or ()),
            shutdown_timeout_s=shutdown_timeout,
        )
        server = ApiServer(options, spawned_engine=spawned)
    except BaseException:  # a bad option, an unusable adapter, Ctrl-C while loading
        if spawned is not None:
            spawned.discard()
        raise
    adapters = server.pool.names()

    def ready(url: str) -> None:
        typer.echo(
            f"serving {server.served_model_name} and {count_of(len(adapters), 'adapter')} "
            f"with OpenAI's API at {url}/v1 "
            f"(executor: {executor or 'embedded'}"
            + (f", shared at {', '.join(executor_bind)}" if executor_bind else "")
            + f"); GET {url}/health, {url}/metrics",
        )

    freeze_startup_heap()  # what this process keeps while it serves: no collection walks it again
    server.run(on_ready=ready)


def register(app: typer.Typer) -> None:
    app.command("api")(api_command)
