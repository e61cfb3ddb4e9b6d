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
from symbiosis.vocabulary import LATENCY_CLASSES_BY_VALUE, LatencyClass, LayerSpec

#: Routes kept per server: one per (layer, op, dtype, latency class) a client used. Bounded so
#: that a client cycling through header variants cannot grow it; past it, calls go the general way.
MAX_ROUTES = 4096


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
    """The server's routes (socket thread only)."""

    def __init__(self, specs: dict[str, LayerSpec], limits: P.Limits, stats: dict[str, dict[str, int]]) -> None:
        self._specs = specs
        self._limits = limits
        self._stats = stats
        self._routes: dict[tuple[str, str, str, str, int], Route] = {}

    def route(self, req: P.Request) -> Route | None:
        """The route of ``req``'s header, or None if it is not valid (the general path says why)."""
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

    @staticmethod
    def rows(route: Route, req: P.Request, payload: memoryview, max_result_bytes: int) -> torch.Tensor | None:
        """The rows of ``req`` over ``payload`` (no copy) if its shape and payload are what its
        route takes and its result fits ``max_result_bytes`` (the lane's message); None otherwise
        (the general path then checks it in full)."""
        shape, call = req.shape, route.shape
        if len(shape) != 2 or shape[1] != call.in_width:
            return None
        n = shape[0]
        count = n * call.in_width
        if not 0 < n <= call.max_rows or count * call.itemsize != payload.nbytes:
            return None
        if n * call.out_width * call.itemsize > max_result_bytes:
            return None
        rows = torch.frombuffer(payload, dtype=route.dtype, count=count)
        if rows.data_ptr() % 64:  # lane payloads start aligned; anything else is copied the general way
            return None
        return rows.view(n, call.in_width)
