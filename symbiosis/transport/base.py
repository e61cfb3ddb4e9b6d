"""The two sides of a transport: what a client calls, and what a server calls in the executor.

A *transport* carries one layer request (rows of activations or gradients) from a VirtLayer to
the executor and the result back. Every transport (in-process, ZeroMQ ipc/tcp, shared memory,
torch.distributed) implements :class:`Transport` on the client side and drives an
:class:`ExecutorService` on the server side, and must pass the same conformance suite.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from typing import Protocol, runtime_checkable

import torch

from symbiosis.vocabulary import LatencyClass, LayerSpec, Op


@runtime_checkable
class Transport(Protocol):
    """Client side of a connection to one executor.

    Guarantees every implementation gives:

    - ``call`` is blocking and thread-safe: several threads of one client may call at once; each
      call gets exactly its own result. Calls from one thread complete in the order issued.
    - ``rows`` is a 2-D tensor ``[n, width]`` on any device and dtype; the result is a new 2-D
      tensor ``[n, out_width]`` on the same device and dtype as ``rows`` (the executor casts at
      its boundary). The caller keeps ownership of ``rows``; the transport never writes into it
      and holds no reference after ``call`` returns. ``n`` may be 0.
    - Errors the executor reports come back as the same typed ``SymbiosisError`` subclass
      (``symbiosis.errors``); a call that cannot complete in its timeout raises
      ``ExecutorTimeoutError``; an unreachable executor raises ``ExecutorUnavailableError``.
    """

    client_id: str

    @property
    def fingerprint(self) -> str:
        """Identity of the checkpoint the executor serves (compared at connect time)."""
        ...

    def layer_specs(self) -> Mapping[str, LayerSpec]:
        """Every base layer the executor serves, by layer id."""
        ...

    def call(self, layer_id: str, op: Op, rows: torch.Tensor, latency_class: LatencyClass) -> torch.Tensor:
        """Run ``op`` of base layer ``layer_id`` on ``rows`` and return the result rows."""
        ...

    def close(self) -> None:
        """Release the connection and any buffers; later calls raise ``ExecutorUnavailableError``."""
        ...


@runtime_checkable
class ExecutorService(Protocol):
    """What a transport's server side calls in the executor (``BaseExecutor`` implements it).

    ``submit`` validates the request (known layer and op, 2-D rows whose width matches the op,
    allowed dtype) and raises a ``ProtocolError`` subclass synchronously if it is bad; otherwise it
    returns a future that completes with the result rows in ``rows``' dtype and device, or with a
    ``SymbiosisError``. The executor holds ``rows`` until the future completes and never writes
    into it.
    """

    @property
    def fingerprint(self) -> str: ...

    def layer_specs(self) -> Mapping[str, LayerSpec]: ...

    def register_client(self, client_id: str) -> None:
        """A client connected (lockstep batching counts the active clients)."""
        ...

    def unregister_client(self, client_id: str) -> None:
        """A client left or died: its pending requests are dropped."""
        ...

    def submit(
        self, client_id: str, layer_id: str, op: Op, rows: torch.Tensor, latency_class: LatencyClass
    ) -> Future[torch.Tensor]: ...
