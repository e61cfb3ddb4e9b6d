"""Symbiosis: one frozen base LLM shared as a service by many fine-tuning and inference clients.

Public API::

    ex = symbiosis.BaseExecutor.from_pretrained(path, device="cpu", dtype=torch.float32)
    srv = ex.serve("tcp://127.0.0.1:7000")
    model = symbiosis.load_client_model(path, executor=ex)   # or executor="tcp://127.0.0.1:7000"
"""

from symbiosis.client.privacy import enable_activation_noise
from symbiosis.client.surgery import load_client_model
from symbiosis.errors import (
    BaseWeightAccessError,
    CheckpointError,
    ExecutorTimeoutError,
    ExecutorUnavailableError,
    ModelMismatchError,
    ProtocolError,
    SymbiosisError,
    UnsupportedModuleError,
    UnsupportedPeftMethodError,
)
from symbiosis.executor.executor import BaseExecutor
from symbiosis.executor.scheduler import SchedulerConfig

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
    "ExecutorTimeoutError",
]
__version__ = "0.1.0"
