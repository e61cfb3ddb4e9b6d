"""Sharded executors for the tests: ranks as threads of the test process, and client processes.

Ranks as threads: each rank is a ``ShardedExecutor`` built by the same ``start_rank`` a
``symbiosis serve`` rank runs, with its own gloo group and ZeroMQ links, over one in-memory store
(``torch.distributed.HashStore``) instead of torchrun's TCPStore. Everything between the ranks
(links, gathers, forwarding) is the real thing; only the processes are not.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from symbiosis.executor.scheduler import SchedulerConfig
from symbiosis.sharding.executor import ShardedExecutor
from symbiosis.sharding.options import ShardOptions
from symbiosis.sharding.serve import start_rank
from symbiosis.sharding.world import RankInfo


@contextlib.contextmanager
def ranks_in_threads(
    path: Path, world_size: int, strategy: str, *, policy: str = "opportunistic", **options
) -> Iterator[list[ShardedExecutor]]:
    """``world_size`` ranks of a sharded executor of ``path``, started together, stopped on exit."""
    store = dist.PrefixStore(f"test-{uuid.uuid4().hex}/", dist.HashStore())
    ranks: list[ShardedExecutor | None] = [None] * world_size
    errors: list[BaseException] = []

    def start(rank: int) -> None:
        try:
            ranks[rank] = start_rank(
                path,
                RankInfo(rank, world_size, rank),
                store,
                device=torch.device("cpu"),
                dtype=torch.float32,
                scheduler_config=SchedulerConfig(policy=policy),
                options=ShardOptions(strategy=strategy, start_timeout_s=60, **options),
            )
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    started = [rank for rank in ranks if rank is not None]
    try:
        if errors or len(started) != world_size:
            raise errors[0] if errors else RuntimeError("ranks did not start in time")
        yield started
    finally:
        stop_ranks(started)


def serve_all(ranks: list[ShardedExecutor], bind: str = "tcp://127.0.0.1:0") -> str:
    """What ``serve`` does: every rank serves its endpoint, rank 0 ``bind`` with routes to them;
    returns rank 0's address."""
    for rank in ranks[1:]:
        rank.serve_rank_endpoints([bind])
    return ranks[0].serve_entry([bind], timeout_s=30)[0].address


def stop_ranks(ranks: list[ShardedExecutor]) -> None:
    """What ``serve`` does on SIGTERM, for every rank at once."""
    for rank in ranks:
        rank.close_servers(drain=False)
    for rank in ranks:
        rank.links.say_bye("test over")
    for rank in ranks:
        rank.links.wait_peers_gone(5.0)
    for rank in ranks:
        rank.close(drain=False)
        rank.links.close()


def resident_bytes(rank: ShardedExecutor) -> int:
    """Bytes of the weight tensors a rank keeps, each storage counted once."""
    storages = {}
    for tensor in rank.resident_tensors():
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


# ---- client processes (spawned: module-level functions) -------------------------------------------


def _train(model, steps: int, seed: int) -> dict[str, torch.Tensor]:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(3, 300, (2, 8), generator=generator)
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def finetune_or_decode_client(path: str, address: str, role: str, seed: int, results) -> None:
    """A client process of a sharded executor at ``address``: fine-tunes LoRA for a few steps, or
    decodes greedily, and compares with the monolithic ``transformers``+``peft`` model doing the
    same in this process. Reports (role, seed, ok, detail)."""
    torch.set_num_threads(1)
    from tests.reference import close_client, make_pair

    try:
        reference, split = make_pair(path, address, "lora", "llama")
        if role == "finetune":
            before = {n: p.detach().clone() for n, p in reference.named_parameters() if p.requires_grad}
            got, want = _train(split, 3, seed), _train(reference, 3, seed)
            worst = max(float((got[n] - w).abs().max()) for n, w in want.items())
            moved = max(float((want[n] - b).abs().max()) for n, b in before.items())
            # Close, not equal (products summed in another order); a lost or doubled step moves
            # the adapters by a whole update (``moved`` is about 1e-3 here).
            ok = set(got) == set(want) and worst < 1e-5 and moved > 1e-4
            detail = f"max adapter difference {worst:.2e}, training moved them by {moved:.2e}"
        else:
            prompt = torch.randint(3, 300, (1, 6), generator=torch.Generator().manual_seed(seed))
            with torch.no_grad():
                got = split.generate(input_ids=prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)
                want = reference.generate(input_ids=prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)
            ok = torch.equal(got, want)
            detail = f"tokens {got.tolist()} vs {want.tolist()}"
        close_client(split)
        results.put((role, seed, ok, detail))
    except Exception as exc:  # noqa: BLE001 - reported to the test process
        results.put((role, seed, False, repr(exc)))
