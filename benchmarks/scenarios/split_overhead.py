"""Scenario 4, ``split_overhead``: one client per transport (inproc, shm+ipc, ipc, tcp, dist+tcp
when it works) vs the monolithic model: training step and decode step (one sequence), each system
in its own process, round-robin (``benchmarks.split_overhead.measure``), against the targets of
``benchmarks.split_overhead.TARGETS``.

``results``: ``train_step, decode_step`` (each ``{system: timing}`` with ``ratio_over_monolithic,
target, verdict`` per split system, plus ``ratio_over_monolithic: {system: ratio}``), ``check``,
``dist``, ``unavailable`` and ``verdicts``.
"""

from __future__ import annotations

from benchmarks.plots import Panel
from benchmarks.scenarios.context import Context, common_table, finish


def run(ctx: Context) -> dict:
    from benchmarks.split_overhead import SYSTEMS, measure, summarize

    path = ctx.checkpoint()
    quick = ctx.quick
    model = f"llama-{ctx.profile.preset}"
    sizes = {
        "train_batch": 1 if quick else 2,
        "seq_len": 32 if quick else 64,
        "prompt_len": ctx.profile.prompt_len,
        "rounds": ctx.profile.step_repeats,
        "decode_steps": 2 if quick else 4,
        "train_steps": 1,
    }
    systems = ctx.profile.split_systems or SYSTEMS
    measured = measure({model: path}, systems=systems, decode_batches=(1,), threads=ctx.threads, log=ctx.log, **sizes)
    summary = summarize(measured, (1,))
    steps = {"train_step": summary["results"][model]["train"], "decode_step": summary["results"][model]["decode_b1"]}
    for step in steps.values():
        step["ratio_over_monolithic"] = {
            n: t["ratio_over_monolithic"] for n, t in list(step.items()) if n != "monolithic"
        }
    train, decode = steps["train_step"]["ratio_over_monolithic"], steps["decode_step"]["ratio_over_monolithic"]
    verdicts = summary["verdicts"]
    headline = [
        "Split / monolithic, one process per system, training step: "
        + ", ".join(f"{t} x{r:.2f}" for t, r in train.items())
        + "; decode step: "
        + ", ".join(f"{t} x{r:.2f}" for t, r in decode.items())
        + f"; {sum(v['verdict'] == 'PASS' for v in verdicts)} of {len(verdicts)} within target."
    ]
    losses = [
        f"{'training' if v['step'] == 'train' else 'decode'} step over {v['system']}: x{v['ratio']:.2f}, target "
        f"x{v['target']:g}."
        for v in verdicts
        if v["verdict"] == "MISS"
    ]
    losses += [f"{system} not measured: {reason}" for system, reason in measured["unavailable"].items()]
    names = list(train)
    rows = [
        [
            "monolithic",
            steps["train_step"]["monolithic"]["median_ms"],
            1.0,
            "–",
            steps["decode_step"]["monolithic"]["median_ms"],
            1.0,
            "–",
        ]
    ]
    for n in names:
        t, d = steps["train_step"][n], steps["decode_step"][n]
        rows.append(
            [
                n,
                t["median_ms"],
                train[n],
                f"{t['target']:g} {t['verdict']}",
                d["median_ms"],
                decode[n],
                f"{d['target']:g} {d['verdict']}",
            ]
        )
    table = common_table(
        [
            "candidate",
            "train median ms",
            "train ratio",
            "train target",
            "decode median ms",
            "decode ratio",
            "decode target",
        ],
        rows,
    )
    panels = [
        Panel(
            "split / monolithic (medians, 1.0 = free)",
            "ratio",
            names,
            {"training step": [train[n] for n in names], "decode step": [decode[n] for n in names]},
        )
    ]
    results = {
        **steps,
        "check": summary["check"][model],
        "dist": measured["dist"],
        "unavailable": measured["unavailable"],
        "verdicts": verdicts,
    }
    config = {
        "model": str(path),
        "decode_batch": 1,
        "systems": list(systems),
        **sizes,
        "scheduling": "one process per system, rounds rotate the order, one system computes at a time",
    }
    return finish(
        ctx,
        "split_overhead",
        results,
        headline,
        losses,
        table,
        panels,
        f"One client per transport vs monolithic ({ctx.profile.preset})",
        config,
    )
