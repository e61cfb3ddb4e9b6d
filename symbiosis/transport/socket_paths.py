"""Claiming a Unix socket path to listen at: the executor's ``ipc://`` socket and its shared-memory
broker (``<ipc path>.shm``) both go through here.

Why: binding a Unix socket fails on an existing file, so a server must remove a stale one (a
crashed server's) first, and libzmq removes whatever lies at an ``ipc://`` path before it binds.
Done without care, that deleted a *live* server's socket file: a second executor took the first
one's address without a word (the first kept running, unreachable), a file named by mistake was
deleted, and the broker replaced another executor's live broker. Two rules prevent it:

- ``check_path_free``: only a socket file nobody listens at may be replaced -- a connect refused
  there. A listener there, a file that is not a socket, or a socket whose state a connect cannot
  tell (its backlog full, as with a frozen server whose clients keep reconnecting; no permission
  to connect, another user's) is refused with ``BindError``.
- ``claiming``: the check and the bind run under one lock, so two servers starting at once cannot
  both find the path free and the second delete the first's socket; a closing server removes its
  own file under the same lock (``remove_own_socket``), so it cannot remove one a starting server
  has just bound there. The lock is an ``flock`` on the folder that holds the path (no lock file
  left behind), held only for the bind or the removal. If the folder cannot be opened, the file
  system has no flock, or someone holds the lock too long, the work goes ahead without it (as
  before this module): a stuck lock must not stop an executor from starting.
"""

from __future__ import annotations

import errno
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


def _connect_error(path: str) -> OSError | None:
    """What a connect to the Unix socket ``path`` says: None if it was accepted (a server listens)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(PROBE_TIMEOUT_S)
        probe.connect(path)
    except OSError as exc:
        return exc
    finally:
        probe.close()
    return None


def check_path_free(path: str, shown_as: str | None = None) -> bool:
    """Raise ``BindError`` unless ``path`` is free or holds a stale socket file (module doc);
    return whether a stale one is there (the caller may replace it). ``shown_as``: how errors
    name the address (default: the path)."""
    shown = shown_as or path
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return False  # nothing there (or unreadable: bind says why)
    if not stat.S_ISSOCK(mode):
        raise BindError(f"cannot listen at {shown}: {path!r} exists and is not a socket")
    error = _connect_error(path)
    if error is None:
        raise BindError(f"cannot listen at {shown}: another server is listening there")
    if error.errno == errno.ENOENT:
        return False  # gone since the look
    if error.errno != errno.ECONNREFUSED:  # a full backlog, no permission, a timeout: maybe live
        raise BindError(
            f"cannot listen at {shown}: a socket there may be in use ({error.strerror or error}); "
            "remove it if no server listens there, or bind another path"
        )
    return True


@contextmanager
def claiming(path: str | None) -> Iterator[None]:
    """Hold the bind lock of ``path``'s folder while the body checks and binds, or removes its
    own socket file (module doc); None: no file, nothing to lock."""
    if path is None:
        yield
        return
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        fd = None  # an unreadable or missing folder: no lock, as before (bind says whether the path works)
    if fd is None:
        yield
        return
    try:
        why_not = _lock(fd)
        if why_not is not None:
            log.warning("working on %s without the bind lock of %s: %s", path, folder, why_not)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def _lock(fd: int) -> str | None:
    """Take the lock; None once held, else why not."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return f"held by someone else for over {LOCK_WAIT_S:g} s"
            time.sleep(0.005)
        except OSError as exc:
            return f"no flock there ({exc.strerror or exc})"


def remove_own_socket(path: str, inode: int) -> None:
    """Remove the socket file at ``path`` if it is still the one we bound (``inode``): another
    server may have replaced it since ours stopped listening. Under the lock, so that none can
    between the look and the removal."""
    with claiming(path):
        try:
            if os.lstat(path).st_ino == inode:
                os.unlink(path)
        except OSError:
            pass


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
