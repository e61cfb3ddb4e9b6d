"""Scenario 3, ``multi_adapter_inference``: K requests, each with its own LoRA adapter, decode
greedily at once. Four systems:

* ``symbiosis``: one split client process per adapter, all clients of one executor process
  (``shm+ipc``); clients run with ``OMP_WAIT_POLICY=PASSIVE`` (``processes.worker_env``).
* ``symbiosis_mixed_batch``: ONE split client process decoding all K requests as one peft
  mixed-adapter batch (``adapter_names=``), its executor in the same process
  (``BaseExecutor.from_pretrained`` + ``load_client_model(path, executor=ex)``).
* ``hf_mixed_batch``: one ``transformers+peft`` process, the same mixed-adapter batch.
* ``hf_per_adapter``: one ``transformers+peft`` process per adapter.

Aggregate tokens/s and p50/p95 per-token latency (time of one decode step, pooled over requests).
Targets (``TARGETS``, PASS/MISS in the headline): ``symbiosis_mixed_batch`` >= 0.9x
``hf_mixed_batch`` and ``symbiosis`` >= 1.0x ``hf_per_adapter``, at every K.

``results``: ``runs, per_k, targets``.
"""

from __future__ import annotations

import math
from typing import Any

from benchmarks.plots import Panel
from benchmarks.scenarios.context import Context, common_table, finish
from benchmarks.scenarios.processes import ScenarioExecutor, env_record, run_group
from benchmarks.timing import percentile, ratio

SYSTEMS = ("symbiosis", "symbiosis_mixed_batch", "hf_mixed_batch", "hf_per_adapter")
# (per_k ratio key, what it compares, the target it must reach at every K)
TARGETS = (
    ("symbiosis_mixed_vs_hf_mixed", "Symbiosis mixed batch (in-process executor) vs HF PEFT mixed batch", 0.9),
    ("throughput_ratio_vs_per_adapter", "Symbiosis process per adapter vs HF PEFT process per adapter", 1.0),
)
# system -> (worker mode, role, one process per adapter?)
LAYOUT = {
    "symbiosis": ("split", "client", True),
    "symbiosis_mixed_batch": ("embedded", "embedded", False),
    "hf_mixed_batch": ("monolithic", "job", False),
    "hf_per_adapter": ("monolithic", "job", True),
}


def run(ctx: Context) -> dict:
    path = ctx.checkpoint()
    runs: dict[str, dict[str, Any]] = {s: {} for s in SYSTEMS}
    rotation = (
        "hf_mixed_batch",
        "hf_per_adapter",
        "symbiosis_mixed_batch",
        "symbiosis",
    )  # the executor loads while the first baselines run
    with ScenarioExecutor(ctx, path) as server:
        for i, k in enumerate(ctx.profile.inference_ks):
            base = {
                "kind": "decode",
                "path": str(path),
                "prompt_len": ctx.profile.prompt_len,
                "tokens": ctx.profile.decode_tokens,
                "seed": 7,
            }
            shift = i % len(rotation)
            for system in rotation[shift:] + rotation[:shift]:
                mode, role, per_adapter = LAYOUT[system]
                adapters = [[j] for j in range(k)] if per_adapter else [list(range(k))]
                specs = [dict(base, mode=mode, role=role, adapters=a) for a in adapters]
                group = run_group(ctx, specs, server=server if mode == "split" else None)
                latencies = [s for e in group.events for s in e["token_latency_s"] for _ in range(e["sequences"])]
                runs[system][str(k)] = {
                    "tokens_per_s": group.tokens_per_s(),
                    "latency_ms_p50": 1e3 * percentile(latencies, 50),
                    "latency_ms_p95": 1e3 * percentile(latencies, 95),
                    "span_s": group.span_s,
                    **group.memory(),
                }
                ctx.log(
                    f"  {system:21s} K={k}: {runs[system][str(k)]['tokens_per_s']:.1f} tokens/s, p50 "
                    f"{runs[system][str(k)]['latency_ms_p50']:.1f} ms"
                )
    per_k = []
    for k in map(str, ctx.profile.inference_ks):
        row = {"k": int(k)}
        for system in SYSTEMS:
            row[f"{system}_tokens_per_s"] = runs[system][k]["tokens_per_s"]
            row[f"{system}_latency_ms_p50"] = runs[system][k]["latency_ms_p50"]
            row[f"{system}_latency_ms_p95"] = runs[system][k]["latency_ms_p95"]
        row["throughput_ratio_vs_mixed"] = ratio(row["symbiosis_tokens_per_s"], row["hf_mixed_batch_tokens_per_s"])
        row["throughput_ratio_vs_per_adapter"] = ratio(
            row["symbiosis_tokens_per_s"], row["hf_per_adapter_tokens_per_s"]
        )
        row["symbiosis_mixed_vs_hf_mixed"] = ratio(
            row["symbiosis_mixed_batch_tokens_per_s"], row["hf_mixed_batch_tokens_per_s"]
        )
        per_k.append(row)
    targets = {key: target_verdict(per_k, key, what, target) for key, what, target in TARGETS}
    last = per_k[-1]
    headline = [
        (
            f"K={last['k']} adapters: Symbiosis (one client process per adapter) {last['symbiosis_tokens_per_s']:.1f} "
            "tokens/s vs HF PEFT mixed batch "
            f"{last['hf_mixed_batch_tokens_per_s']:.1f} (x{last['throughput_ratio_vs_mixed']:.2f}) and one HF process "
            "per adapter "
            f"{last['hf_per_adapter_tokens_per_s']:.1f} (x{last['throughput_ratio_vs_per_adapter']:.2f}); p50/p95 "
            "per-token latency "
            f"{last['symbiosis_latency_ms_p50']:.0f}/{last['symbiosis_latency_ms_p95']:.0f} ms vs "
            f"{last['hf_mixed_batch_latency_ms_p50']:.0f}/"
            f"{last['hf_mixed_batch_latency_ms_p95']:.0f} ms (mixed)."
        ),
        (
            f"K={last['k']} adapters, one mixed-adapter batch: Symbiosis (split client, in-process executor) "
            f"{last['symbiosis_mixed_batch_tokens_per_s']:.1f} "
            f"tokens/s vs HF PEFT {last['hf_mixed_batch_tokens_per_s']:.1f} "
            f"(x{last['symbiosis_mixed_vs_hf_mixed']:.2f}); p50/p95 per-token latency "
            f"{last['symbiosis_mixed_batch_latency_ms_p50']:.0f}/{last['symbiosis_mixed_batch_latency_ms_p95']:.0f} "
            "ms vs "
            f"{last['hf_mixed_batch_latency_ms_p50']:.0f}/{last['hf_mixed_batch_latency_ms_p95']:.0f} ms."
        ),
        *[verdict["line"] for verdict in targets.values()],
    ]
    losses = [
        f"throughput vs {name}: " + ", ".join(f"K={r['k']} x{r[key]:.2f}" for r in per_k if r[key] < 1) + "."
        for key, name in (
            ("throughput_ratio_vs_mixed", "HF PEFT mixed-adapter batches (Symbiosis: one process per adapter)"),
            ("throughput_ratio_vs_per_adapter", "one HF PEFT process per adapter"),
            (
                "symbiosis_mixed_vs_hf_mixed",
                "HF PEFT mixed-adapter batches (Symbiosis: one mixed batch, in-process executor)",
            ),
        )
        if any(r[key] < 1 for r in per_k)
    ]
    losses += [verdict["line"] for verdict in targets.values() if not verdict["pass"]]
    columns = [
        (f"{s}_{m}", f"{s} {m.replace('_', ' ')}")
        for s in SYSTEMS
        for m in ("tokens_per_s", "latency_ms_p50", "latency_ms_p95")
    ]
    columns += [(key, f"{key} (target x{target:g})") for key, _, target in TARGETS]
    table = common_table(["K", *[c[1] for c in columns]], [[r["k"], *[r[c[0]] for c in columns]] for r in per_k])
    labels = [str(k) for k in ctx.profile.inference_ks]
    panels = [
        Panel(
            "aggregate decode tokens/s",
            "tokens/s",
            labels,
            {s: [runs[s][k]["tokens_per_s"] for k in labels] for s in SYSTEMS},
        ),
        Panel(
            "per-token latency p50 (p95 in the table)",
            "ms",
            labels,
            {s: [runs[s][k]["latency_ms_p50"] for k in labels] for s in SYSTEMS},
        ),
    ]
    systems = {
        "symbiosis": {
            "processes": "one split client per adapter + the executor process",
            "transport": "shm+ipc",
            "env": env_record(ctx.threads, "split"),
        },
        "symbiosis_mixed_batch": {
            "processes": "one split client decoding all K requests (adapter_names=), BaseExecutor in the same process",
            "transport": "in-process",
            "env": env_record(ctx.threads, "embedded"),
        },
        "hf_mixed_batch": {
            "processes": "one transformers+peft process decoding all K requests (adapter_names=)",
            "env": env_record(ctx.threads, "monolithic"),
        },
        "hf_per_adapter": {
            "processes": "one transformers+peft process per adapter",
            "env": env_record(ctx.threads, "monolithic"),
        },
    }
    return finish(
        ctx,
        "multi_adapter_inference",
        {"runs": runs, "per_k": per_k, "targets": targets},
        headline,
        losses,
        table,
        panels,
        f"K adapters decoding at once ({ctx.profile.preset}); x axis: K",
        {
            "ks": ctx.profile.inference_ks,
            "prompt_len": ctx.profile.prompt_len,
            "decode_tokens": ctx.profile.decode_tokens,
            "model": str(path),
            "adapter": "LoRA r=8 on q,k,v,o_proj, one per request",
            "transport": "shm+ipc (symbiosis); in-process (symbiosis_mixed_batch)",
            "sequences_per_client": 1,
            "systems": systems,
            "executor_env": env_record(ctx.executor_thread_count),
        },
    )


def target_verdict(per_k: list[dict], key: str, what: str, target: float) -> dict[str, Any]:
    """PASS when ``key`` reaches ``target`` at every K of the run."""
    values = {str(r["k"]): r[key] for r in per_k}
    passed = all(v is not None and not math.isnan(v) and v >= target for v in values.values())
    line = (
        f"Target {what} >= x{target:g}: {'PASS' if passed else 'MISS'} ("
        + ", ".join(f"K={k} x{v:.2f}" for k, v in values.items())
        + ")."
    )
    return {"target": target, "per_k": values, "pass": passed, "line": line}
