"""torch.distributed payloads, client side: ``DistTransport`` (``dist+ipc://…`` / ``dist+tcp://…``).

The protocol, the rendezvous, validation, threading on the server and the security notes are in
``dist_channel.py`` (the server side, which also holds what both sides share).

Small requests ride inline: when neither the payload nor the result reaches ``inline_threshold``
bytes (default ``INLINE_THRESHOLD[backend]``), the request goes the plain ``ZmqTransport`` way,
one ZeroMQ frame each way, which the same ``ZmqServer`` serves with its inline channel. A gloo/NCCL
transfer costs a rendezvous (the executor posts its receive only once it validated the header), two
notifications and a wake-up of a waiting thread on each side: measured on loopback tcp (echo
executor, hidden 4096, a shared 2-core host), a gloo call costs a fixed ~150-200 µs more than an
inline ``tcp://`` call and moves bytes at the same speed (4 rows: 470 vs 320 µs; 64 rows, 1 MiB:
1.19 vs 1.02 ms; 128 rows, 2 MiB: 2.36 vs 2.30 ms; 4096 rows, 64 MiB: 0.22 vs 0.23 s), hence
1 MiB for gloo. Over NCCL an inline call instead copies device to host and back on each side, so
its threshold is lower (64 KiB, not measured: no two-GPU host here). Decode steps, a few rows per
call, stay inline; training and prefill payloads go over the pair group.

So does a request this client cannot validate with the layers from ``Welcome`` (a wrong width, an
unknown layer): the executor refuses it with its reason. A dist header the executor accepts whose
payload the client never posts would leave the executor waiting for it until the group timeout,
so sibling group ids (``vocabulary.group_id``) are resolved from their members' specs, and what
cannot be resolved goes inline.

A dist call posts its payload ``send`` and its result ``recv`` together, before the header leaves
(the result's size follows from the layer specs in ``Welcome``), waits for the reply on the
ZeroMQ socket, then for its receive, which by then has usually completed. A call that ends with a
transfer still posted (the executor refused a header it had not validated, an error reply, a
timeout, a lost connection) abandons the pair group and its connection: the next call
re-handshakes and builds a fresh group, so no stale transfer can meet a later one.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, NoReturn

import msgspec
import torch
import torch.distributed as dist

from symbiosis import protocol as P
from symbiosis.errors import (
    ConfigurationError,
    ExecutorBusyError,
    ExecutorUnavailableError,
    ProtocolError,
    SymbiosisError,
)
from symbiosis.transport.dist_channel import (
    CLIENT_RANK,
    EXECUTOR_RANK,
    MAX_TAG,
    check_backend,
    first_line,
    pair_group,
    wait_work,
)
from symbiosis.transport.schemes import is_loopback_host, tcp_host
from symbiosis.transport.zmq_client import ZmqTransport, _Connection
from symbiosis.vocabulary import Op, spec_of

#: Per backend: requests whose payload and result are both smaller than this many bytes travel
#: inline (see module doc for the gloo measurement; NCCL's is a guess: no two-GPU host here).
INLINE_THRESHOLD = {"gloo": 1 << 20, "nccl": 64 << 10}


@dataclass
class _Lease:
    """One dist call's transfer state, from ``_encode`` to ``_release``."""

    conn: _Connection | None
    group: Any
    tag: int
    result_nbytes: int = 0
    send_work: Any = None
    recv_work: Any = None
    result: torch.Tensor | None = None
    settled: bool = False  # every posted transfer completed (waited for)
    serial: bool = False


class DistTransport(ZmqTransport):
    """``ZmqTransport`` whose large payloads travel on a torch.distributed pair group (``dist+…``).

    ``device``: where payloads leave from and results arrive (default ``cpu``); ``backend``:
    ``gloo`` (default for CPU) or ``nccl`` (default for CUDA). ``hostname``: the address this
    client's gloo device listens on (default: the interface that reaches the executor's store).
    ``inline_threshold``: requests whose payload and result are both smaller (bytes) go inline in
    the ZeroMQ frames instead (default ``INLINE_THRESHOLD``; 0: every request over the pair group).
    ``allow_unencrypted_payloads``: with CURVE keys, accept a pair group on a non-loopback host
    (payload bytes then cross the network in plaintext; CURVE protects only control messages).
    """

    _inline_lane_calls = False  # its inline calls go the general way (``_encode`` decides)

    def __init__(
        self,
        address: str,
        *,
        device: str | torch.device = "cpu",
        backend: str | None = None,
        hostname: str | None = None,
        inline_threshold: int | None = None,
        allow_unencrypted_payloads: bool = False,
        **kwargs: Any,
    ) -> None:
        if not address.startswith("dist+"):
            raise ConfigurationError(f"torch.distributed address must start with 'dist+', got {address!r}")
        self.device = torch.device(device)
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        check_backend(self.backend, self.device)
        self.inline_threshold = INLINE_THRESHOLD[self.backend] if inline_threshold is None else inline_threshold
        self._hostname = hostname
        self._allow_unencrypted_payloads = allow_unencrypted_payloads
        server_host = tcp_host(address) if address.startswith("dist+tcp://") else ""
        if (
            kwargs.get("curve") is not None
            and not allow_unencrypted_payloads
            and server_host
            and not is_loopback_host(server_host)
        ):
            raise ConfigurationError(
                f"refusing {address!r} with CURVE: torch.distributed payloads are not encrypted (CURVE covers control "
                "messages only); connect with tcp:// for encrypted inline payloads, or pass "
                "allow_unencrypted_payloads=True"
            )
        self._group: Any = None
        self._group_conn: _Connection | None = None
        self._store: dist.Store | None = None
        self._serial = threading.Lock() if self.backend == "nccl" else None
        super().__init__(address[len("dist+") :], **kwargs)
        self.address = address

    def _handshake(self, deadline: float) -> _Connection:
        """Hello, retried while the executor has as many pair-group set-ups pending as it allows
        (each takes milliseconds, so a burst of clients starting at once gets through)."""
        delay_s = 0.02
        while True:
            try:
                return super()._handshake(deadline)
            except ExecutorBusyError:
                if time.monotonic() + delay_s >= deadline:
                    raise
                time.sleep(delay_s)
                delay_s = min(2 * delay_s, 0.5)

    def _hello_options(self) -> dict[str, Any]:
        return {"dist_backend": self.backend}

    @property
    def _payload_device(self) -> torch.device:
        """Where payloads leave from and results land: gloo moves CPU memory, NCCL device memory."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def _stage(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.detach().contiguous()  # moved where it leaves from once ``_encode`` chose the way

    def _on_session(self, welcome: P.Welcome, conn: _Connection) -> None:
        if not welcome.dist_store or not welcome.dist_prefix:
            raise ProtocolError(f"executor at {self.address} did not open a torch.distributed session")
        host, _, port = welcome.dist_store.rpartition(":")
        host = host.strip("[]")
        if self.curve is not None and not self._allow_unencrypted_payloads and not is_loopback_host(host):
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
            group = pair_group(prefixed, CLIENT_RANK, self.backend, self.timeout_s, gloo_device, self._payload_device)
        except (RuntimeError, ValueError, OSError) as exc:
            reason = f"torch.distributed pair group with {welcome.dist_store} failed: {exc}"
            raise ExecutorUnavailableError(reason) from None
        self._group, self._group_conn, self._store = group, conn, store  # the old group (if any) is dropped

    def _encode(self, request: P.Request, rows: torch.Tensor) -> tuple[P.Request, list[Any], Any]:
        nbytes = rows.numel() * rows.element_size()
        result_nbytes = self._result_nbytes(request, rows, nbytes)
        if result_nbytes < 0 or max(nbytes, result_nbytes) < self.inline_threshold:
            # Inline: small, or a request this client cannot vouch for (the executor decides and says why).
            return super()._encode(request, rows.cpu())
        request = msgspec.structs.replace(request, dist_tag=request.request_id % (MAX_TAG + 1), dist_nbytes=nbytes)
        lease = _Lease(self._group_conn, self._group, request.dist_tag, result_nbytes)
        if lease.group is None:  # abandoned by another thread a moment ago: retry on a new session
            raise ExecutorUnavailableError("the torch.distributed session was abandoned")
        if self._serial is not None:
            self._serial.acquire()
            lease.serial = True
        group, tag = lease.group, lease.tag
        try:
            if nbytes:
                payload = rows.to(self._payload_device).reshape(-1).view(torch.uint8)
                lease.send_work = group.send([payload], EXECUTOR_RANK, tag)
            if result_nbytes:  # posted now: the executor's send finds it and its bytes leave at once
                lease.result = torch.empty(result_nbytes, dtype=torch.uint8, device=self._payload_device)
                lease.recv_work = group.recv([lease.result], EXECUTOR_RANK, tag)
        except RuntimeError as exc:  # the pair is closed (executor gone or it ended the session)
            if lease.serial:
                lease.serial = False
                assert self._serial is not None
                self._serial.release()
            self._fail_transfer(lease, exc)
        lease.settled = lease.send_work is None and lease.recv_work is None
        return request, [P.encode(request)], lease

    def _result_nbytes(self, request: P.Request, rows: torch.Tensor, nbytes: int) -> int:
        """Bytes of the result, or -1 for a request this client cannot validate with the layers
        from ``Welcome`` (the executor will refuse it, or it names a sibling group this client
        cannot resolve)."""
        # a sibling group id too; the executor has the last word on which groups it serves (one it
        # refuses after the payload was posted costs a fresh pair group, see the module doc)
        spec = spec_of(request.layer_id, self._specs)
        if spec is None:
            return -1
        assert self._welcome is not None
        try:
            P.validate_request(request, nbytes, {request.layer_id: spec}, self._welcome.limits)
        except SymbiosisError:
            return -1
        return rows.shape[0] * Op(request.op).output_width(spec) * rows.element_size()

    def _decode(self, reply: P.Reply, payload: list[memoryview], lease: Any) -> torch.Tensor:
        if lease is None:  # an inline request
            return super()._decode(reply, payload, lease)
        if reply.dtype not in P.WIRE_DTYPES or len(reply.shape) != 2 or min(reply.shape) < 0 or payload:
            raise ProtocolError(f"malformed reply: dtype {reply.dtype!r}, shape {reply.shape}, {len(payload)} frames")
        nbytes = P.declared_nbytes(reply.dtype, reply.shape)
        if nbytes != lease.result_nbytes:
            raise ProtocolError(f"reply of {nbytes} bytes, expected {lease.result_nbytes}")
        device = self._payload_device
        try:
            if lease.send_work is not None:
                wait_work(lease.send_work, device)  # done already: the executor replies after receiving
            if lease.recv_work is not None:
                wait_work(lease.recv_work, device)
        except RuntimeError as exc:
            self._fail_transfer(lease, exc)
        lease.settled = True
        result = lease.result if lease.result is not None else torch.empty(0, dtype=torch.uint8, device=device)
        return P.owned_tensor(result, P.WIRE_DTYPES[reply.dtype], reply.shape)  # not a view: see owned_tensor

    def _release(self, lease: Any, reusable: bool) -> None:
        if lease is None:
            return
        if lease.serial:
            lease.serial = False
            assert self._serial is not None
            self._serial.release()
        if not lease.settled:  # a transfer may still be posted: it must never meet a later one
            lease.settled = True
            self._abandon(
                lease, "a torch.distributed call ended with a transfer still posted; starting a fresh session"
            )

    def _on_close(self) -> None:
        self._group, self._group_conn, self._store = None, None, None

    def _fail_transfer(self, lease: _Lease, exc: RuntimeError) -> NoReturn:
        reason = f"torch.distributed transfer failed: {first_line(exc)}"
        lease.settled = True
        self._abandon(lease, reason)
        raise ExecutorUnavailableError(reason) from None

    def _abandon(self, lease: _Lease, reason: str) -> None:
        """Stop using ``lease``'s group and connection: the next call re-handshakes (new group)."""
        if lease.conn is not None:
            lease.conn.fail(reason)
        if self._group is lease.group:
            self._group = None


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
