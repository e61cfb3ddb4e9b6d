"""The lone client's fast path on a lane (``symbiosis/transport/lane_routes.py``) against a real
``BaseExecutor``: the same results as the executor computes in-process, the product really taken
on the fast path, and every request the fast path cannot vouch for sent the general way -- which
answers it, or refuses it with the same typed error as before.

The fakes in ``fakes.py`` cannot be driven (no ``try_alone``), so the fast path never runs there;
these tests are its coverage. Small shared-memory calls riding the lane inline are checked here too.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import types
from collections.abc import Iterator

import pytest
import torch

from symbiosis import protocol as P
from symbiosis.errors import ExecutorUnavailableError, ProtocolError, ShapeError, UnknownLayerError
from symbiosis.executor.executor import BaseExecutor
from symbiosis.executor.scheduler import SchedulerConfig
from symbiosis.executor.weights import BaseModelWeights, LayerWeights
from symbiosis.transport.schemes import open_transport
from symbiosis.vocabulary import LatencyClass, LayerSpec, Op

from .fakes import assert_same_product

SPECS = {
    "q": LayerSpec("q", 32, 48, has_bias=True),
    "o": LayerSpec("o", 48, 32, has_bias=False),
    "wide": LayerSpec("wide", 32, 4096, has_bias=False),  # 2 rows: 32 KiB of result
}


# Holds every request for the other joined clients (up to 1 ms): with a peer, every call is queued.
QUEUED = SchedulerConfig(policy="lockstep", lockstep_timeout_ms=1.0)


@pytest.fixture
def executor(request: pytest.FixtureRequest) -> Iterator[BaseExecutor]:
    """An executor over ``SPECS``, with the scheduler config the test asks for (indirect
    parametrization; default: the default config)."""
    generator = torch.Generator().manual_seed(0)
    layers = {
        name: LayerWeights(
            torch.randn(s.out_features, s.in_features, generator=generator),
            torch.randn(s.out_features, generator=generator) if s.has_bias else None,
        )
        for name, s in SPECS.items()
    }
    config = getattr(request, "param", None) or SchedulerConfig()
    service = BaseExecutor(BaseModelWeights(SPECS, layers, "fast-path-test", "test"), config)
    yield service
    service.close(drain=False)


@pytest.fixture
def addresses(executor: BaseExecutor) -> Iterator[dict[str, str]]:
    folder = tempfile.mkdtemp(prefix="symb-fast-")
    ipc = executor.serve(f"ipc://{folder}/executor.sock").address
    tcp = executor.serve("tcp://127.0.0.1:0").address
    yield {"ipc": ipc, "tcp": tcp, "shm": f"shm+{ipc}"}
    shutil.rmtree(folder, ignore_errors=True)


def alone_batches(executor: BaseExecutor) -> int:
    return executor.stats()["batches_run_by"]["alone"]


@pytest.mark.parametrize("kind", ["ipc", "tcp", "shm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lone_client_calls_are_exact_and_served_at_once(
    executor: BaseExecutor, addresses: dict[str, str], kind: str, dtype: torch.dtype
) -> None:
    with open_transport(addresses[kind]) as transport:
        lane = transport._conn.lane
        assert lane is not None
        before, made = alone_batches(executor), []
        for layer in ("q", "o"):
            for op in Op:
                for n in (1, 3):
                    rows = torch.randn(n, op.input_width(SPECS[layer])).to(dtype)
                    got = transport.call(layer, op, rows, LatencyClass.DECODE)
                    made.append((layer, op, rows, got.clone()))
                    got.add_(1)  # a tensor of its own, writable
        assert lane.calls == len(made)  # every call took the lane (shm: small calls ride it inline)
        assert alone_batches(executor) - before == len(made)  # ... and was computed at once, not queued
        routes = [key for server in executor._servers for key in server._lane_routes._routes]
        assert {(layer, op.value) for layer, op, _, _ in made} <= {key[:2] for key in routes}  # by the fast path
    for layer, op, rows, got in made:  # references afterwards: ``run`` is a client too (no longer alone)
        assert_same_product(got, executor.run(layer, op, rows), (layer, op, rows.shape))


@pytest.mark.parametrize("kind", ["ipc", "tcp"])
@pytest.mark.parametrize(
    ("executor", "joined"), [(None, False), (QUEUED, True)], ids=["alone", "joined"], indirect=["executor"]
)
def test_invalid_requests_get_their_typed_errors(
    executor: BaseExecutor, addresses: dict[str, str], kind: str, joined: bool
) -> None:
    """Alone, and with another client joined under a rule that holds every request for it (its
    calls are queued, not served at once: the short path skips only the checks its route made),
    every invalid request gets its typed error."""
    with contextlib.ExitStack() as stack:
        transport = stack.enter_context(open_transport(addresses[kind]))
        peer = stack.enter_context(open_transport(addresses["ipc"])) if joined else None

        def peer_active() -> None:
            """The peer calls between the checks: the executor serves two clients."""
            if peer is not None:
                peer.call("q", Op.FORWARD, torch.randn(1, 32), LatencyClass.DECODE)

        transport.call("q", Op.FORWARD, torch.randn(1, 32), LatencyClass.DECODE)  # both sent: neither is idle
        peer_active()
        before = alone_batches(executor)
        with pytest.raises(ShapeError):
            transport.call("q", Op.FORWARD, torch.randn(2, 31), LatencyClass.DECODE)
        peer_active()
        with pytest.raises(UnknownLayerError):
            transport.call("nope", Op.FORWARD, torch.randn(2, 32), LatencyClass.DECODE)
        peer_active()
        with pytest.raises(ProtocolError):
            transport.call("q", Op.FORWARD, torch.randn(2, 32, dtype=torch.float64), LatencyClass.DECODE)
        lane = transport._conn.lane
        # A header whose shape does not match its payload (no client sends this; a hostile one may).
        header = P.encode(
            P.Request(P.PROTOCOL_VERSION, transport.client_id, 10**6, "q", "forward", "float32", [2, 32], "decode")
        )
        peer_active()
        reply, _ = lane.exchange(header, P.tensor_payload(torch.randn(1, 32)), 10**6, 0, 5.0)
        assert not reply.ok and reply.error_code == ShapeError.code
        header = P.encode(
            P.Request(P.PROTOCOL_VERSION, "someone-else", 10**6 + 1, "q", "forward", "float32", [1, 32], "decode")
        )
        peer_active()
        reply, _ = lane.exchange(header, P.tensor_payload(torch.randn(1, 32)), 10**6 + 1, 0, 5.0)
        assert not reply.ok and reply.error_code == ProtocolError.code
        # A result too large for one lane message: the short path leaves it to the general one,
        # which sends it back as a long message (``lane.py``).
        n = lane.max_message_bytes // (4 * SPECS["wide"].out_features) + 1
        header = P.encode(
            P.Request(
                P.PROTOCOL_VERSION, transport.client_id, 10**6 + 2, "wide", "forward", "float32", [n, 32], "decode"
            )
        )
        rows = torch.randn(n, 32)
        out_nbytes = 4 * n * SPECS["wide"].out_features
        peer_active()
        reply, payload = lane.exchange(header, P.tensor_payload(rows), 10**6 + 2, out_nbytes, 5.0)
        assert reply.ok and payload.nbytes == out_nbytes
        got = P.tensor_from_payload(payload, "float32", reply.shape)
        assert_same_product(got, executor.run("wide", Op.FORWARD, rows))
        rows = torch.randn(2, 32)  # and the session goes on
        peer_active()
        assert_same_product(
            transport.call("q", Op.FORWARD, rows, LatencyClass.DECODE), executor.run("q", Op.FORWARD, rows)
        )
        assert (alone_batches(executor) == before) == joined  # with a peer: queued, never served alone


@pytest.mark.parametrize("kind", ["ipc", "tcp", "shm"])
@pytest.mark.parametrize(
    ("executor", "at_once"),
    [(SchedulerConfig(policy="immediate"), True), (QUEUED, False)],
    ids=["immediate", "lockstep"],
    indirect=["executor"],
)
def test_two_active_clients_are_queued_only_where_the_rule_would_hold_their_requests(
    executor: BaseExecutor, addresses: dict[str, str], kind: str, at_once: bool
) -> None:
    """Two clients calling in turn, nothing pending at each call: a rule that holds a request for
    no one (``immediate``) has them served at once, without the queue; one that holds it for the
    other client (lockstep) queues them (``Scheduler.serves_at_once``). Exact either way."""
    other = "tcp" if kind == "ipc" else "ipc"
    with open_transport(addresses[kind]) as first, open_transport(addresses[other]) as second:
        for transport in (first, second):
            transport.call("q", Op.FORWARD, torch.randn(1, 32), LatencyClass.DECODE)
        before = alone_batches(executor)
        made = []
        for transport in (first, second, first):
            rows = torch.randn(3, 32)
            made.append((rows, transport.call("q", Op.FORWARD, rows, LatencyClass.DECODE).clone()))
        assert first._conn.lane.calls == 3 and second._conn.lane.calls == 2
        assert alone_batches(executor) - before == (3 if at_once else 0)
    for rows, got in made:
        assert_same_product(got, executor.run("q", Op.FORWARD, rows))


def test_shared_memory_small_calls_inline_large_calls_in_segments(
    executor: BaseExecutor, addresses: dict[str, str]
) -> None:
    with open_transport(addresses["shm"], inline_threshold=24 << 10) as transport:
        small, large = torch.randn(1, 32), torch.randn(2, 32)  # results of 16 KiB / 32 KiB on "wide"
        assert_same_product(
            transport.call("wide", Op.FORWARD, small, LatencyClass.DECODE), executor.run("wide", Op.FORWARD, small)
        )
        assert not transport._free and transport._conn.lane.calls == 1  # inline: no segment made
        assert_same_product(
            transport.call("wide", Op.FORWARD, large, LatencyClass.DECODE), executor.run("wide", Op.FORWARD, large)
        )
        assert len(transport._free) == 1  # through a segment, back in the pool
    with open_transport(addresses["shm"], inline_threshold=0) as transport:
        assert_same_product(
            transport.call("q", Op.FORWARD, small, LatencyClass.DECODE), executor.run("q", Op.FORWARD, small)
        )
        assert len(transport._free) == 1


def test_shared_memory_results_copied_out_anyway_ride_the_lane(
    executor: BaseExecutor, addresses: dict[str, str]
) -> None:
    """A result under ``HANDOUT_MIN_BYTES`` would be copied out of a segment anyway: such calls
    travel on the lane (as a long message where one lane message is shorter), not through a segment."""
    from symbiosis.transport.shm_client import HANDOUT_MIN_BYTES

    with open_transport(addresses["shm"]) as transport:
        lane = transport._conn.lane
        rows = torch.randn(20, 32)  # a result of 320 KiB on "wide" (a 16-sequence decode's gate/up: 256 KiB)
        assert 20 * 4096 * 4 < HANDOUT_MIN_BYTES
        got = transport.call("wide", Op.FORWARD, rows, LatencyClass.DECODE)
        assert_same_product(got, executor.run("wide", Op.FORWARD, rows))
        assert not transport._free and not transport._leased and lane.calls == 1  # no segment made


def test_an_executor_error_on_the_fast_path_reaches_the_client_typed(
    executor: BaseExecutor, addresses: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sharded executor's ``try_alone`` raises ``ExecutorUnavailableError`` for a dead rank: the
    client must get that error (and re-handshake), not a generic one."""

    def unavailable(*args: object, **kwargs: object) -> None:
        raise ExecutorUnavailableError("shard 1 of 2 is unavailable")

    with open_transport(addresses["ipc"], connect_timeout_s=0.5) as transport:
        monkeypatch.setattr(executor, "try_alone", unavailable)
        with pytest.raises(ExecutorUnavailableError, match="shard 1 of 2"):
            transport.call("q", Op.FORWARD, torch.randn(1, 32), LatencyClass.DECODE)


@pytest.mark.parametrize("kind", ["ipc", "shm", "tcp"])
def test_reused_slots_never_mix_one_call_with_another(
    executor: BaseExecutor, addresses: dict[str, str], kind: str
) -> None:
    """Lane calls are computed in views the server keeps (``LaneRoutes.slot``): the rows of the
    next call land where the last one's were, and every result is written to one reply buffer.
    Calls of row counts that come and go, on layers with and without a bias, each get their own
    product, and a result stays the caller's after later calls."""
    made = []
    with open_transport(addresses[kind]) as transport:
        for n in (1, 2, 1, 3, 2, 1, 1):
            for layer in ("q", "o"):
                rows = torch.randn(n, SPECS[layer].in_features)
                made.append((layer, rows, transport.call(layer, Op.FORWARD, rows, LatencyClass.DECODE)))
        slots = sum(
            len(server._lane_routes._slots) + sum(len(lane.slots) for lane in server._lanes.values())
            for server in executor._servers
        )
        assert slots == 6  # (q, o) x (1, 2, 3 rows): one each, made once and reused
    for layer, rows, got in made:
        assert_same_product(got, executor.run(layer, Op.FORWARD, rows), (layer, rows.shape))


def test_a_slot_views_the_payload_where_its_header_length_puts_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A message's payload starts after its header, rounded up to 64 bytes: requests of one route
    whose headers differ in length (here the client id; a growing request id does it too) get
    slots over different places, each holding exactly the rows sent. Past ``MAX_SLOTS`` all are
    dropped and made again as used."""
    from symbiosis.transport import lane_routes
    from symbiosis.transport.lane import frame, payload_start, split

    routes = lane_routes.LaneRoutes(dict(SPECS), P.Limits(), {})
    buffer = routes.receive_buffer
    same_host_lane = types.SimpleNamespace(stream=False)

    def slot_for(client_id: str, rows: torch.Tensor):
        req = P.Request(P.PROTOCOL_VERSION, client_id, 7, "q", "forward", "float32", list(rows.shape), "decode")
        header = P.encode(req)
        message = b"".join(bytes(part) for part in frame(header, P.tensor_payload(rows)))
        buffer[: len(message)] = message  # what the server's receive does
        _, payload = split(buffer[: len(message)])
        slot = routes.slot(routes.route(req), req, payload, len(header), 1 << 20, same_host_lane)
        assert slot is not None and torch.equal(slot.rows, rows)
        return slot, payload_start(len(header))

    rows = torch.randn(2, 32)
    short, short_start = slot_for("c", rows)
    long, long_start = slot_for("c" * 100, rows)
    assert short_start != long_start and short is not long
    again, _ = slot_for("c", torch.randn(2, 32))
    assert again is short  # the same place: the same views
    monkeypatch.setattr(lane_routes, "MAX_SLOTS", 3)
    for n in (1, 3, 4, 5):  # the fourth new slot drops the others
        slot_for("c", torch.randn(n, 32))
    assert len(routes._slots) <= 3
