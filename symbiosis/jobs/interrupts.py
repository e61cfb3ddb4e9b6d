"""Ctrl-C in a fine-tuning job: finish the step in progress, save it, and say how to go on.

A KeyboardInterrupt can land anywhere in a step -- after the optimizer stepped but before the
step was counted, or between two micro-batches of an accumulation -- so state saved from there
would not resume exactly. The first SIGINT therefore only asks the loop to stop at its next step
boundary (``requested``), where ``FinetuneRun`` saves a checkpoint and raises ``JobInterrupted``;
a second SIGINT is Python's own again and stops at once (a step blocked on an executor that went
away must not hold the user hostage).

Signals reach only the main thread, and only a process that left SIGINT at Python's default
handler wants this (not one that ignores it, as a background shell job does, nor one with a
handler of its own): elsewhere ``StopAtStepBoundary`` does nothing and ``requested`` stays False.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType

from symbiosis.jobs.base import JobError


class JobInterrupted(JobError):
    """The user stopped a job (Ctrl-C); the message says what was kept and how to go on."""

    code = "interrupted"


class StopAtStepBoundary:
    """While entered: the first SIGINT sets ``requested`` (see module doc); leaving restores SIGINT."""

    def __init__(self) -> None:
        self.requested = False
        self._installed = False

    def __enter__(self) -> StopAtStepBoundary:
        in_main = threading.current_thread() is threading.main_thread()
        if in_main and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self._installed = False

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C stops at once
        print("\nstopping after the step in progress (Ctrl-C again to stop now)", file=sys.stderr, flush=True)
