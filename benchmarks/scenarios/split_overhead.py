"""Scenario 4, ``split_overhead``: one client per transport (inproc, shm+ipc, ipc, tcp, dist+tcp
when present) vs the monolithic model: training step and decode step, interleaved
(``benchmarks.transport.step_ratios``).

``results``: ``train_step, decode_step, check, dist``.
"""

from __future__ import annotations

from benchmarks import common
from benchmarks.scenarios.context import Context, common_table, finish


def run(ctx: Context) -> dict:
    from benchmarks.transport import step_ratios

    path = ctx.checkpoint()
    quick = ctx.quick
    steps = step_ratios(path, train_batch=1 if quick else 2, seq_len=32 if quick else 64, decode_batch=1, prompt_len=ctx.profile.prompt_len,
                        warmup=1 if quick else 2, repeats=ctx.profile.step_repeats, threads=ctx.threads)
    train, decode = steps["train_step"]["ratio_over_monolithic"], steps["decode_step"]["ratio_over_monolithic"]
    headline = ["Split / monolithic, training step: " + ", ".join(f"{t} x{r:.2f}" for t, r in train.items()) + "; decode step: " + ", ".join(f"{t} x{r:.2f}" for t, r in decode.items()) + "."]
    losses = [f"a {kind} step costs " + ", ".join(f"x{r:.2f} over {t}" for t, r in ratios.items() if r > 1.05) + " the monolithic time."
              for kind, ratios in (("training", train), ("decode", decode)) if any(r > 1.05 for r in ratios.values())]
    if not steps["dist"]["available"]:
        losses.append(f"dist+tcp not measured: {steps['dist']['reason']}")
    names = list(train)
    table = common_table(["candidate", "train median ms", "train ratio", "decode median ms", "decode ratio"],
                         [["monolithic", steps["train_step"]["monolithic"]["median_ms"], 1.0, steps["decode_step"]["monolithic"]["median_ms"], 1.0]]
                         + [[n, steps["train_step"][n]["median_ms"], train[n], steps["decode_step"][n]["median_ms"], decode[n]] for n in names])
    panels = [common.Panel("split / monolithic (medians, 1.0 = free)", "ratio", names, {"training step": [train[n] for n in names], "decode step": [decode[n] for n in names]})]
    results = {k: steps[k] for k in ("train_step", "decode_step", "check", "dist")}
    return finish(ctx, "split_overhead", results, headline, losses, table, panels, f"One client per transport vs monolithic ({ctx.profile.preset})", steps["config"])
