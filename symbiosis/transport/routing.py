"""A client of a sharded executor sends each layer's requests straight to the rank that runs it.

A sharded executor (``symbiosis/sharding``) is reached at one address, like a single one: its
rank 0 serves every layer, relaying the requests for layers another rank owns to that rank and
the answers back. Its ``Welcome`` also lists the other ranks (``protocol.Route``: an address of
the same kind as the one the client used, and the layers that rank runs). ``open_transport``
wraps a connection whose Welcome has routes in a ``RoutingTransport``, which connects to each of
those ranks the same way (same scheme: ``shm+``/``dist+`` stay on) and sends each layer's
requests to its rank: no relay hop (about 0.9 ms per call on this 2-core host, measured by
``benchmarks/sharded.py``). The client's code does not change.

A sibling group id (``vocabulary.group_id``) goes where its first member goes: the executor
keeps a sibling block on one rank.

Failures: a call on a rank's connection that fails with ``ExecutorUnavailableError`` (after that
connection's own retries) goes through the entry instead, which relays it or says which shard is
down; that rank's layers then use the entry until the entry's Welcome changes (a reconnect, e.g.
after the launcher restarted the group, whose ranks may listen at new addresses), when the routes
are read again. A rank that cannot be reached at start is likewise left to the entry.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from symbiosis import protocol as P
from symbiosis.errors import ExecutorUnavailableError, SymbiosisError
from symbiosis.vocabulary import GROUP_SEPARATOR, LatencyClass, LayerSpec, Op

log = logging.getLogger(__name__)

#: How long a call on a rank's connection retries a lost connection before the entry takes the call
#: over (the entry keeps its own, longer, window). Short: a rank that restarted may listen elsewhere.
ROUTE_CONNECT_TIMEOUT_S = 2.0


class RoutingTransport:
    """``Transport`` over a sharded executor's entry and the ranks its Welcome routes to."""

    def __init__(self, entry: Any, open_route: Callable[[str], Any]) -> None:
        """``entry``: the connection to the address the user gave (a ``ZmqTransport``); it must
        have said Hello. ``open_route(address)``: a connection to another rank."""
        self._entry = entry
        self._open_route = open_route
        self._lock = threading.Lock()
        self._closed = False
        self._routes_of: Any = None  # the Welcome the routes were read from
        self._by_address: dict[str, Any] = {}
        self._by_layer: dict[str, Any] = {}
        self._refresh()

    # ---- Transport ------------------------------------------------------------------------

    @property
    def client_id(self) -> str:
        return self._entry.client_id

    @property
    def address(self) -> str:
        return self._entry.address

    @property
    def fingerprint(self) -> str:
        return self._entry.fingerprint

    @property
    def quantization(self) -> str | None:
        return self._entry.quantization

    @property
    def latency_rows(self) -> int | None:
        return self._entry.latency_rows

    def layer_specs(self) -> Mapping[str, LayerSpec]:
        return self._entry.layer_specs()

    def call(self, layer_id: str, op: Op, rows: torch.Tensor, latency_class: LatencyClass) -> torch.Tensor:
        route = self._by_layer.get(layer_id)
        if route is None:
            route = self._route_of(layer_id)
        if route is self._entry:
            return self._entry.call(layer_id, op, rows, latency_class)
        try:
            return route.call(layer_id, op, rows, latency_class)
        except ExecutorUnavailableError:
            if self._closed:
                raise
            self._drop(route)
            result = self._entry.call(layer_id, op, rows, latency_class)
            self._refresh()
            return result

    def close(self) -> None:
        with self._lock:
            self._closed = True
            routes, self._by_address, self._by_layer = list(self._by_address.values()), {}, {}
        for route in routes:
            route.close()
        self._entry.close()

    # ---- timeouts apply to every connection (tests and jobs set them after connecting) ---------

    @property
    def timeout_s(self) -> float:
        return self._entry.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        for transport in self._transports():
            transport.timeout_s = value

    @property
    def connect_timeout_s(self) -> float:
        return self._entry.connect_timeout_s

    @connect_timeout_s.setter
    def connect_timeout_s(self, value: float) -> None:
        self._entry.connect_timeout_s = value  # a route fails fast (ROUTE_CONNECT_TIMEOUT_S): the entry takes over

    def routed_addresses(self) -> list[str]:
        """The ranks this client sends to directly (besides the entry)."""
        return list(self._by_address)

    def connections(self) -> list[Any]:
        """Every connection this client holds, the entry first."""
        return self._transports()

    # ---- routes ---------------------------------------------------------------------------

    def _transports(self) -> list[Any]:
        return [self._entry, *self._by_address.values()]

    def _route_of(self, layer_id: str) -> Any:
        """A group id goes where its first member goes (cached: the ids are this client's own, a
        few per block); anything else unknown goes to the entry, which answers it."""
        first = layer_id.partition(GROUP_SEPARATOR)[0]
        route = self._by_layer.get(first, self._entry)
        if first != layer_id:
            self._by_layer[layer_id] = route
        return route

    def _drop(self, route: Any) -> None:
        """``route`` failed: its layers go through the entry until the Welcome changes."""
        with self._lock:
            self._by_layer = {layer: t for layer, t in self._by_layer.items() if t is not route}
            self._by_address = {address: t for address, t in self._by_address.items() if t is not route}
        log.warning("a rank of the sharded executor failed; its layers go through %s", self._entry.address)
        try:
            route.close()
        except SymbiosisError:
            pass

    def _refresh(self) -> None:
        """Read the routes of the entry's latest Welcome, if it is not the one read last."""
        welcome = self._entry.welcome
        if welcome is None or welcome is self._routes_of:
            return
        routes: list[P.Route] = list(welcome.routes)
        names = [layer.layer_id for layer in welcome.layers]
        opened: dict[str, Any] = {}
        by_layer: dict[str, Any] = {}
        for route in routes:
            try:
                transport = self._by_address.get(route.address) or self._open_route(route.address)
            except SymbiosisError as exc:
                log.warning(
                    "cannot reach rank at %s (%s); its layers go through %s", route.address, exc, self._entry.address
                )
                continue
            opened[route.address] = transport
            for index in route.layers:
                if 0 <= index < len(names):
                    by_layer[names[index]] = transport
        with self._lock:
            stale = [t for address, t in self._by_address.items() if address not in opened]
            self._by_address, self._by_layer, self._routes_of = opened, by_layer, welcome
        for transport in stale:
            transport.close()

    def __deepcopy__(self, memo) -> RoutingTransport:
        return self  # one connection per client, shared by copies of the model
