"""The split model equals the monolithic `transformers`+`peft` model: logits, loss, adapter
gradients and greedy tokens, for every architecture family × every PEFT method peft supports,
in-process and over every remote transport (ipc, tcp, shm+ipc, dist+tcp).

In-process runs the full matrix. Each remote transport runs a rotated subset (see ``ROTATION``)
in which every family and every method appears, plus, on tcp, the cases that once broke only
over a socket. The remote part is marked ``slow``: ``pytest -m "not slow"`` is the fast set.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
import warnings

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

import symbiosis
from symbiosis.modelzoo import ARCHS
from tests.reference import METHODS, assert_matches_reference, close_client, loss_and_grads, make_pair, peft_config

# Close, not equal: the executor runs each base layer as its own GEMM (batched with other rows,
# decoded at another alignment, biases added apart) where the monolithic model runs transformers'
# kernels, so float32 sums come out in another order; through two layers, softmax and the loss
# those ulp-level differences stay far inside 1e-4 relative / 1e-5 absolute, while a dropped bias,
# norm, adapter or prefix moves logits and gradients by orders of magnitude more. Greedy tokens
# must still be equal.
TOL = dict(rtol=1e-4, atol=1e-5)

REMOTE = ("ipc", "tcp", "shm", "dist")

# Rotation rule: remote transport t (its index in REMOTE) runs (ARCHS[i], METHODS[j]) iff
# (i + j + t) % ROTATION == 0. Each family i then meets the methods j ≡ -(i + t) (mod 4) and each
# method j the families i ≡ -(j + t) (mod 4): with 10 families and 8 methods (both ≥ 4) every
# family and every method appears on every transport (~20 cases each), and because t runs over
# all four residues, every (family, method) pair runs on exactly one remote transport.
ROTATION = 4

# Always on tcp: transports once returned tensor *views*, and peft's in-place add on a base
# layer's output then failed ("Output 0 of View is a view and is being modified inplace") only
# over a socket, for AdaLoRA and for Falcon's adapters.
TCP_REGRESSIONS = [(arch, "adalora") for arch in ("llama", "gpt2", "gemma2", "gpt_neox")] + [
    ("falcon", method) for method in ("lora", "loha", "lokr", "adalora")
]


def rotated_cases(transport: str) -> list[tuple[str, str]]:
    t = REMOTE.index(transport)
    return [
        (arch, method)
        for i, arch in enumerate(ARCHS)
        for j, method in enumerate(METHODS)
        if (i + j + t) % ROTATION == 0
    ]


def remote_cases() -> list[tuple[str, str, str]]:
    """(transport, arch, method), grouped by arch so one arch's servers serve a run of tests."""
    cases = set()
    for transport in REMOTE:
        cases.update((transport, arch, method) for arch, method in rotated_cases(transport))
    cases.update(("tcp", arch, method) for arch, method in TCP_REGRESSIONS)
    return sorted(cases, key=lambda c: (ARCHS.index(c[1]), REMOTE.index(c[0]), METHODS.index(c[2])))


class ArchServers:
    """One executor per arch (module-scoped) and, when a remote test needs them, one tcp and one
    ipc server on it. Only the current arch's servers stay open (remote tests run arch by arch)."""

    def __init__(self, tiny_checkpoint) -> None:
        self._checkpoint = tiny_checkpoint
        self._executors: dict[str, symbiosis.BaseExecutor] = {}
        self._servers: dict[str, list] = {}
        self._addresses: dict[str, dict[str, str]] = {}
        self._sock_dir = tempfile.mkdtemp(prefix="symb-ref-", dir="/tmp")  # short: ipc paths ≤ ~100 chars

    def executor(self, arch: str) -> symbiosis.BaseExecutor:
        if arch not in self._executors:
            self._executors[arch] = symbiosis.BaseExecutor.from_pretrained(self._checkpoint(arch))
        return self._executors[arch]

    def address(self, arch: str, transport: str) -> str:
        if arch not in self._addresses:
            for other in list(self._servers):
                self._close_servers(other)
            executor = self.executor(arch)
            tcp = executor.serve("tcp://127.0.0.1:0")
            ipc = executor.serve(f"ipc://{self._sock_dir}/{arch}.sock")
            self._servers[arch] = [tcp, ipc]
            self._addresses[arch] = {
                "tcp": tcp.address,
                "ipc": ipc.address,
                "shm": f"shm+{ipc.address}",
                "dist": f"dist+{tcp.address}",
            }
        return self._addresses[arch][transport]

    def _close_servers(self, arch: str) -> None:
        for server in self._servers.pop(arch):
            server.close()
        del self._addresses[arch]

    def close(self) -> None:
        for arch in list(self._servers):
            self._close_servers(arch)
        for executor in self._executors.values():
            executor.close()
        shutil.rmtree(self._sock_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def arch_servers(tiny_checkpoint):
    servers = ArchServers(tiny_checkpoint)
    yield servers
    servers.close()


@functools.cache
def _peft_supports(path, method, arch) -> str | None:
    """Why peft itself cannot apply ``method`` to ``arch`` (then there is nothing to compare), or None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path), peft_config(method, arch))
            ids = torch.tensor([[1, 2, 3]])
            model(input_ids=ids, labels=ids).loss.backward()
            model.generate(input_ids=ids, max_new_tokens=2, do_sample=False)
    except Exception as exc:  # noqa: BLE001 - peft/transformers' own limitation, not ours
        return f"{type(exc).__name__}: {exc}"
    return None


def _check_split_matches_monolithic(path, executor, method: str, arch: str) -> None:
    """``executor``: a BaseExecutor (in-process) or an address (a remote transport)."""
    reason = _peft_supports(path, method, arch)
    if reason:
        pytest.skip(f"peft does not support {method} on {arch}: {reason[:200]}")
    reference, split = make_pair(path, executor, method, arch)
    try:
        input_ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(1))
        assert_matches_reference(loss_and_grads(split, input_ids), loss_and_grads(reference, input_ids), **TOL)

        prompt = input_ids[:1, :5]
        with torch.no_grad():
            ref_tokens = reference.generate(input_ids=prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False)
            tokens = split.generate(input_ids=prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False)
        assert tokens.shape[-1] == prompt.shape[-1] + 20
        assert torch.equal(tokens, ref_tokens)  # greedy tokens: exact, whatever the transport
    finally:
        close_client(split)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ARCHS)
def test_split_matches_monolithic(arch, method, tiny_checkpoint, arch_servers):
    _check_split_matches_monolithic(tiny_checkpoint(arch), arch_servers.executor(arch), method, arch)


@pytest.mark.slow
@pytest.mark.parametrize(("transport", "arch", "method"), remote_cases())
def test_split_matches_monolithic_remote(transport, arch, method, tiny_checkpoint, arch_servers, monkeypatch):
    if transport == "dist":  # every payload over the gloo pair group: small ones would ride inline
        monkeypatch.setattr("symbiosis.transport.dist_client.INLINE_THRESHOLD", {"gloo": 0, "nccl": 0})
    address = arch_servers.address(arch, transport)
    _check_split_matches_monolithic(tiny_checkpoint(arch), address, method, arch)


def test_rotation_covers_every_family_and_method_on_every_transport():
    cases = remote_cases()
    for transport in REMOTE:
        on_transport = [(arch, method) for t, arch, method in cases if t == transport]
        assert {arch for arch, _ in on_transport} == set(ARCHS), transport
        assert {method for _, method in on_transport} == set(METHODS), transport
    assert {("tcp", arch, method) for arch, method in TCP_REGRESSIONS} <= set(cases)
    # Together the remote transports cover the full matrix once (plus the tcp regressions).
    assert {(arch, method) for _, arch, method in cases} == {(a, m) for a in ARCHS for m in METHODS}
    assert "phi3" in ARCHS and "gpt_neox" in ARCHS  # fused qkv/gate_up; embed_out as lm_head


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
@pytest.mark.parametrize(("arch", "method"), [("llama", "lora"), ("gpt_neox", "adalora")])
def test_long_lane_messages_match_monolithic(transport, arch, method, tiny_checkpoint, arch_servers, monkeypatch):
    """Calls larger than one lane message travel on the lane as long messages (``lane.py``). Lanes
    made while one message holds 12 KiB send every call of this batch that way, in many pieces
    (a training step of a real model does so with 1 MiB messages): logits, loss, adapter
    gradients and greedy tokens still match the monolithic model."""
    from symbiosis.transport import lane as L

    monkeypatch.setattr(L, "MAX_MESSAGE_BYTES", 12 * 1024)
    long_calls = {"sent": 0}  # the client's long requests
    real_send_long = L.ClientLane._send_long

    def send_long(lane, header, payload):
        long_calls["sent"] += 1
        real_send_long(lane, header, payload)

    monkeypatch.setattr(L.ClientLane, "_send_long", send_long)
    path, address = tiny_checkpoint(arch), arch_servers.address(arch, transport)
    reference, split = make_pair(path, address, method, arch)
    try:
        lane = split.symbiosis_transport._conn.lane
        assert lane is not None and lane.max_payload_bytes == 8 * 1024
        input_ids = torch.randint(3, 200, (4, 32), generator=torch.Generator().manual_seed(2))
        assert_matches_reference(loss_and_grads(split, input_ids), loss_and_grads(reference, input_ids), **TOL)
        with torch.no_grad():
            ref_tokens = reference.generate(input_ids=input_ids, max_new_tokens=4, do_sample=False)
            tokens = split.generate(input_ids=input_ids, max_new_tokens=4, do_sample=False)
        assert torch.equal(tokens, ref_tokens)
        assert lane.calls > 0 and long_calls["sent"] > 0  # the calls did travel as long messages
    finally:
        close_client(split)
