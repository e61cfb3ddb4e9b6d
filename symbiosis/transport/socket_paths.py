"""Claiming a Unix socket path to listen at: the executor's ``ipc://`` socket and its shared-memory
broker (``<ipc path>.shm``) both go through here.

Why: binding a Unix socket fails on an existing file, so a server must remove a stale one (a
crashed server's) first, and libzmq removes whatever lies at an ``ipc://`` path before it binds.
Done without care, that deleted a *live* server's socket file: a second executor took the first
one's address without a word (the first kept running, unreachable), a file named by mistake was
deleted, and the broker replaced another executor's live broker. Two rules prevent it:

- ``check_path_free``: only a socket file nobody listens at may be replaced; a listener there or a
  file that is not a socket is refused with ``BindError``.
- ``claiming``: the check and the bind run under one lock, so two servers starting at once cannot
  both find the path free and the second delete the first's socket. The lock is an ``flock`` on
  the folder that holds the path (no lock file left behind); it is held only for the bind. If
  the folder cannot be opened or someone holds the lock too long, the bind goes ahead without it
  (as before this module): a stuck lock must not stop an executor from starting.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager

from symbiosis.errors import BindError

log = logging.getLogger(__name__)

LOCK_WAIT_S = 5.0  # binds take milliseconds: a lock held this long is stuck, not busy
PROBE_TIMEOUT_S = 1.0


def someone_listens_at(path: str) -> bool:
    """True if a server accepts connections at the Unix socket ``path`` (a connect succeeds)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(PROBE_TIMEOUT_S)
        probe.connect(path)
    except OSError:
        return False  # refused (a stale socket file), or nothing there
    finally:
        probe.close()
    return True


def check_path_free(path: str, shown_as: str | None = None) -> bool:
    """Raise ``BindError`` if a server listens at ``path`` or a file that is not a socket lies
    there; otherwise return whether a stale socket file is there (the caller may replace it).
    ``shown_as``: how errors name the address (default: the path)."""
    shown = shown_as or path
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return False  # nothing there (or unreadable: bind says why)
    if not stat.S_ISSOCK(mode):
        raise BindError(f"cannot listen at {shown}: {path!r} exists and is not a socket")
    if someone_listens_at(path):
        raise BindError(f"cannot listen at {shown}: another server is listening there")
    return True


@contextmanager
def claiming(path: str) -> Iterator[None]:
    """Hold the bind lock of ``path``'s folder while the body checks and binds (module doc)."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        yield  # an unreadable folder: no lock, as before (bind says whether the path works)
        return
    try:
        locked = _lock(fd)
        if not locked:
            log.warning("the bind lock of %s is held for over %.0f s; binding %s without it", folder, LOCK_WAIT_S, path)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def _lock(fd: int) -> bool:
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        except OSError:
            return False  # a file system without flock


def listen_unix(path: str, backlog: int = 64) -> socket.socket:
    """A non-blocking listening Unix stream socket at ``path``, claimed by the rules above: a stale
    socket file is replaced, a live listener or another file is left alone (``BindError``)."""
    with claiming(path):
        if check_path_free(path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            sock.listen(backlog)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
    return sock
