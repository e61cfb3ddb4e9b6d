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


#: The highest tcp port.
MAX_PORT = 65535


def split_tcp_address(address: str, *, bind: bool = False) -> tuple[str, str]:
    """``(host, port)`` of a ``[scheme+]tcp://HOST:PORT`` address, the host without IPv6's brackets.
    A ConfigurationError says what is wrong where the host or port is missing or the port out of
    range (before, a missing port got libzmq's "Invalid argument" at connect, and at bind a refusal
    as "not a loopback address"; a port over 65535 bound that port less 65536). ``bind``: port 0
    or ``*`` (any free port) is allowed."""
    rest = address.partition("://")[2]
    if rest.startswith("["):  # [IPv6]:PORT
        host, bracket, after = rest[1:].partition("]")
        colon, port = after[:1], after[1:]
        if not bracket:
            raise ConfigurationError(f"{address!r}: an IPv6 address's bracket is not closed")
    else:
        host, colon, port = rest.rpartition(":")
        if ":" in host:
            raise ConfigurationError(f"{address!r}: an IPv6 address goes in brackets, tcp://[ADDRESS]:PORT")
    if colon != ":" or not port:
        raise ConfigurationError(f"{address!r} names no port: use tcp://HOST:PORT (IPv6: tcp://[ADDRESS]:PORT)")
    if not host:
        raise ConfigurationError(f"{address!r} names no host: use tcp://HOST:PORT (any interface: tcp://*:PORT)")
    if bind and port == "*":
        return host, port
    lowest = 0 if bind else 1
    if not (port.isascii() and port.isdigit()) or not lowest <= int(port) <= MAX_PORT:
        raise ConfigurationError(f"{address!r}: the port must be a number from {lowest} to {MAX_PORT}, got {port!r}")
    return host, port


def tcp_host(address: str) -> str:
    """The host of a ``[scheme+]tcp://`` address, without IPv6's brackets; "" when it names none
    (an address ``split_tcp_address`` would refuse)."""
    try:
        return split_tcp_address(address, bind=True)[0]
    except ConfigurationError:
        return ""


def tcp_address(host: str, port: int | str) -> str:
    """``tcp://HOST:PORT``, an IPv6 host in brackets."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def ipc_path(address: str) -> str | None:
    """The socket file of an ``ipc://PATH`` address; None for tcp, abstract names (``ipc://@NAME``)
    and ``ipc://*`` (libzmq picks a path)."""
    if not address.startswith("ipc://") or address.startswith("ipc://@") or address == "ipc://*":
        return None
    return address[len("ipc://") :]


def is_ipv6_tcp(address: str) -> bool:
    """Whether a tcp address names an IPv6 host (``tcp://[::1]:PORT``): ZeroMQ sockets need
    ``zmq.IPV6`` set for those, or bind fails with "No such device" and connect never connects."""
    return "tcp://[" in address


def on_this_host(address: str) -> bool:
    """Whether an executor ``address`` is on this machine: any ipc scheme, or tcp to loopback."""
    if address.partition("://")[0].endswith("ipc"):
        return True
    return is_loopback_host(tcp_host(address))


def transport_class(address: str) -> type:
    """The client transport for ``address`` (``TRANSPORTS``); a ConfigurationError saying what is
    wrong with an unknown scheme, or a tcp address without a host and a port."""
    for prefix, target in TRANSPORTS.items():
        if address.startswith(prefix):
            if "tcp://" in prefix:
                split_tcp_address(address)
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
