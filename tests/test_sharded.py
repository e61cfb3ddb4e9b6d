"""The sharded executor (issue 12): clients see one executor, whatever the strategy and rank count.

Fast tests run the ranks as threads of this process (``sharding_helpers.ranks_in_threads``: real
links, real gloo groups, real ``ZmqServer``s); the slow ones start real rank processes through
``symbiosis serve --shards`` and ``torchrun`` and kill one.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import peft
import pytest
import torch

import symbiosis
from symbiosis.errors import ExecutorUnavailableError, UnknownLayerError
from symbiosis.executor.process import ExecutorProcess
from symbiosis.sharding.placement import STRATEGIES, Layout, place_units, row_range
from symbiosis.transport.zmq_client import ZmqTransport
from symbiosis.vocabulary import LayerSpec
from tests.reference import assert_matches_reference, close_client, loss_and_grads, make_pair
from tests.sharding_helpers import _train, finetune_or_decode_client, ranks_in_threads, resident_bytes, serve_all
from tests.test_more_architectures import TOP2_OF_4
from tests.test_more_architectures import checkpoint as moe_checkpoint

TOL = {"rtol": 1e-4, "atol": 1e-5}  # as tests/test_split_reference.py: another summation order, same model


# ---- placement (pure) -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sizes", "world_size", "owners"),
    [
        ([], 2, []),
        ([5], 3, [1]),  # the middle third holds its midpoint
        ([1, 1, 1, 1], 2, [0, 0, 1, 1]),
        ([1, 1, 1, 1], 4, [0, 1, 2, 3]),
        ([10, 1, 1, 1, 1], 2, [0, 1, 1, 1, 1]),
        ([1, 1, 1, 1, 10], 2, [0, 0, 0, 0, 1]),
        ([3, 3, 3], 4, [0, 2, 3]),  # more ranks than units: some own nothing
    ],
)
def test_units_go_to_contiguous_ranks_balanced_by_size(sizes, world_size, owners):
    assert place_units(sizes, world_size) == owners
    for rank in range(world_size):
        held = sum(size for size, owner in zip(sizes, owners) if owner == rank)
        assert held <= sum(sizes) / world_size + max(sizes, default=0)
    assert owners == sorted(owners)


@pytest.mark.parametrize(
    ("rows", "world_size", "ranges"),
    [
        (8, 2, [(0, 4, 4), (4, 8, 4)]),
        (5, 2, [(0, 3, 3), (3, 5, 3)]),
        (5, 4, [(0, 2, 2), (2, 4, 2), (4, 5, 2), (5, 5, 2)]),  # torch.chunk: the last rank gets nothing
        (1, 3, [(0, 1, 1), (1, 1, 1), (1, 1, 1)]),
    ],
)
def test_rows_are_split_as_fsdp_splits_a_parameter(rows, world_size, ranges):
    assert [row_range(rows, world_size, rank) for rank in range(world_size)] == ranges
    chunks = torch.arange(rows).chunk(world_size)
    for rank, (start, stop, _) in enumerate(ranges):
        want = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(range(start, stop)) == want


def test_layout_serves_the_groups_the_single_executor_serves():
    specs = {
        name: LayerSpec(name, 4, out, False)
        for name, out in [("a.q", 4), ("a.k", 2), ("a.v", 2), ("a.o", 4), ("m.up", 8), ("m.down", 4)]
    }
    specs["m.down"] = LayerSpec("m.down", 8, 4, False)
    layout = Layout(specs)
    assert [u.layer_ids for u in layout.units] == [("a.q", "a.k", "a.v", "a.o"), ("m.up",), ("m.down",)]
    assert layout.locate("a.k") == (0, 4, 6)
    assert layout.locate("a.q+a.k+a.v") == (0, 0, 8)
    assert layout.spec("a.k+a.v").out_features == 4
    assert layout.locate("a.q+a.v") is None  # not contiguous
    assert layout.locate("a.q+m.up") is None  # two units
    assert layout.locate("nope") is None


# ---- the reference checks over a real transport, ranks as threads ---------------------------------


def _check_reference(path, address: str, arch: str) -> None:
    reference, split = make_pair(path, address, "lora", arch)
    try:
        ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(1))
        assert_matches_reference(loss_and_grads(split, ids), loss_and_grads(reference, ids), **TOL)
        prompt = ids[:1, :5]
        with torch.no_grad():
            want = reference.generate(input_ids=prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
            got = split.generate(input_ids=prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert torch.equal(got, want)
    finally:
        close_client(split)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])  # gpt2: Conv1D and tied embeddings; gemma2: tied
@pytest.mark.slow
def test_sharded_executor_matches_monolithic(arch, world_size, strategy, tiny_checkpoint):
    """A client given rank 0's address, as for one executor: under ``layers`` it sends each layer
    to the rank that runs it (routes in the Welcome); under ``fsdp`` rank 0 gathers every layer."""
    path = tiny_checkpoint(arch)
    with ranks_in_threads(path, world_size, strategy) as ranks:
        _check_reference(path, serve_all(ranks), arch)
        # Each rank counts a gather once its own part of the collective returns, which may be a
        # moment after the client had its last reply: read until the counts settle.
        deadline = time.monotonic() + 5
        while True:
            per_rank = ranks[0].stats()["shards"]
            counts = {s["shard"]["gathers"]["gathers"] for s in per_rank if s["shard"]["gathers"]}
            if len(counts) <= 1 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
    shards = [s["shard"] for s in per_rank]
    assert [s["rank"] for s in shards] == list(range(world_size)) and all(s["up"] for s in shards)
    assert all(s["relayed_requests"] == 0 for s in shards)  # nothing needed a relay
    if strategy == "layers":  # each rank ran its own layers' requests, straight from the client
        served = [sum(c["requests"] for c in s["layers"].values()) for s in per_rank]
        assert all(n > 0 for n, s in zip(served, shards) if s["owned_layers"])
    else:  # every rank took part in every gather
        assert len({s["gathers"]["gathers"] for s in shards}) == 1 and shards[0]["gathers"]["gathers"] > 0


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.slow
def test_a_sharded_executor_serves_moe_experts(strategy, tmp_path):
    """Each expert's matrix is a layer (``layers``: placed whole on a rank; ``fsdp``: its rows split
    like any layer's, read from the experts tensor that transformers' converter joins)."""
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    path = moe_checkpoint(tmp_path, "mixtral", TOP2_OF_4)
    with ranks_in_threads(path, 2, strategy) as ranks:
        reference, split = make_pair(path, serve_all(ranks), config, "mixtral")
        try:
            ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(1))
            assert_matches_reference(loss_and_grads(split, ids), loss_and_grads(reference, ids), **TOL)
        finally:
            close_client(split)


@pytest.mark.parametrize("scheme", ["ipc", "shm+ipc", "dist+tcp"])
@pytest.mark.slow
def test_routes_keep_the_clients_transport(scheme, tiny_checkpoint, tmp_path):
    """A client of ``shm+ipc://`` or ``dist+tcp://`` reaches the other ranks the same way."""
    path = tiny_checkpoint("llama")
    bind = f"ipc://{tmp_path}/entry.sock" if "ipc" in scheme else "tcp://127.0.0.1:0"
    with ranks_in_threads(path, 2, "layers") as ranks:
        address = serve_all(ranks, bind)
        address = scheme + address[address.index("://") :]
        reference, split = make_pair(path, address, "lora", "llama")
        try:
            connections = split.get_base_model().symbiosis_transport.connections()
            assert len(connections) == 2 and type(connections[0]) is type(connections[1])  # same scheme to rank 1
            ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(1))
            assert_matches_reference(loss_and_grads(split, ids), loss_and_grads(reference, ids), **TOL)
        finally:
            close_client(split)
        assert ranks[0].local_stats()["shard"]["relayed_requests"] == 0


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.slow
def test_a_client_that_ignores_routes_is_relayed(world_size, tiny_checkpoint):
    """A plain connection to rank 0 (no routing, as an older client would be): rank 0 relays the
    other ranks' layers, and the results are the same."""
    path = tiny_checkpoint("llama")
    with ranks_in_threads(path, world_size, "layers") as ranks:
        address = serve_all(ranks)
        _check_reference(path, ZmqTransport(address), "llama")
        shards = [s["shard"] for s in ranks[0].stats()["shards"]]
    assert shards[0]["relayed_requests"] > 0
    assert all(s["served_for_peers"] > 0 for s in shards[1:] if s["owned_layers"])


@pytest.mark.slow
def test_a_failed_route_falls_back_to_the_entry(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    with ranks_in_threads(path, 2, "layers") as ranks:
        address = serve_all(ranks)
        reference, split = make_pair(path, address, "lora", "llama")
        transport = split.get_base_model().symbiosis_transport
        assert len(transport.routed_addresses()) == 1
        transport.connect_timeout_s = 0.5
        ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(1))
        ranks[1].close_servers(drain=False)  # rank 1 stops serving clients; its links stay up
        assert_matches_reference(loss_and_grads(split, ids), loss_and_grads(reference, ids), **TOL)
        assert transport.routed_addresses() == []  # rank 1's layers now go through rank 0
        assert ranks[0].local_stats()["shard"]["relayed_requests"] > 0
        close_client(split)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.slow
def test_a_client_of_another_rank_is_served_alike(strategy, tiny_checkpoint):
    """The paper's "client talks to its local shard": any rank's endpoint serves the whole model."""
    path = tiny_checkpoint("llama")
    with ranks_in_threads(path, 3, strategy) as ranks:
        server = ranks[2].serve("tcp://127.0.0.1:0")
        _check_reference(path, server.address, "llama")


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world_size", [2, 4])
def test_each_rank_holds_its_share_of_the_weights(strategy, world_size, tiny_checkpoint):
    path = tiny_checkpoint("llama")
    with symbiosis.BaseExecutor.from_pretrained(path) as single:
        total = single.weights.nbytes()
    largest_unit = max(u.numel for u in Layout(single.layer_specs()).units) * 4
    with ranks_in_threads(path, world_size, strategy) as ranks:
        held = [resident_bytes(rank) for rank in ranks]
        reported = [rank.local_stats()["shard"]["resident_weight_bytes"] for rank in ranks]
    assert held == reported
    for nbytes in held:
        assert nbytes <= total / world_size + largest_unit, (held, total)
    if strategy == "layers":
        assert sum(held) == total  # every weight on exactly one rank
    else:
        assert total <= sum(held) <= total + world_size * largest_unit / 8  # padding rows only


def test_unknown_layers_and_bad_rows_get_typed_errors(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    with ranks_in_threads(path, 2, "layers") as ranks:
        with pytest.raises(UnknownLayerError):
            ranks[0].submit("c", "model.layers.0.nope", "forward", torch.randn(1, 64), "decode")
        remote_layer = next(layer for layer in ranks[0].layer_specs() if ranks[0].owner_of(layer) == 1)
        with pytest.raises(symbiosis.errors.ShapeError):
            ranks[0].submit("c", remote_layer, "forward", torch.randn(1, 3), "decode")
        # and the executor still serves
        spec = ranks[0].layer_specs()[remote_layer]
        assert ranks[0].run(remote_layer, "forward", torch.randn(2, spec.in_features)).shape == (2, spec.out_features)


@pytest.mark.slow
def test_a_dead_rank_is_named_to_clients(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    with ranks_in_threads(path, 2, "layers") as ranks:
        server = ranks[0].serve("tcp://127.0.0.1:0")
        transport = ZmqTransport(server.address, connect_timeout_s=1.0)
        model = symbiosis.load_client_model(path, executor=transport)
        ids = torch.tensor([[1, 2, 3]])
        model(input_ids=ids)
        ranks[1].links.close()  # rank 1's sockets close, as a killed process's do
        with pytest.raises(ExecutorUnavailableError, match="shard 1 of 2 .* is unavailable"):
            model(input_ids=ids)
        assert ranks[0].health()["status"] == "unavailable"
        transport.close()


# ---- real processes --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:  # 503 carries the same JSON
        return json.loads(exc.read())


@pytest.mark.slow
def test_shards_launcher_serves_reports_every_shard_and_names_a_dead_one(tiny_checkpoint):
    """``serve --shards 2 --shard-strategy fsdp``: a remote client matches the monolithic model,
    /health lists both ranks; rank 1 killed with no restart left: the client's call fails with an
    error naming shard 1, and the launcher exits non-zero (never hangs).

    Rank 0 gets SIGTERM right after the kill, as the launcher's elastic agent sends it within 0.1 s
    of a rank's death: when that signal came before rank 0 had seen the death, it stopped cleanly
    and the client found no executor ("no executor answered": once in a full -n 2 run on
    2026-12-06; 2 of 2 with the signal sent at once, before ``sharding.serve.FAILURE_GRACE_S``)."""
    path = tiny_checkpoint("gpt2")
    extra = ["--shards", "2", "--shard-strategy", "fsdp", "--max-restarts", "0", "--failure-linger-s", "5"]
    executor = ExecutorProcess(path, ["tcp://127.0.0.1:0"], extra_args=extra, metrics=True, timeout_s=180)
    try:
        _check_reference(path, executor.address, "gpt2")
        health = _get_json(executor.info.metrics_url + "/health")
        assert health["status"] == "ok" and [s["rank"] for s in health["shards"]] == [0, 1]
        assert health["shards"][0]["pid"] == executor.info.pid
        transport = ZmqTransport(executor.address, connect_timeout_s=2.0)
        model = symbiosis.load_client_model(path, executor=transport)
        os.kill(health["shards"][1]["pid"], signal.SIGKILL)
        os.kill(health["shards"][0]["pid"], signal.SIGTERM)  # the launcher's answer, at once
        with pytest.raises(ExecutorUnavailableError, match="shard 1 of 2"):
            for _ in range(50):
                model(input_ids=torch.tensor([[1, 2, 3]]))
        transport.close()
        assert executor.wait(timeout_s=60) != 0
    finally:
        executor.close()


@pytest.mark.slow
def test_torchrun_four_ranks_serve_four_client_processes(tiny_checkpoint, tmp_path):
    """``torchrun --nproc-per-node 4 -m symbiosis serve``: two client processes fine-tune and two
    decode at once, each equal to the monolithic model doing the same."""
    path = tiny_checkpoint("llama")
    address = f"ipc://{tmp_path}/sharded.sock"
    ready = tmp_path / "ready.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "4",
        "--master-port",
        str(_free_port()),
    ]
    command += ["-m", "symbiosis", "serve", str(path), "--bind", address, "--ready-file", str(ready)]
    ranks = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    try:
        deadline = time.monotonic() + 180
        while not ready.exists():
            assert ranks.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.1)
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        roles = [("finetune", 1), ("finetune", 2), ("decode", 3), ("decode", 4)]
        clients = [
            ctx.Process(target=finetune_or_decode_client, args=(str(path), address, role, seed, results))
            for role, seed in roles
        ]
        for client in clients:
            client.start()
        outcomes = [results.get(timeout=300) for _ in clients]
        for client in clients:
            client.join(timeout=30)
    finally:
        ranks.send_signal(signal.SIGTERM)
        ranks.wait(timeout=60)
    assert sorted((role, seed) for role, seed, _, _ in outcomes) == sorted(roles)
    for role, seed, ok, detail in outcomes:
        assert ok, (role, seed, detail)


@pytest.mark.slow
def test_a_killed_rank_is_restarted_and_training_resumes_exactly(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    with symbiosis.BaseExecutor.from_pretrained(path) as local:
        _, model = make_pair(path, local, "lora", "llama")
        uninterrupted = _train(model, 6, seed=5)
        close_client(model)
    address = f"tcp://127.0.0.1:{_free_port()}"  # a fixed port: the restarted group binds it again
    extra = ["--shards", "2", "--max-restarts", "1"]
    executor = ExecutorProcess(path, [address], extra_args=extra, metrics=True, timeout_s=180)
    try:
        first_pids = [s["pid"] for s in _get_json(executor.info.metrics_url + "/health")["shards"]]
        _, remote = make_pair(path, address, "lora", "llama")
        transport = remote.get_base_model().symbiosis_transport
        transport.connect_timeout_s = 120.0  # the whole group restarts: seconds of imports and loading
        calls = {"n": 0}
        real_call = transport.call

        def call(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 40:  # mid-training (a step is about 30 calls): in flight or refused
                threading.Thread(target=os.kill, args=(first_pids[1], signal.SIGKILL)).start()
            return real_call(*args, **kwargs)

        transport.call = call
        resumed = _train(remote, 6, seed=5)
        close_client(remote)
        restarted = json.loads(executor.ready_file.read_text())  # rewritten by the new group's rank 0
        assert restarted["pid"] not in first_pids, "the group was not restarted"
    finally:
        executor.close()
    # Close, not equal, as in tests/test_service.py: a lost, doubled or stale step moves the adapters
    # by a whole update (about 4e-4), hundreds of times atol.
    for name, value in uninterrupted.items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-5, atol=1e-6)
