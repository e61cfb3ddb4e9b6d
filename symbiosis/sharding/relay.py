"""Strategy ``layers``: a request for a layer another rank owns travels there, and its answer back.

The rank a client talks to sends the request (``Forward``: the client's id, the layer, the op,
the rows as a raw frame) to the owner over the links; the owner submits it to its engine under
the client's id, so its scheduler batches it with every other client's rows for that layer as a
single executor would, and answers (``Result``) when it is done. Clients whose transport follows
the entry's routes (``transport/routing.py``) send to the owner directly and never pass here;
this is the path for the rest (a client of another rank's endpoint, an in-process client, a
route that failed).

The owner's link thread runs the products it was sent itself (``try_alone``, or ``run_ready``
after a burst: it is one of the engine's drivers, like ``ZmqServer``'s socket thread), so a
relayed request meets no thread hand-off on the owner either.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import zmq

from symbiosis import protocol as P
from symbiosis.errors import ExecutorUnavailableError, ProtocolError, SymbiosisError, error_from_code
from symbiosis.executor.engine import ExecutionEngine
from symbiosis.sharding import messages as M
from symbiosis.sharding.links import PeerLinks
from symbiosis.vocabulary import LATENCY_CLASSES_BY_VALUE, OPS_BY_VALUE, LatencyClass, Op


@dataclass
class _Relayed:
    """A request waiting for its owner's answer."""

    future: Future
    owner: int
    out_dtype: torch.dtype
    out_device: torch.device
    staged: torch.Tensor  # the rows as sent (ZeroMQ may still hold their bytes)


class Relay:
    """Both ends of relayed requests for one rank (see module doc)."""

    def __init__(self, engine: ExecutionEngine, links: PeerLinks):
        self._engine = engine
        self._links = links
        self._lock = threading.Lock()
        self._seqs = itertools.count(1)
        self._pending: dict[int, _Relayed] = {}
        self.forwarded = 0  # requests this rank sent to owners
        self.served_for_peers = 0  # requests owners here ran for other ranks
        self.submitted = False  # the link thread queued products: run them after the burst

    # ---- the rank a client talks to ------------------------------------------------------------

    def forward(
        self, owner: int, client_id: str, layer_id: str, op: Op, rows: torch.Tensor, latency_class: LatencyClass
    ) -> Future:
        """Send a request to ``owner``; the future completes with the result in ``rows``' dtype
        and device, or with the owner's typed error, or ``ExecutorUnavailableError``."""
        staged = rows.detach().to("cpu").contiguous()
        seq = next(self._seqs)
        future: Future = Future()
        with self._lock:
            self._pending[seq] = _Relayed(future, owner, rows.dtype, rows.device, staged)
            self.forwarded += 1
        header = M.Forward(
            seq, client_id, layer_id, op.value, latency_class.value, P.dtype_name(staged.dtype), list(staged.shape)
        )
        try:
            self._links.send(owner, header, P.tensor_payload(staged))
        except ExecutorUnavailableError:
            with self._lock:
                self._pending.pop(seq, None)
            raise
        return future

    def on_result(self, message: M.Result, payload: list[zmq.Frame]) -> None:
        """(Link thread.) An owner answered."""
        with self._lock:
            pending = self._pending.pop(message.seq, None)
        if pending is None or pending.future.done():
            return
        if not message.ok:
            pending.future.set_exception(error_from_code(message.error_code, message.error_message))
            return
        well_formed = message.dtype in P.WIRE_DTYPES and len(message.shape) == 2 and len(payload) == 1
        if not well_formed or len(payload[0].buffer) != P.declared_nbytes(message.dtype, message.shape):
            pending.future.set_exception(ProtocolError(f"malformed answer from {self._links.describe(pending.owner)}"))
            return
        result = P.tensor_from_payload(payload[0].buffer, message.dtype, message.shape)
        pending.future.set_result(result.to(device=pending.out_device, dtype=pending.out_dtype))

    def fail_all(self, error: ExecutorUnavailableError) -> None:
        """Every request waiting for an owner fails with ``error`` (a rank went down)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for entry in pending.values():
            if not entry.future.done():
                entry.future.set_exception(error)

    # ---- the owner -----------------------------------------------------------------------------

    def on_forward(self, peer: int, message: M.Forward, payload: list[zmq.Frame]) -> None:
        """(Link thread.) Run a peer's request for a layer of this rank; answer when it is done."""
        try:
            op, latency_class = OPS_BY_VALUE.get(message.op), LATENCY_CLASSES_BY_VALUE.get(message.latency_class)
            if op is None or latency_class is None or message.dtype not in P.WIRE_DTYPES or len(payload) != 1:
                raise ProtocolError(f"malformed forwarded request for {message.layer_id!r}")
            if len(message.shape) != 2 or len(payload[0].buffer) != P.declared_nbytes(message.dtype, message.shape):
                raise ProtocolError("forwarded rows do not match their declared shape")
            rows = P.tensor_from_payload(payload[0].buffer, message.dtype, message.shape)
            self._engine.validate(message.layer_id, op, rows)
            self.served_for_peers += 1
            result = self._engine.try_alone(message.client_id, message.layer_id, op, rows, latency_class)
            if result is not None:
                self._answer(peer, message.seq, result, None)
                return
            future = self._engine.submit(message.client_id, message.layer_id, op, rows, latency_class, wake=False)
            self.submitted = True
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
        self._links.answer(
            peer, M.Result(seq, True, P.dtype_name(result.dtype), list(result.shape)), P.tensor_payload(result)
        )
