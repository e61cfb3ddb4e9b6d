"""A socketpair that lets any thread wake a ZeroMQ socket-owning thread out of ``Poller.poll``.

A ZeroMQ socket must be used by one thread at a time, so each side of the ZeroMQ transports has
exactly one thread that owns its socket; other threads hand it work through a queue and then
``wake`` it. The owner polls ``fileno()`` next to its ZeroMQ sockets and ``drain``s on wake-up.
"""

from __future__ import annotations

import socket


class Waker:
    def __init__(self) -> None:
        self._recv, self._send = socket.socketpair()
        self._recv.setblocking(False)
        self._send.setblocking(False)

    def fileno(self) -> int:
        return self._recv.fileno()

    def wake(self) -> None:
        try:
            self._send.send(b"\0")
        except OSError:  # buffer full: a wake-up is already pending, which is all we need
            pass

    def drain(self) -> None:
        try:
            while self._recv.recv(4096):
                pass
        except OSError:
            pass

    def close(self) -> None:
        self._recv.close()
        self._send.close()
