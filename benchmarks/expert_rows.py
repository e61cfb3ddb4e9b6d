"""Decode step of a split MoE model: one request per experts tensor (expert rows) vs one per expert.

A split MoE model's grouped experts forward sends the rows of every expert its tokens chose in
one request (``Request.expert_rows``); before, each chosen expert was a request of its own. This
times a greedy decode step (KV cache, ``--batch`` sequences) of a random-weight mixtral checkpoint
(``--preset``, with ``--experts`` experts and ``--top-k`` chosen per token) both ways, in one
client process against one executor, alternating round by round so both see the same background
load; "per expert" is the same client with its transport saying it takes no expert rows (what a
sharded executor says). The executor runs in a child process for ``shm+ipc`` and ``tcp`` (one
torch thread each side), in the client process for ``inproc``.

JSON on stdout (and ``expert_rows.json`` in ``--output`` when given): per transport the median ms
per step each way and their ratio (expert rows / per expert).

Run: ``python -m benchmarks.expert_rows [--transports inproc shm+ipc tcp] [--experts 32 --top-k 8]
[--batch 1] [--rounds 7] [--output DIR]``.
"""

from __future__ import annotations

import os

# As ``symbiosis`` commands start their clients (``symbiosis/threads.py``): idle OpenMP threads of
# this client process sleep instead of spinning on the cores its executor needs. Before torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import symbiosis
from benchmarks.results import machine_info, write_json
from symbiosis.modelzoo import build_random_model, preset_config

SERVER = """
import sys, time, torch, symbiosis
torch.set_num_threads(1)
server = symbiosis.BaseExecutor.from_pretrained(sys.argv[1]).serve(sys.argv[2])
print(server.address, flush=True)
time.sleep(24 * 3600)
"""


def decode_ms(model, ids: torch.Tensor, steps: int) -> float:
    """Mean ms of ``steps`` greedy decode steps after a prefill of ``ids`` (one timed block)."""
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        started = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return 1e3 * (time.perf_counter() - started) / steps


def measure(path: Path, transport: str, args: argparse.Namespace) -> dict[str, Any]:
    server, executor = None, None
    try:
        if transport == "inproc":
            executor = symbiosis.BaseExecutor.from_pretrained(path)
            target: Any = executor
        else:
            bind = "tcp://127.0.0.1:0" if transport == "tcp" else f"ipc://{tempfile.mkdtemp()}/executor.sock"
            command = [sys.executable, "-c", SERVER, str(path), bind]
            server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
            address = server.stdout.readline().strip()
            target = ("shm+" if transport.startswith("shm+") else "") + address
        model = symbiosis.load_client_model(path, executor=target).eval()
        connection = model.symbiosis_transport
        serves = type(connection).serves_expert_rows
        ids = torch.randint(5, model.config.vocab_size, (args.batch, 16), generator=torch.Generator().manual_seed(0))
        samples: dict[str, list[float]] = {"expert_rows": [], "per_expert": []}
        try:
            for round_ in range(args.rounds + 1):  # round 0: warm-up
                ways = list(samples) if round_ % 2 == 0 else list(reversed(samples))
                for way in ways:
                    type(connection).serves_expert_rows = serves if way == "expert_rows" else property(lambda _: False)
                    ms = decode_ms(model, ids, args.steps)
                    if round_:
                        samples[way].append(ms)
        finally:
            type(connection).serves_expert_rows = serves
            connection.close()
        medians = {way: statistics.median(values) for way, values in samples.items()}
        return {
            "median_ms": medians,
            "ratio": medians["expert_rows"] / medians["per_expert"],
            "samples_ms": samples,
        }
    finally:
        if server is not None:
            server.kill()
        if executor is not None:
            executor.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transports", nargs="+", default=["inproc", "shm+ipc", "tcp"])
    parser.add_argument("--preset", default="small", help="modelzoo size of the mixtral checkpoint")
    parser.add_argument("--experts", type=int, default=32, help="experts per layer")
    parser.add_argument("--top-k", type=int, default=8, help="experts chosen per token")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    parser.add_argument("--steps", type=int, default=12, help="decode steps per timed block")
    parser.add_argument("--rounds", type=int, default=7, help="timed blocks each way, interleaved")
    parser.add_argument("--output", type=Path, help="folder for expert_rows.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    config = preset_config("mixtral", args.preset)
    config.num_local_experts, config.num_experts_per_tok = args.experts, args.top_k
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "mixtral"
        build_random_model(config).save_pretrained(path)
        results = {}
        for transport in args.transports:
            results[transport] = measure(path, transport, args)
            medians = results[transport]["median_ms"]
            print(
                f"{transport}: expert rows {medians['expert_rows']:.2f} ms/step, per expert "
                f"{medians['per_expert']:.2f}: x{results[transport]['ratio']:.2f}",
                file=sys.stderr,
            )
    config_out = vars(args) | {"output": str(args.output)}
    report = {"benchmark": "expert_rows", "config": config_out, "machine": machine_info(), "results": results}
    if args.output is not None:
        write_json(args.output / "expert_rows.json", report)
    print(report if args.output is None else f"wrote {args.output / 'expert_rows.json'}")


if __name__ == "__main__":
    main()
