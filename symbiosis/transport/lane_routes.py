"""Validated request shapes of lane calls, so that a lone client's call is served in a few steps.

Why. A decode step makes one call per base-layer group, each waiting for the last, and on the
machines we measure every Python call and torch call on that path costs three times what a hot
loop suggests (each round trip switches processes, and the interpreter restarts cold). The general
path of a request (``ZmqServer._on_request``: channel, admission, in-flight entry, validation,
``_try_alone``, ``_reply``) runs ~100 functions; most of what they check is the same for every
call of one layer. A ``Route`` is that part, checked once by ``protocol.validate_request`` and
kept: what is left per call is the row count, the payload size and the sender.

Only what a ``Route`` cannot vouch for is checked per call (``LaneRoutes.slot``); anything else —
an unknown layer, a bad dtype, a request that is not alone, shared memory or dist payloads, a
result too large for the lane — goes the general way, which gives the typed error or queues it.
The two paths compute the same product with the same kernel (``apply_op``), so the bits agree.

Lane calls go one step further (``LaneRoutes.slot``). Every message is read to the start of a
buffer -- for same-host lanes one receive buffer of the server's, for a tcp lane its own inbox --
so the payload of a call with a given header length and row count always lies at the same place;
a ``Slot`` keeps the tensor over that place and another over the reply buffer, made once. A call
then costs no tensor construction at all: its rows are the slot's view, the product is written
into the slot's result view (``apply_op``'s ``out``), and those bytes are sent. Measured on the
1-row round trip over ipc (``benchmarks/roundtrip.py``): making the two tensors and the payload
views per call was ~25 µs of the server's ~80.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from symbiosis import protocol as P
from symbiosis.transport import lane as lanes
from symbiosis.transport.lane import ExecutorLane, aligned_buffer, payload_start
from symbiosis.vocabulary import LATENCY_CLASSES_BY_VALUE, LatencyClass, LayerSpec

#: Routes kept per server: one per (layer, op, dtype, latency class) a client used. Bounded so
#: that a client cycling through header variants cannot grow it; past it, calls go the general way.
MAX_ROUTES = 4096
#: Slots kept over the same-host receive buffer: one per (route, row count, header length) used.
#: Decode uses a few row counts per layer; a client whose every call has a new row count (prefill
#: of ever new lengths) would fill them, so they are all dropped when full and made again as used.
MAX_SLOTS = 1024
#: The same, per tcp lane (over its own inbox).
MAX_SLOTS_PER_TCP_LANE = 256


@dataclass(frozen=True, slots=True)
class Slot:
    """Where a lane call of one route, row count and header length has its rows and its result:
    views of the buffer the lane reads into (the server's receive buffer, or a tcp lane's inbox)
    and of the server's reply buffer, made once (module doc)."""

    rows: torch.Tensor  # [n, in_width], where such a call's payload lands
    out: torch.Tensor  # [n, out_width], over the reply buffer, in the route's dtype
    out_bytes: memoryview  # out's bytes: the reply's payload
    reply_shape: list[int]  # [n, out_width], for the reply header


@dataclass(frozen=True, slots=True)
class Route:
    """What a valid request header of one (layer, op, dtype, latency class) means."""

    layer_id: str
    shape: P.CallShape  # op, widths, item size, rows the payload cap allows
    latency_class: LatencyClass
    dtype: torch.dtype
    wire_dtype: str
    counts: dict[str, int]  # the server's per-layer stats entry (requests, rows, errors)


class LaneRoutes:
    """The server's routes, and the buffers every same-host lane message is read into and every
    slot's reply is written to (socket thread only)."""

    def __init__(self, specs: dict[str, LayerSpec], limits: P.Limits, stats: dict[str, dict[str, int]]) -> None:
        self._specs = specs
        self._limits = limits
        self._stats = stats
        self._routes: dict[tuple[str, str, str, str, int], Route] = {}
        self._receive_buffer: memoryview | None = None
        self._reply_buffer: memoryview | None = None
        # Over the receive buffer, by (id of the route, rows, header length): a route is never
        # dropped, so its id names it for the server's life.
        self._slots: dict[tuple[int, int, int], Slot] = {}

    @property
    def receive_buffer(self) -> memoryview:
        """Where the server reads every same-host lane message, at its start (made on first use:
        a server without lanes does not hold the MiB)."""
        if self._receive_buffer is None:
            # (the size read now, as lanes read it when made: a test that shrinks it for its lanes
            # made this buffer that small for every later server when it was an import-time copy)
            self._receive_buffer = aligned_buffer(lanes.MAX_MESSAGE_BYTES)
        return self._receive_buffer

    def route(self, req: P.Request) -> Route | None:
        """The route of ``req``'s header, or None if it is not valid (the general path says why).
        A request with ``expert_rows`` takes its experts tensor's route: the executor checks the
        counts (``try_alone``, ``submit``)."""
        key = (req.layer_id, req.op, req.dtype, req.latency_class, req.version)
        route = self._routes.get(key)
        if route is None and len(self._routes) < MAX_ROUTES and req.version == P.PROTOCOL_VERSION:
            shape = P.call_shape(req.layer_id, req.op, req.dtype, req.latency_class, self._specs, self._limits)
            if shape is not None:
                counts = self._stats.setdefault(req.layer_id, {"requests": 0, "rows": 0, "errors": 0})
                route = self._routes[key] = Route(
                    req.layer_id,
                    shape,
                    LATENCY_CLASSES_BY_VALUE[req.latency_class],
                    P.WIRE_DTYPES[req.dtype],
                    req.dtype,
                    counts,
                )
        return route

    def slot(
        self,
        route: Route,
        req: P.Request,
        payload: memoryview,
        header_nbytes: int,
        max_result_bytes: int,
        lane: ExecutorLane,
    ) -> Slot | None:
        """The slot of ``req``, a call ``lane`` read to the start of its buffer (``receive_buffer``,
        or a tcp lane's inbox: its ``payload`` lies right after its header of ``header_nbytes``),
        if its shape and payload are what its route takes and its result fits
        ``max_result_bytes``; None otherwise (the general path then checks it in full)."""
        shape, call = req.shape, route.shape
        if len(shape) != 2 or shape[1] != call.in_width:
            return None
        n = shape[0]
        if not 0 < n <= call.max_rows or n * call.in_width * call.itemsize != payload.nbytes:
            return None
        if n * call.out_width * call.itemsize > max_result_bytes:
            return None
        key = (id(route), n, header_nbytes)
        slots = lane.slots if lane.stream else self._slots
        slot = slots.get(key)
        if slot is None:
            buffer = lane.inbox if lane.stream else self.receive_buffer
            if buffer is None:
                return None
            if len(slots) >= (MAX_SLOTS_PER_TCP_LANE if lane.stream else MAX_SLOTS):
                slots.clear()
            slot = slots[key] = self._new_slot(route, n, header_nbytes, buffer)
        return slot

    def _new_slot(self, route: Route, n: int, header_nbytes: int, buffer: memoryview) -> Slot:
        if self._reply_buffer is None:
            self._reply_buffer = aligned_buffer(lanes.MAX_MESSAGE_BYTES)
        call = route.shape
        start = payload_start(header_nbytes)
        rows_view = buffer[start : start + n * call.in_width * call.itemsize]
        out_bytes = self._reply_buffer[: n * call.out_width * call.itemsize]
        return Slot(
            torch.frombuffer(rows_view, dtype=route.dtype).view(n, call.in_width),
            torch.frombuffer(out_bytes, dtype=route.dtype).view(n, call.out_width),
            out_bytes,
            [n, call.out_width],
        )
