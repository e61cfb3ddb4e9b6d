"""Validated request shapes of lane calls, so that a lone client's call is served in a few steps.

Why. A decode step makes one call per base-layer group, each waiting for the last, and on the
machines we measure every Python call and torch call on that path costs three times what a hot
loop suggests (each round trip switches processes, and the interpreter restarts cold). The general
path of a request (``ZmqServer._on_request``: channel, admission, in-flight entry, validation,
``_try_alone``, ``_reply``) runs ~100 functions; most of what they check is the same for every
call of one layer. A ``Route`` is that part, checked once by ``protocol.validate_request`` and
kept: what is left per call is the row count, the payload size and the sender.

Only what a ``Route`` cannot vouch for is checked per call (``LaneRoutes.rows``); anything else —
an unknown layer, a bad dtype, a request that is not alone, shared memory or dist payloads, a
result too large for the lane — goes the general way, which gives the typed error or queues it.
The two paths compute the same product with the same kernel (``apply_op``), so the bits agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from symbiosis import protocol as P
from symbiosis.errors import SymbiosisError
from symbiosis.vocabulary import LATENCY_CLASSES_BY_VALUE, OPS_BY_VALUE, LatencyClass, LayerSpec, Op

#: Routes kept per server: one per (layer, op, dtype, latency class) a client used. Bounded so
#: that a client cycling through header variants cannot grow it; past it, calls go the general way.
MAX_ROUTES = 4096


@dataclass(frozen=True, slots=True)
class Route:
    """What a valid request header of one (layer, op, dtype, latency class) means."""

    layer_id: str
    op: Op
    latency_class: LatencyClass
    dtype: torch.dtype
    wire_dtype: str
    in_width: int
    out_width: int
    max_rows: int  # most rows whose rows and result both fit the payload cap and one lane message
    counts: dict[str, int]  # the server's per-layer stats entry (requests, rows, errors)


class LaneRoutes:
    """The server's routes (socket thread only)."""

    def __init__(self, specs: dict[str, LayerSpec], limits: P.Limits, stats: dict[str, dict[str, int]]) -> None:
        self._specs = specs
        self._limits = limits
        self._stats = stats
        self._routes: dict[tuple[str, str, str, str, int], Route] = {}

    def route(self, req: P.Request, max_lane_payload_bytes: int) -> Route | None:
        """The route of ``req``'s header, or None if it is not valid (the general path says why)."""
        key = (req.layer_id, req.op, req.dtype, req.latency_class, req.version)
        route = self._routes.get(key)
        if route is None and len(self._routes) < MAX_ROUTES:
            route = self._build(req, max_lane_payload_bytes)
            if route is not None:
                self._routes[key] = route
        return route

    def _build(self, req: P.Request, max_lane_payload_bytes: int) -> Route | None:
        spec = self._specs.get(req.layer_id)
        op = OPS_BY_VALUE.get(req.op)
        if spec is None or op is None:
            return None
        one_row = P.Request(
            req.version, req.client_id, 1, req.layer_id, req.op, req.dtype, [1, op.input_width(spec)], req.latency_class
        )
        itemsize = P.ITEMSIZE.get(req.dtype, 0)
        try:  # the same checks as every general-path request, on a one-row request of this header
            P.validate_request(one_row, one_row.shape[1] * itemsize, self._specs, self._limits)
        except SymbiosisError:
            return None
        in_width, out_width = op.input_width(spec), op.output_width(spec)
        widest_row = max(in_width, out_width) * itemsize
        max_rows = min(self._limits.max_payload_bytes, max_lane_payload_bytes) // widest_row
        counts = self._stats.setdefault(req.layer_id, {"requests": 0, "rows": 0, "errors": 0})
        return Route(
            req.layer_id,
            op,
            LATENCY_CLASSES_BY_VALUE[req.latency_class],
            P.WIRE_DTYPES[req.dtype],
            req.dtype,
            in_width,
            out_width,
            max_rows,
            counts,
        )

    @staticmethod
    def rows(route: Route, req: P.Request, payload: memoryview) -> torch.Tensor | None:
        """The rows of ``req`` over ``payload`` (no copy) if its shape and payload are what its
        route takes; None otherwise (the general path then checks it in full)."""
        shape = req.shape
        if len(shape) != 2 or shape[1] != route.in_width:
            return None
        n = shape[0]
        count = n * route.in_width
        if not 0 < n <= route.max_rows or count * route.dtype.itemsize != payload.nbytes:
            return None
        rows = torch.frombuffer(payload, dtype=route.dtype, count=count)
        if rows.data_ptr() % 64:  # lane payloads start aligned; anything else is copied the general way
            return None
        return rows.view(n, route.in_width)
