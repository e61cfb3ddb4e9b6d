"""Scenario 5, ``executor_efficiency``: the executor's batched products recorded while C
in-process clients train and decode, timed in place (``in_situ``) and replayed through the
executor's own ``run_batch`` vs plain ``torch.matmul`` on the same shapes, interleaved, with a
1024² ``torch.matmul`` as the machine's ceiling.

``results``: ``phases, matmul_ceiling_gflops``.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from typing import Any

import torch

from benchmarks.plots import Panel
from benchmarks.scenarios.context import Context, common_table, finish
from benchmarks.timing import ratio, square_matmul, summarize, time_interleaved


def run(ctx: Context) -> dict:
    import peft

    import symbiosis
    import symbiosis.executor.engine as engine
    from benchmarks.split_overhead import Decoder, lora_config, train_step_fn
    from symbiosis.executor.runner import run_batch

    path = ctx.checkpoint()
    torch.set_num_threads(ctx.threads)
    executor = symbiosis.BaseExecutor.from_pretrained(path, device="cpu", dtype=torch.float32)
    records: list[tuple[Any, Any, list[int], float]] = []

    def timed_run_batch(layer, op, inputs):
        began = time.perf_counter()
        out = run_batch(layer, op, inputs)
        records.append((layer, op, [t.shape[0] for t in inputs], time.perf_counter() - began))
        return out

    clients = []
    phases: dict[str, Any] = {}
    engine.run_batch = timed_run_batch  # the engine looks the name up per batch
    try:
        for index in range(ctx.profile.efficiency_clients):
            torch.manual_seed(index)
            clients.append(peft.get_peft_model(symbiosis.load_client_model(path, executor=executor), lora_config()))
        vocab = clients[0].config.vocab_size
        seq = ctx.profile.finetune_seq
        workloads = {
            "train": [
                train_step_fn(c.train(), torch.randint(0, vocab, (ctx.profile.finetune_batch, seq))) for c in clients
            ],
        }
        for phase in ("train", "decode"):
            if phase == "decode":
                decoders = [Decoder(c.eval(), torch.randint(0, vocab, (1, ctx.profile.prompt_len))) for c in clients]
                workloads["decode"] = [d.step for d in decoders]
            for fn in workloads[phase]:
                fn()  # warm-up, alone
            records.clear()
            wall = time.perf_counter()
            calls = 2 if phase == "train" else 4
            threads = [
                threading.Thread(target=lambda f=fn, n=calls: [f() for _ in range(n)]) for fn in workloads[phase]
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - wall
            phases[phase] = efficiency_of(list(records), wall, ctx.profile.efficiency_repeats)
            ctx.log(
                f"  {phase}: executor products {phases[phase]['replay_executor_gflops']:.1f} GFLOP/s vs torch.matmul "
                f"{phases[phase]['replay_torch_matmul_gflops']:.1f} "
                f"(ratio {phases[phase]['executor_over_matmul']:.2f}), ceiling "
                f"{phases[phase]['matmul_1024_gflops']:.1f}"
            )
    finally:
        engine.run_batch = run_batch
        for c in clients:
            c.base_model.model.symbiosis_transport.close()
        executor.close()
    ceiling = max(p["matmul_1024_gflops"] for p in phases.values())
    headline = [
        f"{phase}: executor batched products {p['replay_executor_gflops']:.1f} GFLOP/s vs plain torch.matmul "
        f"{p['replay_torch_matmul_gflops']:.1f} on the same shapes "
        f"(x{p['executor_over_matmul']:.2f}); in place under load {p['in_situ_gflops']:.1f}; mean "
        f"{p['mean_rows_per_batch']:.1f} rows/batch; 1024² matmul ceiling {p['matmul_1024_gflops']:.1f}."
        for phase, p in phases.items()
    ]
    losses = [
        f"{phase}: the executor's products run at x{p['executor_over_matmul']:.2f} of plain torch.matmul."
        for phase, p in phases.items()
        if p["executor_over_matmul"] < 0.95
    ]
    table = common_table(
        [
            "phase",
            "batches",
            "rows/batch",
            "GFLOP",
            "in situ GFLOP/s",
            "executor replay GFLOP/s",
            "torch.matmul GFLOP/s",
            "ratio",
            "1024² ceiling GFLOP/s",
        ],
        [
            [
                ph,
                p["batches"],
                p["mean_rows_per_batch"],
                p["gflop"],
                p["in_situ_gflops"],
                p["replay_executor_gflops"],
                p["replay_torch_matmul_gflops"],
                p["executor_over_matmul"],
                p["matmul_1024_gflops"],
            ]
            for ph, p in phases.items()
        ],
    )
    names = list(phases)
    panels = [
        Panel(
            "GFLOP/s on the executor's shapes",
            "GFLOP/s",
            names,
            {
                k: [phases[n][g] for n in names]
                for k, g in (
                    ("in situ", "in_situ_gflops"),
                    ("executor replay", "replay_executor_gflops"),
                    ("torch.matmul", "replay_torch_matmul_gflops"),
                    ("1024² ceiling", "matmul_1024_gflops"),
                )
            },
        )
    ]
    return finish(
        ctx,
        "executor_efficiency",
        {"phases": phases, "matmul_ceiling_gflops": ceiling},
        headline,
        losses,
        table,
        panels,
        f"Executor GEMM efficiency ({ctx.profile.preset}, {ctx.profile.efficiency_clients} in-process clients)",
        {
            "clients": ctx.profile.efficiency_clients,
            "model": str(path),
            "repeats": ctx.profile.efficiency_repeats,
            "threads": ctx.threads,
        },
    )


def efficiency_of(records: list, wall_s: float, repeats: int) -> dict[str, Any]:
    """GFLOP/s of recorded batches: in place, replayed via ``run_batch``, and as plain ``torch.matmul``."""
    from symbiosis.executor.runner import run_batch
    from symbiosis.vocabulary import Op

    replays = []
    flop = 0.0
    for layer, op, pieces, _ in records:
        out_features, in_features = layer.weight.shape
        flop += 2.0 * sum(pieces) * in_features * out_features
        width = out_features if op is Op.BACKWARD else in_features
        inputs = [torch.randn(n, width) for n in pieces]
        matrix = layer.weight if op is Op.BACKWARD else layer.weight.t()
        replays.append((layer, op, inputs, torch.cat(inputs), matrix))
    probe, probe_gflop = square_matmul()
    samples = time_interleaved(
        {
            "executor": lambda: [run_batch(layer, op, inputs) for layer, op, inputs, _, _ in replays],
            "torch_matmul": lambda: [torch.matmul(x, m) for _, _, _, x, m in replays],
            "matmul_1024": probe,
        },
        warmup=1,
        repeats=repeats,
    )
    gflop = flop / 1e9
    median = {k: statistics.median(v) for k, v in samples.items()}
    rows = [sum(p) for _, _, p, _ in records]
    return {
        "batches": len(records),
        "mean_rows_per_batch": statistics.fmean(rows) if rows else math.nan,
        "gflop": gflop,
        "in_situ_gflops": ratio(gflop, sum(r[3] for r in records)),
        "in_situ_wall_gflops": ratio(gflop, wall_s),
        "replay_executor_gflops": ratio(gflop, median["executor"]),
        "replay_torch_matmul_gflops": ratio(gflop, median["torch_matmul"]),
        "executor_over_matmul": ratio(median["torch_matmul"], median["executor"]),
        "matmul_1024_gflops": ratio(probe_gflop, median["matmul_1024"]),
        "timing": {k: summarize(v) for k, v in samples.items()},
    }
