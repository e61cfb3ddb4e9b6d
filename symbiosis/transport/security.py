"""CURVE keys for the ZeroMQ transports: authentication and encryption of network clients.

Why CURVE: a ``tcp://`` executor reachable from other hosts must not serve (or leak activations
to) whoever can open a socket. ZeroMQ's CURVE mechanism (CurveZMQ: Curve25519 key exchange,
XSalsa20-Poly1305 boxes) encrypts and authenticates every frame, and the server accepts only
clients whose public key it has been given, through a ZAP handler (``ThreadAuthenticator``) in
the server's ZeroMQ context. A client authenticates the server too: it must know the server's
public key before connecting, so a man in the middle cannot complete the handshake.

Key files are the czmq/pyzmq certificate format: ``generate_keypair`` (``symbiosis keys``)
writes ``NAME.key`` (public key only: hand it out) and ``NAME.key_secret`` (public + secret key,
mode 0600: keep it). The server reads its ``.key_secret`` and a folder of authorized clients'
``.key`` files; a client reads the server's ``.key`` and its own ``.key_secret``.

What CURVE covers: every ZeroMQ frame — Hello/Welcome, request headers, replies, errors and
inline tensor payloads (``tcp://``/``ipc://``). It does *not* cover payloads that bypass the
socket: shared-memory segments (``shm+ipc://``; same host: sealed memfd segments passed only to the
session's own peer over a Unix socket) and
torch.distributed pair groups (``dist+…``; gloo/NCCL send plaintext, and their TCPStore is
unauthenticated). That is why a CURVE server keeps its dist channel on loopback unless told
``allow_non_loopback=True``, and a CURVE ``dist+`` client refuses a non-loopback pair group unless
``allow_unencrypted_payloads=True``.

Authorized client keys are read when the server starts; restart it to add or revoke a key.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from symbiosis.errors import (
    CurveKeyError,
    MissingDependencyError,
    MissingFileError,
    OutputExistsError,
    UnsafeBindError,
)

SERVER_KEY_ENV = "SYMBIOSIS_CURVE_SERVER_KEY"
CLIENT_KEY_ENV = "SYMBIOSIS_CURVE_CLIENT_KEY"

HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def require_curve() -> None:
    """Fail loudly when libzmq was built without CURVE (libsodium/tweetnacl)."""
    if not zmq.has("curve"):
        raise MissingDependencyError(
            "this libzmq was built without CURVE support; install a pyzmq wheel with libsodium"
        )


def generate_keypair(folder: str | os.PathLike[str], name: str = "client") -> tuple[Path, Path]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` (secret, mode 0600) into ``folder``.

    Refuses to overwrite an existing pair (``OutputExistsError``): a replaced key silently locks
    out every peer that trusted the old one. Returns ``(public_file, secret_file)``.
    """
    require_curve()
    if not name or os.sep in name or name.startswith("."):
        raise CurveKeyError(f"key name {name!r} must be a plain file name")
    folder = Path(folder)
    public, secret = folder / f"{name}.key", folder / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise OutputExistsError(f"{path} exists; pick another --name or remove the old key pair first")
    folder.mkdir(parents=True, exist_ok=True)
    old_umask = os.umask(0o077)  # the secret file never exists with wider permissions
    try:
        zmq.auth.create_certificates(folder, name)
    finally:
        os.umask(old_umask)
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)
    return public, secret


def load_public_key(path: str | os.PathLike[str]) -> bytes:
    """The Z85 public key in a ``.key`` (or ``.key_secret``) file."""
    public, _ = _load(path)
    return public


def load_secret_key(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """``(public, secret)`` Z85 keys from a ``.key_secret`` file; a public-only file is an error."""
    public, secret = _load(path)
    if secret is None:
        raise CurveKeyError(f"{path} holds no secret key: pass the NAME.key_secret file, not NAME.key")
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CurveKeyError(
            f"secret key file {path} is readable by other users (mode {oct(mode & 0o777)}); chmod 600 it"
        )
    return public, secret


def _load(path: str | os.PathLike[str]) -> tuple[bytes, bytes | None]:
    if not Path(path).is_file():
        raise MissingFileError(f"no CURVE key file at {path}")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except ValueError:
        raise CurveKeyError(
            f"{path} is not a ZeroMQ certificate (no public-key line); make one with `symbiosis keys`"
        ) from None
    for key in (public, secret):
        if key is not None and not is_z85_key(key):
            raise CurveKeyError(f"{path} holds a malformed key (expected 40 Z85 characters)")
    return public, secret


def is_z85_key(key: bytes) -> bool:
    """True for a 40-character Z85 encoding of a 32-byte key.

    Checked here because libzmq refuses anything else only when the key is set on a socket, and a
    socket left open by that failure makes ``Context.term()`` wait forever.
    """
    if len(key) != 40:
        return False
    try:
        z85.decode(key)
    except (KeyError, ValueError, struct.error):  # a character outside Z85, or a group >= 2**32
        return False
    return True


def check_abstract_ipc(address: str, curve: object | None) -> None:
    """Refuse to bind ``ipc://@NAME`` (a Linux abstract socket) without CURVE.

    A socket file's permissions decide which local users may connect to ``ipc:///PATH``; an
    abstract socket has no file, so every user (and every process in the network namespace) can
    connect. Only CURVE authentication keeps them out.
    """
    if address.startswith("ipc://@") and curve is None:
        raise UnsafeBindError(
            f"refusing to bind {address!r} without CURVE: an abstract socket has no file permissions, so any "
            "local user could connect. Bind ipc:///PATH (a socket file) instead, or turn on CURVE "
            "(--curve-secret-key FILE --authorized-clients DIR)"
        )


@dataclass(frozen=True)
class CurveServerKeys:
    """Server side of CURVE: the server's ``.key_secret`` file, and a folder of the ``.key``
    (public) files of every client allowed to connect. Files are checked here, at construction."""

    secret_key_file: Path
    authorized_clients_dir: Path

    HELP: ClassVar[dict[str, str]] = {
        "secret_key_file": (
            "The executor's CURVE secret key file (NAME.key_secret from `symbiosis keys`). Turns on CURVE: clients "
            "must authenticate and all ZeroMQ traffic is encrypted."
        ),
        "authorized_clients_dir": (
            "Folder of authorized clients' public key files (*.key); only these clients may connect."
        ),
    }

    def __post_init__(self) -> None:
        object.__setattr__(self, "secret_key_file", Path(self.secret_key_file))
        object.__setattr__(self, "authorized_clients_dir", Path(self.authorized_clients_dir))
        load_secret_key(self.secret_key_file)
        if not self.authorized_clients_dir.is_dir():
            raise MissingFileError(f"authorized clients folder {self.authorized_clients_dir} does not exist")
        if not self.authorized_public_keys():
            raise CurveKeyError(
                f"no client public keys (*.key) in {self.authorized_clients_dir}: no client could connect"
            )

    def authorized_public_keys(self) -> list[bytes]:
        return list(zmq.auth.load_certificates(self.authorized_clients_dir))


@dataclass(frozen=True)
class CurveClientKeys:
    """Client side of CURVE: the server's public key file (``.key``, so the client knows it talks
    to the real executor) and this client's ``.key_secret`` (its public half must be in the
    server's authorized folder)."""

    server_public_key_file: Path
    client_secret_key_file: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "server_public_key_file", Path(self.server_public_key_file))
        object.__setattr__(self, "client_secret_key_file", Path(self.client_secret_key_file))
        load_public_key(self.server_public_key_file)
        load_secret_key(self.client_secret_key_file)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> CurveClientKeys | None:
        """Keys named by ``SYMBIOSIS_CURVE_SERVER_KEY`` and ``SYMBIOSIS_CURVE_CLIENT_KEY``, or None
        when neither is set (one without the other is an error)."""
        server, client = environ.get(SERVER_KEY_ENV), environ.get(CLIENT_KEY_ENV)
        if not server and not client:
            return None
        if not server or not client:
            missing = SERVER_KEY_ENV if not server else CLIENT_KEY_ENV
            raise CurveKeyError(f"CURVE needs both {SERVER_KEY_ENV} and {CLIENT_KEY_ENV}; {missing} is not set")
        return cls(Path(server), Path(client))


def configure_server_socket(sock: zmq.Socket, keys: CurveServerKeys) -> None:
    """Make ``sock`` a CURVE server (call before ``bind``; the authenticator must run first)."""
    public, secret = load_secret_key(keys.secret_key_file)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True


def configure_client_socket(sock: zmq.Socket, keys: CurveClientKeys) -> None:
    """Make ``sock`` a CURVE client of the server whose public key ``keys`` names (before ``connect``)."""
    public, secret = load_secret_key(keys.client_secret_key_file)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = load_public_key(keys.server_public_key_file)


def start_authenticator(ctx: zmq.Context, keys: CurveServerKeys) -> ThreadAuthenticator:
    """Start the ZAP handler of ``ctx``: only the public keys in ``keys.authorized_clients_dir``
    pass. Without a ZAP handler a CURVE server would accept *any* key, so this runs before bind."""
    require_curve()
    auth = ThreadAuthenticator(ctx)
    auth.start()
    try:
        auth.configure_curve(domain="*", location=str(keys.authorized_clients_dir))
    except BaseException:
        auth.stop()
        raise
    return auth


def handshake_failure(address: str, event: int, value: int, curve_on: bool) -> str:
    """A one-line reason for a failed ZMTP handshake, as the client's socket monitor reports it.

    A security-mechanism mismatch is not always reported as one: the side that detects it first
    closes the connection, and the other side may see only a reset (``NO_DETAIL``; a client
    without CURVE sees that from a CURVE executor almost every time). A peer that is not a ZeroMQ
    socket at all (an HTTP server, say) is reported the same way -- it answers the greeting with
    bytes that are not ZMTP, or closes -- so only ``PROTOCOL`` with a mechanism mismatch proves
    the peer is a ZeroMQ endpoint that wants another mechanism; anything else names both
    possibilities. ``AUTH`` means the server's ZAP handler refused this client's key.
    """
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            f"the executor at {address} refused this client's CURVE key (ZAP status {value}): "
            "add the client's public key (NAME.key) to the executor's authorized clients folder and restart it"
        )
    mismatch = event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
    if curve_on:
        if mismatch:
            return f"the executor at {address} does not use CURVE, but this client was given CURVE keys"
        return (
            f"the CURVE handshake with the executor at {address} failed: either it does not use CURVE, or the "
            f"server public key ({SERVER_KEY_ENV}) is not the executor's, or {address} is not a Symbiosis "
            "executor at all"
        )
    how = (
        "pass curve=CurveClientKeys(server_public_key_file, client_secret_key_file) or set "
        f"{SERVER_KEY_ENV} and {CLIENT_KEY_ENV}"
    )
    if mismatch:
        return f"the executor at {address} requires CURVE authentication; {how} (security mechanism mismatch)"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        what = f"broke the ZeroMQ handshake (ZMTP protocol error {value:#x})"
    else:
        what = "closed the connection during the ZeroMQ handshake"
    return (
        f"the peer at {address} {what}: either it is an executor that requires CURVE authentication ({how}), "
        "or it is not a Symbiosis executor at all (e.g. an HTTP server such as `symbiosis api`); check the address"
    )
