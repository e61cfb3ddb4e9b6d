"""One request for the rows of several experts (``expert_rows``: symbiosis/executor/expert_rows.py).

A split MoE model's experts module runs transformers' grouped forward, whose product over all the
experts its tokens chose is one executor request per experts tensor (and one for its backward),
where it was one per expert. The executor serves each expert's rows with that expert's own layer,
and refuses what does not add up with typed errors, staying up. Exactness of whole models over
every transport: tests/test_more_architectures.py, tests/test_split_reference.py.
"""

from __future__ import annotations

import collections
import threading
import time

import numpy
import pytest
import torch
from transformers import AutoModelForCausalLM

import symbiosis
from symbiosis.errors import ProtocolError, ShapeError, UnknownLayerError
from symbiosis.executor.executor import BaseExecutor
from symbiosis.transport.zmq_client import ZmqTransport
from symbiosis.vocabulary import LatencyClass, Op
from tests.reference import close_client
from tests.sharding_helpers import ranks_in_threads, serve_all
from tests.test_moe_experts import mixtral_checkpoint
from tests.test_more_architectures import SERVED_EXPERTS, checkpoint

TENSOR = "model.layers.0.mlp.experts.gate_up_proj"
IDS = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]])


def expert(e: int) -> str:
    return f"{TENSOR}.{e}"


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A tiny Mixtral checkpoint (4 experts, top 2), an executor of it and its tcp address."""
    path = mixtral_checkpoint(tmp_path_factory.mktemp("mixtral"))
    with BaseExecutor.from_pretrained(path) as executor:
        server = executor.serve("tcp://127.0.0.1:0")
        try:
            yield path, executor, server.address
        finally:
            server.close()


@pytest.fixture
def transport(mixtral):
    connection = ZmqTransport(mixtral[2])
    yield connection
    connection.close()


def rows_for(executor, op: Op, counts) -> torch.Tensor:
    spec = executor.layer_specs()[expert(0)]
    return torch.randn(sum(counts), op.input_width(spec), generator=torch.Generator().manual_seed(sum(counts)))


def one_by_one(executor, op: Op, rows: torch.Tensor, counts) -> torch.Tensor:
    pieces, start = [], 0
    for e, n in enumerate(counts):
        if n:
            pieces.append(executor.run(expert(e), op, rows[start : start + n]))
        start += n
    return torch.cat(pieces)


COUNTS = [[3, 0, 2, 1], [0, 4], [0, 0, 0, 5], [1]]


@pytest.mark.parametrize("op", [Op.FORWARD, Op.BACKWARD])
@pytest.mark.parametrize("counts", COUNTS, ids=str)
def test_a_request_for_several_experts_rows_is_each_experts_product(mixtral, transport, op, counts):
    """In-process (served alone), queued (``submit``: each expert's rows a request of its own,
    answered together) and over tcp: what each expert's own request gives."""
    _, executor, _ = mixtral
    rows = rows_for(executor, op, counts)
    expected = one_by_one(executor, op, rows, counts)
    alone = executor.call("alone", TENSOR, op, rows, LatencyClass.DECODE, expert_rows=counts)
    queued = executor.submit("queued", TENSOR, op, rows, LatencyClass.FINETUNE, expert_rows=counts).result(30)
    remote = transport.call_expert_rows(TENSOR, counts, op, rows, LatencyClass.DECODE)
    for result in (alone, queued, remote):
        torch.testing.assert_close(result, expected, atol=1e-6, rtol=1e-6)


def test_parts_from_several_clients_are_answered_each_with_its_own_rows(mixtral):
    """Queued from threads of two clients at once: every part completes its own request."""
    _, executor, _ = mixtral
    counts = [[2, 3, 0, 1], [0, 1, 4, 2]]
    rows = [rows_for(executor, Op.FORWARD, c) for c in counts]
    futures = [
        executor.submit(f"client-{i}", TENSOR, Op.FORWARD, rows[i], LatencyClass.DECODE, expert_rows=counts[i])
        for i in range(2)
    ]
    for i, future in enumerate(futures):
        expected = one_by_one(executor, Op.FORWARD, rows[i], counts[i])
        torch.testing.assert_close(future.result(30), expected, atol=1e-6, rtol=1e-6)


def test_an_in_process_callers_parts_wait_together_beside_another_client(tmp_path):
    """In-process, a caller not alone was served one expert after another: each part a call of
    its own, queued only once the one before was done, so each waited its own turn (for other
    clients' rows of its expert, or a policy's timeout). Every part is queued at once now and
    batched with the other client's rows for its expert: one wait."""
    path = mixtral_checkpoint(tmp_path)
    counts = [1, 2, 0, 1]
    with BaseExecutor.from_pretrained(path, policy="lockstep", lockstep_timeout_ms=10_000) as executor:
        executor.register_client("a")
        executor.register_client("b")
        rows = rows_for(executor, Op.FORWARD, counts)
        result = {}
        caller = threading.Thread(
            target=lambda: result.update(
                a=executor.call("a", TENSOR, Op.FORWARD, rows, LatencyClass.DECODE, expert_rows=counts)
            )
        )
        caller.start()
        scheduler = executor._engine.scheduler
        deadline = time.monotonic() + 5
        while scheduler.pending_rows() < sum(counts) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert scheduler.pending_rows() == sum(counts)  # (before: the first part's row alone)
        others = [executor.submit("b", expert(e), Op.FORWARD, rows[:1], LatencyClass.DECODE) for e in (0, 1, 3)]
        caller.join(10)
        assert [f.result(10).shape[0] for f in others] == [1, 1, 1]
        layers = executor.stats()["layers"]
        assert [layers[expert(e)]["batches"] for e in (0, 1, 3)] == [1, 1, 1]  # (each part with b's rows)
        executor.unregister_client("a")
        executor.unregister_client("b")
        torch.testing.assert_close(result["a"], one_by_one(executor, Op.FORWARD, rows, counts), atol=1e-6, rtol=1e-6)


BAD = {
    "sum": (TENSOR, [2, 2], 3, ShapeError),
    "negative": (TENSOR, [4, -1], 3, ShapeError),
    "too_many_counts": (TENSOR, [1, 1, 1, 1, 1], 5, ShapeError),
    "not_experts": ("model.layers.0.self_attn.q_proj", [3], 3, UnknownLayerError),
    "no_counts": (TENSOR, [], 3, ShapeError),
}


@pytest.mark.parametrize("case", BAD)
def test_what_does_not_add_up_is_refused_with_a_typed_error_and_the_executor_stays_up(mixtral, transport, case):
    _, executor, _ = mixtral
    layer_id, counts, n, error = BAD[case]
    rows = torch.randn(n, executor.layer_specs()[expert(0)].in_features)
    with pytest.raises(error):
        executor.call("c", layer_id, Op.FORWARD, rows, LatencyClass.DECODE, expert_rows=counts)
    with pytest.raises(error):
        if counts:
            transport.call_expert_rows(layer_id, counts, Op.FORWARD, rows, LatencyClass.DECODE)
        else:  # (an experts tensor named in a plain request)
            transport.call(layer_id, Op.FORWARD, rows, LatencyClass.DECODE)
    good = rows_for(executor, Op.FORWARD, [1, 2])
    torch.testing.assert_close(
        transport.call_expert_rows(TENSOR, [1, 2], Op.FORWARD, good, LatencyClass.DECODE),
        one_by_one(executor, Op.FORWARD, good, [1, 2]),
        atol=1e-6,
        rtol=1e-6,
    )


def test_counts_of_numpy_or_torch_integers_are_taken_and_others_refused_leaving_the_transport_usable(
    mixtral, transport
):
    """A header that failed to encode (counts msgspec cannot carry) left the lane taken: the next
    call went the slow way and ``close()`` hung."""
    _, executor, _ = mixtral
    rows = rows_for(executor, Op.FORWARD, [1, 2])
    expected = one_by_one(executor, Op.FORWARD, rows, [1, 2])
    for counts in (numpy.array([1, 2]), torch.tensor([1, 2]), (numpy.int64(1), 2)):
        got = transport.call_expert_rows(TENSOR, counts, Op.FORWARD, rows, LatencyClass.DECODE)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
        got = executor.call("c", TENSOR, Op.FORWARD, rows, LatencyClass.DECODE, expert_rows=counts)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    for counts in ([1.0, 2.0], [2**64, 0], ["1", "2"]):
        with pytest.raises(ShapeError):
            transport.call_expert_rows(TENSOR, counts, Op.FORWARD, rows, LatencyClass.DECODE)
        with pytest.raises(ShapeError):
            executor.call("c", TENSOR, Op.FORWARD, rows, LatencyClass.DECODE, expert_rows=counts)
    assert not transport._conn.lane.lock.locked()
    transport.call_expert_rows(TENSOR, [1, 2], Op.FORWARD, rows, LatencyClass.DECODE)


def test_a_lone_clients_request_gives_the_bits_of_one_request_per_expert(tmp_path):
    """Served at once, each expert's rows are aligned as a batch's are: at a width whose rows are
    not a multiple of 64 bytes a slice of the request's rows is not aligned, and the product of
    unaligned rows differed in the last bits (2 of 20 requests, ~1e-7) from the queued path's."""
    options = dict(num_local_experts=4, hidden_size=130, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    path = checkpoint(tmp_path, "mixtral", options | dict(num_experts_per_tok=2, intermediate_size=56))
    with BaseExecutor.from_pretrained(path) as executor:
        server = executor.serve("tcp://127.0.0.1:0")
        connection = ZmqTransport(server.address)
        try:
            width = executor.layer_specs()[expert(0)].in_features
            for seed in range(20):
                generator = torch.Generator().manual_seed(seed)
                counts = torch.randint(1, 6, (4,), generator=generator).tolist()
                rows = torch.randn(sum(counts), width, generator=generator)
                alone = connection.call_expert_rows(TENSOR, counts, Op.FORWARD, rows, LatencyClass.DECODE)
                pieces, start = [], 0
                for e, n in enumerate(counts):
                    part = rows[start : start + n].contiguous()
                    pieces.append(connection.call(expert(e), Op.FORWARD, part, LatencyClass.DECODE))
                    start += n
                assert torch.equal(alone, torch.cat(pieces)), counts
        finally:
            connection.close()
            server.close()


def test_a_request_submitted_under_inference_mode_is_answered_by_the_executors_threads(mixtral):
    """Its joined result was an inference tensor, which the threads running its parts (outside
    inference mode) could not write into."""
    _, executor, _ = mixtral
    executor.register_client("x")
    executor.register_client("y")  # (two clients: the parts are queued, run by another thread)
    try:
        counts = [1, 2, 2, 1]
        rows = rows_for(executor, Op.FORWARD, counts)
        with torch.inference_mode():
            future = executor.submit("x", TENSOR, Op.FORWARD, rows, LatencyClass.FINETUNE, expert_rows=counts)
        expected = one_by_one(executor, Op.FORWARD, rows, counts)
        torch.testing.assert_close(future.result(30), expected, atol=1e-6, rtol=1e-6)
    finally:
        executor.unregister_client("x")
        executor.unregister_client("y")


def counted_calls(model) -> collections.Counter:
    """Calls of the model's transport, by kind (``call``, ``call_expert_rows``), from now on."""
    transport = model.symbiosis_transport
    counts: collections.Counter = collections.Counter()
    for kind in ("call", "call_expert_rows"):
        original = getattr(transport, kind)

        def counting(*args, _original=original, _kind=kind, **kwargs):
            counts[_kind] += 1
            return _original(*args, **kwargs)

        setattr(transport, kind, counting)
    return counts


def loss_and_input_grad(model):
    embeddings = model.get_input_embeddings()(IDS).detach().requires_grad_()
    loss = model(inputs_embeds=embeddings, labels=IDS).loss
    loss.backward()
    return loss.detach(), embeddings.grad


def test_a_split_moe_model_asks_once_per_experts_tensor_each_way(mixtral, monkeypatch):
    """Forward and backward of 16 tokens (top 2 of 4 experts: several experts each): one request
    per experts tensor and way; with an executor that does not take them, one per expert, and
    the same loss and gradients."""
    path, _, address = mixtral
    model = symbiosis.load_client_model(path, executor=address)
    try:
        calls = counted_calls(model)
        grouped = loss_and_input_grad(model)
        layers = model.config.num_hidden_layers
        assert calls["call_expert_rows"] == 2 * 2 * layers  # (gate_up and down, forward and backward)
        monkeypatch.setattr(ZmqTransport, "serves_expert_rows", property(lambda self: False))
        calls.clear()
        one_by_one_ = loss_and_input_grad(model)
        assert calls["call_expert_rows"] == 0 and calls["call"] > 2 * 2 * 2 * layers
        torch.testing.assert_close(grouped, one_by_one_, atol=1e-6, rtol=1e-5)
    finally:
        close_client(model)


def test_activation_noise_sees_each_experts_calls(mixtral):
    """A wrapped link (activation noise) must see its own layer's calls: one request per expert."""
    path, _, address = mixtral
    model = symbiosis.load_client_model(path, executor=address)
    try:
        calls = counted_calls(model)
        with symbiosis.enable_activation_noise(model, seed=0), torch.no_grad():
            model(IDS)
        assert calls["call_expert_rows"] == 0 and calls["call"] > 0
    finally:
        close_client(model)


def test_a_sharded_executor_says_it_takes_none_and_refuses_them(tmp_path):
    """Its experts may lie on several ranks: clients call each expert (exact:
    tests/test_sharded.py::test_a_sharded_executor_serves_moe_experts)."""
    path = mixtral_checkpoint(tmp_path)
    with ranks_in_threads(path, 2, "layers") as ranks:
        transport = ZmqTransport(serve_all(ranks))
        try:
            transport.layer_specs()
            assert transport.serves_expert_rows is False
            rows = torch.randn(2, transport.layer_specs()[expert(0)].in_features)
            with pytest.raises(ProtocolError, match="expert_rows"):
                transport.call_expert_rows(TENSOR, [1, 1], Op.FORWARD, rows, LatencyClass.DECODE)
            assert transport.call(expert(0), Op.FORWARD, rows, LatencyClass.DECODE).shape[0] == 2
        finally:
            transport.close()


def test_llama4s_experts_send_only_the_rows_their_router_chose(tmp_path, monkeypatch):
    """llama4's experts (not the standard module) give every expert every row, zeros where its
    router did not choose it; they were kept in every client. Served now: each tensor's product
    is one request of the chosen rows alone (16 tokens, top 1 of 4: 16 rows, where the monolithic
    model multiplies 64), its backward one of the rows whose gradient is not zero; the same loss
    and gradients as one request per expert and as the monolithic model
    (tests/test_more_architectures.py compares whole models)."""
    options, _, _ = SERVED_EXPERTS["llama4_text"]
    path = checkpoint(tmp_path, "llama4_text", options)
    with BaseExecutor.from_pretrained(path) as executor:
        model = symbiosis.load_client_model(path, executor=executor)
        try:
            sent: dict[Op, list[int]] = {Op.FORWARD: [], Op.BACKWARD: []}
            transport = model.symbiosis_transport
            original = transport.call_expert_rows

            def recording(layer_id, counts, op, rows, latency_class):
                assert sum(counts) == rows.shape[0]
                sent[op].append(rows.shape[0])
                return original(layer_id, counts, op, rows, latency_class)

            monkeypatch.setattr(transport, "call_expert_rows", recording)
            every_row_tensors = loss_and_input_grad(model)
            moe_layers = model.config.num_hidden_layers  # (interleave_moe_layer_step=1)
            assert sent[Op.FORWARD] == [IDS.numel()] * 2 * moe_layers  # (gate_up and down; top 1: a row per token)
            assert len(sent[Op.BACKWARD]) == 2 * moe_layers and max(sent[Op.BACKWARD]) <= 4 * IDS.numel()
            monkeypatch.setattr(type(transport), "serves_expert_rows", property(lambda self: False))
            one_by_one_ = loss_and_input_grad(model)
            torch.testing.assert_close(every_row_tensors, one_by_one_, atol=1e-6, rtol=1e-5)
        finally:
            close_client(model)


def test_an_all_zero_row_of_an_every_row_product_gets_its_gradient(tmp_path):
    """A row of zeros has a product of zeros, so it is not sent forward; its gradient is not
    zero (``g·W`` of its output's gradient), and was: the backward sent only the rows sent
    forward. It shows where an activation is not zero at zero (a chosen token whose hidden state
    is zero, then ``up · act(gate)``, act = sigmoid) or in any ``torch.bmm(x, W)`` (a helper's
    probe, /tmp/review29/p14_zero_row_grad.py)."""
    options, _, _ = SERVED_EXPERTS["llama4_text"]
    path = checkpoint(tmp_path, "llama4_text", options | dict(hidden_act="sigmoid"))
    tensor = "model.layers.0.feed_forward.experts.gate_up_proj"
    with BaseExecutor.from_pretrained(path) as executor:
        model = symbiosis.load_client_model(path, executor=executor)
        try:
            monolithic = AutoModelForCausalLM.from_pretrained(path)
            x = torch.randn(4, 3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
            x[1, 2] = 0
            grads = []
            for weights in (model.get_parameter(tensor), monolithic.get_parameter(tensor).detach()):
                rows = x.clone().requires_grad_()
                product = torch.bmm(rows, weights)
                product.backward(torch.ones_like(product))
                grads.append(rows.grad)
            assert grads[1][1, 2].abs().max() > 0.1  # (a gradient to miss)
            torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-5)
        finally:
            close_client(model)
