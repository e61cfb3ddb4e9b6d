"""Which client transport serves an executor address: a table from address scheme to class.

``open_transport(address)`` looks the scheme up here and imports that one module, so the ZeroMQ
client never imports the shared-memory or torch.distributed transports (which build on it).
"""

from __future__ import annotations

import importlib
import ipaddress
from typing import Any

from symbiosis.errors import ConfigurationError
from symbiosis.transport.security import CurveClientKeys

#: address prefix -> "module:Class" of the client transport. Longest prefixes first.
TRANSPORTS: dict[str, str] = {
    "shm+ipc://": "symbiosis.transport.shm_client:ShmTransport",  # same host only: never shm+tcp
    "dist+ipc://": "symbiosis.transport.dist_client:DistTransport",
    "dist+tcp://": "symbiosis.transport.dist_client:DistTransport",
    "ipc://": "symbiosis.transport.zmq_client:ZmqTransport",
    "tcp://": "symbiosis.transport.zmq_client:ZmqTransport",
}


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an IP address, bracketed IPv6 too, or ``localhost``) is this machine's loopback."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def on_this_host(address: str) -> bool:
    """Whether an executor ``address`` is on this machine: any ipc scheme, or tcp to loopback."""
    scheme, _, rest = address.partition("://")
    if scheme.endswith("ipc"):
        return True
    return is_loopback_host(rest.rpartition(":")[0])


def transport_class(address: str) -> type:
    for prefix, target in TRANSPORTS.items():
        if address.startswith(prefix):
            module_name, class_name = target.split(":")
            return getattr(importlib.import_module(module_name), class_name)
    schemes = ", ".join(TRANSPORTS)
    raise ConfigurationError(f"unsupported executor address {address!r}: use one of the schemes {schemes}")


def open_transport(address: str, *, curve: CurveClientKeys | None = None, **kwargs: Any):
    """Open the client transport for ``address``: ``tcp://``, ``ipc://``, ``shm+ipc://`` (payloads
    in shared memory the executor makes; ipc only) or ``dist+ipc://`` / ``dist+tcp://`` (payloads
    over torch.distributed). A sharded executor's address gives a ``RoutingTransport``
    (``routing.py``): connections of the same kind to its other ranks too, each layer's requests
    sent to the rank that runs it.

    ``curve``: CURVE keys for an authenticating executor; when None, the key files named by
    ``SYMBIOSIS_CURVE_SERVER_KEY`` and ``SYMBIOSIS_CURVE_CLIENT_KEY`` are used if set."""
    cls = transport_class(address)
    kwargs["curve"] = curve if curve is not None else CurveClientKeys.from_env()
    transport = cls(address, **kwargs)
    if not transport.welcome.routes:  # every scheme here is the ZeroMQ family; only a sharded executor routes
        return transport
    from symbiosis.transport.routing import ROUTE_CONNECT_TIMEOUT_S, RoutingTransport

    scheme = address[: address.index("://")].rpartition("+")[0]  # "shm", "dist" or ""
    # one client (one id) over several connections; each route gives up quickly (the entry takes over)
    kwargs.update(client_id=transport.client_id, connect_timeout_s=ROUTE_CONNECT_TIMEOUT_S)

    def open_route(route: str) -> Any:
        return cls(f"{scheme}+{route}" if scheme else route, **kwargs)

    return RoutingTransport(transport, open_route)
