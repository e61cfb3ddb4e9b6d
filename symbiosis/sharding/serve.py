"""Starting, running and stopping the ranks of a sharded executor.

Two launches, one code path per rank:

- ``torchrun --nproc-per-node N -m symbiosis serve MODEL --bind ADDRESS`` starts N processes
  that each run ``symbiosis serve``; each sees ``RANK``/``WORLD_SIZE`` (``world.RankInfo``) and
  runs ``run_rank``.
- ``symbiosis serve MODEL --shards N --bind ADDRESS`` (one host) starts the same N commands
  itself through torch.distributed's elastic launcher (``launch_local``: ``elastic_launch``, a
  c10d rendezvous on loopback), which also restarts the whole group when a rank dies, up to
  ``--max-restarts`` times, as ``torchrun --max-restarts`` does.

A rank's life (``run_rank``): join the store, load its share of the weights (``start_rank``),
connect to the other ranks, serve (rank 0 the ``--bind`` addresses, every rank its
``--shard-bind`` endpoints), and wait for a signal or a failure.

- SIGINT/SIGTERM: drain this rank's clients, say ``Bye`` to the peers, keep serving the peers'
  forwarded requests until every peer has said ``Bye`` too (so their drains complete), exit 0 --
  unless a peer turns out to have died first (within ``FAILURE_GRACE_S``: a launcher stops the
  group when a rank dies), which is a failure.
- A peer goes down: this rank fails (``ShardedExecutor.fail``: requests get
  ``ExecutorUnavailableError`` naming the shard) and exits with status 1, so the launcher restarts
  the group if it has restarts left. When it has none, rank 0 first keeps answering for
  ``failure_linger_s`` so that clients retrying in that time learn which shard failed instead of
  finding no executor. Threads may be stuck in a collective with the dead rank, so the process
  ends with ``os._exit`` (a clean interpreter exit could wait on them).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from symbiosis.checkpoint import Checkpoint, build_skeleton, discover_base_layers
from symbiosis.errors import ConfigurationError
from symbiosis.executor.engine import ExecutionEngine
from symbiosis.executor.executor import parse_dtype
from symbiosis.executor.scheduler import Scheduler, SchedulerConfig
from symbiosis.executor.weights import BaseModelWeights
from symbiosis.heap import freeze_startup_heap
from symbiosis.sharding import messages as M
from symbiosis.sharding.executor import ShardedExecutor, ShardSetup
from symbiosis.sharding.gather import GatheredWeights, GatherSequencer, load_row_shards
from symbiosis.sharding.links import PeerLinks
from symbiosis.sharding.options import ShardOptions
from symbiosis.sharding.placement import Layout, place_units
from symbiosis.sharding.world import RankInfo, connect_store, make_group, rank_device, this_host

log = logging.getLogger(__name__)

# How long a rank told to stop (SIGINT/SIGTERM) waits to see whether a peer died first. A launcher
# stops the whole group right after one of its ranks dies -- torch's elastic agent (``--shards``,
# torchrun) sends SIGTERM within its monitor interval, 0.1 s -- which can come before this rank's
# link thread has seen the death; stopping cleanly then, rank 0 drained and left, and its clients
# found no executor instead of learning which shard failed (a rank killed, then SIGTERM to rank 0
# at once: "no executor answered" in 2 runs of 2; `test_sharded.py`). The price: a clean stop of
# a sharded executor takes this much longer.
FAILURE_GRACE_S = 0.5


def start_rank(
    path: str | Path,
    info: RankInfo,
    store,
    *,
    device: torch.device,
    dtype: torch.dtype,
    scheduler_config: SchedulerConfig,
    options: ShardOptions,
) -> ShardedExecutor:
    """Load this rank's share of the base weights, connect to the other ranks (every rank calls
    this at about the same time: it blocks until all are connected) and return the rank."""
    checkpoint = Checkpoint(path)
    specs = discover_base_layers(build_skeleton(checkpoint.config))
    layout = Layout(specs)
    fingerprint = checkpoint.fingerprint(specs)
    links = PeerLinks(
        info.rank,
        info.world_size,
        options.link_host,
        heartbeat_s=options.heartbeat_s,
        peer_timeout_s=options.peer_timeout_s,
    )
    try:
        store.set(f"link/{info.rank}", links.address)
        total_bytes = sum(unit.numel for unit in layout.units) * torch.empty(0, dtype=dtype).element_size()
        owners: list[int] | None = None
        sequencer = None
        if options.strategy == "layers":
            owners = place_units([unit.numel for unit in layout.units], info.world_size)
            owned = {
                layer for unit, owner in zip(layout.units, owners) if owner == info.rank for layer in unit.layer_ids
            }
            weights = BaseModelWeights.load(path, device=device, dtype=dtype, layer_ids=owned)
        else:
            group = make_group(
                store, info.rank, info.world_size, device, options.collective_timeout_s, host=options.link_host
            )
            shards = load_row_shards(path, layout, info.world_size, info.rank, device=device, dtype=dtype)
            sequencer = GatherSequencer(
                info.rank,
                info.world_size,
                group,
                layout,
                shards,
                send_to_leader=lambda message: links.send(0, message),
                announce=links.broadcast,
                timeout_s=options.collective_timeout_s,
            )
            weights = GatheredWeights(layout, shards, sequencer, fingerprint, checkpoint.config.model_type)
        engine = ExecutionEngine(weights, Scheduler(scheduler_config))
        executor = ShardedExecutor(
            ShardSetup(
                info.rank,
                info.world_size,
                options.strategy,
                layout,
                owners,
                engine,
                links,
                sequencer,
                fingerprint,
                checkpoint.config.model_type,
                scheduler_config,
                weights.nbytes(),
                total_bytes,
                this_host(),
            )
        )
        addresses = [store.get(f"link/{rank}").decode() for rank in range(info.world_size)]
        links.start(addresses, executor, M.Ready(info.rank, os.getpid(), this_host()))
        links.wait_ready(options.start_timeout_s)
        return executor
    except BaseException:
        links.close()
        raise


@dataclass
class ServeRequest:
    """What ``symbiosis serve`` asks a rank to do (its flags, parsed)."""

    model_dir: Path
    bind: list[str]
    shard_bind: list[str] = field(default_factory=list)
    device: str = "cpu"
    dtype: str = "float32"
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    options: ShardOptions = field(default_factory=ShardOptions)
    server_options: dict = field(default_factory=dict)  # allow_non_loopback, curve
    metrics_port: int | None = None
    ready_file: Path | None = None


def run_rank(request: ServeRequest, info: RankInfo, echo=None) -> int:
    """Serve as rank ``info.rank`` until a signal (exit status 0) or a failure (status 1, see
    module doc; the process ends here then)."""
    echo = echo or _echo
    freeze_startup_heap(collect=False)  # the modules imported (see heap.py)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    options = request.options
    device = rank_device(request.device, info)
    store = connect_store(info, options.start_timeout_s)
    executor = start_rank(
        request.model_dir,
        info,
        store,
        device=device,
        dtype=parse_dtype(request.dtype),
        scheduler_config=request.scheduler_config,
        options=options,
    )
    failed = threading.Event()
    executor.on_failure(lambda reason: failed.set())
    if info.is_entry:  # once the other ranks serve too: rank 0's Welcome routes clients to them
        servers = executor.serve_entry(request.bind, options.start_timeout_s, **request.server_options)
        for template in request.shard_bind:
            servers.append(
                executor.serve(template.format(rank=0, local_rank=info.local_rank), **request.server_options)
            )
    else:
        servers = executor.serve_rank_endpoints(
            request.bind, request.shard_bind, info.local_rank, **request.server_options
        )
    metrics = None
    if info.is_entry and request.metrics_port is not None:
        from symbiosis.executor.metrics import MetricsServer

        metrics = MetricsServer(executor, request.metrics_port)
    freeze_startup_heap()  # what this rank keeps while it serves: no collection walks it again
    if info.is_entry:
        stats = executor.local_stats()["shard"]
        echo(
            f"serving {len(executor.layer_specs())} base layers of {request.model_dir} ({executor.model_type}, "
            f"{stats['total_weight_bytes'] / 2**20:.1f} MiB, {executor.dtype}) sharded over {info.world_size} ranks "
            f"(strategy {options.strategy}, {stats['resident_weight_bytes'] / 2**20:.1f} MiB on rank 0) "
            f"at {' and '.join(s.address for s in servers)}"
            + (f"; metrics at http://127.0.0.1:{metrics.port}/metrics" if metrics else "")
        )
        if request.ready_file is not None:
            from symbiosis.executor.process import ReadyInfo, write_ready_file

            metrics_url = f"http://127.0.0.1:{metrics.port}" if metrics else None
            ready = ReadyInfo(
                [s.address for s in servers], os.getpid(), executor.fingerprint, executor.model_type, metrics_url
            )
            write_ready_file(request.ready_file, ready)
    while not stop.is_set() and not failed.is_set():
        stop.wait(0.2)
    if not failed.is_set() and info.world_size > 1:
        failed.wait(FAILURE_GRACE_S)  # a signal may be a launcher's answer to a rank's death (above)
    if failed.is_set():
        _exit_failed(executor, info, options, request, metrics, echo)
    return _stop_cleanly(executor, options, request, metrics, echo)


def _exit_failed(
    executor: ShardedExecutor, info: RankInfo, options: ShardOptions, request: ServeRequest, metrics, echo
) -> None:
    reason = str(executor.failure)
    linger_s = options.failure_linger_s if info.is_entry and info.restarts_left == 0 else 0.5
    echo(
        f"rank {info.rank}: {reason}; "
        + (
            "exiting so that the launcher restarts the group"
            if info.restarts_left
            else f"no restart left, exiting in {linger_s:.0f} s"
        ),
        err=True,
    )
    time.sleep(linger_s)  # rank 0 keeps answering clients meanwhile, naming the failed shard
    if info.is_entry and request.ready_file is not None:
        request.ready_file.unlink(missing_ok=True)
    if metrics is not None:
        metrics.close()
    try:
        executor.close_servers(drain=True)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _stop_cleanly(executor: ShardedExecutor, options: ShardOptions, request: ServeRequest, metrics, echo) -> int:
    if executor.rank == 0:
        if request.ready_file is not None:
            request.ready_file.unlink(missing_ok=True)
        echo("draining in-flight requests and shutting down", err=True)
    if metrics is not None:
        metrics.close()
    executor.close_servers(drain=True)
    links = executor.links
    links.say_bye("stopping")
    if not links.wait_peers_gone(options.stop_timeout_s):
        log.warning("rank %d: some ranks did not stop within %.0f s", executor.rank, options.stop_timeout_s)
    executor.close(drain=False)
    links.close()
    if executor.rank == 0:
        echo("stopped", err=True)
    return 0


def launch_local(shards: int, max_restarts: int, command: list[str], echo=None) -> int:
    """Run ``command`` (a ``symbiosis`` command line, without the program) as ``shards`` ranks on
    this host through ``elastic_launch``; return when the group stops (0: stopped by a signal or
    cleanly; 1: failed for good)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    echo = echo or _echo
    # torchrun's choice for a host shared by several ranks: each rank one OpenMP thread per core it gets.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // shards)))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=shards,
        run_id=f"symbiosis-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=max_restarts,
        monitor_interval=0.1,
    )
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "symbiosis", *command)
    except SignalException:
        return 0
    except ChildFailedError as exc:
        echo(f"error: the sharded executor failed: {exc}", err=True)
        return 1
    return 0


def _echo(message: str, err: bool = False) -> None:
    stream = sys.stderr if err else sys.stdout
    print(message, file=stream, flush=True)


def serve_sharded(request: ServeRequest, shards: int, max_restarts: int) -> int:
    """``symbiosis serve`` of a sharded executor: as one rank under ``torchrun`` (or under the
    launcher this function starts), or as the launcher of ``shards`` ranks on this host."""
    info = RankInfo.from_env()
    if info is None:
        return launch_local(shards, max_restarts, _command_line())
    if shards not in (1, info.world_size):
        raise ConfigurationError(
            f"--shards {shards}, but the launcher started {info.world_size} ranks; leave --shards out under torchrun"
        )
    return run_rank(request, info)


def _command_line() -> list[str]:
    """This process's ``symbiosis`` arguments, which every rank runs again: a rank sees
    ``RANK``/``WORLD_SIZE`` and serves instead of launching."""
    command = sys.argv[1:]
    if "serve" not in command:
        raise ConfigurationError(
            "--shards starts its ranks with this process's own command line; run it as `symbiosis serve ... --shards N`"
        )
    return command
