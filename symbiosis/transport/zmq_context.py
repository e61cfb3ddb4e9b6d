"""The one way this project makes a ZeroMQ context: with a bounded default linger.

libzmq's default ``LINGER`` is forever, and ``Context.term()`` waits for every socket's queued
messages. A context that is never closed (a caller that forgot ``close()``, an object dropped
after a failure) is closed by pyzmq's ``Context.__del__`` in whichever thread the garbage
collector happens to run -- once that was an executor's socket thread, which then waited forever
for a message to a peer that was gone, and every client of that executor stalled. Sockets that
must deliver a last message (a Goodbye) set their own linger when they close; every other socket
inherits this bound, so no ``term()`` of ours can hang.
"""

from __future__ import annotations

import zmq

DEFAULT_LINGER_MS = 500


def new_context(linger_ms: int = DEFAULT_LINGER_MS) -> zmq.Context:
    """A fresh (never shared) context whose sockets default to ``linger_ms`` of linger."""
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, linger_ms)
    return ctx
