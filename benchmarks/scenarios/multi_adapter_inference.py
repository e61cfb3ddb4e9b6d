"""Scenario 3, ``multi_adapter_inference``: K clients, each with its own LoRA adapter, decode
greedily at once, vs (a) one ``transformers+peft`` process decoding all K requests as one
mixed-adapter batch (``adapter_names=``), (b) one ``transformers+peft`` process per adapter.
Aggregate tokens/s and p50/p95 per-token latency (time of one decode step, pooled over requests).

``results``: ``runs, per_k``.
"""

from __future__ import annotations

from typing import Any

from benchmarks import common
from benchmarks.scenarios.context import Context, common_table, finish
from benchmarks.scenarios.processes import ScenarioExecutor, run_group


def run(ctx: Context) -> dict:
    path = ctx.checkpoint()
    systems = ("symbiosis", "hf_mixed_batch", "hf_per_adapter")
    runs: dict[str, dict[str, Any]] = {s: {} for s in systems}
    rotation = ("hf_mixed_batch", "hf_per_adapter", "symbiosis")  # the executor loads while the first baseline runs
    with ScenarioExecutor(ctx, path) as server:
        for i, k in enumerate(ctx.profile.inference_ks):
            base = {"kind": "decode", "path": str(path), "prompt_len": ctx.profile.prompt_len, "tokens": ctx.profile.decode_tokens, "seed": 7}
            for system in rotation[i % 3 :] + rotation[: i % 3]:
                if system == "hf_mixed_batch":
                    specs = [dict(base, mode="monolithic", role="job", adapters=list(range(k)))]
                else:
                    mode, role = ("split", "client") if system == "symbiosis" else ("monolithic", "job")
                    specs = [dict(base, mode=mode, role=role, adapters=[j]) for j in range(k)]
                group = run_group(ctx, specs, server=server if system == "symbiosis" else None)
                latencies = [s for e in group.events for s in e["token_latency_s"] for _ in range(e["sequences"])]
                runs[system][str(k)] = {"tokens_per_s": group.tokens_per_s(), "latency_ms_p50": 1e3 * common.percentile(latencies, 50),
                                        "latency_ms_p95": 1e3 * common.percentile(latencies, 95), "span_s": group.span_s, **group.memory()}
                ctx.log(f"  {system:14s} K={k}: {runs[system][str(k)]['tokens_per_s']:.1f} tokens/s, p50 {runs[system][str(k)]['latency_ms_p50']:.1f} ms")
    per_k = []
    for k in map(str, ctx.profile.inference_ks):
        row = {"k": int(k)}
        for system in systems:
            row[f"{system}_tokens_per_s"] = runs[system][k]["tokens_per_s"]
            row[f"{system}_latency_ms_p50"] = runs[system][k]["latency_ms_p50"]
            row[f"{system}_latency_ms_p95"] = runs[system][k]["latency_ms_p95"]
        row["throughput_ratio_vs_mixed"] = common.ratio(row["symbiosis_tokens_per_s"], row["hf_mixed_batch_tokens_per_s"])
        row["throughput_ratio_vs_per_adapter"] = common.ratio(row["symbiosis_tokens_per_s"], row["hf_per_adapter_tokens_per_s"])
        per_k.append(row)
    last = per_k[-1]
    headline = [f"K={last['k']} adapters: Symbiosis {last['symbiosis_tokens_per_s']:.1f} tokens/s vs HF PEFT mixed batch {last['hf_mixed_batch_tokens_per_s']:.1f} "
                f"(x{last['throughput_ratio_vs_mixed']:.2f}) and one HF process per adapter {last['hf_per_adapter_tokens_per_s']:.1f} (x{last['throughput_ratio_vs_per_adapter']:.2f}); "
                f"p50/p95 per-token latency {last['symbiosis_latency_ms_p50']:.0f}/{last['symbiosis_latency_ms_p95']:.0f} ms vs {last['hf_mixed_batch_latency_ms_p50']:.0f}/{last['hf_mixed_batch_latency_ms_p95']:.0f} ms (mixed)."]
    losses = [f"throughput vs {name}: " + ", ".join(f"K={r['k']} x{r[key]:.2f}" for r in per_k if r[key] < 1) + "."
              for key, name in (("throughput_ratio_vs_mixed", "HF PEFT mixed-adapter batches"), ("throughput_ratio_vs_per_adapter", "one HF PEFT process per adapter"))
              if any(r[key] < 1 for r in per_k)]
    columns = [(f"{s}_{m}", f"{s} {m.replace('_', ' ')}") for s in systems for m in ("tokens_per_s", "latency_ms_p50", "latency_ms_p95")]
    table = common_table(["K", *[c[1] for c in columns]], [[r["k"], *[r[c[0]] for c in columns]] for r in per_k])
    labels = [str(k) for k in ctx.profile.inference_ks]
    panels = [common.Panel("aggregate decode tokens/s", "tokens/s", labels, {s: [runs[s][k]["tokens_per_s"] for k in labels] for s in systems}),
              common.Panel("per-token latency p50 (p95 in the table)", "ms", labels, {s: [runs[s][k]["latency_ms_p50"] for k in labels] for s in systems})]
    return finish(ctx, "multi_adapter_inference", {"runs": runs, "per_k": per_k}, headline, losses, table, panels, f"K adapters decoding at once ({ctx.profile.preset}); x axis: K",
                  {"ks": ctx.profile.inference_ks, "prompt_len": ctx.profile.prompt_len, "decode_tokens": ctx.profile.decode_tokens, "model": str(path),
                   "adapter": "LoRA r=8 on q,k,v,o_proj, one per request", "transport": "shm+ipc", "sequences_per_client": 1})
