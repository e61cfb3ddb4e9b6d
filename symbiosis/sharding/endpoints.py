"""Where clients reach the ranks of a sharded executor, and the routes rank 0 tells them.

Rank 0 serves the addresses the user gave (``--bind``). Every other rank serves, for each of them,
an address of the same kind (``rank_address``: the ipc path plus ``.rank<R>``, or a free port on
the same tcp host), and any ``--shard-bind`` templates; it tells rank 0 (``Endpoints``), and rank
0 lists them in its Welcome (``protocol.Route``) with the layers each rank runs (strategy
``layers``), so that clients send each layer's requests to its rank (``transport/routing.py``).
Under ``fsdp`` every rank runs every layer (on gathered weights): no routes, a client computes
where it connected.
"""

from __future__ import annotations

import threading
import time

from symbiosis import protocol as P
from symbiosis.errors import ExecutorUnavailableError
from symbiosis.sharding.placement import Layout
from symbiosis.transport.schemes import tcp_address, tcp_host

_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "")


def rank_address(address: str, rank: int) -> str | None:
    """Rank ``rank``'s counterpart of a ``--bind`` address; None when there is none to tell clients
    (a wildcard tcp host: they are relayed through rank 0 instead)."""
    if address.startswith("ipc://"):
        return f"{address}.rank{rank}"
    if address.startswith("tcp://"):
        host = tcp_host(address)
        return None if host in _WILDCARD_HOSTS else tcp_address(host, 0)
    return None


def routes_for(
    layout: Layout, owners: list[int] | None, endpoints: dict[int, list[str]], bind_index: int
) -> list[P.Route]:
    """The routes rank 0's ``bind_index``-th address tells its clients: per other rank, its
    address of that kind and the indices (in ``layout.specs`` order, which is ``Welcome.layers``'s)
    of the layers it runs."""
    if owners is None:
        return []
    index_of = {layer: i for i, layer in enumerate(layout.specs)}
    found = []
    for rank, addresses in sorted(endpoints.items()):
        address = addresses[bind_index] if bind_index < len(addresses) else ""
        layers = [
            index_of[layer] for unit, owner in zip(layout.units, owners) if owner == rank for layer in unit.layer_ids
        ]
        if address and layers:
            found.append(P.Route(address, layers))
    return found


class EndpointBook:
    """(Rank 0.) The other ranks' client addresses, as they report them."""

    def __init__(self, world_size: int):
        self._world_size = world_size
        self._cond = threading.Condition()
        self._by_rank: dict[int, list[str]] = {}

    def add(self, rank: int, addresses: list[str]) -> None:
        with self._cond:
            self._by_rank[rank] = list(addresses)
            self._cond.notify_all()

    def wait(self, timeout_s: float) -> dict[int, list[str]]:
        """Every other rank's addresses; ``ExecutorUnavailableError`` naming the ranks still
        missing after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._by_rank) < self._world_size - 1:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(1, self._world_size)) - set(self._by_rank))
                    raise ExecutorUnavailableError(
                        f"ranks {missing} did not report their client endpoints in {timeout_s:.0f} s"
                    )
                self._cond.wait(remaining)
            return dict(self._by_rank)

    def snapshot(self) -> dict[int, list[str]]:
        with self._cond:
            return dict(self._by_rank)
