"""Typed errors. Every failure a user can cause maps to one of these, with a message naming the cause.

Each error has a stable ``code`` so that it can cross the wire (see ``protocol.py``) and be
re-raised as the same Python type on the client side.
"""

from __future__ import annotations


class SymbiosisError(Exception):
    """Base class of every error Symbiosis raises on purpose."""

    code = "internal"


class CheckpointError(SymbiosisError):
    """A checkpoint folder is missing, incomplete, or does not hold a tensor a module needs."""

    code = "checkpoint"


class UnsupportedModuleError(SymbiosisError):
    """The model holds a module with weights that Symbiosis cannot split (not a linear layer)."""

    code = "unsupported_module"


class BaseWeightAccessError(SymbiosisError, RuntimeError):
    """Client code tried to read or write a base-layer weight, which lives only in the executor."""

    code = "base_weight_access"


class UnsupportedPeftMethodError(SymbiosisError):
    """A PEFT method or option needs the base weights (merging, DoRA) or is unknown."""

    code = "unsupported_peft_method"


class ProtocolError(SymbiosisError):
    """A request was malformed: bad header, unknown layer or op, wrong shape, dtype or size."""

    code = "protocol"


class UnknownLayerError(ProtocolError):
    code = "unknown_layer"


class ShapeError(ProtocolError):
    code = "shape"


class ModelMismatchError(SymbiosisError):
    """Client and executor were built from different checkpoints (fingerprints differ)."""

    code = "model_mismatch"


class ExecutorUnavailableError(SymbiosisError, ConnectionError):
    """The executor could not be reached, or it is shutting down and refuses new work."""

    code = "unavailable"


class ExecutorLostError(ExecutorUnavailableError):
    """Raised client-side only (never on the wire, where it is an ``ExecutorUnavailableError``):
    an established session with the executor ended (``cause``: it said Goodbye, went silent,
    dropped the connection, refused the call) and the executor did not come back within
    ``waited_s`` (``connect_timeout_s``); ``last``: why the last reconnection attempt failed, where
    that says more than "no executor answered"."""

    def __init__(self, cause: str, waited_s: float, last: str | None = None, flag: str | None = None) -> None:
        """``flag``: the option that set the wait, named with advice (a job's ``--connect-timeout``)."""
        self.cause, self.waited_s, self.last, self.flag = cause, waited_s, last, flag
        wait = f"{waited_s:g}s"
        if flag is not None:
            wait = f"{flag} ({wait}): raise {flag} to wait longer for a restarting executor"
        super().__init__(f"{cause}, and the executor did not come back within {wait}{self.detail}")

    @property
    def detail(self) -> str:
        """`` (last try: …)``, or nothing."""
        return f" (last try: {self.last})" if self.last else ""

    def __reduce__(self) -> tuple[type[ExecutorLostError], tuple[str, float, str | None, str | None]]:
        return type(self), (self.cause, self.waited_s, self.last, self.flag)


class ExecutorTimeoutError(SymbiosisError, TimeoutError):
    """A call to the executor did not complete within its timeout."""

    code = "timeout"


ERRORS_BY_CODE: dict[str, type[SymbiosisError]] = {
    cls.code: cls
    for cls in (
        SymbiosisError,
        CheckpointError,
        UnsupportedModuleError,
        BaseWeightAccessError,
        UnsupportedPeftMethodError,
        ProtocolError,
        UnknownLayerError,
        ShapeError,
        ModelMismatchError,
        ExecutorUnavailableError,
        ExecutorTimeoutError,
    )
}


def error_from_code(code: str, message: str) -> SymbiosisError:
    """Rebuild a typed error received over the wire (unknown codes become ``SymbiosisError``)."""
    return ERRORS_BY_CODE.get(code, SymbiosisError)(message)


# Local configuration errors (they never cross the wire). Each is also a ``ValueError``, which
# callers caught before these types existed.


class ConfigurationError(SymbiosisError, ValueError):
    """A setting the user gave is invalid: an unknown name or choice, a value out of range, an
    address of a kind that is not served. The message names what is accepted."""

    code = "configuration"


class MissingFileError(SymbiosisError, FileNotFoundError):
    """A file or folder the user named does not exist."""

    code = "missing_file"


class OutputExistsError(SymbiosisError, FileExistsError):
    """An output the user named already exists and is not ours to replace."""

    code = "output_exists"


class CurveKeyError(SymbiosisError, ValueError):
    """A CURVE key file is malformed (not 40 Z85 characters), lacks a key, or is readable by others."""

    code = "curve_key"


class UnsafeBindError(SymbiosisError, ValueError):
    """A bind address would let others connect unauthenticated: a non-loopback ``tcp://`` address
    without CURVE, or an abstract socket (``ipc://@NAME``), which any local user can reach."""

    code = "unsafe_bind"


class UnsupportedQuantizationError(SymbiosisError, ValueError):
    """An unknown quantization name, or one the executor's device cannot store; the message names
    what is supported."""

    code = "unsupported_quantization"


class BindError(SymbiosisError, OSError):
    """A server could not listen at the address the user gave: the port is taken, the folder of an
    ``ipc://`` path does not exist, the host is not one of this machine's."""

    code = "bind"


class MissingDependencyError(SymbiosisError, RuntimeError):
    """A feature the user asked for needs a library (or a build of one) that is not installed; the
    message names what to install."""

    code = "missing_dependency"


# Errors that do cross the wire, added after ``ERRORS_BY_CODE``: each registers itself there.


class ExecutorBusyError(SymbiosisError):
    """The executor refused work for now: this client already has as many requests or bytes in
    flight as the executor allows one session, or too many torch.distributed set-ups are pending.
    Nothing was computed; the same call may succeed once earlier ones completed."""

    code = "busy"


ERRORS_BY_CODE[ExecutorBusyError.code] = ExecutorBusyError
# A bad adapter name or setting, raised in the API server's engine process (``serving/engine_process.py``).
ERRORS_BY_CODE[ConfigurationError.code] = ConfigurationError
