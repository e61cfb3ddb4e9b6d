"""``ShardedExecutor``: one rank of a base executor whose weights are spread over several processes.

Every rank is a whole executor to its clients: it implements ``ExecutorService`` (and the driver
interface ``ZmqServer`` uses), so ``ZmqServer`` serves it unchanged and a client cannot tell a
sharded executor from a single one. Rank 0 serves the addresses the user gave and tells clients
where the other ranks are (``endpoints.py``, ``transport/routing.py``); every rank also serves
endpoints of its own (the paper's "client talks to its local shard").

Where a request runs depends on the strategy (``placement.py``):

- ``layers``: on the rank that owns the layer. A client that follows the routes sends it there;
  otherwise the rank it talks to relays it (``relay.py``).
- ``fsdp``: on the rank the client talks to, on weights gathered from every rank for the batch
  (``gather.py``).

Clients are counted per rank by where they come from (a session here, or relayed requests from a
peer, ``Member``), so a client connected to several ranks stays known to each as long as one of
its ways in is open.

Failures: when a peer goes down (``links.py``) this rank *fails*: every request in flight that
needs another rank, and every new request, gets ``ExecutorUnavailableError`` naming the shard
that went (``failure``), and ``on_failure`` tells the serving loop (``serve.py``), which exits
so that the launcher can restart the group. Nothing is kept between calls, so a restarted group
computes what the old one would have.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import resource
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import msgspec
import torch
import zmq

from symbiosis import protocol as P
from symbiosis.errors import (
    ExecutorTimeoutError,
    ExecutorUnavailableError,
    ProtocolError,
    ShapeError,
    UnknownLayerError,
)
from symbiosis.executor.engine import ExecutionEngine, ResultSink
from symbiosis.executor.scheduler import SchedulerConfig
from symbiosis.sharding import messages as M
from symbiosis.sharding.endpoints import EndpointBook, rank_address, routes_for
from symbiosis.sharding.gather import GatherSequencer
from symbiosis.sharding.links import PeerLinks
from symbiosis.sharding.observe import health_of, merge_layers
from symbiosis.sharding.placement import Layout, SpecRegistry
from symbiosis.sharding.relay import Relay
from symbiosis.vocabulary import LatencyClass, LayerSpec, Op

STATS_TIMEOUT_S = 2.0
_LOCAL = -1  # the source of a client that has a session on this rank (peers are sources by rank)


def _pass_on(done: Future, sink: ResultSink) -> None:
    """A relayed request's result (or failure) to the sink it was submitted with."""
    if done.cancelled():
        sink.set_exception(ExecutorUnavailableError("the relayed request was cancelled"))
    elif (error := done.exception()) is not None:
        sink.set_exception(error)
    else:
        sink.set_result(done.result())


@dataclass
class ShardSetup:
    """What ``serve.start_rank`` hands a ``ShardedExecutor``."""

    rank: int
    world_size: int
    strategy: str
    layout: Layout
    owners: list[int] | None  # strategy "layers": the rank owning each unit
    engine: ExecutionEngine
    links: PeerLinks
    sequencer: GatherSequencer | None  # strategy "fsdp"
    fingerprint: str
    model_type: str
    scheduler_config: SchedulerConfig
    resident_bytes: int
    total_bytes: int
    host: str


class ShardedExecutor:
    """One rank of a sharded executor (see module doc). Built by ``serve.start_rank``."""

    def __init__(self, setup: ShardSetup):
        self.rank = setup.rank
        self.world_size = setup.world_size
        self.strategy = setup.strategy
        self.layout = setup.layout
        self.scheduler_config = setup.scheduler_config
        self._setup = setup
        self._engine = setup.engine
        self._links = setup.links
        self._sequencer = setup.sequencer
        self._specs = SpecRegistry(setup.layout)
        self._owner_of_unit = setup.owners
        self._relay = Relay(setup.engine, setup.links)
        self._endpoints = EndpointBook(setup.world_size)
        self._lock = threading.Lock()
        self._sources: dict[str, collections.Counter] = {}  # client id -> where it comes from
        self._seqs = itertools.count(1)
        self._stats_replies: dict[int, Future] = {}
        self._failure: ExecutorUnavailableError | None = None
        self._failure_listeners: list[Callable[[str], None]] = []
        self._servers: list = []
        self.addresses: list[str] = []
        # ``layers``: the link thread runs relayed products itself (a driver, like ZmqServer's
        # socket thread). Never in ``fsdp``: a product there may wait for a gather, whose
        # announcement the link thread must be free to read.
        self._links_drive = setup.strategy == "layers"
        if self._links_drive:
            self._engine.attach_driver(self._links.wake)

    # ---- ExecutorService -------------------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        return self._setup.fingerprint

    @property
    def device(self) -> torch.device:
        return self._engine.device

    @property
    def dtype(self) -> torch.dtype:
        return self._engine.dtype

    @property
    def model_type(self) -> str:
        return self._setup.model_type

    def layer_specs(self) -> Mapping[str, LayerSpec]:
        return self._specs

    def register_client(self, client_id: str) -> None:
        self._joined(client_id, _LOCAL)
        if self._links_drive:  # owners may get this client's requests relayed from here
            self._tell_peers(M.Member(client_id, True))

    def unregister_client(self, client_id: str) -> None:
        self._left(client_id, _LOCAL)
        if self._links_drive:
            self._tell_peers(M.Member(client_id, False))

    def submit(
        self,
        client_id: str,
        layer_id: str,
        op: Op,
        rows: torch.Tensor,
        latency_class: LatencyClass,
        *,
        wake: bool = True,
        sink: ResultSink | None = None,
        borrowed: bool = False,
    ) -> Future | ResultSink:
        """See ``BaseExecutor.submit``; a request for another rank's layer is relayed there (its
        result comes back through a future, passed on to ``sink`` when given)."""
        self._check_up()
        owner = self.owner_of(layer_id)
        op, latency_class = Op(op), LatencyClass(latency_class)
        if owner == self.rank:
            return self._engine.submit(
                client_id, layer_id, op, rows, latency_class, wake=wake, sink=sink, borrowed=borrowed
            )
        self._check_request(layer_id, op, rows)
        if borrowed:  # the relay sends them later, from another thread
            rows = rows.clone()
        if rows.shape[0] == 0:
            future: Future = Future()
            future.set_result(rows.new_empty((0, op.output_width(self._specs[layer_id]))))
        else:
            future = self._relay.forward(owner, client_id, layer_id, op, rows, latency_class)
        if sink is None:
            return future
        future.add_done_callback(lambda done: _pass_on(done, sink))
        return sink

    # ---- the driver interface (ZmqServer's socket thread runs local products itself) --------

    def attach_driver(self, wake) -> None:
        self._engine.attach_driver(wake)

    def detach_driver(self, wake) -> None:
        self._engine.detach_driver(wake)

    def run_ready(self) -> float | None:
        return self._engine.run_ready()

    def try_alone(self, client_id, layer_id, op, rows, latency_class, out=None):
        """The lone-client fast path for layers this rank runs (``BaseExecutor.try_alone``);
        None for layers another rank owns (the server then ``submit``s, which relays)."""
        self._check_up()
        if self.owner_of(layer_id) != self.rank:
            return None
        return self._engine.try_alone(client_id, layer_id, op, rows, latency_class, out, align=True)

    def validate(self, layer_id: str, op: Op, rows: torch.Tensor) -> None:
        self.owner_of(layer_id)
        self._check_request(layer_id, op, rows)

    def call(
        self,
        client_id: str,
        layer_id: str,
        op: Op,
        rows: torch.Tensor,
        latency_class: LatencyClass,
        timeout_s: float = 300.0,
    ) -> torch.Tensor:
        """Blocking call for in-process clients of this rank (``InProcTransport``)."""
        self._check_up()
        if self.owner_of(layer_id) == self.rank:
            return self._engine.call(client_id, layer_id, Op(op), rows, LatencyClass(latency_class), timeout_s)
        future = self.submit(client_id, layer_id, op, rows, latency_class)
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError as exc:
            raise ExecutorTimeoutError(f"{Op(op).value} of {layer_id!r} took longer than {timeout_s} s") from exc

    def run(self, layer_id: str, op: Op | str, rows: torch.Tensor) -> torch.Tensor:
        """Synchronous single call, for tests and tools."""
        return self.call("direct", layer_id, Op(op), rows, LatencyClass.PREFILL)

    # ---- routing and membership -------------------------------------------------------------

    def owner_of(self, layer_id: str) -> int:
        """The rank that runs ``layer_id`` for a client of this rank (this one under ``fsdp``)."""
        unit = self.layout.unit_of(layer_id) if isinstance(layer_id, str) else None
        if unit is None:
            raise UnknownLayerError(
                f"unknown base layer {layer_id!r} (the executor serves {len(self.layout.specs)} layers)"
            )
        return self.rank if self._owner_of_unit is None else self._owner_of_unit[unit]

    def _check_request(self, layer_id: str, op: Op, rows: torch.Tensor) -> None:
        """What the owner's engine would refuse, refused here before anything is sent."""
        spec, op = self._specs[layer_id], Op(op)
        if rows.dim() != 2 or rows.shape[1] != op.input_width(spec):
            raise ShapeError(
                f"{op.value} of {layer_id!r} takes rows of width {op.input_width(spec)}, got shape {tuple(rows.shape)}"
            )
        if rows.dtype not in P.WIRE_DTYPES.values():
            raise ProtocolError(f"dtype {rows.dtype} is not allowed; use one of {list(P.WIRE_DTYPES)}")

    def _joined(self, client_id: str, source: int) -> None:
        with self._lock:
            sources = self._sources.setdefault(client_id, collections.Counter())
            first = not sources
            sources[source] += 1
        if first:
            self._engine.client_joined(client_id)

    def _left(self, client_id: str, source: int) -> None:
        with self._lock:
            sources = self._sources.get(client_id)
            if not sources or not sources[source]:
                return
            sources[source] -= 1
            gone = not +sources  # no positive count left
            if gone:
                del self._sources[client_id]
        if gone:
            self._engine.client_left(client_id)

    def _tell_peers(self, message: M.LinkMessage) -> None:
        try:
            self._links.broadcast(message)
        except ExecutorUnavailableError:
            pass  # the failure path reports it

    # ---- LinkHandler (the link thread) ------------------------------------------------------

    def on_message(self, peer: int, message: M.LinkMessage, payload: list[zmq.Frame]) -> None:
        if isinstance(message, M.Forward):
            self._relay.on_forward(peer, message, payload)
        elif isinstance(message, M.Result):
            self._relay.on_result(message, payload)
        elif isinstance(message, M.Member):
            (self._joined if message.joined else self._left)(message.client_id, peer)
        elif isinstance(message, M.Gather) and self._sequencer is not None:
            self._sequencer.on_gather(message.seq, message.unit)
        elif isinstance(message, M.Want) and self._sequencer is not None:
            self._sequencer.on_want(message.unit, message.after_seq)
        elif isinstance(message, M.Endpoints):
            self._endpoints.add(message.rank, message.addresses)
        elif isinstance(message, M.StatsQuery):
            self._links.answer(peer, M.StatsReply(message.seq, msgspec.json.encode(self.local_stats())))
        elif isinstance(message, M.StatsReply):
            with self._lock:
                future = self._stats_replies.pop(message.seq, None)
            if future is not None and not future.done():
                future.set_result(msgspec.json.decode(message.stats_json))

    def after_messages(self) -> float | None:
        """Called by the link thread after each burst: run the products it queued (a driver)."""
        if not self._links_drive:
            return None
        self._relay.submitted = False
        return self._engine.run_ready()

    def on_peer_down(self, peer: int, reason: str, clean: bool) -> None:
        self.fail(
            ExecutorUnavailableError(f"{self._links.describe(peer)} is unavailable: {'stopped' if clean else reason}")
        )

    # ---- failures --------------------------------------------------------------------------

    @property
    def failure(self) -> ExecutorUnavailableError | None:
        """Why this rank refuses work (a shard went down), or None while all are up."""
        return self._failure

    def on_failure(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(reason)`` (once, from the thread that noticed) when this rank fails."""
        self._failure_listeners.append(listener)

    def fail(self, error: ExecutorUnavailableError) -> None:
        with self._lock:
            if self._failure is not None:
                return
            self._failure = error
        self._relay.fail_all(error)
        if self._sequencer is not None:
            self._sequencer.fail(error)
        for listener in self._failure_listeners:
            listener(str(error))

    def _check_up(self) -> None:
        if self._failure is not None:
            raise self._failure

    # ---- observability ----------------------------------------------------------------------

    def resident_tensors(self) -> list[torch.Tensor]:
        """The weight tensors this rank keeps for good (its layers, or its row shards)."""
        weights = self._engine.weights
        if self._sequencer is not None:
            return [t for shard in weights.shards for t in (shard.weight, shard.bias) if t is not None]
        return [t for w in weights.layers.values() for t in (w.weight, w.bias) if t is not None]

    def local_stats(self) -> dict:
        """This rank's own figures (what ``stats()`` reports per shard)."""
        stats = self._engine.stats()
        stats["config"] = dataclasses.asdict(self.scheduler_config)
        stats["weights_bytes"] = self._setup.resident_bytes
        stats["device"] = str(self.device)
        stats["dtype"] = str(self.dtype).removeprefix("torch.")
        owners = self._owner_of_unit
        stats["shard"] = {
            "rank": self.rank,
            "world_size": self.world_size,
            "strategy": self.strategy,
            "up": self._failure is None,
            "failure": None if self._failure is None else str(self._failure),
            "pid": os.getpid(),
            "host": self._setup.host,
            "addresses": list(self.addresses),
            "resident_weight_bytes": self._setup.resident_bytes,
            "total_weight_bytes": self._setup.total_bytes,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
            "owned_layers": len(self.layout.specs)
            if owners is None
            else sum(len(unit.layer_ids) for unit, owner in zip(self.layout.units, owners) if owner == self.rank),
            "relayed_requests": self._relay.forwarded,
            "served_for_peers": self._relay.served_for_peers,
            "gathers": self._sequencer.stats() if self._sequencer is not None else None,
        }
        return stats

    def shard_stats(self, timeout_s: float = STATS_TIMEOUT_S) -> list[dict]:
        """Every rank's ``local_stats()`` in rank order; a rank that is down or does not answer in
        ``timeout_s`` is ``{"shard": {"rank": k, "up": False, "failure": why}}``."""
        futures: dict[int, Future] = {}
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            seq = next(self._seqs)
            futures[peer] = future = Future()
            with self._lock:
                self._stats_replies[seq] = future
            try:
                self._links.send(peer, M.StatsQuery(seq))
            except ExecutorUnavailableError as exc:
                future.set_exception(exc)
        shards: list[dict] = []
        for peer in range(self.world_size):
            if peer == self.rank:
                shards.append(self.local_stats())
                continue
            try:
                shards.append(futures[peer].result(timeout=timeout_s))
            except Exception as exc:  # noqa: BLE001 - down, or too slow to answer: say so
                shards.append(
                    {"shard": {"rank": peer, "up": False, "failure": str(exc) or f"no answer in {timeout_s} s"}}
                )
        return shards

    def stats(self) -> dict:
        """``BaseExecutor.stats()``'s keys for this rank, ``layers`` summed over every shard, and
        ``shards``: each rank's own stats."""
        stats = self.local_stats()
        shards = self.shard_stats()
        stats["layers"] = merge_layers(s.get("layers", {}) for s in shards)
        stats["weights_bytes"] = sum(s.get("weights_bytes", 0) for s in shards)
        stats["shards"] = shards
        return stats

    def health(self) -> dict:
        """``/health``: every shard, up or not; status ``ok`` only when all are."""
        return health_of(self.shard_stats(timeout_s=1.0), self.strategy, str(self.device))

    # ---- serving ---------------------------------------------------------------------------

    def serve(self, address: str, **server_options):
        """Serve this rank to clients at ``address`` (see ``BaseExecutor.serve``)."""
        from symbiosis.transport.zmq import ZmqServer

        server = ZmqServer(self, address, **server_options)
        server.start()
        self._servers.append(server)
        self.addresses.append(server.address)
        return server

    def serve_rank_endpoints(
        self, entry_binds: Sequence[str], templates: Sequence[str] = (), local_rank: int = 0, **server_options
    ) -> list:
        """(Ranks but 0.) Serve this rank's counterpart of each of rank 0's addresses and the
        ``--shard-bind`` templates, and tell rank 0 (``endpoints.py``)."""
        servers, reported = [], []
        for address in entry_binds:
            own = rank_address(address, self.rank)
            server = self.serve(own, **server_options) if own is not None else None
            servers += [server] if server is not None else []
            reported.append(server.address if server is not None else "")
        for template in templates:
            server = self.serve(template.format(rank=self.rank, local_rank=local_rank), **server_options)
            servers.append(server)
            reported.append(server.address)
        self._links.send(0, M.Endpoints(self.rank, reported))
        return servers

    def serve_entry(self, binds: Sequence[str], timeout_s: float, **server_options) -> list:
        """(Rank 0.) Once every other rank reported its endpoints, serve ``binds``, each telling
        its clients the routes to the ranks that run the other layers (strategy ``layers``)."""
        endpoints = self._endpoints.wait(timeout_s)
        return [
            self.serve(address, routes=routes_for(self.layout, self._owner_of_unit, endpoints, index), **server_options)
            for index, address in enumerate(binds)
        ]

    @property
    def links(self) -> PeerLinks:
        return self._links

    def close_servers(self, drain: bool = True) -> None:
        """Stop serving this rank's clients (``drain``: finish what is in flight first). Peers may
        still relay work here until they stop too, so the engine and links stay up."""
        for server in self._servers:
            server.close(drain=drain)
        self._servers.clear()

    def close(self, drain: bool = True) -> None:
        """Stop this rank's servers and engine. The links are closed by whoever made them (the
        serving loop, once every rank has drained)."""
        self.close_servers(drain)
        if self._links_drive:
            self._engine.detach_driver(self._links.wake)
        if self._sequencer is not None:
            self._sequencer.stop()
        self._engine.close(drain=drain)
