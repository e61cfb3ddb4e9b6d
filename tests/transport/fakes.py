"""A small ``ExecutorService`` with real torch math, and process entry points for transport tests.

Importable by ``multiprocessing`` 'spawn' children, so the same fake can serve from another
process. Weights come from a seeded generator: two processes with the same seed hold the same
weights, so a test can compute the reference locally for a server running elsewhere.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from symbiosis.errors import ProtocolError, ShapeError, UnknownLayerError
from symbiosis.vocabulary import LatencyClass, LayerSpec, Op

DEFAULT_SPECS: tuple[LayerSpec, ...] = (
    LayerSpec("q", in_features=16, out_features=24, has_bias=True),
    LayerSpec("o", in_features=24, out_features=16, has_bias=False),
    LayerSpec("wide", in_features=256, out_features=256, has_bias=True),
    LayerSpec("slow", in_features=16, out_features=8, has_bias=True),  # never completes if hung
)
ALLOWED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# How far a product computed by the server may be from the same product computed in the test.
# Same code, same weights, same inputs, yet not always the same bits: MKL picks its sgemm kernel
# (and so the order in which it sums the K products, and where it uses FMA) by CPU, by row count
# and by the *alignment* of the input's memory, and a decoded payload does not sit where the
# test's own tensor sits. Seen: one-ulp differences on an AMD CPU running AVX2 kernels; on this
# project's AVX-512 machine about half of the misaligned (n, K) inputs tried give other bits.
# The fake's widths are K <= 256 with y ~ N(0, 1): reordering K float32 additions of terms
# ~1/sqrt(K) moves y by ~sqrt(K)·eps ≈ 2e-6 typically and by K·eps/2 ≈ 1.5e-5 if every rounding
# errs the same way; rtol=atol=1e-5 (2e-5 at |y| = 1) covers any summation order, while a
# transport bug (a wrong row, shifted or truncated bytes, another client's result) is off by
# O(1), 10^5 times more. float16/bfloat16 results are the float32 product rounded once: a
# one-ulp float32 difference can flip that rounding, i.e. one ulp of the half type, at most
# 2^-10 (float16) or 2^-7 (bfloat16) of the value.
PRODUCT_TOLERANCE: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 2**-10, "atol": 1e-5},
    torch.bfloat16: {"rtol": 2**-7, "atol": 1e-5},
}


def assert_same_product(got: torch.Tensor, expected: torch.Tensor, msg: object = None) -> None:
    """``got`` (computed by a server) is ``expected`` (the same math done here) up to summation
    order: same dtype and shape, values within ``PRODUCT_TOLERANCE`` (see there for why)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got.dtype, got.shape, expected.shape, msg)
    tolerance = PRODUCT_TOLERANCE[expected.dtype]
    torch.testing.assert_close(got, expected, **tolerance, msg=None if msg is None else lambda m: f"{msg}: {m}")


def same_product(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """``assert_same_product`` as a bool, for worker threads that collect outcomes."""
    try:
        assert_same_product(got, expected)
    except AssertionError:
        return False
    return True


class FakeExecutorService:
    """``ExecutorService`` computing ``x Wᵀ + b``, ``g W``, ``n Wᵀ`` in float32 on small weights.

    ``threaded``: futures complete on a worker thread (after ``delay_s``) instead of before
    ``submit`` returns. Requests for ``hang_layers`` never complete; ``unregister_client`` cancels
    them, like the real executor dropping a dead client's work. ``events`` records every call.
    """

    def __init__(
        self,
        specs: Iterable[LayerSpec] = DEFAULT_SPECS,
        *,
        seed: int = 0,
        threaded: bool = False,
        delay_s: float = 0.0,
        hang_layers: Iterable[str] = (),
    ) -> None:
        self._specs = {s.layer_id: s for s in specs}
        generator = torch.Generator().manual_seed(seed)
        self.weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for spec in self._specs.values():
            weight = torch.randn(spec.out_features, spec.in_features, generator=generator) / spec.in_features**0.5
            bias = torch.randn(spec.out_features, generator=generator) if spec.has_bias else None
            self.weights[spec.layer_id] = (weight, bias)
        self._fingerprint = f"fake-{seed}"
        self._delay_s = delay_s
        self._hang_layers = frozenset(hang_layers)
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="fake-executor") if threaded else None
        self._cond = threading.Condition()
        self._hanging: dict[str, list[Future[torch.Tensor]]] = {}
        self.events: list[tuple[Any, ...]] = []

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def layer_specs(self) -> Mapping[str, LayerSpec]:
        return dict(self._specs)

    def register_client(self, client_id: str) -> None:
        self._record("register", client_id)

    def unregister_client(self, client_id: str) -> None:
        with self._cond:
            dropped = self._hanging.pop(client_id, [])
        for future in dropped:
            future.cancel()
        self._record("unregister", client_id, len(dropped))

    def submit(
        self, client_id: str, layer_id: str, op: Op, rows: torch.Tensor, latency_class: LatencyClass
    ) -> Future[torch.Tensor]:
        self._record("submit", client_id, layer_id, Op(op), tuple(rows.shape), LatencyClass(latency_class))
        spec = self._specs.get(layer_id)
        if spec is None:
            raise UnknownLayerError(f"unknown layer {layer_id!r}")
        if rows.dtype not in ALLOWED_DTYPES:
            raise ProtocolError(f"dtype {rows.dtype} not allowed")
        if rows.dim() != 2 or rows.shape[1] != Op(op).input_width(spec):
            raise ShapeError(f"{op} of {layer_id!r} takes [n, {Op(op).input_width(spec)}], got {list(rows.shape)}")
        future: Future[torch.Tensor] = Future()
        if layer_id in self._hang_layers:
            with self._cond:
                self._hanging.setdefault(client_id, []).append(future)
            return future
        if self._pool is None:
            future.set_result(self.compute(layer_id, op, rows))
        else:
            self._pool.submit(self._complete_later, future, layer_id, op, rows)
        return future

    def compute(self, layer_id: str, op: Op, rows: torch.Tensor) -> torch.Tensor:
        """The reference: float32 math on the layer's weights, cast back to ``rows``' dtype."""
        weight, bias = self.weights[layer_id]
        x = rows.to(torch.float32)
        if Op(op) is Op.BACKWARD:
            y = x @ weight
        else:
            y = x @ weight.T
            if Op(op) is Op.FORWARD and bias is not None:
                y = y + bias
        return y.to(rows.dtype)

    def wait_for(self, predicate: Callable[[list[tuple[Any, ...]]], bool], timeout_s: float) -> bool:
        """Wait until ``predicate(events)`` holds; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.events), timeout=timeout_s)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _complete_later(self, future: Future[torch.Tensor], layer_id: str, op: Op, rows: torch.Tensor) -> None:
        if self._delay_s:
            time.sleep(self._delay_s)
        try:
            future.set_result(self.compute(layer_id, op, rows))
        except Exception as exc:  # noqa: BLE001
            future.set_exception(exc)

    def _record(self, *event: Any) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()


def serve_in_process(addresses: list[str], seed: int, ready: Any, stop: Any) -> None:
    """Spawn-process entry: serve a fake on ``addresses`` until ``stop`` is set (at most 120 s)."""
    from symbiosis.transport.zmq import ZmqServer

    service = FakeExecutorService(seed=seed, threaded=True)
    servers = [ZmqServer(service, address).start() for address in addresses]
    ready.put([server.address for server in servers])
    stop.wait(120)
    for server in servers:
        server.close()
    service.close()


def call_and_wait(address: str, client_id: str, layer_id: str) -> None:
    """Spawn-process entry: connect and make one call that the test's fake never completes."""
    from symbiosis.transport.schemes import open_transport

    # shm: every payload through a segment (small ones would ride the lane inline), since the
    # tests check that a dead client's segments are unmapped
    options = {"inline_threshold": 0} if address.startswith("shm+") else {}
    transport = open_transport(address, client_id=client_id, timeout_s=120, **options)
    transport.call(layer_id, Op.FORWARD, torch.randn(4, 16), LatencyClass.PREFILL)


def declare_dist_payload(transport: Any, layer_id: str = "q", rows: int = 4) -> int:
    """Send a dist request header over ``transport``'s connection but never post its payload (a
    stuck or dying peer); returns the request id. Uses ``DistTransport`` internals on purpose."""
    from symbiosis import protocol as P

    rid = 10**6
    width = transport.layer_specs()[layer_id].in_features
    request = P.Request(
        P.PROTOCOL_VERSION,
        transport.client_id,
        rid,
        layer_id,
        "forward",
        "float32",
        [rows, width],
        "prefill",
        dist_tag=rid,
        dist_nbytes=rows * width * 4,
    )
    transport._conn.submit(rid, [P.encode(request)], True)
    return rid


def declare_dist_payload_and_hang(address: str, client_id: str) -> None:
    """Spawn-process entry: open a dist session, declare a payload, never send it, wait to be killed."""
    from symbiosis.transport.schemes import open_transport

    transport = open_transport(address, client_id=client_id, timeout_s=120)
    declare_dist_payload(transport)
    time.sleep(120)


@contextlib.contextmanager
def raw_tcp_peer(answer: Callable[[socket.socket], None] = lambda conn: None) -> Iterator[str]:
    """A loopback TCP listener that is not a Symbiosis executor: ``answer(conn)`` runs on each
    connection it accepts (default: nothing, the connection stays open). Yields ``tcp://`` its
    address; on exit stops accepting and closes every connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed: the test is over
            accepted.append(conn)
            try:
                answer(conn)
            except OSError:
                pass  # the client hung up first

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone does not)
        listener.close()
        thread.join(timeout=5)
        for conn in accepted:
            conn.close()
