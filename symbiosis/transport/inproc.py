"""In-process transport: client threads call the executor object directly.

No copies beyond the executor's boundary cast, and no thread hand-off: an executor with a blocking
``call`` (``BaseExecutor``) runs ready batches in the calling thread. Concurrent calls from many
threads still meet in the executor's scheduler and are batched like remote ones.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence

import torch

from symbiosis.errors import ExecutorTimeoutError, ExecutorUnavailableError
from symbiosis.protocol import expert_row_counts
from symbiosis.transport.base import ExecutorService
from symbiosis.vocabulary import LatencyClass, LayerSpec, Op


class InProcTransport:
    """``Transport`` over an ``ExecutorService`` living in this process."""

    def __init__(self, service: ExecutorService, *, client_id: str | None = None, timeout_s: float = 300.0):
        self.service = service
        self.client_id = client_id or f"inproc-{uuid.uuid4().hex[:8]}"
        self.timeout_s = timeout_s
        self._closed = False
        service.register_client(self.client_id)

    @property
    def fingerprint(self) -> str:
        return self.service.fingerprint

    @property
    def quantization(self) -> str | None:
        """How the executor stores the base weights (None: full precision, also for services
        without the attribute)."""
        return getattr(self.service, "quantization", None)

    @property
    def latency_rows(self) -> int | None:
        """Rows up to which a decode or prefill request is latency work (None: the service does not say)."""
        return getattr(self.service, "latency_rows", None) or None

    def layer_specs(self) -> Mapping[str, LayerSpec]:
        return self.service.layer_specs()

    def call(self, layer_id: str, op: Op, rows: torch.Tensor, latency_class: LatencyClass) -> torch.Tensor:
        if self._closed:
            raise ExecutorUnavailableError(f"transport of client {self.client_id!r} is closed")
        call = getattr(self.service, "call", None)
        if call is not None:
            return call(self.client_id, layer_id, op, rows, latency_class, self.timeout_s)
        future = self.service.submit(self.client_id, layer_id, op, rows, latency_class)  # any other ExecutorService
        try:
            return future.result(timeout=self.timeout_s)
        except TimeoutError as exc:
            future.cancel()
            raise ExecutorTimeoutError(f"{op.value} of {layer_id!r} took longer than {self.timeout_s} s") from exc

    @property
    def serves_expert_rows(self) -> bool:
        """Whether the service takes ``call_expert_rows`` (``BaseExecutor`` does)."""
        return bool(getattr(self.service, "serves_expert_rows", False)) and hasattr(self.service, "call")

    def call_expert_rows(
        self, layer_id: str, expert_rows: Sequence[int], op: Op, rows: torch.Tensor, latency_class: LatencyClass
    ) -> torch.Tensor:
        """``call`` for the rows of several experts of the experts tensor ``layer_id`` at once
        (``protocol.Request.expert_rows``)."""
        if self._closed:
            raise ExecutorUnavailableError(f"transport of client {self.client_id!r} is closed")
        counts = expert_row_counts(expert_rows)
        return self.service.call(self.client_id, layer_id, op, rows, latency_class, self.timeout_s, counts)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.service.unregister_client(self.client_id)

    def __deepcopy__(self, memo) -> InProcTransport:
        return self  # a connection is shared, never duplicated (copy.deepcopy of a model keeps it)
