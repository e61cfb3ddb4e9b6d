"""Strategy ``fsdp``: every unit row-sharded across the ranks, all-gathered to run a batch, then dropped.

This is what FSDP2's ``fully_shard`` does for a frozen parameter — the same ``Shard(0)`` layout
(``placement.row_range``), one all-gather per unit, the gathered tensor freed after use — done on
the executor's plain block-stored tensors instead of on ``nn.Module``s: the executor holds no
modules, and on this machine ``unshard()``/``reshard()`` of a ``fully_shard``ed ``nn.Linear`` took
about twice as long as the bare all-gather of the same bytes (3.2 vs 1.9 ms for a 6x5 layer, 87 vs
41 ms for 768x3072, gloo, 2 ranks, medians of 30).

Who decides which collective runs next. A collective must be entered by every rank in the same
order, but requests arrive at any rank's endpoint at any time. Rank 0 (the *leader*) is the one
sequencer: a rank whose batch needs a unit registers as a waiter and, on a follower, sends
``Want(unit, after_seq)`` to the leader; the leader numbers a gather of that unit and announces
``Gather(seq, unit)`` to every follower over the links (in order, one connection each), then runs
it itself. Each rank's *gather worker* thread runs the announced gathers in ``seq`` order and
hands each result to the local waiters of that unit. Because the weights are frozen, *any*
gather of a unit that finishes after a waiter registered serves it: a waiter records the last
``seq`` its rank had finished, and the leader starts a new gather only if none of that unit was
numbered after it. Idle ranks wait on their queue, never inside a collective, so the process
group's timeout never fires on an idle executor.

Memory: a rank keeps its shards (``1/N`` of the weights, plus padding rows) for good; a gathered
unit lives only while a batch uses it (``live_gathered_bytes``, ``peak_gathered_bytes``).
"""

from __future__ import annotations

import collections
import datetime
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from symbiosis.checkpoint import (
    Checkpoint,
    Conv1D,
    ConvertedSource,
    base_layer_tensor_names,
    build_skeleton,
    expert_tensors,
    locate_tensors,
)
from symbiosis.errors import ExecutorTimeoutError, ExecutorUnavailableError
from symbiosis.executor.weights import LayerWeights
from symbiosis.sharding import messages as M
from symbiosis.sharding.placement import Layout, SpecRegistry, row_range
from symbiosis.threads import with_torch_threads

log = logging.getLogger(__name__)

LEADER = 0


@dataclass(frozen=True)
class UnitShard:
    """This rank's rows of one unit: ``rows_per_rank`` rows, zero-padded past the unit's end."""

    weight: torch.Tensor  # [rows_per_rank, in]
    bias: torch.Tensor | None  # [rows_per_rank]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.bias) if t is not None)


def load_row_shards(
    path: str | Path, layout: Layout, world_size: int, rank: int, *, device: torch.device, dtype: torch.dtype
) -> list[UnitShard]:
    """Read only ``rank``'s rows of every unit from the safetensors files (``get_slice``: the other
    rows are never copied), in the executor's ``[out, in]`` layout (``Conv1D``'s ``[in, out]``
    is sliced by columns and transposed)."""
    checkpoint = Checkpoint(path)
    skeleton = build_skeleton(checkpoint.config)
    conv1d_layers = {name for name, module in skeleton.named_modules() if isinstance(module, Conv1D)}
    experts = expert_tensors(skeleton)
    sources = locate_tensors(checkpoint, skeleton, base_layer_tensor_names(layout.specs, experts))
    expert_sources = locate_tensors(checkpoint, skeleton, experts)
    expert_of = {layer_id: (t, e) for t in experts.values() for e, layer_id in enumerate(t.layer_ids)}
    # The experts tensor being read. Each rank joins a whole one (transformers' converter joins all
    # of a module's per-expert matrices at once) to keep its rows of each expert; its experts are
    # units in a row, so each tensor is joined once.
    joined: dict[str, torch.Tensor] = {}

    def read(name: str, start: int, stop: int, columns: bool) -> torch.Tensor:
        # Opened per read: a file stays mapped only while its rows are copied out, so the pages
        # of the whole checkpoint never count in this rank's RSS at once (measured, ~1B Llama at
        # N=2: peak RSS 4.0 GiB with the files kept open, for 1.8 GiB of shards).
        source = sources[name]
        if isinstance(source, ConvertedSource):  # (joined from parts by transformers' converter: whole)
            whole = dict(checkpoint.iter_tensors({name: source}))[name]
            return (whole[:, start:stop].t() if columns else whole[start:stop]).clone()
        with safe_open(source.file, framework="pt") as handle:
            sliced = handle.get_slice(source.key)
            return (sliced[:, start:stop].t() if columns else sliced[start:stop]).clone()

    def read_expert(layer_id: str, start: int, stop: int) -> torch.Tensor:
        tensor, expert = expert_of[layer_id]
        if tensor.name not in joined:  # (one at a time)
            joined.clear()
            joined.update(checkpoint.iter_tensors({tensor.name: expert_sources[tensor.name]}))
        weight = joined[tensor.name][expert]
        return (weight.t() if tensor.transposed else weight)[start:stop].clone()

    shards = []
    for unit in layout.units:
        first, stop, rows_per_rank = row_range(unit.out_features, world_size, rank)
        weight = torch.zeros(rows_per_rank, unit.in_features, device=device, dtype=dtype)
        bias = torch.zeros(rows_per_rank, device=device, dtype=dtype) if unit.has_bias else None
        member_start = 0
        for member in unit.layer_ids:
            member_stop = member_start + layout.specs[member].out_features
            lo, hi = max(first, member_start), min(stop, member_stop)
            if lo < hi:
                a, b = lo - member_start, hi - member_start
                if member in expert_of:
                    weight[lo - first : hi - first] = read_expert(member, a, b)
                else:
                    weight[lo - first : hi - first] = read(f"{member}.weight", a, b, columns=member in conv1d_layers)
                if bias is not None:
                    bias[lo - first : hi - first] = read(f"{member}.bias", a, b, columns=False)
            member_start = member_stop
        shards.append(UnitShard(weight, bias))
    return shards


@dataclass
class _Waiter:
    after_seq: int
    event: threading.Event = field(default_factory=threading.Event)
    result: tuple[torch.Tensor, torch.Tensor | None] | None = None
    error: BaseException | None = None


class GatherSequencer:
    """Runs the all-gathers of one rank in the leader's order (see module doc)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        group: Any,
        layout: Layout,
        shards: list[UnitShard],
        send_to_leader: Callable[[M.LinkMessage], None],
        announce: Callable[[M.LinkMessage], None],
        timeout_s: float,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self._group = group
        self._layout = layout
        self._shards = shards
        self._send_to_leader = send_to_leader
        self._announce = announce
        self._timeout_s = timeout_s
        self._cond = threading.Condition()
        self._ops: collections.deque[tuple[int, int]] = collections.deque()  # (seq, unit) to run, in order
        self._waiters: dict[int, list[_Waiter]] = collections.defaultdict(list)
        self._completed_seq = 0
        self._expected_seq = 1  # followers: the next announcement must carry this seq
        self._latest_seq_of_unit: dict[int, int] = {}  # leader: the newest gather numbered per unit
        self._next_seq = 1  # leader
        self._failure: BaseException | None = None
        self._stopping = False
        self._live_bytes = 0
        self.peak_gathered_bytes = 0
        self.gathers = 0
        self.gathered_bytes = 0
        self.gather_s = 0.0
        self._thread = threading.Thread(
            target=with_torch_threads(self._run), name=f"shard-gather(rank {rank})", daemon=True
        )
        self._thread.start()

    # ---- any thread ------------------------------------------------------------------------

    def fetch(self, unit: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The whole unit (weight ``[out, in]``, bias), gathered from every rank; blocks until a
        gather of it finished after this call began. Raises ``ExecutorUnavailableError`` once the
        executor failed, ``ExecutorTimeoutError`` after the collective timeout."""
        with self._cond:
            if self._failure is not None:
                raise self._failure
            waiter = _Waiter(self._completed_seq)
            self._waiters[unit].append(waiter)
            if self.rank == LEADER:
                self._schedule(unit, waiter.after_seq)
        if self.rank != LEADER:
            try:
                self._send_to_leader(M.Want(unit, waiter.after_seq))
            except ExecutorUnavailableError as exc:
                self.fail(exc)
        if not waiter.event.wait(self._timeout_s + 5.0):
            with self._cond:
                if waiter in self._waiters[unit]:
                    self._waiters[unit].remove(waiter)
            raise ExecutorTimeoutError(f"gathering unit {unit} from every shard took longer than {self._timeout_s} s")
        if waiter.error is not None:
            raise waiter.error
        assert waiter.result is not None
        return waiter.result

    def fail(self, error: BaseException) -> None:
        """The executor failed (a rank is gone): every waiter, now and later, gets ``error``."""
        with self._cond:
            if self._failure is None:
                self._failure = error
            for waiters in self._waiters.values():
                for waiter in waiters:
                    waiter.error = self._failure
                    waiter.event.set()
            self._waiters.clear()
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    # ---- the link thread -------------------------------------------------------------------

    def on_want(self, unit: int, after_seq: int) -> None:
        """(Leader.) A follower's batch waits for ``unit``."""
        if not 0 <= unit < len(self._shards):
            log.warning("ignoring a Want for unknown unit %d", unit)
            return
        with self._cond:
            if self._failure is None:
                self._schedule(unit, after_seq)

    def on_gather(self, seq: int, unit: int) -> None:
        """(Follower.) The leader's next gather."""
        with self._cond:  # an RLock underneath: fail() may take it again
            if seq != self._expected_seq or not 0 <= unit < len(self._shards):
                self.fail(
                    ExecutorUnavailableError(
                        f"shard {self.rank} got gather {seq} of unit {unit}, expected gather {self._expected_seq}"
                    )
                )
                return
            self._expected_seq += 1
            self._ops.append((seq, unit))
            self._cond.notify_all()

    def _schedule(self, unit: int, after_seq: int) -> None:
        """(Leader, holding ``_cond``.) Number a gather of ``unit`` unless one numbered after
        ``after_seq`` exists; announce it to the followers in number order."""
        if self._latest_seq_of_unit.get(unit, 0) > after_seq:
            return
        seq = self._next_seq
        self._next_seq += 1
        self._latest_seq_of_unit[unit] = seq
        try:
            self._announce(M.Gather(seq, unit))
        except ExecutorUnavailableError as exc:
            self._failure = self._failure or exc
        self._ops.append((seq, unit))
        self._cond.notify_all()

    # ---- the gather worker ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._ops and not self._stopping and self._failure is None:
                    self._cond.wait()
                if self._stopping or self._failure is not None:
                    return
                seq, unit = self._ops.popleft()
            try:
                result = self._gather(unit)
            except Exception as exc:  # noqa: BLE001 - a failed collective means a rank is gone
                self.fail(
                    ExecutorUnavailableError(
                        f"all-gather of unit {unit} failed: {(str(exc).splitlines() or [repr(exc)])[0]}"
                    )
                )
                return
            self._hand_out(seq, unit, result)
            del result  # this thread keeps no reference: the unit is freed when its batches end

    def _hand_out(self, seq: int, unit: int, result: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        """Gather ``seq`` of ``unit`` finished here: serve the waiters it can serve."""
        with self._cond:
            self._completed_seq = seq
            waiting = self._waiters.get(unit, [])
            served = [w for w in waiting if w.after_seq < seq]
            self._waiters[unit] = [w for w in waiting if w.after_seq >= seq]
        for waiter in served:
            waiter.result = result
            waiter.event.set()

    def _gather(self, unit_index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        unit, shard = self._layout.units[unit_index], self._shards[unit_index]
        started = time.perf_counter()
        weight = self._all_gather(shard.weight)[: unit.out_features]
        bias = self._all_gather(shard.bias)[: unit.out_features] if shard.bias is not None else None
        self.gather_s += time.perf_counter() - started
        self.gathers += 1
        nbytes = sum(t.numel() * t.element_size() for t in (weight, bias) if t is not None)
        self.gathered_bytes += nbytes
        return weight, bias

    def _all_gather(self, local: torch.Tensor) -> torch.Tensor:
        out = local.new_empty((self.world_size * local.shape[0], *local.shape[1:]))
        work = self._group._allgather_base(out, local)  # what dist.all_gather_into_tensor calls
        work.wait(datetime.timedelta(seconds=self._timeout_s))
        if out.device.type == "cuda":  # the bytes must have landed before another stream reads them
            torch.cuda.current_stream(out.device).synchronize()
        self._track(out)
        return out

    def _track(self, gathered: torch.Tensor) -> None:
        """Count ``gathered`` as live until its last view dies (peak memory of gathered units)."""
        nbytes = gathered.numel() * gathered.element_size()
        with self._cond:
            self._live_bytes += nbytes
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._live_bytes)
        weakref.finalize(gathered, self._untrack, nbytes)

    def _untrack(self, nbytes: int) -> None:
        with self._cond:
            self._live_bytes -= nbytes

    def stats(self) -> dict:
        with self._cond:
            return {
                "gathers": self.gathers,
                "gathered_bytes": self.gathered_bytes,
                "gather_ms_total": 1e3 * self.gather_s,
                "mean_gather_ms": 1e3 * self.gather_s / self.gathers if self.gathers else 0.0,
                "live_gathered_bytes": self._live_bytes,
                "peak_gathered_bytes": self.peak_gathered_bytes,
            }


class _GatheringLayers(Mapping):
    """``weights.layers`` of an ``fsdp`` rank: looking a layer (or sibling group) up gathers its
    unit and returns its rows of it; iteration lists the real layer ids without gathering."""

    def __init__(self, layout: Layout, sequencer: GatherSequencer):
        self._layout = layout
        self._sequencer = sequencer

    def __getitem__(self, layer_id: str) -> LayerWeights:
        located = self._layout.locate(layer_id) if isinstance(layer_id, str) else None
        if located is None:
            raise KeyError(layer_id)
        unit, start, stop = located
        weight, bias = self._sequencer.fetch(unit)
        return LayerWeights(weight[start:stop], None if bias is None else bias[start:stop], packable=False)

    def __iter__(self) -> Iterator[str]:
        return iter(self._layout.specs)

    def __len__(self) -> int:
        return len(self._layout.specs)


class GatheredWeights:
    """``BaseModelWeights``' interface over this rank's row shards, for the ``ExecutionEngine``."""

    def __init__(
        self, layout: Layout, shards: list[UnitShard], sequencer: GatherSequencer, fingerprint: str, model_type: str
    ):
        self.specs = SpecRegistry(layout)
        self.layers = _GatheringLayers(layout, sequencer)
        self.fingerprint = fingerprint
        self.model_type = model_type
        self.shards = shards
        first = shards[0].weight if shards else torch.empty(0)
        self.device, self.dtype = first.device, first.dtype

    def nbytes(self) -> int:
        """Bytes this rank keeps for good (its shards, padding included)."""
        return sum(shard.nbytes() for shard in self.shards)
