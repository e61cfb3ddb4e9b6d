"""Sibling fusion: layers that read the same input are served by one request, exactly as if apart."""

from __future__ import annotations

import pytest
import torch

import symbiosis
from symbiosis.errors import UnknownLayerError
from symbiosis.vocabulary import LatencyClass, Op, group_id, sibling_blocks
from tests.reference import assert_matches_reference, close_client, loss_and_grads, make_pair

TOL = dict(rtol=1e-4, atol=1e-5)
ATTN = "model.layers.0.self_attn"


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    with symbiosis.BaseExecutor.from_pretrained(path) as executor:
        yield path, executor


def _fusion(model):
    return next(m.fusion for m in model.modules() if getattr(m, "fusion", None) is not None)


def _requests(executor) -> int:
    return sum(layer["requests"] for layer in executor.stats()["layers"].values())


def test_blocks_share_one_weight_and_groups_resolve_to_views(llama):
    _, executor = llama
    weights = executor.weights
    q, k, v, o = (weights.layers[f"{ATTN}.{n}_proj"] for n in "qkvo")
    assert q.weight.untyped_storage().data_ptr() == o.weight.untyped_storage().data_ptr()  # one block
    stored = sum(w.weight.numel() + (0 if w.bias is None else w.bias.numel()) for w in weights.layers.values())
    assert weights.nbytes() == stored * 4  # nothing held twice
    qkv = group_id(f"{ATTN}.{n}_proj" for n in "qkv")
    assert weights.layers[qkv].weight.data_ptr() == q.weight.data_ptr()
    assert weights.specs[qkv].out_features == sum(weights.specs[f"{ATTN}.{n}_proj"].out_features for n in "qkv")
    assert qkv not in list(weights.specs)  # groups are resolved on lookup, never listed

    rows = torch.randn(5, 64)
    fused = executor.run(qkv, "forward", rows)
    apart = torch.cat([executor.run(f"{ATTN}.{n}_proj", "forward", rows) for n in "qkv"], dim=1)
    # Same inputs, same weights, one GEMM of a wider matrix: the reduction over in_features is the
    # same per element, but a different BLAS blocking may round differently (one ulp).
    torch.testing.assert_close(fused, apart, rtol=1e-5, atol=1e-6)
    grads = torch.randn(5, weights.specs[qkv].out_features)
    torch.testing.assert_close(
        executor.run(qkv, "backward", grads),
        sum(
            executor.run(f"{ATTN}.{n}_proj", "backward", g)
            for n, g in zip("qkv", torch.split(grads, [64, 32, 32], dim=1))
        ),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize(
    "members",
    [
        ["q", "v"],  # not contiguous in the block
        ["k", "q"],  # not in block order
        ["q", "nope"],
    ],
)
def test_executor_refuses_groups_it_cannot_serve_as_one_view(llama, members):
    _, executor = llama
    bad = group_id(f"{ATTN}.{n}_proj" for n in members)
    with pytest.raises(UnknownLayerError):
        executor.submit("c", bad, Op.FORWARD, torch.randn(1, 64), LatencyClass.DECODE)
    cross = group_id([f"{ATTN}.v_proj", "model.layers.0.mlp.gate_proj"])
    with pytest.raises(UnknownLayerError):
        executor.submit("c", cross, Op.FORWARD, torch.randn(1, 64), LatencyClass.DECODE)


def test_sibling_blocks_follow_parent_width_and_bias():
    from symbiosis.vocabulary import LayerSpec

    specs = [
        LayerSpec("a.q", 8, 8, True),
        LayerSpec("a.k", 8, 4, True),
        LayerSpec("a.o", 8, 8, False),  # no bias: not with q/k
        LayerSpec("b.up", 8, 16, False),
        LayerSpec("b.down", 16, 8, False),  # other width
        LayerSpec("b.gate", 8, 16, False),
        # An MoE's experts each read their own tokens: never siblings (their id ends in a number).
        *(LayerSpec(f"c.experts.gate_up_proj.{e}", 8, 16, False) for e in range(4)),
    ]
    assert sibling_blocks(specs) == [("a.q", "a.k"), ("b.up", "b.gate")]


@pytest.mark.parametrize("method", ["lora", "ia3", "adalora", "prefix"])
@pytest.mark.parametrize("arch", ["llama", "opt", "qwen2"])
def test_fused_training_and_decoding_match_monolithic(arch, method, tiny_checkpoint):
    path = tiny_checkpoint(arch)
    with symbiosis.BaseExecutor.from_pretrained(path) as executor:
        reference, split = make_pair(path, executor, method, arch, fuse_siblings=True)
        try:
            ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(3))
            loss_and_grads(split, ids)  # two passes: groups are learned, then used
            loss_and_grads(split, ids)
            assert _fusion(split).groups(), "no sibling group was formed"
            # forward and backward through the fused path, every adapter gradient compared
            assert_matches_reference(loss_and_grads(split, ids), loss_and_grads(reference, ids), **TOL)
            prompt = ids[:1, :5]
            with torch.no_grad():
                expected = reference.generate(input_ids=prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)
                assert torch.equal(
                    split.generate(input_ids=prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False), expected
                )
        finally:
            close_client(split)


def test_llama_decodes_with_four_calls_per_layer_plus_head(llama):
    path, executor = llama
    model = symbiosis.load_client_model(path, executor=executor, fuse_siblings=True)
    prompt = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        model.generate(input_ids=prompt, max_new_tokens=3, do_sample=False)  # learn
        before = _requests(executor)
        model.generate(input_ids=prompt, max_new_tokens=9, min_new_tokens=9, do_sample=False)
        per_token = (_requests(executor) - before) / 9  # prefill + 8 decode steps = 9 forward passes
    layers = model.config.num_hidden_layers
    assert per_token == 4 * layers + 1  # q/k/v, o, gate/up, down per layer; lm_head
    model.symbiosis_transport.close()


def test_a_model_that_stops_sharing_inputs_dissolves_its_group(llama):
    path, executor = llama
    model = symbiosis.load_client_model(path, executor=executor, fuse_siblings=True)
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 3, 64)
    with torch.no_grad():
        for _ in range(2):
            attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), attn.o_proj(x + 1)
        assert (f"{ATTN}.q_proj", f"{ATTN}.k_proj", f"{ATTN}.v_proj") in _fusion(model).groups()
        for _ in range(4):  # k and v now read other inputs: kept outputs are wasted, then no group
            q = attn.q_proj(x)
            y = x * 2
            k, v = attn.k_proj(y), attn.v_proj(y)
            torch.testing.assert_close(k, executor.run(f"{ATTN}.k_proj", "forward", y.reshape(-1, 64)).view(1, 3, -1))
            torch.testing.assert_close(v, executor.run(f"{ATTN}.v_proj", "forward", y.reshape(-1, 64)).view(1, 3, -1))
            torch.testing.assert_close(q, executor.run(f"{ATTN}.q_proj", "forward", x.reshape(-1, 64)).view(1, 3, -1))
    assert not any(f"{ATTN}.q_proj" in g for g in _fusion(model).groups())
    model.symbiosis_transport.close()


def test_in_place_change_of_the_input_is_not_served_from_kept_outputs(llama):
    path, executor = llama
    model = symbiosis.load_client_model(path, executor=executor, fuse_siblings=True)
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 64)
    with torch.no_grad():
        for _ in range(2):
            mlp.gate_proj(x), mlp.up_proj(x)
        mlp.gate_proj(x)  # the group call keeps up_proj(x)
        x.mul_(3)  # same tensor object, new values
        up = mlp.up_proj(x)
    torch.testing.assert_close(up, executor.run("model.layers.0.mlp.up_proj", "forward", x))
    model.symbiosis_transport.close()


def test_fusion_can_be_turned_off_and_is_off_in_process_by_default(llama):
    path, executor = llama
    for options in ({"fuse_siblings": False}, {}):
        model = symbiosis.load_client_model(path, executor=executor, **options)
        assert all(getattr(m, "fusion", None) is None for m in model.modules())
        model.symbiosis_transport.close()


def test_fusion_is_on_by_default_for_a_remote_executor(llama, tmp_path):
    path, executor = llama
    server = executor.serve(f"ipc://{tmp_path}/fusion.sock")
    try:
        model = symbiosis.load_client_model(path, executor=server.address)
        assert any(getattr(m, "fusion", None) is not None for m in model.modules())
        with torch.no_grad():
            model.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)
        assert _fusion(model).groups()
        model.symbiosis_transport.close()
    finally:
        server.close()


def test_in_process_products_run_in_the_callers_thread(llama):
    # The executor's compute thread never multiplies for in-process clients: a second OpenMP team
    # in the process would slow every torch op of its neighbours (see executor/engine.py).
    path, executor = llama
    before = executor.stats()["batches_run_by"]["compute_thread"]
    model = symbiosis.load_client_model(path, executor=executor, fuse_siblings=True)
    with torch.no_grad():
        model.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)
    assert executor.stats()["batches_run_by"]["compute_thread"] == before
    model.symbiosis_transport.close()


def test_siblings_fuse_under_autocast(llama):
    """Under autocast each base layer casts its input; a cast for each of q, k and v made three
    inputs of one, so no group formed (15 requests a forward of the tiny llama instead of 9).
    Siblings now share one cast of their input."""
    path, executor = llama
    model = symbiosis.load_client_model(path, executor=executor, fuse_siblings=True)
    try:
        ids = torch.tensor([[5, 6, 7, 8]])
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            for _ in range(3):  # groups are learned from the first forwards
                before = _requests(executor)
                logits = model(ids).logits
            fused = _requests(executor) - before
        assert (f"{ATTN}.q_proj", f"{ATTN}.k_proj", f"{ATTN}.v_proj") in _fusion(model).groups()
        assert fused == 9  # per block: q+k+v, o, gate+up, down; and the head
        unfused = symbiosis.load_client_model(path, executor=executor)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            apart = unfused(ids).logits
        unfused.symbiosis_transport.close()
        torch.testing.assert_close(logits, apart, rtol=2e-2, atol=2e-2)  # bf16 products, grouped or not
    finally:
        model.symbiosis_transport.close()
