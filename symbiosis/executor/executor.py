"""``BaseExecutor``: the frozen base layers of one checkpoint, served to many clients.

The executor is stateless between calls: it keeps the weights and nothing else — no
activations, no KV cache, no optimizer state — so any number of clients can come and go, and a
restarted executor is indistinguishable from the one before.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path

import torch

from symbiosis.errors import ConfigurationError
from symbiosis.executor import matmul_forms
from symbiosis.executor.engine import ExecutionEngine, ResultSink
from symbiosis.executor.scheduler import Scheduler, SchedulerConfig
from symbiosis.executor.weights import BaseModelWeights
from symbiosis.protocol import expert_row_counts
from symbiosis.vocabulary import LatencyClass, LayerSpec, Op

DTYPES_BY_NAME = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: Short names users bring from other tools (vLLM's --dtype, PyTorch Lightning's precision).
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
#: ``warm_up`` times forwards of 1 to this many rows: the decode batches of a few clients. Larger
#: ones are timed on first use (packed layers, the default on a CPU, time only 1-2 rows anyway).
WARM_UP_ROWS = 8
#: ``/health`` says "stalled" once a request has waited this long (``BaseExecutor.health``).
HEALTH_STALL_S = 30.0


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A dtype given as one, or by name (and the short names other tools use). An executor casts
    rows at its boundary, so any torch dtype serves (float64 for a reference run); a client's
    rows travel in its own dtype, which ``load_client_model`` checks."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPES_BY_NAME:
        raise ConfigurationError(f"unsupported dtype {dtype!r}; use one of {list(DTYPES_BY_NAME)}")
    return DTYPES_BY_NAME[name]


def parse_device(device: torch.device | str) -> torch.device:
    """``device`` as a ``torch.device``: a malformed name (``--device gpu``) or a CUDA device on a
    machine where torch sees none is the user's to fix (``ConfigurationError``), not a crash deep
    inside the first ``.to(device)``."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigurationError(f"unsupported device {device!r}: {exc}") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ConfigurationError(f"device {str(device)!r}: torch sees no CUDA device on this machine; use cpu")
    return parsed


class BaseExecutor:
    """Serves forward, backward and noise ops of every base layer; implements ``ExecutorService``."""

    def __init__(self, weights: BaseModelWeights, scheduler_config: SchedulerConfig | None = None):
        self.weights = weights
        self.scheduler_config = scheduler_config or SchedulerConfig()
        self._engine = ExecutionEngine(weights, Scheduler(self.scheduler_config))
        self._servers: list = []

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        policy: str = "opportunistic",
        quantization: str | None = None,
        scheduler_config: SchedulerConfig | None = None,
        **scheduler_options,
    ) -> BaseExecutor:
        """Load only the base layers of the checkpoint at ``path`` onto ``device`` in ``dtype``.

        ``quantization``: None (weights in ``dtype``), "int8" or "fp8-rowwise": weights stored
        quantized with one scale per output row, quantized as they are read; ``dtype`` is then the
        dtype products are computed and answered in (``executor/quantized.py``). Clients need no
        change. ``scheduler_options`` are the other ``SchedulerConfig`` fields (``max_wait_ms``,
        ``row_budget``, ``decode_slo_ms``, ...); or pass a whole ``scheduler_config`` instead.
        """
        if scheduler_config is not None and (scheduler_options or policy != "opportunistic"):
            raise ConfigurationError("pass either scheduler_config or policy and SchedulerConfig fields, not both")
        config = scheduler_config or SchedulerConfig(policy=policy, **scheduler_options)
        device, dtype = parse_device(device), parse_dtype(dtype)
        weights = BaseModelWeights.load(path, device=device, dtype=dtype, quantization=quantization)
        return cls(weights, config)

    # ---- ExecutorService -----------------------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        return self.weights.fingerprint

    @property
    def device(self) -> torch.device:
        return self._engine.device

    @property
    def dtype(self) -> torch.dtype:
        return self._engine.dtype

    @property
    def quantization(self) -> str | None:
        """How the base weights are stored: None (full precision ``dtype``), "int8" or "fp8-rowwise"."""
        return self.weights.quantization

    @property
    def latency_rows(self) -> int:
        """A decode or prefill request of at most this many rows is latency work, served before
        bulk work (``SchedulerConfig.decode_share_rows``): clients that split long prompts into
        chunks (the API server's chunked prefill) make their chunks no larger."""
        return self.scheduler_config.decode_share_rows

    def layer_specs(self) -> Mapping[str, LayerSpec]:
        return self.weights.specs

    def register_client(self, client_id: str) -> None:
        self._engine.client_joined(client_id)

    def unregister_client(self, client_id: str) -> None:
        self._engine.client_left(client_id)

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
        expert_rows: Sequence[int] = (),
    ) -> Future[torch.Tensor] | ResultSink:
        """See ``ExecutionEngine.submit`` (``sink``: where the result goes instead of a new future;
        ``borrowed``: ``rows`` are valid only until this returns; ``expert_rows``: the rows of
        several experts of the experts tensor ``layer_id``, ``protocol.Request``)."""
        op = op if type(op) is Op else Op(op)  # an enum call costs a microsecond on the queued path
        latency_class = latency_class if type(latency_class) is LatencyClass else LatencyClass(latency_class)
        return self._engine.submit(
            client_id,
            layer_id,
            op,
            rows,
            latency_class,
            wake=wake,
            sink=sink,
            borrowed=borrowed,
            expert_rows=_counts(expert_rows),
        )

    #: Requests may carry ``expert_rows`` (said in ``Welcome.expert_rows``; a sharded executor does not).
    serves_expert_rows = True

    def attach_driver(self, wake) -> None:
        """See ``ExecutionEngine.attach_driver``: a server thread that runs ready batches itself."""
        self._engine.attach_driver(wake)

    def detach_driver(self, wake) -> None:
        self._engine.detach_driver(wake)

    def validate(self, layer_id: str, op: Op, rows: torch.Tensor, expert_rows: Sequence[int] = ()) -> None:
        """Raise the typed error ``submit`` would raise for this request (unknown layer, bad shape or dtype)."""
        self._engine.validate(layer_id, op, rows, _counts(expert_rows))

    def try_alone(
        self,
        client_id: str,
        layer_id: str,
        op: Op,
        rows: torch.Tensor,
        latency_class: LatencyClass,
        out: torch.Tensor | None = None,
        expert_rows: Sequence[int] = (),
    ):
        """For a driver: the result now if nothing could share its batch (no other client, or
        nothing pending and no rule in force holding it for another: ``Scheduler.serves_at_once``),
        else None; the request
        must have been validated (``validate``) and be non-empty. ``out``: where the driver sends
        the result from (e.g. a shared-memory reply region); the product is computed straight into
        it when it can be (see ``ExecutionEngine.try_alone``). ``rows`` may lie anywhere (a ZeroMQ
        frame's bytes): they are aligned here, in the thread that computes, when this request is
        served at once (``runner.aligned``). ``expert_rows``: see ``submit`` (validated here)."""
        return self._engine.try_alone(client_id, layer_id, op, rows, latency_class, out, True, _counts(expert_rows))

    def run_ready(self) -> float | None:
        """Run every batch ready now in the calling thread; the next wake-up time (monotonic) or None."""
        return self._engine.run_ready()

    def call(
        self,
        client_id: str,
        layer_id: str,
        op: Op,
        rows: torch.Tensor,
        latency_class: LatencyClass,
        timeout_s: float = 300.0,
        expert_rows: Sequence[int] = (),
    ) -> torch.Tensor:
        """Blocking ``submit`` for in-process clients: the calling thread runs ready batches itself
        (its own rows and any rows others queued meanwhile), so a lone client pays no thread
        hand-off while concurrent ones still share products. Raises ``ExecutorTimeoutError``."""
        op = op if type(op) is Op else Op(op)  # enum lookups cost more than the check
        latency_class = latency_class if type(latency_class) is LatencyClass else LatencyClass(latency_class)
        return self._engine.call(client_id, layer_id, op, rows, latency_class, timeout_s, _counts(expert_rows))

    # ---- conveniences --------------------------------------------------------------------------

    def run(self, layer_id: str, op: Op | str, rows: torch.Tensor) -> torch.Tensor:
        """Synchronous single call, for tests and tools (goes through the same batching path)."""
        return self.call("direct", layer_id, Op(op), rows, LatencyClass.PREFILL)

    def warm_up(self, most_rows: int = WARM_UP_ROWS, say: Callable[[str], None] | None = None) -> int:
        """Time the forward forms of 1 to ``most_rows`` rows for every weight shape a client may
        ask for (``MatmulForms.warm_up``), before serving: done on first use, each trial (~80 ms
        on the ~105M llama here) ran on the server's thread while every client waited, and
        heterogeneous decoders bring new row counts seconds into serving -- profiled (py-spy,
        2026-11-30, this 2-core host, 6 client processes, 6 s windows after 2 s of warm-up), the
        server's thread spent 11-15% of the measured windows in trials. Call it from the thread
        that then calls ``serve`` (the server's thread takes its torch thread count, and the
        forms are kept per count). ``say``: told when the timing starts and how long it took
        (``symbiosis serve``, ``symbiosis api --embedded``: it takes seconds on a large model).
        Returns how many trials ran (0 when tuning is off, the weights are not on a CPU, or all
        were timed before)."""
        from symbiosis.executor.packed_weights import WEIGHT_PACKING

        if not matmul_forms.MATMUL_FORMS.enabled or self.device.type != "cpu":
            return 0

        # Past the packing budget layers stay unpacked, with forms of their own: a sibling group
        # packs a copy of its members' rows, so the packed copies may reach twice the weights.
        room = WEIGHT_PACKING.budget_bytes - WEIGHT_PACKING.packed_bytes
        unpacked_too = 2 * self.weights.nbytes() > room
        shapes = ((w.weight, w.bias, w.packable) for w in self.weights.forward_shapes())
        if say is not None:
            say("timing the forms of decode-sized products for each weight shape ...")
        started = time.monotonic()
        trials = matmul_forms.MATMUL_FORMS.warm_up(shapes, most_rows, unpacked_too)
        if say is not None:
            say(f"  {trials} trials in {time.monotonic() - started:.1f} s")
        return trials

    def serve(self, address: str, **server_options):
        """Start serving remote clients at ``address`` (``tcp://host:port`` or ``ipc:///path``).

        Non-blocking; returns the server handle (``.address``, ``.close()``). Binds loopback only
        unless ``allow_non_loopback=True``.
        """
        from symbiosis.transport.zmq import ZmqServer

        server = ZmqServer(self, address, **server_options)
        server.start()
        self._servers.append(server)
        return server

    def stats(self) -> dict:
        stats = self._engine.stats()
        stats["config"] = dataclasses.asdict(self.scheduler_config)
        stats["weights_bytes"] = self.weights.nbytes()
        stats["packed_weights_bytes"] = self.weights.packed_nbytes()
        stats["device"] = str(self.device)
        stats["dtype"] = str(self.dtype).removeprefix("torch.")
        stats["quantization"] = self.quantization or "none"
        stats["kernels"] = self.weights.kernels()
        stats["matmul_forms"] = matmul_forms.MATMUL_FORMS.chosen()
        return stats

    def health(self) -> dict:
        """What ``/health`` reports; any ``status`` but "ok" answers 503, so that a monitor
        restarts an executor that stopped serving as it would a dead one: "stopping" once closed
        (draining), "unavailable" when a server's socket thread stopped (its clients get nothing),
        "stalled" when a request has waited ``HEALTH_STALL_S`` (or twice the lockstep timeout, if
        longer) -- no product or hold of ours lasts that long (a product that never ends, say)."""
        stats = self._engine.stats()
        stalled_after_s = max(HEALTH_STALL_S, 2e-3 * self.scheduler_config.lockstep_timeout_ms)
        oldest_wait_s = self._engine.oldest_wait_s()
        stopped = [server.address for server in self._servers if not server.serving]
        if not self._engine.accepting:
            status, reason = "stopping", "the executor is closing"
        elif stopped:
            status, reason = "unavailable", f"not serving at {', '.join(stopped)} (its socket thread stopped)"
        elif oldest_wait_s >= stalled_after_s:
            status, reason = "stalled", f"a request has waited {oldest_wait_s:.0f} s"
        else:
            status, reason = "ok", None
        return {
            "status": status,
            **({"reason": reason} if reason else {}),
            "inflight_requests": stats["inflight_requests"],
            "oldest_wait_s": round(oldest_wait_s, 3),
            "device": str(self.device),
        }

    def close(self, drain: bool = True) -> None:
        """Stop serving. ``drain``: finish the requests in flight first (up to each server's
        ``drain_timeout_s``); otherwise answer them ``ExecutorUnavailableError`` at once."""
        for server in self._servers:
            server.close(drain=drain)
        self._servers.clear()
        self._engine.close(drain=drain)

    def __enter__(self) -> BaseExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _counts(expert_rows: Sequence[int]) -> Sequence[int]:
    """``expert_rows`` as Python ints (a caller's numpy or tensor counts too: ``ShapeError`` for
    anything else), or ``()`` for none."""
    return expert_row_counts(expert_rows) if len(expert_rows) else ()
