"""How a job reaches the base executor: a running one at an address, or one it embeds."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from symbiosis.errors import CheckpointError, ExecutorLostError, ExecutorUnavailableError
from symbiosis.jobs.base import JobError, _help


def require_model_dir(model: Path) -> Path:
    model = Path(model)
    if not model.is_dir():
        raise CheckpointError(f"model folder {str(model)!r} does not exist")
    if not (model / "config.json").is_file():
        raise CheckpointError(f"model folder {str(model)!r} has no config.json (not a transformers checkpoint)")
    return model


@dataclass
class ClientOptions:
    """Where the base layers are served; each field's ``metadata["help"]`` is the CLI help text."""

    executor: str | None = field(
        default=None,
        metadata=_help(
            "Address of a running executor (tcp://HOST:PORT or ipc:///PATH; shm+ipc://… for shared memory)."
        ),
    )
    embedded: bool = field(
        default=False, metadata=_help("Start an executor in this process instead of connecting to one.")
    )
    device: str = field(
        default="cpu", metadata=_help("Device of the client (and of an embedded executor): cpu, cuda, cuda:N.")
    )
    dtype: str = field(
        default="float32", metadata=_help("Client dtype (and embedded executor dtype): float32, bfloat16, float16.")
    )
    timeout_s: float = field(default=60.0, metadata=_help("Seconds one executor call may take before failing."))
    connect_timeout_s: float = field(
        default=10.0,
        metadata=_help(
            "Seconds to wait for the executor to answer when connecting; also how long a running job waits for a "
            "lost or restarting executor to come back before it fails (raise it to ride out longer restarts)."
        ),
    )
    quantization: str | None = field(
        default=None,
        metadata=_help(
            "With --embedded: store the embedded executor's base weights quantized (none, int8 or fp8-rowwise; see "
            "`symbiosis serve --help`). A running executor was started with its own."
        ),
    )

    def __post_init__(self) -> None:
        from symbiosis.executor.quantized import parse_quantization

        if (self.executor is None) == (not self.embedded):
            raise JobError("give exactly one of --executor ADDRESS or --embedded")
        self.quantization = parse_quantization(self.quantization)
        if self.quantization and not self.embedded:
            raise JobError(
                "--quantization applies to an --embedded executor; start a running one with `symbiosis serve "
                "--quantization`"
            )


@contextlib.contextmanager
def executor_restart_hint(options: ClientOptions) -> Iterator[None]:
    """Add to an ``ExecutorUnavailableError`` raised while a job runs what bounds the wait for the
    executor, so that a user whose executor restarts slowly knows which flag to raise.

    The transport retries a call whose executor went away (said goodbye, went silent, dropped the
    connection) for ``connect_timeout_s`` from the call's start, then raises ``ExecutorLostError``
    naming the executor's address and why its session ended; this says which flag set that wait.
    An embedded executor never goes away, so its errors pass unchanged.
    """
    try:
        yield
    except ExecutorUnavailableError as exc:
        if options.embedded:
            raise
        if isinstance(exc, ExecutorLostError):  # the same type, so a Python caller can catch it
            raise ExecutorLostError(exc.cause, options.connect_timeout_s, exc.last, flag="--connect-timeout") from exc
        wait = f"within --connect-timeout ({options.connect_timeout_s:g}s)"
        advice = "raise --connect-timeout to wait longer for a restarting executor"
        message = f"{exc}; the executor at {options.executor} did not come back {wait}: {advice}"
        raise ExecutorUnavailableError(message) from exc


class ExecutorTarget:
    """Where client models get their base layers: an embedded executor or a remote address.

    ``client()`` makes one more split client model (each with its own connection); ``close()``
    disconnects them all and stops an embedded executor.
    """

    def __init__(self, model_dir: Path, options: ClientOptions, scheduler_config=None) -> None:
        """``scheduler_config``: the embedded executor's (None: the defaults)."""
        import symbiosis

        self.model_dir = require_model_dir(model_dir)
        self.options = options
        self.executor = None
        self._models: list = []
        if options.embedded:
            self.executor = symbiosis.BaseExecutor.from_pretrained(
                self.model_dir,
                device=options.device,
                dtype=options.dtype,
                quantization=options.quantization,
                scheduler_config=scheduler_config,
            )

    def client(self, client_id: str | None = None):
        import symbiosis

        options = self.options
        if self.executor is not None:
            target: Any = self.executor
        else:
            from symbiosis.transport.schemes import open_transport

            target = open_transport(
                options.executor,
                client_id=client_id,
                timeout_s=options.timeout_s,
                connect_timeout_s=options.connect_timeout_s,
            )
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = symbiosis.load_client_model(
                    self.model_dir,
                    executor=target,
                    device=options.device,
                    dtype=options.dtype,
                    client_id=client_id,
                    timeout_s=options.timeout_s,
                )
        except BaseException:
            if self.executor is None:
                target.close()
            raise
        self._models.append(model)
        return model

    def close(self) -> None:
        for model in self._models:
            model.symbiosis_transport.close()
        self._models.clear()
        if self.executor is not None:
            self.executor.close()
            self.executor = None

    def __enter__(self) -> ExecutorTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SplitClient:
    """One split client model plus what must be closed with it (connection, embedded executor)."""

    def __init__(self, model_dir: Path, options: ClientOptions, client_id: str | None = None) -> None:
        self.target = ExecutorTarget(model_dir, options)
        try:
            self.model = self.target.client(client_id)
        except BaseException:
            self.target.close()
            raise

    def close(self) -> None:
        self.target.close()

    def __enter__(self) -> SplitClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_token_id(tokenizer) -> int:
    """What an empty prompt starts from: BOS, else EOS, else 0 (``symbiosis generate`` and the API
    server alike)."""
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    return start if start is not None else 0


def load_tokenizer(model_dir: Path):
    """The tokenizer in the local folder ``model_dir``; never a download.

    ``from_pretrained`` treats a name that is not a folder as a hub id, so the folder is checked
    first and hub look-ups are off (``local_files_only``): nothing reaches the network.
    """
    from transformers import AutoTokenizer

    model_dir = require_model_dir(model_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot load the tokenizer of {str(model_dir)!r}: {exc}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# ---- the job ------------------------------------------------------------------------------------
