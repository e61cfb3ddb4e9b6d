"""Several clients with different PEFT methods train and generate at the same time against one
executor; each matches its own monolithic reference, and the executor's memory stays flat."""

from __future__ import annotations

import threading

import psutil
import pytest
import torch

import symbiosis
from tests.reference import close_client, make_pair

METHODS = ("lora", "ia3", "prefix", "loha")
TOL = dict(rtol=1e-4, atol=1e-5)


def _train(model, batches, steps):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(steps):
        ids = batches[step % len(batches)]
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _batches(seed, n=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (2, 8), generator=g) for _ in range(n)]


@pytest.mark.parametrize("policy", ["opportunistic", "immediate", "lockstep"])
@pytest.mark.slow
def test_four_clients_train_and_generate_concurrently(policy, tiny_checkpoint):
    """The policy changes timing, never numbers."""
    path = tiny_checkpoint("llama")
    with symbiosis.BaseExecutor.from_pretrained(
        path, policy=policy, max_wait_ms=2.0, lockstep_timeout_ms=5.0
    ) as executor:
        pairs = {m: make_pair(path, executor, m, "llama") for m in METHODS}
        results, errors = {}, []
        start = threading.Barrier(len(METHODS))

        def client(method):
            try:
                reference, split = pairs[method]
                batches = _batches(seed=len(method))
                start.wait()
                split_losses = _train(split, batches, steps=3)
                split.eval()
                with torch.no_grad():
                    tokens = split.generate(
                        input_ids=batches[0][:1, :4], max_new_tokens=10, min_new_tokens=10, do_sample=False
                    )
                results[method] = (split_losses, tokens)
            except Exception as exc:  # surfaced in the main thread
                errors.append((method, exc))

        threads = [threading.Thread(target=client, args=(m,)) for m in METHODS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors, errors
        stats = executor.stats()["layers"]
        requests = sum(s["requests"] for s in stats.values())
        batches_run = sum(s["batches"] for s in stats.values())
        if policy != "immediate":
            assert batches_run < requests, "requests of concurrent clients were never batched together"

        for method, (reference, split) in pairs.items():
            batches = _batches(seed=len(method))
            ref_losses = _train(reference, batches, steps=3)
            reference.eval()
            with torch.no_grad():
                ref_tokens = reference.generate(
                    input_ids=batches[0][:1, :4], max_new_tokens=10, min_new_tokens=10, do_sample=False
                )
            split_losses, tokens = results[method]
            torch.testing.assert_close(torch.tensor(split_losses), torch.tensor(ref_losses), **TOL)
            ref_params = {n: p for n, p in reference.named_parameters() if p.requires_grad}
            for name, param in split.named_parameters():
                if param.requires_grad:
                    torch.testing.assert_close(param, ref_params[name], **TOL)
            assert torch.equal(tokens, ref_tokens), method
            close_client(split)


@pytest.mark.slow
def test_executor_memory_is_flat_over_training(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    process = psutil.Process()
    with symbiosis.BaseExecutor.from_pretrained(path) as executor:
        clients = [make_pair(path, executor, m, "llama")[1] for m in METHODS]
        optimizers = [torch.optim.AdamW([p for p in c.parameters() if p.requires_grad], lr=1e-3) for c in clients]
        batches = _batches(seed=3)
        rss = []

        def step(i):
            def run(c, o):
                o.zero_grad()
                c(input_ids=batches[i % 3], labels=batches[i % 3]).loss.backward()
                o.step()

            threads = [threading.Thread(target=run, args=pair) for pair in zip(clients, optimizers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        for i in range(20):
            step(i)
            if i in (4, 19):
                rss.append(process.memory_info().rss)
            assert executor.stats()["inflight_requests"] == 0
        weights_before = executor.weights.nbytes()
        for c in clients:
            close_client(c)
    assert executor.weights.nbytes() == weights_before
    # 15 more steps of 4 clients after warm-up: allocator noise only, no per-step growth.
    assert rss[1] - rss[0] < 32 * 2**20, f"RSS grew by {(rss[1] - rss[0]) / 2**20:.1f} MiB"
