"""Symbiosis: one frozen base LLM shared as a service by many fine-tuning and inference clients.

Public API::

    ex = symbiosis.BaseExecutor.from_pretrained(path, device="cpu", dtype=torch.float32)
    srv = ex.serve("tcp://127.0.0.1:7000")
    model = symbiosis.load_client_model(path, executor=ex)   # or executor="tcp://127.0.0.1:7000"

Names are imported on first use (PEP 562), so ``import symbiosis.cli`` does not import torch:
the command line sets thread settings (``symbiosis/threads.py``) before OpenMP starts.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from symbiosis.errors import (
    BaseWeightAccessError,
    BindError,
    CheckpointError,
    ConfigurationError,
    ExecutorBusyError,
    ExecutorLostError,
    ExecutorTimeoutError,
    ExecutorUnavailableError,
    ModelMismatchError,
    ProtocolError,
    SymbiosisError,
    UnsupportedModuleError,
    UnsupportedPeftMethodError,
    UnsupportedQuantizationError,
)

if TYPE_CHECKING:
    from symbiosis.client.privacy import enable_activation_noise
    from symbiosis.client.surgery import load_client_model
    from symbiosis.executor.executor import BaseExecutor
    from symbiosis.executor.scheduler import SchedulerConfig

_LAZY = {
    "BaseExecutor": "symbiosis.executor.executor",
    "load_client_model": "symbiosis.client.surgery",
    "enable_activation_noise": "symbiosis.client.privacy",
    "SchedulerConfig": "symbiosis.executor.scheduler",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'symbiosis' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "BaseExecutor",
    "load_client_model",
    "enable_activation_noise",
    "SchedulerConfig",
    "SymbiosisError",
    "CheckpointError",
    "UnsupportedModuleError",
    "BaseWeightAccessError",
    "UnsupportedPeftMethodError",
    "ProtocolError",
    "ModelMismatchError",
    "ExecutorUnavailableError",
    "ExecutorLostError",
    "ExecutorBusyError",
    "ExecutorTimeoutError",
    "ConfigurationError",
    "BindError",
    "UnsupportedQuantizationError",
]
__version__ = "0.1.0"
