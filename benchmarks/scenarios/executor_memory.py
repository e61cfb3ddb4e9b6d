"""Scenario 2, ``executor_memory``: one executor process; 0, 1, 2, 4, 8, 16 training clients
(cumulative), each level running a few steps of every client; executor RSS per level (should stay
flat).

``results``: ``levels, executor_rss_growth``.
"""

from __future__ import annotations

import statistics
import time

from benchmarks.memory import GIB, RssSampler
from benchmarks.plots import Panel
from benchmarks.scenarios.context import Context, common_table, finish
from benchmarks.scenarios.processes import WORKER_MODULE, ScenarioExecutor, finetune_spec
from benchmarks.timing import ratio
from benchmarks.workers import Worker


def run(ctx: Context) -> dict:
    path = ctx.checkpoint()
    levels = []
    workers: list[Worker] = []
    with ScenarioExecutor(ctx, path) as server:
        server.wait_ready()  # level 0 is the loaded, idle executor
        try:
            for n in ctx.profile.memory_levels:
                sampler = RssSampler(0.1)
                sampler.watch(server.pid, "executor")
                for worker in workers:
                    sampler.watch(worker.pid, "client")
                sampler.start()
                while len(workers) < n:
                    spec = dict(
                        finetune_spec(ctx, path, "split", len(workers), steps=ctx.profile.memory_steps),
                        executor="shm+" + server.addresses[0],
                    )
                    workers.append(Worker(WORKER_MODULE, spec, threads=ctx.threads))
                    sampler.watch(workers[-1].pid, "client")
                for worker in workers:
                    worker.wait_ready()
                for worker in workers:
                    worker.go()
                for worker in workers:
                    worker.wait_done()
                if n == 0:
                    time.sleep(1.0)
                sampler.stop()
                levels.append(
                    {
                        "clients": n,
                        "executor_peak_rss_gib": max(sampler.peaks_of("executor")) / GIB,
                        "executor_end_rss_gib": sampler.last_by_pid[server.pid] / GIB,
                        "client_peak_rss_gib_median": statistics.median(sampler.peaks_of("client")) / GIB
                        if n
                        else None,
                    }
                )
                ctx.log(f"  {n:>2} clients: executor peak RSS {levels[-1]['executor_peak_rss_gib']:.3f} GiB")
        finally:
            for worker in workers:
                worker.request_exit()
            for worker in workers:
                worker.close()
    first_busy = next((lv for lv in levels if lv["clients"] > 0), levels[0])
    growth = {
        "last_over_first_busy": ratio(levels[-1]["executor_peak_rss_gib"], first_busy["executor_peak_rss_gib"]),
        "last_over_idle": ratio(levels[-1]["executor_peak_rss_gib"], levels[0]["executor_peak_rss_gib"]),
        "max_minus_min_mib": (
            max(lv["executor_peak_rss_gib"] for lv in levels) - min(lv["executor_peak_rss_gib"] for lv in levels)
        )
        * 1024,
    }
    headline = [
        f"Executor peak RSS with {levels[-1]['clients']} training clients is x{growth['last_over_first_busy']:.3f} "
        f"its value with {first_busy['clients']} "
        f"(x{growth['last_over_idle']:.3f} of idle); spread {growth['max_minus_min_mib']:.0f} MiB across levels."
    ]
    losses = (
        []
        if growth["last_over_first_busy"] < 1.1
        else [f"Executor memory grew x{growth['last_over_first_busy']:.2f} from 1 to {levels[-1]['clients']} clients."]
    )
    table = common_table(
        ["clients", "executor peak GiB", "executor end GiB", "client peak GiB (median)"],
        [
            [lv["clients"], lv["executor_peak_rss_gib"], lv["executor_end_rss_gib"], lv["client_peak_rss_gib_median"]]
            for lv in levels
        ],
    )
    panels = [
        Panel(
            "executor RSS vs training clients",
            "GiB",
            [str(lv["clients"]) for lv in levels],
            {
                "peak": [lv["executor_peak_rss_gib"] for lv in levels],
                "end of level": [lv["executor_end_rss_gib"] for lv in levels],
            },
            kind="line",
        )
    ]
    return finish(
        ctx,
        "executor_memory",
        {"levels": levels, "executor_rss_growth": growth},
        headline,
        losses,
        table,
        panels,
        f"Executor memory vs clients ({ctx.profile.preset})",
        {
            "levels": ctx.profile.memory_levels,
            "steps_per_level": ctx.profile.memory_steps,
            "model": str(path),
            "transport": "shm+ipc",
            "clients": "cumulative: one executor process, clients added level by level",
        },
    )
