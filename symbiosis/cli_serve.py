"""``symbiosis serve``: run a base executor as a service until SIGINT/SIGTERM."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Annotated

import typer

from symbiosis.cli_jobs import count_of
from symbiosis.cli_scheduler import with_scheduler_options
from symbiosis.errors import MissingFileError
from symbiosis.executor.quantization_options import QUANTIZATION_CHOICES, QUANTIZATION_HELP
from symbiosis.executor.scheduler import SchedulerConfig
from symbiosis.sharding.options import DEFAULT_STRATEGY, SHARD_HELP, ShardOptions
from symbiosis.transport.security import CurveServerKeys, check_abstract_ipc


@with_scheduler_options  # --policy, --max-wait-ms, --decode-slo-ms, ...: every SchedulerConfig field
def serve(
    model_dir: Annotated[Path, typer.Argument(help="Checkpoint folder (config.json + *.safetensors).")],
    bind: Annotated[
        list[str],
        typer.Option(
            help=(
                "Address to listen on: tcp://HOST:PORT or ipc:///PATH (repeat to listen on several). Loopback only "
                "unless --allow-non-loopback. Same-host clients of an ipc:// address may connect with "
                "shm+ipc://PATH to pass payloads through shared memory."
            )
        ),
    ] = ("tcp://127.0.0.1:7000",),  # a tuple: typer hands the command a list either way
    device: Annotated[str, typer.Option(help="Device of the base weights: cpu, cuda, cuda:1, ...")] = "cpu",
    dtype: Annotated[
        str,
        typer.Option(
            help=(
                "dtype of the base weights: float32, bfloat16 or float16 (with --quantization: the dtype products "
                "are computed in)."
            )
        ),
    ] = "float32",
    quantization: Annotated[
        str, typer.Option(help=QUANTIZATION_HELP + f" One of {', '.join(QUANTIZATION_CHOICES)}.")
    ] = "none",
    metrics_port: Annotated[
        int | None,
        typer.Option(help="Serve Prometheus /metrics and /health on this port (loopback).", min=0, max=65535),
    ] = None,
    allow_non_loopback: Annotated[
        bool,
        typer.Option(
            help=(
                "Allow binding an address other than loopback without CURVE (exposes the service to the network "
                "unauthenticated and unencrypted). Not needed with --curve-secret-key."
            )
        ),
    ] = False,
    curve_secret_key: Annotated[
        Path | None,
        typer.Option(
            help=CurveServerKeys.HELP["secret_key_file"] + " Needs --authorized-clients; allows non-loopback --bind."
        ),
    ] = None,
    authorized_clients: Annotated[
        Path | None, typer.Option(help=CurveServerKeys.HELP["authorized_clients_dir"])
    ] = None,
    ready_file: Annotated[
        Path | None,
        typer.Option(
            help=(
                "Once serving, write JSON here (addresses with real ports, pid, checkpoint fingerprint, model type, "
                "metrics URL) for scripts and supervisors to read instead of parsing the log; written atomically, "
                "removed on exit."
            )
        ),
    ] = None,
    shards: Annotated[int, typer.Option(min=1, help=SHARD_HELP["shards"])] = 1,
    shard_strategy: Annotated[
        str, typer.Option(help=SHARD_HELP["shard_strategy"] + f" Default {DEFAULT_STRATEGY}.")
    ] = DEFAULT_STRATEGY,
    shard_bind: Annotated[list[str] | None, typer.Option(help=SHARD_HELP["shard_bind"])] = None,
    max_restarts: Annotated[int, typer.Option(min=0, help=SHARD_HELP["max_restarts"])] = 3,
    shard_host: Annotated[str, typer.Option(help=SHARD_HELP["shard_host"])] = "127.0.0.1",
    failure_linger_s: Annotated[
        float, typer.Option(min=0.0, help=SHARD_HELP["failure_linger_s"])
    ] = ShardOptions.failure_linger_s,
    tune_matmul: Annotated[
        bool,
        typer.Option(
            help=(
                "Time the two ways of writing a forward product of 1-64 rows on CPU (rows @ W.T as nn.Linear does, "
                "or (W @ rows.T).T) the first time each weight shape and row count comes up, and keep the faster "
                "one for the life of the process: BLAS libraries' small-batch kernels differ between the two, "
                "x0.2-x1.7 here. Results then agree with nn.Linear's within float tolerance, not bit for bit. "
                "A layer with a packed copy (--pack-weights) times three forms, oneDNN's packed product among them, "
                "and only at 1-2 rows. The decode sizes (1-8 rows) of every weight shape are timed before the server "
                "says ready (a few seconds), so that no client waits behind a trial. "
                "--no-tune-matmul (or SYMBIOSIS_TUNE_MATMUL=0) times nothing: packed layers run the packed product, "
                "the others nn.Linear's form."
            )
        ),
    ] = True,
    pack_weights: Annotated[
        bool,
        typer.Option(
            help=(
                "Keep a copy of each weight in oneDNN's blocked layout, made the first time a forward uses the "
                "layer, and run forward products on CPU against it: x0.4-0.9 of the time of torch's mm here at 3 "
                "rows and more (at 1-2 rows the timed forms of --tune-matmul may keep torch's), at the cost of "
                "holding the forward-used weights twice in memory (up to a quarter of the machine's). Results agree "
                "with nn.Linear's within float tolerance. --no-pack-weights (or SYMBIOSIS_PACK_WEIGHTS=0) keeps one "
                "copy and torch's mm."
            )
        ),
    ] = True,
    scheduler_config: SchedulerConfig | None = None,  # made by @with_scheduler_options from its options
) -> None:
    """Load the base layers of MODEL_DIR and serve them to clients until interrupted.

    SIGINT/SIGTERM stop accepting new requests, finish the ones in flight, and exit cleanly.
    With --curve-secret-key and --authorized-clients, clients authenticate with CURVE keys
    (`symbiosis keys`) and all ZeroMQ traffic is encrypted.
    """
    from symbiosis.executor.executor import BaseExecutor, parse_device
    from symbiosis.executor.scheduler_config import resolve_bulk_lane
    from symbiosis.heap import freeze_startup_heap
    from symbiosis.transport.zmq_server import check_bind_address, check_ipc_path_free, check_tcp_port_free

    freeze_startup_heap(collect=False)  # the modules just imported (see heap.py)

    if (curve_secret_key is None) != (authorized_clients is None):
        raise typer.BadParameter("--curve-secret-key and --authorized-clients go together")
    curve = CurveServerKeys(curve_secret_key, authorized_clients) if curve_secret_key and authorized_clients else None
    for address in bind:  # before loading anything
        check_abstract_ipc(address, curve)
        check_bind_address(address, allow_non_loopback, authenticated=curve is not None)
        check_ipc_path_free(address)
        check_tcp_port_free(address)
    if metrics_port:
        check_tcp_port_free(f"tcp://127.0.0.1:{metrics_port}", shown_as=f"--metrics-port {metrics_port}")
    if ready_file is not None and not ready_file.parent.is_dir():
        raise MissingFileError(f"--ready-file {str(ready_file)!r}: folder {str(ready_file.parent)!r} does not exist")
    from symbiosis.executor.quantized import parse_quantization

    quantization = parse_quantization(quantization)  # an unknown name fails before anything loads
    from symbiosis.executor.matmul_forms import MATMUL_FORMS, TUNE_VARIABLE
    from symbiosis.executor.packed_weights import PACK_VARIABLE, WEIGHT_PACKING

    for wanted, variable, setting in (
        (tune_matmul, TUNE_VARIABLE, MATMUL_FORMS),
        (pack_weights, PACK_VARIABLE, WEIGHT_PACKING),
    ):
        if not wanted:
            os.environ[variable] = "0"  # and for the ranks of a sharded executor, which read it at import
            setting.enabled = False
    if shards > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:  # several processes (torchrun, or --shards)
        if quantization:
            raise typer.BadParameter("--quantization is not supported with a sharded executor (--shards, torchrun) yet")
        from symbiosis.sharding.serve import ServeRequest, serve_sharded

        options = ShardOptions(strategy=shard_strategy, link_host=shard_host, failure_linger_s=failure_linger_s)
        request = ServeRequest(
            model_dir,
            bind,
            shard_bind or [],
            device,
            dtype,
            scheduler_config,
            options,
            {"allow_non_loopback": allow_non_loopback, "curve": curve},
            metrics_port,
            ready_file,
        )
        raise typer.Exit(serve_sharded(request, shards, max_restarts))

    # Its own process: bulk products on a background thread by default (``bulk_lane="auto"``).
    scheduler_config = resolve_bulk_lane(scheduler_config, parse_device(device).type, own_process=True)
    executor = BaseExecutor.from_pretrained(
        model_dir,
        device=device,
        dtype=dtype,
        quantization=quantization,
        scheduler_config=scheduler_config,
    )
    try:  # an address or port that is taken (or Ctrl-C while warming up): stop what started, then report it
        # Before serving: each trial would otherwise stall every client at its first request of a
        # size. Progress on stdout, with the "serving ..." line: stderr carries errors alone.
        executor.warm_up(say=typer.echo)
        servers = [executor.serve(address, allow_non_loopback=allow_non_loopback, curve=curve) for address in bind]
        metrics = None
        if metrics_port is not None:
            from symbiosis.executor.metrics import MetricsServer

            metrics = MetricsServer(executor, metrics_port)
    except BaseException:
        executor.close(drain=False)
        raise
    freeze_startup_heap()  # what this process keeps while it serves: no collection walks it again
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    layers = len(executor.layer_specs())
    typer.echo(
        f"serving {layers} base layers of {model_dir} ({executor.weights.model_type}, "
        f"{executor.weights.nbytes() / 2**20:.1f} MiB, {executor.dtype}, {executor.device}"
        + (f", {quantization} weights" if quantization else "")
        + ") "
        f"at {' and '.join(s.address for s in servers)} with policy {scheduler_config.policy}"
        + (f", decode target {scheduler_config.decode_slo_ms:g} ms per token" if scheduler_config.decode_slo_ms else "")
        + (f"; CURVE on, {count_of(len(curve.authorized_public_keys()), 'authorized client key')}" if curve else "")
        + (f"; metrics at http://127.0.0.1:{metrics.port}/metrics" if metrics else ""),
        err=False,
    )
    if ready_file is not None:
        from symbiosis.executor.process import ReadyInfo, write_ready_file

        metrics_url = f"http://127.0.0.1:{metrics.port}" if metrics else None
        info = ReadyInfo(
            [s.address for s in servers], os.getpid(), executor.fingerprint, executor.weights.model_type, metrics_url
        )
        write_ready_file(ready_file, info)
    stop.wait()
    if ready_file is not None:
        ready_file.unlink(missing_ok=True)
    typer.echo("draining in-flight requests and shutting down", err=True)
    if metrics:
        metrics.close()
    executor.close(drain=True)
    typer.echo("stopped", err=True)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
