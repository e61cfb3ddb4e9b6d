"""``ShardedExecutor``: one rank of a base executor whose weights are spread over several processes.

Every rank is a whole executor to its clients: it implements ``ExecutorService`` (and the driver
interface ``ZmqServer`` uses), so ``ZmqServer`` serves it unchanged and a client cannot tell a
sharded executor from a single one. Rank 0 serves the address the user gave; any rank may also
serve endpoints of its own (the paper's "client talks to its local shard").

Where a request runs depends on the strategy (``placement.py``):

- ``layers``: the rank that owns the layer runs it. A request for a layer owned elsewhere is
  forwarded over the links (``Forward``) with the client's id, so the owner's scheduler batches
  it with every other client's rows for that layer, exactly as a single executor would; the
  answer (``Result``) completes the request's future here.
- ``fsdp``: the rank the client talks to runs it, on weights gathered from every rank for the
  batch (``gather.py``).

Failures: when a peer goes down (``links.py``) this rank *fails*: every request in flight that
needs another rank, and every new request, gets ``ExecutorUnavailableError`` naming the shard
that went (``failure``), and ``on_failure`` tells the serving loop (``serve.py``), which exits
so that the launcher can restart the group. Nothing is kept between calls, so a restarted group
computes what the old one would have.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
from collections.abc import Callable, Mapping
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
    SymbiosisError,
    UnknownLayerError,
    error_from_code,
)
from symbiosis.executor.engine import ExecutionEngine
from symbiosis.executor.scheduler import SchedulerConfig
from symbiosis.sharding import messages as M
from symbiosis.sharding.gather import GatherSequencer
from symbiosis.sharding.links import PeerLinks
from symbiosis.sharding.placement import Layout, SpecRegistry
from symbiosis.vocabulary import LATENCY_CLASSES_BY_VALUE, OPS_BY_VALUE, LatencyClass, LayerSpec, Op

STATS_TIMEOUT_S = 2.0


@dataclass
class _Forwarded:
    """A request waiting for its owner's answer."""

    future: Future
    owner: int
    out_dtype: torch.dtype
    out_device: torch.device
    staged: torch.Tensor  # the rows as sent (their bytes may still be in ZeroMQ's queue)


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
        self._lock = threading.Lock()
        self._seqs = itertools.count(1)
        self._forwarded: dict[int, _Forwarded] = {}
        self._stats_replies: dict[int, Future] = {}
        self._counters = {"forwarded": 0, "served_for_peers": 0}
        self._failure: ExecutorUnavailableError | None = None
        self._failure_listeners: list[Callable[[str], None]] = []
        self._servers: list = []
        self.addresses: list[str] = []
        # ``layers``: the link thread runs products for peers itself (a driver, like ZmqServer's
        # socket thread). Never in ``fsdp``: a product there may wait for a gather, whose
        # announcement the link thread must be free to read.
        self._links_drive = setup.strategy == "layers"
        self._link_submitted = False
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
        self._engine.client_joined(client_id)
        if self._links_drive:
            self._tell_peers(M.Member(client_id, True))

    def unregister_client(self, client_id: str) -> None:
        self._engine.client_left(client_id)
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
    ) -> Future:
        self._check_up()
        owner = self.owner_of(layer_id)
        op, latency_class = Op(op), LatencyClass(latency_class)
        if owner == self.rank:
            return self._engine.submit(client_id, layer_id, op, rows, latency_class, wake=wake)
        self._check_request(layer_id, op, rows)
        if rows.shape[0] == 0:
            future: Future = Future()
            future.set_result(rows.new_empty((0, op.output_width(self._specs[layer_id]))))
            return future
        return self._forward(owner, client_id, layer_id, op, rows, latency_class)

    # ---- the driver interface (ZmqServer's socket thread runs local products itself) --------

    def attach_driver(self, wake) -> None:
        self._engine.attach_driver(wake)

    def detach_driver(self, wake) -> None:
        self._engine.detach_driver(wake)

    def run_ready(self) -> float | None:
        return self._engine.run_ready()

    def try_alone(self, client_id, layer_id, op, rows, latency_class, out=None):
        """The lone-client fast path for layers this rank runs (``BaseExecutor.try_alone``);
        None for layers another rank owns (the server then ``submit``s, which forwards)."""
        self._check_up()
        if self.owner_of(layer_id) != self.rank:
            return None
        return self._engine.try_alone(client_id, layer_id, op, rows, latency_class, out)

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

    # ---- routing ---------------------------------------------------------------------------

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
        spec = self._specs[layer_id]
        op = Op(op)
        if rows.dim() != 2 or rows.shape[1] != op.input_width(spec):
            raise ShapeError(
                f"{op.value} of {layer_id!r} takes rows of width {op.input_width(spec)}, got shape {tuple(rows.shape)}"
            )
        if rows.dtype not in P.WIRE_DTYPES.values():
            raise ProtocolError(f"dtype {rows.dtype} is not allowed; use one of {list(P.WIRE_DTYPES)}")

    def _forward(
        self, owner: int, client_id: str, layer_id: str, op: Op, rows: torch.Tensor, latency_class: LatencyClass
    ) -> Future:
        staged = rows.detach().to("cpu").contiguous()
        seq = next(self._seqs)
        future: Future = Future()
        with self._lock:
            self._forwarded[seq] = _Forwarded(future, owner, rows.dtype, rows.device, staged)
            self._counters["forwarded"] += 1
        message = M.Forward(
            seq, client_id, layer_id, op.value, latency_class.value, P.dtype_name(staged.dtype), list(staged.shape)
        )
        try:
            self._links.send(owner, message, P.tensor_payload(staged))
        except ExecutorUnavailableError:
            with self._lock:
                self._forwarded.pop(seq, None)
            raise
        return future

    def _tell_peers(self, message: M.LinkMessage) -> None:
        try:
            self._links.broadcast(message)
        except ExecutorUnavailableError:
            pass  # the failure path reports it

    # ---- LinkHandler (the link thread) ------------------------------------------------------

    def on_message(self, peer: int, message: M.LinkMessage, payload: list[zmq.Frame]) -> None:
        if isinstance(message, M.Forward):
            self._serve_forward(peer, message, payload)
        elif isinstance(message, M.Result):
            self._complete_forward(message, payload)
        elif isinstance(message, M.Member):
            (self._engine.client_joined if message.joined else self._engine.client_left)(message.client_id)
        elif isinstance(message, M.Gather) and self._sequencer is not None:
            self._sequencer.on_gather(message.seq, message.unit)
        elif isinstance(message, M.Want) and self._sequencer is not None:
            self._sequencer.on_want(message.unit, message.after_seq)
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
        self._link_submitted = False
        return self._engine.run_ready()

    def on_peer_down(self, peer: int, reason: str, clean: bool) -> None:
        what = "stopped" if clean else reason
        self.fail(ExecutorUnavailableError(f"{self._links.describe(peer)} is unavailable: {what}"))

    def _serve_forward(self, peer: int, message: M.Forward, payload: list[zmq.Frame]) -> None:
        """(Owner.) Run a peer's request for a layer of this rank; answer when it is done."""
        try:
            op, latency_class = OPS_BY_VALUE.get(message.op), LATENCY_CLASSES_BY_VALUE.get(message.latency_class)
            if op is None or latency_class is None or message.dtype not in P.WIRE_DTYPES or len(payload) != 1:
                raise ProtocolError(f"malformed forwarded request for {message.layer_id!r}")
            if len(message.shape) != 2 or len(payload[0].buffer) != P.declared_nbytes(message.dtype, message.shape):
                raise ProtocolError("forwarded rows do not match their declared shape")
            rows = P.tensor_from_payload(payload[0].buffer, message.dtype, message.shape)
            self._engine.validate(message.layer_id, op, rows)
            self._counters["served_for_peers"] += 1
            result = self._engine.try_alone(message.client_id, message.layer_id, op, rows, latency_class)
            if result is not None:
                self._answer(peer, message.seq, result, None)
                return
            future = self._engine.submit(message.client_id, message.layer_id, op, rows, latency_class, wake=False)
            self._link_submitted = True
            future.add_done_callback(lambda f, seq=message.seq: self._answer_future(peer, seq, f))
        except SymbiosisError as exc:
            self._answer(peer, message.seq, None, exc)

    def _answer_future(self, peer: int, seq: int, future: Future) -> None:
        exc = future.exception()
        self._answer(peer, seq, None if exc is not None else future.result(), exc)

    def _answer(self, peer: int, seq: int, result: torch.Tensor | None, exc: BaseException | None) -> None:
        if exc is not None:
            code = exc.code if isinstance(exc, SymbiosisError) else SymbiosisError.code
            self._links.answer(
                peer, M.Result(seq, False, error_code=code, error_message=f"{type(exc).__name__}: {exc}")
            )
            return
        assert result is not None
        result = result.detach().to("cpu").contiguous()
        dtype = P.dtype_name(result.dtype)
        self._links.answer(peer, M.Result(seq, True, dtype, list(result.shape)), P.tensor_payload(result))

    def _complete_forward(self, message: M.Result, payload: list[zmq.Frame]) -> None:
        """(Entry.) The owner answered a forwarded request."""
        with self._lock:
            pending = self._forwarded.pop(message.seq, None)
        if pending is None or pending.future.done():
            return
        if not message.ok:
            pending.future.set_exception(error_from_code(message.error_code, message.error_message))
            return
        if (
            message.dtype not in P.WIRE_DTYPES
            or len(message.shape) != 2
            or len(payload) != 1
            or len(payload[0].buffer) != P.declared_nbytes(message.dtype, message.shape)
        ):
            pending.future.set_exception(ProtocolError(f"malformed answer from {self._links.describe(pending.owner)}"))
            return
        result = P.tensor_from_payload(payload[0].buffer, message.dtype, message.shape)
        pending.future.set_result(result.to(device=pending.out_device, dtype=pending.out_dtype))

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
            pending, self._forwarded = self._forwarded, {}
        for entry in pending.values():
            if not entry.future.done():
                entry.future.set_exception(error)
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
        owned = [u for u, owner in enumerate(self._owner_of_unit or []) if owner == self.rank]
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
            "owned_layers": sum(len(self.layout.units[u].layer_ids) for u in owned)
            if self._owner_of_unit
            else len(self.layout.specs),
            "forwarded_requests": self._counters["forwarded"],
            "served_for_peers": self._counters["served_for_peers"],
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
            future: Future = Future()
            with self._lock:
                self._stats_replies[seq] = future
            futures[peer] = future
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
                why = str(exc) or f"no answer in {timeout_s} s"
                shards.append({"shard": {"rank": peer, "up": False, "failure": why}})
        return shards

    def stats(self) -> dict:
        """``BaseExecutor.stats()``'s keys for this rank, ``layers`` summed over every shard, and
        ``shards``: each rank's own stats."""
        stats = self.local_stats()
        shards = self.shard_stats()
        stats["layers"] = _merge_layers(s.get("layers", {}) for s in shards)
        stats["weights_bytes"] = sum(s.get("weights_bytes", 0) for s in shards)
        stats["shards"] = shards
        return stats

    def health(self) -> dict:
        """``/health``: every shard, up or not; status ``ok`` only when all are."""
        shards = [
            s["shard"] | {"inflight_requests": s.get("inflight_requests")} for s in self.shard_stats(timeout_s=1.0)
        ]
        status = "ok" if all(s["up"] for s in shards) else "unavailable"
        return {
            "status": status,
            "strategy": self.strategy,
            "world_size": self.world_size,
            "device": str(self.device),
            "shards": shards,
        }

    # ---- serving ---------------------------------------------------------------------------

    def serve(self, address: str, **server_options):
        """Serve this rank to clients at ``address`` (see ``BaseExecutor.serve``)."""
        from symbiosis.transport.zmq import ZmqServer

        server = ZmqServer(self, address, **server_options)
        server.start()
        self._servers.append(server)
        self.addresses.append(server.address)
        return server

    @property
    def links(self) -> PeerLinks:
        return self._links

    def close_servers(self, drain: bool = True) -> None:
        """Stop serving this rank's clients (``drain``: finish what is in flight first). Peers may
        still forward work here until they stop too, so the engine and links stay up."""
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


def _merge_layers(per_shard) -> dict:
    """Sum per-layer counters over shards (means weighted by their counts)."""
    merged: dict[str, dict] = {}
    for layers in per_shard:
        for layer_id, c in layers.items():
            m = merged.setdefault(
                layer_id,
                {
                    "requests": 0,
                    "rows": 0,
                    "batches": 0,
                    "errors": 0,
                    "_rows_in_batches": 0.0,
                    "_wait": 0.0,
                    "_latency": 0.0,
                },
            )
            m["requests"] += c["requests"]
            m["rows"] += c["rows"]
            m["batches"] += c["batches"]
            m["errors"] += c["errors"]
            m["_rows_in_batches"] += c["mean_rows_per_batch"] * c["batches"]
            m["_wait"] += c["mean_queue_wait_ms"] * c["requests"]
            m["_latency"] += c["mean_latency_ms"] * c["requests"]
    for m in merged.values():
        m["mean_rows_per_batch"] = m.pop("_rows_in_batches") / m["batches"] if m["batches"] else 0.0
        m["mean_queue_wait_ms"] = m.pop("_wait") / m["requests"] if m["requests"] else 0.0
        m["mean_latency_ms"] = m.pop("_latency") / m["requests"] if m["requests"] else 0.0
    return merged
