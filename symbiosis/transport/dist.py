"""torch.distributed payloads: the paper's GPU↔GPU path (NCCL), with gloo as its CPU twin.

Address form: ``dist+ipc:///path/executor.sock`` or ``dist+tcp://127.0.0.1:PORT``: the part after
``dist+`` is the ``ZmqServer`` address. Every control message (Hello/Welcome, request headers,
replies, errors, heartbeats) flows over that ZeroMQ socket exactly as for inline requests; only
tensor bytes move over a *pairwise* process group (rank 0 = executor, rank 1 = client), built
without a global ``init_process_group``, so one executor holds one small group per client.

Rendezvous: the executor hosts one ``TCPStore`` per server, created on the first dist Hello and
listening on the dist host (loopback unless the server was told otherwise). A Hello with
``dist_backend`` makes the server start that session's *pair worker* (rank 0) and answer with the
store's address and a random 128-bit key prefix in ``Welcome``; the client then builds rank 1
under that prefix. Backend: ``gloo`` for CPU payloads, ``nccl`` when the client's device is CUDA
(the server then receives on its ``dist_device``).

Matching: a request header carries ``dist_tag`` (the request id) and ``dist_nbytes``; the payload
is sent on that tag and the result comes back on the same tag, the other way.

Validation before any payload byte moves: the server validates the header (declared bytes equal
shape × itemsize, under the cap, known layer/op/dtype/width) and posts the matching ``recv`` only
if it accepts it. gloo point-to-point is a rendezvous — a ``send`` whose ``recv`` was never
posted transfers no data (measured: 64 MB stays on the sender) — so a refused payload is never
received, drained or buffered, and no extra round trip is spent on an "accepted" message. The
client also runs the same validation locally with the limits and layers from ``Welcome`` and does
not post payloads the server would refuse; if the server refuses one the client had posted (it
shut down meanwhile), the client abandons that pair group and reconnects, which drops the posted
send. Receive buffers are zero-filled, so a peer that sends fewer bytes than it declared cannot
read stale executor memory back through its result.

Threading: the server's socket thread never blocks on a transfer. Each dist session has one
worker thread that builds the group, then posts and waits for its transfers in arrival order and
hands received rows back to the socket thread (``ChannelHost.call_soon``), which submits them.

Dead or stuck peers: a killed client's pair sockets close, so its pending transfers fail at once;
the worker reports it and the server ends the session (pending requests get errors, the executor
unregisters the client) and drops the group. A live peer that never sends a declared payload, or
never takes its result, hits the group timeout (the server's ``client_timeout_s``); gloo then
closes the pair, and the session ends the same way. ``ProcessGroup.abort`` does not wake a
pending wait, which is why waits live on the worker, never on the socket thread.

NCCL (code path present, not tested here — no GPU in CI, and NCCL cannot pair two ranks on one
GPU): NCCL ignores tags and matches sends and receives by order, and an unmatched send blocks the
communicator. The client therefore keeps one call in flight per NCCL transport, so both sides
post in the same order, and refused headers after a posted send rebuild the group as above.

Security: CURVE (``security.py``) covers the ZeroMQ control messages only; gloo/NCCL payloads and
the TCPStore are neither authenticated nor encrypted. With CURVE on, a server keeps its dist
channel on loopback unless ``allow_non_loopback=True``, and a client refuses a pair group on a
non-loopback host unless ``allow_unencrypted_payloads=True``.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import queue
import secrets
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import msgspec
import torch
import torch.distributed as dist

from symbiosis import protocol as P
from symbiosis.errors import ExecutorUnavailableError, ProtocolError, SymbiosisError
from symbiosis.transport.channels import Accepted, ChannelHost, RequestKey, Session
from symbiosis.transport.zmq_client import ZmqTransport, _Connection
from symbiosis.vocabulary import LayerSpec

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
MAX_TAG = 2**31 - 1  # c10d tags are C ints
_EXECUTOR_RANK, _CLIENT_RANK = 0, 1
_RENDEZVOUS_KEYS = ("0/0", "0/1")  # what ProcessGroupGloo writes under its prefix (rank addresses)


def _pair_group(store: dist.Store, rank: int, backend: str, timeout_s: float, gloo_device: Any) -> Any:
    """A 2-rank process group over ``store`` (blocks until the other rank joins)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [gloo_device]
    return dist.ProcessGroupGloo(store, rank, 2, options)


def _check_backend(backend: str, device: torch.device) -> None:
    if backend not in BACKENDS:
        raise ProtocolError(f"unknown torch.distributed backend {backend!r}; supported: {list(BACKENDS)}")
    if backend == "nccl" and (device.type != "cuda" or not dist.is_nccl_available()):
        raise ProtocolError(f"nccl needs CUDA payload devices and a build with NCCL (device here: {device})")


def _wait(work: Any, device: torch.device) -> None:
    work.wait()
    if device.type == "cuda":  # the bytes must have landed before another stream or thread reads them
        torch.cuda.synchronize(device)


# ---- server side ---------------------------------------------------------------------------


class _PairWorker:
    """Server side of one dist session: a thread that builds the pair group (rank 0), then posts
    and waits for the session's transfers in order. Jobs run on that thread, never the socket's."""

    def __init__(self, channel: "DistChannel", session: Session, backend: str, prefix: str, gloo_device: Any) -> None:
        self.session = session
        self._channel = channel
        self.backend = backend
        self._gloo_device = gloo_device
        self._store = dist.PrefixStore(prefix, channel.store())
        self._jobs: queue.SimpleQueue[Callable[[Any], None] | None] = queue.SimpleQueue()
        self.ended = False
        self._thread = threading.Thread(target=self._run, name=f"dist-pair({session.client_id})", daemon=True)
        self._thread.start()

    def post(self, job: Callable[[Any], None]) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        """The session ended: finish the jobs already posted, then drop the group. Results whose
        Reply went out (a draining shutdown) still reach the client; receives are skipped, since
        nobody waits for their rows (see ``DistChannel.accept``)."""
        self.ended = True
        self._jobs.put(None)

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            for key in _RENDEZVOUS_KEYS:
                try:
                    self._store.delete_key(key)
                except Exception:  # noqa: BLE001 - the store may be gone with its server
                    pass

    def _serve(self) -> None:
        try:
            group = _pair_group(self._store, _EXECUTOR_RANK, self.backend, self._channel.timeout_s, self._gloo_device)
        except Exception as exc:  # noqa: BLE001 - the client never joined, or joined wrongly
            self._report(f"pair group setup failed: {str(exc).splitlines()[0]}")
            return
        try:
            while (job := self._jobs.get()) is not None:
                job(group)
        except Exception as exc:  # noqa: BLE001 - peer died, timed out, or sent the wrong size
            self._report(str(exc).splitlines()[0])
        # The group goes with this frame: its pair sockets close, the client's pending ops fail.

    def _report(self, reason: str) -> None:
        session, host = self.session, self._channel.host

        def on_socket_thread() -> None:
            if session.channel_state.get("dist") is self:  # not a stale worker of a replaced group
                host.transfer_failed(session, reason)

        if not self.ended:
            host.call_soon(on_socket_thread)


class DistChannel:
    """Server side (``channels.PayloadChannel``): payloads and results on per-session pair groups."""

    def __init__(
        self,
        host: ChannelHost,
        specs: dict[str, LayerSpec],
        limits: P.Limits,
        listen_host: str,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        self.host = host
        self.timeout_s = timeout_s
        self._specs = specs
        self._limits = limits
        self._listen_host = listen_host
        self._device = device
        self._store: dist.TCPStore | None = None
        self._store_address = ""
        self._gloo_device: Any = None

    def store(self) -> dist.TCPStore:
        """The rendezvous store, hosted here and created on first use (on the socket thread)."""
        if self._store is None:
            family = socket.AF_INET6 if ":" in self._listen_host else socket.AF_INET
            listener = socket.socket(family, socket.SOCK_STREAM)
            try:
                listener.bind((self._listen_host, 0))  # our own socket: the store listens only here
                listener.listen(128)
                port = listener.getsockname()[1]
            except OSError:
                listener.close()
                raise
            timeout = datetime.timedelta(seconds=self.timeout_s)
            # TCPStore takes ownership of the listening fd (and closes it), hence detach().
            self._store = dist.TCPStore(
                self._listen_host, port, None, True, timeout, wait_for_workers=False, master_listen_fd=listener.detach()
            )
            shown = f"[{self._listen_host}]" if family == socket.AF_INET6 else self._listen_host
            self._store_address = f"{shown}:{port}"
        return self._store

    def gloo_device(self) -> Any:
        if self._gloo_device is None:  # one device (one I/O loop) for every session's group
            self._gloo_device = dist.ProcessGroupGloo.create_device(hostname=self._listen_host)
        return self._gloo_device

    def open(self, session: Session, backend: str) -> tuple[str, str]:
        """Start ``session``'s pair group; returns (store address, key prefix) for the Welcome."""
        _check_backend(backend, self._device)
        self.end_session(session)  # a second Hello on one connection replaces the group
        self.store()
        gloo_device = self.gloo_device() if backend == "gloo" else None
        prefix = secrets.token_hex(16)
        session.channel_state["dist"] = _PairWorker(self, session, backend, prefix, gloo_device)
        return self._store_address, prefix

    def accept(self, session: Session, key: RequestKey, req: P.Request, frames: list[Any]) -> Accepted:
        if frames:
            raise ProtocolError("a torch.distributed request carries no payload frame")
        worker = session.channel_state.get("dist")
        if worker is None:
            raise ProtocolError("no torch.distributed session: say Hello with a dist_backend first")
        tag = req.dist_tag
        if tag is None or not 0 <= tag <= MAX_TAG:
            raise ProtocolError(f"dist tag {tag} out of range [0, {MAX_TAG}]")
        spec = P.validate_request(req, req.dist_nbytes, self._specs, self._limits)
        dtype, shape, nbytes = P.WIRE_DTYPES[req.dtype], list(req.shape), req.dist_nbytes
        if nbytes == 0:
            return Accepted(spec, torch.empty(shape, dtype=dtype), tag)
        device = self._device if worker.backend == "nccl" else torch.device("cpu")

        def receive(group: Any) -> None:
            if worker.ended:
                return
            buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)  # zeros: see module doc
            _wait(group.recv([buffer], _CLIENT_RANK, tag), device)
            rows = buffer.view(dtype).view(shape)
            self.host.call_soon(lambda: self.host.rows_arrived(key, rows))

        worker.post(receive)
        return Accepted(spec, None, tag)

    def reply(self, session: Session, req: P.Request, reply: P.Reply, result: torch.Tensor, ticket: Any) -> None:
        worker = session.channel_state.get("dist")
        if worker is None:
            return  # the session's group was replaced: nobody can receive this result
        self.host.send(session.identity, reply)
        if result.numel() == 0:
            return
        device = self._device if worker.backend == "nccl" else torch.device("cpu")
        payload = result.to(device).contiguous().reshape(-1).view(torch.uint8)
        worker.post(lambda group: _wait(group.send([payload], _CLIENT_RANK, ticket), device))

    def end_session(self, session: Session) -> None:
        worker = session.channel_state.pop("dist", None)
        if worker is not None:
            worker.stop()

    def close(self) -> None:
        # Workers keep the store alive until they finish; the store's server stops with the last one.
        self._store = None
        self._gloo_device = None


# ---- client side ---------------------------------------------------------------------------


@dataclass
class _Lease:
    """One call's transfer state, from ``_encode`` to ``_release``."""

    conn: _Connection | None
    group: Any
    tag: int
    send_work: Any = None
    serial: bool = False


class DistTransport(ZmqTransport):
    """``ZmqTransport`` whose payloads travel on a torch.distributed pair group (``dist+…``).

    ``device``: where payloads leave from and results arrive (default ``cpu``); ``backend``:
    ``gloo`` (default for CPU) or ``nccl`` (default for CUDA). ``hostname``: the address this
    client's gloo device listens on (default: the interface that reaches the executor's store).
    ``allow_unencrypted_payloads``: with CURVE keys, accept a pair group on a non-loopback host
    (payload bytes then cross the network in plaintext; CURVE protects only control messages).
    """

    def __init__(
        self,
        address: str,
        *,
        device: str | torch.device = "cpu",
        backend: str | None = None,
        hostname: str | None = None,
        allow_unencrypted_payloads: bool = False,
        **kwargs: Any,
    ) -> None:
        if not address.startswith("dist+"):
            raise ValueError(f"torch.distributed address must start with 'dist+', got {address!r}")
        self.device = torch.device(device)
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        _check_backend(self.backend, self.device)
        self._hostname = hostname
        self._allow_unencrypted_payloads = allow_unencrypted_payloads
        server_host = address[len("dist+tcp://") :].rpartition(":")[0].strip("[]") if address.startswith("dist+tcp://") else ""
        if kwargs.get("curve") is not None and not allow_unencrypted_payloads and server_host and not _is_loopback(server_host):
            raise ValueError(
                f"refusing {address!r} with CURVE: torch.distributed payloads are not encrypted (CURVE covers control "
                "messages only); connect with tcp:// for encrypted inline payloads, or pass allow_unencrypted_payloads=True"
            )
        self._group: Any = None
        self._group_conn: _Connection | None = None
        self._store: dist.Store | None = None
        self._post_lock = threading.Lock()
        self._serial = threading.Lock() if self.backend == "nccl" else None
        super().__init__(address[len("dist+") :], **kwargs)
        self.address = address

    def _hello_options(self) -> dict[str, Any]:
        return {"dist_backend": self.backend}

    @property
    def _payload_device(self) -> torch.device:
        """Where payloads leave from and results land: gloo moves CPU memory, NCCL device memory."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def _stage(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.detach().to(self._payload_device).contiguous()

    def _on_session(self, welcome: P.Welcome, conn: _Connection) -> None:
        if not welcome.dist_store or not welcome.dist_prefix:
            raise ProtocolError(f"executor at {self.address} did not open a torch.distributed session")
        host, _, port = welcome.dist_store.rpartition(":")
        host = host.strip("[]")
        if self.curve is not None and not self._allow_unencrypted_payloads and not _is_loopback(host):
            raise ProtocolError(
                f"refusing torch.distributed payloads to {host}: CURVE encrypts control messages only and "
                "gloo/NCCL payloads would cross the network in plaintext; use tcp:// (inline, encrypted) or "
                "pass allow_unencrypted_payloads=True"
            )
        timeout = datetime.timedelta(seconds=self.connect_timeout_s)
        try:
            store = dist.TCPStore(host, int(port), None, False, timeout)
            prefixed = dist.PrefixStore(welcome.dist_prefix, store)
            gloo_device = None
            if self.backend == "gloo":
                hostname = self._hostname or _local_address_towards(host)
                gloo_device = dist.ProcessGroupGloo.create_device(hostname=hostname)
            group = _pair_group(prefixed, _CLIENT_RANK, self.backend, self.timeout_s, gloo_device)
        except (RuntimeError, ValueError, OSError) as exc:
            reason = f"torch.distributed pair group with {welcome.dist_store} failed: {exc}"
            raise ExecutorUnavailableError(reason) from None
        self._group, self._group_conn, self._store = group, conn, store  # the old group (if any) is dropped

    def _encode(self, request: P.Request, rows: torch.Tensor) -> tuple[P.Request, list[Any], Any]:
        nbytes = rows.numel() * rows.element_size()
        request = msgspec.structs.replace(request, dist_tag=request.request_id % (MAX_TAG + 1), dist_nbytes=nbytes)
        lease = _Lease(self._group_conn, self._group, request.dist_tag)
        if lease.group is None:  # abandoned by another thread a moment ago: retry on a new session
            raise ExecutorUnavailableError("the torch.distributed session was abandoned")
        if self._serial is not None:
            self._serial.acquire()
            lease.serial = True
        try:
            assert self._welcome is not None
            P.validate_request(request, nbytes, self._specs, self._welcome.limits)
        except SymbiosisError:
            return request, [P.encode(request)], lease  # the executor refuses it and says why: send no bytes
        if nbytes:
            payload = rows.reshape(-1).view(torch.uint8)
            lease.send_work = self._post(lease, lambda: lease.group.send([payload], _EXECUTOR_RANK, lease.tag))
        return request, [P.encode(request)], lease

    def _decode(self, reply: P.Reply, frames: list[Any], lease: Any) -> torch.Tensor:
        if reply.dtype not in P.WIRE_DTYPES or len(reply.shape) != 2 or min(reply.shape) < 0 or frames:
            raise ProtocolError(f"malformed reply: dtype {reply.dtype!r}, shape {reply.shape}, {len(frames)} frames")
        nbytes = P.declared_nbytes(reply.dtype, reply.shape)
        assert self._welcome is not None
        if nbytes > self._welcome.limits.max_payload_bytes:
            raise ProtocolError(f"reply of {nbytes} bytes exceeds the cap")
        device = self._payload_device
        if lease.send_work is not None:
            self._wait(lease, lease.send_work, device)  # done already: the executor replies after receiving
        result = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if nbytes:
            work = self._post(lease, lambda: lease.group.recv([result], _EXECUTOR_RANK, lease.tag))
            self._wait(lease, work, device)
        return P.owned_tensor(result, P.WIRE_DTYPES[reply.dtype], reply.shape)  # not a view: see owned_tensor

    def _release(self, lease: Any, reusable: bool) -> None:
        if lease is None:
            return
        if lease.serial:
            lease.serial = False
            assert self._serial is not None
            self._serial.release()
        if not reusable:  # timed out or lost: the executor may still send on this tag
            self._abandon(lease, "a call did not complete; starting a fresh torch.distributed session")
        elif lease.send_work is not None and not lease.send_work.is_completed():
            self._abandon(lease, "the executor refused a payload already posted; starting a fresh session")

    def _on_close(self) -> None:
        self._group, self._group_conn, self._store = None, None, None

    def _post(self, lease: _Lease, post: Callable[[], Any]) -> Any:
        try:
            with self._post_lock:  # posting is cheap; waits happen outside the lock
                return post()
        except RuntimeError as exc:  # the pair is closed (executor gone or it ended the session)
            self._fail_transfer(lease, exc)

    def _wait(self, lease: _Lease, work: Any, device: torch.device) -> None:
        try:
            _wait(work, device)
        except RuntimeError as exc:
            self._fail_transfer(lease, exc)

    def _fail_transfer(self, lease: _Lease, exc: RuntimeError) -> NoReturn:
        reason = f"torch.distributed transfer failed: {str(exc).splitlines()[0]}"
        self._abandon(lease, reason)
        raise ExecutorUnavailableError(reason) from None

    def _abandon(self, lease: _Lease, reason: str) -> None:
        """Stop using ``lease``'s group and connection: the next call re-handshakes (new group)."""
        if lease.conn is not None:
            lease.conn.fail(reason)
        if self._group is lease.group:
            self._group = None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _local_address_towards(host: str) -> str:
    """The local address this host uses to reach ``host`` (what the peer can connect back to)."""
    try:
        if ipaddress.ip_address(host).is_loopback:
            return host
    except ValueError:
        pass
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # UDP connect sends nothing; it only picks the route
        return probe.getsockname()[0]
