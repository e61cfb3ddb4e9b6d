"""A ZeroMQ context dropped without ``close()`` must not hang the thread that collects it.

Seen once in the fast set: a test failed and left its raw peer's context to the garbage
collector, which ran in an executor's socket thread; pyzmq's ``Context.__del__`` terminated the
context there, waited forever for a queued message, and every later test hung.
"""

from __future__ import annotations

import gc
import threading

import pytest
import zmq

from symbiosis.transport.zmq_context import DEFAULT_LINGER_MS, new_context


def _drop_a_context_with_a_queued_message(make_context) -> None:
    ctx = make_context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect("tcp://127.0.0.1:9")  # nobody listens: the message stays queued
    dealer.send(b"never delivered", zmq.NOBLOCK)
    del dealer, ctx
    gc.collect()


@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_collecting_an_unclosed_context_with_a_queued_message_returns() -> None:
    # The thread's own full collection walks this test session's whole heap: on a loaded machine
    # that took over 5 s three times (seen in the fast set, the collector inside weakref callbacks,
    # not in Context.term). Collect the session's garbage first, here, and allow a wait far above
    # the linger: what this test catches is a hang for good, not a slow collection.
    gc.collect()
    collector = threading.Thread(target=_drop_a_context_with_a_queued_message, args=(new_context,), daemon=True)
    collector.start()
    collector.join(timeout=max(30.0, 10 * DEFAULT_LINGER_MS / 1000))
    assert not collector.is_alive(), "Context.__del__ hung on a queued message"


def test_sockets_inherit_the_bounded_linger_and_may_still_set_their_own() -> None:
    ctx = new_context()
    try:
        inherited, own = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        own.setsockopt(zmq.LINGER, 0)
        assert inherited.getsockopt(zmq.LINGER) == DEFAULT_LINGER_MS
        assert own.getsockopt(zmq.LINGER) == 0
        inherited.close()
        own.close()
    finally:
        ctx.term()
