"""Activation noise (paper §3.8): results equal the monolithic reference, the executor never sees a
layer's raw input in forward, and noise requests are bounded by layers × pool, not by calls."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

import symbiosis
from symbiosis.client.privacy import NoiseConfig, NoisyLink, enable_activation_noise
from symbiosis.client.virt import ExecutorLink, VirtConv1D, VirtLinear
from symbiosis.transport.inproc import InProcTransport
from symbiosis.vocabulary import LatencyClass, Op
from tests.reference import assert_matches_reference, close_client, loss_and_grads, make_pair
from tests.transport.fakes import FakeExecutorService

# Close, not equal: with noise on, the executor computes (x + n)Wᵀ and the client subtracts nWᵀ;
# with |n| ≈ |x| that cancellation costs about one bit of the float32 result per layer, on top of
# the usual summation-order differences, still far inside 1e-4 relative / 1e-5 absolute, while
# noise that is not removed exactly moves outputs by O(|x W|).
TOL = {"rtol": 1e-4, "atol": 1e-5}


class SpyTransport:
    """A ``Transport`` that records (layer_id, op, copy of rows) for every call, then forwards it."""

    def __init__(self, inner):
        self.inner = inner
        self.client_id = inner.client_id
        self.calls: list[tuple[str, Op, torch.Tensor]] = []

    @property
    def fingerprint(self) -> str:
        return self.inner.fingerprint

    def layer_specs(self):
        return self.inner.layer_specs()

    def call(self, layer_id, op, rows, latency_class):
        self.calls.append((layer_id, op, rows.detach().clone()))
        return self.inner.call(layer_id, op, rows, latency_class)

    def close(self) -> None:
        self.inner.close()

    def count(self, op: Op) -> int:
        return sum(1 for _, called_op, _ in self.calls if called_op is op)


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    executor = symbiosis.BaseExecutor.from_pretrained(path)
    yield path, executor
    executor.close()


def _virt_layers(model):
    return [m for m in model.modules() if isinstance(m, (VirtLinear, VirtConv1D))]


def _input_ids():
    return torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("method", ["lora", "prefix"])
def test_private_split_matches_monolithic(method, llama):
    path, executor = llama
    reference, split = make_pair(path, executor, method, "llama")
    spy = SpyTransport(split.get_base_model().symbiosis_transport)
    for layer in _virt_layers(split):
        layer.link.transport = spy
    handle = enable_activation_noise(split, scale=1.0, pool_size=4, seed=0)
    try:
        input_ids = _input_ids()
        assert_matches_reference(loss_and_grads(split, input_ids), loss_and_grads(reference, input_ids), **TOL)

        prompt = input_ids[:1, :5]
        with torch.no_grad():
            ref_tokens = reference.generate(input_ids=prompt, max_new_tokens=10, min_new_tokens=10, do_sample=False)
            tokens = split.generate(input_ids=prompt, max_new_tokens=10, min_new_tokens=10, do_sample=False)
        assert torch.equal(tokens, ref_tokens)
        # The noise path was really taken: one pool per layer, fetched once.
        assert spy.count(Op.NOISE) == handle.layers == len(_virt_layers(split))
    finally:
        handle.disable()
        close_client(split)


def _true_inputs(model, input_ids) -> tuple[dict[str, list[torch.Tensor]], torch.Tensor]:
    """Each VirtLayer's input rows per call, recorded by forward pre-hooks on a plain run."""
    inputs: dict[str, list[torch.Tensor]] = defaultdict(list)
    hooks = [
        layer.register_forward_pre_hook(
            lambda module, args: inputs[module.layer_id].append(
                args[0].detach().reshape(-1, module.in_features).clone()
            )
        )
        for layer in _virt_layers(model)
    ]
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits
    finally:
        for hook in hooks:
            hook.remove()
    return inputs, logits


def test_executor_never_sees_raw_activations(llama):
    path, executor = llama
    spy = SpyTransport(InProcTransport(executor))
    model = symbiosis.load_client_model(path, executor=spy)
    try:
        input_ids = _input_ids()
        true_inputs, plain_logits = _true_inputs(model, input_ids)
        assert set(true_inputs) == {layer.layer_id for layer in _virt_layers(model)}

        spy.calls.clear()
        handle = enable_activation_noise(model, scale=1.0, seed=3)
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits
        torch.testing.assert_close(logits, plain_logits, **TOL)  # same run, so same true inputs

        sent: dict[str, list[torch.Tensor]] = defaultdict(list)
        for layer_id, op, rows in spy.calls:
            if op is Op.FORWARD:
                sent[layer_id].append(rows)
        assert set(sent) == set(true_inputs)
        for layer_id, rows_per_call in sent.items():
            assert len(rows_per_call) == len(true_inputs[layer_id])
            for rows, true_rows in zip(rows_per_call, true_inputs[layer_id]):
                assert rows.shape == true_rows.shape
                assert not torch.allclose(rows, true_rows, rtol=1e-2, atol=1e-3), layer_id
                # Every single row is displaced by about `scale` times its own RMS (not just some rows).
                distance = (rows - true_rows).pow(2).mean(dim=1).sqrt()
                true_rms = true_rows.pow(2).mean(dim=1).sqrt()
                assert torch.all(distance > 0.5 * true_rms), layer_id
        handle.disable()
    finally:
        close_client(model)


def test_disable_restores_plain_behaviour(llama):
    path, executor = llama
    spy = SpyTransport(InProcTransport(executor))
    model = symbiosis.load_client_model(path, executor=spy)
    try:
        input_ids = _input_ids()
        originals = {layer.layer_id: layer.link for layer in _virt_layers(model)}
        with torch.no_grad():
            plain_logits = model(input_ids=input_ids).logits
            with enable_activation_noise(model, seed=1) as handle:
                assert all(isinstance(layer.link, NoisyLink) for layer in _virt_layers(model))
                noisy_logits = model(input_ids=input_ids).logits
            assert not handle.active
            noise_requests = spy.count(Op.NOISE)
            assert noise_requests == len(originals)
            restored_logits = model(input_ids=input_ids).logits

        assert all(layer.link is originals[layer.layer_id] for layer in _virt_layers(model))
        assert torch.equal(restored_logits, plain_logits)  # bit-exact: the plain path again
        assert not torch.equal(noisy_logits, plain_logits)  # rounding differs: noise was on
        torch.testing.assert_close(noisy_logits, plain_logits, **TOL)
        assert spy.count(Op.NOISE) == noise_requests  # no noise requests after disable
        forward_rows = [rows for _, op, rows in spy.calls[-len(originals) :] if op is Op.FORWARD]
        assert len(forward_rows) == len(originals)

        handle.disable()  # idempotent
        again = enable_activation_noise(model, seed=2)  # can be enabled again after disable
        with pytest.raises(ValueError, match="already enabled"):
            enable_activation_noise(model)
        again.disable()
    finally:
        close_client(model)


@pytest.mark.parametrize("refresh_every", [None, 3])
def test_noise_requests_bounded_by_layers_and_pool(refresh_every, llama):
    path, executor = llama
    spy = SpyTransport(InProcTransport(executor))
    model = symbiosis.load_client_model(path, executor=spy)
    pool_size = 2
    try:
        handle = enable_activation_noise(model, pool_size=pool_size, refresh_every=refresh_every, seed=4)
        prompt = _input_ids()[:1, :4]
        with torch.no_grad():
            for _ in range(2):
                model(input_ids=_input_ids())
            model.generate(input_ids=prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        layers = handle.layers
        calls_per_layer = 2 + 6  # two forwards, then one prefill + five decode steps (last token is not fed back)
        assert spy.count(Op.FORWARD) == layers * calls_per_layer
        pools_per_layer = 1 if refresh_every is None else math.ceil(calls_per_layer / refresh_every)
        noise_calls = [rows for _, op, rows in spy.calls if op is Op.NOISE]
        assert len(noise_calls) == handle.noise_requests == layers * pools_per_layer
        assert all(rows.shape[0] == pool_size for rows in noise_calls)
        handle.disable()
    finally:
        close_client(model)


# --- the link alone, on a fake executor with a biased layer -------------------------------------------


@pytest.fixture
def fake_link():
    service = FakeExecutorService()
    transport = InProcTransport(service)
    yield service, ExecutorLink(service.layer_specs()["q"], transport)
    transport.close()


def test_noisy_link_is_exact_with_bias_and_zero_rows(fake_link):
    service, link = fake_link
    weight, bias = service.weights["q"]
    assert bias is not None
    noisy = NoisyLink(link, NoiseConfig(scale=3.0, pool_size=2), seed=0)
    rows = torch.randn(6, link.in_features, generator=torch.Generator().manual_seed(0)) * 5
    rows[2] = 0  # a zero row is noised too (its RMS counts as 1)
    out = noisy.call(Op.FORWARD, rows, LatencyClass.PREFILL)
    torch.testing.assert_close(out, rows @ weight.t() + bias, **TOL)
    submitted = [(event[3], event[4]) for event in service.events if event[0] == "submit"]
    assert submitted == [(Op.NOISE, (2, link.in_features)), (Op.FORWARD, (6, link.in_features))]

    grad = torch.randn(6, link.out_features)
    torch.testing.assert_close(noisy.call(Op.BACKWARD, grad, LatencyClass.FINETUNE), grad @ weight, **TOL)
    empty = noisy.call(Op.FORWARD, rows[:0], LatencyClass.DECODE)
    assert empty.shape == (0, link.out_features)
    assert noisy.noise_requests == 1


def test_noise_config_rejects_bad_values():
    for bad in ({"scale": 0.0}, {"pool_size": 0}, {"refresh_every": 0}):
        with pytest.raises(ValueError):
            NoiseConfig(**bad)
