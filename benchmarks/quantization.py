"""A quantized base (issue 13): int8 and fp8-rowwise executors against fp32, side by side in one run.

Sections (each writes its part of ``quantization.json``; the PNG shows the headline figures):

- ``bytes``: the executor's stored weight bytes (``weights.nbytes()``: codes, scales, biases) and
  the resident memory a fresh process gains by loading it (RSS after minus before; each variant in
  its own child process), plus that child's peak RSS while loading.
- ``kernels``: one decode step's base-layer products (every layer of the model once) at several
  row counts, per stored form: where fbgemm beats BLAS on fp32 and where dequantizing takes over
  (``quantized.FBGEMM_MAX_ROWS``); backward too.
- ``decode``: 8 client threads decoding at once against one in-process executor (their rows batch
  together), aggregate tokens/s, fp32/int8/fp8 executors rotated round by round.
- ``train``: one LoRA client's training step (forward, backward, optimizer), rotated likewise.
- ``quality``: logits of the quantized split model vs the fp32 one (relative error, top-1
  agreement) on random prompts, and the demo's four fine-tuning tasks trained against each base,
  with the int8-trained adapters then loaded on the fp32 monolithic model with plain peft.
- ``jobs``: (full runs) how many ~1B-model fine-tuning jobs fit in 24 GiB: ``executor peak + n x
  client peak <= 24 GiB``, from the peaks of a ``symbiosis serve --quantization`` process and a
  client process doing one training step, as ``benchmarks/scenarios/multi_job_finetune.py`` does.

``python -m benchmarks.quantization --output docs/benchmarks/quantization`` (75 minutes on 2 shared
cores, most of it the quality section's 12 fine-tuning runs); ``--quick`` runs the tiny preset in
about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import quantization_quality
from benchmarks.options import add_common_arguments, checkpoint_path, resolve_common
from benchmarks.plots import Panel, plot_panels
from benchmarks.results import command_line, machine_info, repo_root, write_json
from benchmarks.timing import ratio, time_interleaved

VARIANTS = quantization_quality.VARIANTS
TARGETS = {"bytes_ratio_max": 0.27, "decode_ratio_min": 1.2, "train_ratio_max": 1.2}
BUDGET_GIB = quantization_quality.BUDGET_GIB
_quantization = quantization_quality.quantization_of
_executor = quantization_quality.executor_of
_client = quantization_quality.client_of


# ---- bytes ---------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_load(path: str, variant: str) -> dict[str, Any]:
    """In a fresh process: RSS before and after loading the executor, its stored bytes, the peak."""
    import resource

    import symbiosis  # noqa: F401  (imports counted in the baseline)
    from symbiosis.checkpoint import Checkpoint, build_skeleton

    build_skeleton(Checkpoint(path).config)  # transformers' model classes imported: baseline
    before = _rss_bytes()
    executor = _executor(Path(path), variant)
    after = _rss_bytes()
    result = {
        "weights_bytes": executor.weights.nbytes(),
        "rss_gain_bytes": after - before,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "kernels": executor.weights.kernels(),
    }
    executor.close()
    return result


def section_bytes(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for variant in VARIANTS:
        code = "import json,sys; from benchmarks import quantization as q; print(json.dumps(q.measure_load(*sys.argv[1:])))"  # noqa: E501
        done = subprocess.run(
            [sys.executable, "-c", code, str(path), variant],
            capture_output=True,
            text=True,
            check=True,
            cwd=repo_root(),
        )
        out[variant] = json.loads(done.stdout.strip().splitlines()[-1])
    for variant in VARIANTS:
        out[variant]["bytes_ratio"] = ratio(out[variant]["weights_bytes"], out["fp32"]["weights_bytes"])
        out[variant]["rss_gain_ratio"] = ratio(out[variant]["rss_gain_bytes"], out["fp32"]["rss_gain_bytes"])
    return out


# ---- kernels -------------------------------------------------------------------------------------


def section_kernels(path: Path, row_counts: list[int], repeats: int) -> dict[str, Any]:
    """Every base layer's product once (one decode step's worth of weights), per stored form."""
    from symbiosis.executor import quantized as Q
    from symbiosis.vocabulary import Op

    executors = {v: _executor(path, v) for v in VARIANTS}
    layers = {v: [ex.weights.layers[name] for name in ex.weights.specs] for v, ex in executors.items()}
    specs = list(executors["fp32"].weights.specs.values())
    from symbiosis.executor.runner import apply_op

    def products(variant: str, op: Op, rows: int, fbgemm_rows: int | None = None):
        inputs = [torch.randn(rows, s.out_features if op is Op.BACKWARD else s.in_features) for s in specs]

        def run():
            saved = Q.FBGEMM_MAX_ROWS
            if fbgemm_rows is not None:
                Q.FBGEMM_MAX_ROWS = fbgemm_rows
            try:
                for layer, x in zip(layers[variant], inputs):
                    apply_op(layer, op, x)
            finally:
                Q.FBGEMM_MAX_ROWS = saved

        return run

    results: dict[str, Any] = {"forward": {}, "backward": {}}
    for rows in row_counts:
        candidates = {v: products(v, Op.FORWARD, rows) for v in VARIANTS}
        candidates["int8 (fbgemm forced)"] = products("int8", Op.FORWARD, rows, fbgemm_rows=1 << 30)
        candidates["int8 (dequantize forced)"] = products("int8", Op.FORWARD, rows, fbgemm_rows=0)
        samples = time_interleaved(candidates, warmup=1, repeats=repeats)
        results["forward"][str(rows)] = {name: 1e3 * statistics.median(s) for name, s in samples.items()}
    for rows in row_counts[-2:]:
        samples = time_interleaved({v: products(v, Op.BACKWARD, rows) for v in VARIANTS}, warmup=1, repeats=repeats)
        results["backward"][str(rows)] = {name: 1e3 * statistics.median(s) for name, s in samples.items()}
    for ex in executors.values():
        ex.close()
    results["fbgemm_max_rows"] = Q.FBGEMM_MAX_ROWS
    return results


# ---- decode and training -----------------------------------------------------------------------------


def _decode_round(clients: list, prompt_len: int, new_tokens: int) -> float:
    """All clients generate ``new_tokens`` greedy tokens at once; aggregate tokens/s."""
    barrier = threading.Barrier(len(clients) + 1)
    errors: list[BaseException] = []

    def work(model, seed):
        ids = torch.randint(3, 1000, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
        barrier.wait()
        try:
            with torch.no_grad():
                model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
        except BaseException as exc:  # reported after the round
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(m, i)) for i, m in enumerate(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return len(clients) * new_tokens / (time.perf_counter() - start)


def section_decode(path: Path, clients_n: int, new_tokens: int, rounds: int) -> dict[str, Any]:
    executors = {v: _executor(path, v) for v in VARIANTS}
    clients = {v: [_client(path, ex, f"decode-{v}-{i}") for i in range(clients_n)] for v, ex in executors.items()}
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    _decode_round(clients["fp32"], 8, 2)  # warm-up
    for r in range(rounds):
        order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
        for v in order:
            samples[v].append(_decode_round(clients[v], 8, new_tokens))
    stats = {v: executors[v].stats() for v in VARIANTS}
    for v in VARIANTS:
        for model in clients[v]:
            model.symbiosis_transport.close()
        executors[v].close()
    out = {v: {"tokens_per_s": statistics.median(s), "samples": s} for v, s in samples.items()}
    for v in VARIANTS:
        out[v]["ratio_to_fp32"] = ratio(out[v]["tokens_per_s"], out["fp32"]["tokens_per_s"])
        layers = stats[v]["layers"].values()
        batches = sum(layer["batches"] for layer in layers)
        out[v]["mean_rows_per_batch"] = sum(layer["mean_rows_per_batch"] * layer["batches"] for layer in layers) / max(
            1, batches
        )
    return out


def section_train(path: Path, batch: int, seq: int, steps: int) -> dict[str, Any]:
    import peft

    executors = {v: _executor(path, v) for v in VARIANTS}
    runs = {}
    for v, ex in executors.items():
        torch.manual_seed(0)
        model = peft.get_peft_model(_client(path, ex), peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        ids = torch.randint(3, 1000, (batch, seq), generator=torch.Generator().manual_seed(0))

        def step(model=model, optimizer=optimizer, ids=ids):
            optimizer.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()

        runs[v] = (model, step)
    samples = time_interleaved({v: run[1] for v, run in runs.items()}, warmup=1, repeats=steps)
    for v, (model, _) in runs.items():
        model.get_base_model().symbiosis_transport.close()
        executors[v].close()
    out = {v: {"step_s": statistics.median(s), "samples_s": s} for v, s in samples.items()}
    for v in VARIANTS:
        out[v]["ratio_to_fp32"] = ratio(out[v]["step_s"], out["fp32"]["step_s"])
    return out


# ---- driver --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_arguments(parser, default_repeats=5, quick_repeats=2)
    parser.add_argument(
        "--sections",
        nargs="*",
        default=["bytes", "kernels", "decode", "train", "quality", "jobs"],
        help="Which sections to run (default: all; --quick skips jobs).",
    )
    args = parser.parse_args(argv)
    if args.preset is None and not args.quick:
        args.preset = "base"
    args = resolve_common(args)
    started = time.perf_counter()
    machine = machine_info()
    path = checkpoint_path(args)
    from symbiosis.modelzoo import make_model

    tiny = make_model("llama", "tiny", Path(args.cache) / "llama-tiny-seed0", seed=0)
    workdir = Path(tempfile.mkdtemp(prefix="symbiosis-quantization-"))  # adapters, sockets: not results
    quick = args.quick
    results: dict[str, Any] = {}
    sections = [s for s in args.sections if not (quick and s == "jobs")]
    for section in sections:
        print(f"[quantization] {section} ...", flush=True)
        t0 = time.perf_counter()
        if section == "bytes":
            results["bytes"] = section_bytes(path)
        elif section == "kernels":
            results["kernels"] = section_kernels(path, [1, 8] if quick else [1, 8, 64, 256, 1024], args.repeats)
        elif section == "decode":
            results["decode"] = section_decode(path, 8, 4 if quick else 16, args.repeats)
        elif section == "train":
            batch, seq = (2, 16) if quick else (8, 128)
            results["train"] = dict(section_train(path, batch, seq, args.repeats), batch=batch, seq_len=seq)
        elif section == "quality":
            methods = ["lora"] if quick else ["lora", "ia3", "prefix", "loha"]
            results["quality"] = quantization_quality.section_quality(
                path, tiny, methods, 20 if quick else None, workdir
            )
        elif section == "jobs":
            results["jobs"] = quantization_quality.section_jobs(Path(args.cache), workdir)
        else:
            raise SystemExit(f"unknown section {section!r}")
        print(f"[quantization] {section} done in {time.perf_counter() - t0:.0f} s", flush=True)
        write_json(Path(args.output) / "quantization.partial.json", results)  # a long run's sections so far
    summary = {
        "benchmark": "quantization",
        "command": command_line(argv, "benchmarks.quantization"),
        "model": str(path),
        "preset": args.preset,
        "machine": machine,
        "wall_s": time.perf_counter() - started,
        "targets": TARGETS,
        "results": results,
        "headline": headline(results),
    }
    shutil.rmtree(workdir, ignore_errors=True)
    out = Path(args.output)
    write_json(out / "quantization.json", summary)
    (out / "quantization.partial.json").unlink(missing_ok=True)
    plot(out / "quantization.png", results, args.preset)
    for line in summary["headline"]:
        print(line)
    return summary


def headline(results: dict[str, Any]) -> list[str]:
    lines = []

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "MISS"

    if "bytes" in results:
        b, most = results["bytes"], TARGETS["bytes_ratio_max"]
        stored = [
            f"{v} x{b[v]['bytes_ratio']:.3f} ({verdict(b[v]['bytes_ratio'] <= most)} <= x{most})" for v in VARIANTS[1:]
        ]
        gained = [f"{v} x{b[v]['rss_gain_ratio']:.3f}" for v in VARIANTS[1:]]
        lines.append(
            f"Stored weight bytes vs fp32 (scales included): {', '.join(stored)}; "
            f"resident memory a fresh process gains by loading: {', '.join(gained)}."
        )
    if "decode" in results:
        d, least = results["decode"], TARGETS["decode_ratio_min"]
        int8, fp8 = d["int8"], d["fp8-rowwise"]
        lines.append(
            f"Decode, 8 clients: fp32 {d['fp32']['tokens_per_s']:.1f} tokens/s, int8 {int8['tokens_per_s']:.1f} "
            f"(x{int8['ratio_to_fp32']:.2f}, {verdict(int8['ratio_to_fp32'] >= least)} >= x{least}), "
            f"fp8-rowwise {fp8['tokens_per_s']:.1f} (x{fp8['ratio_to_fp32']:.2f}; dequantize-then-matmul on CPU)."
        )
    if "train" in results:
        t, most = results["train"], TARGETS["train_ratio_max"]
        int8, fp8 = t["int8"]["ratio_to_fp32"], t["fp8-rowwise"]["ratio_to_fp32"]
        lines.append(
            f"Training step ({t['batch']}x{t['seq_len']} tokens, LoRA): fp32 {t['fp32']['step_s']:.2f} s, "
            f"int8 x{int8:.2f} ({verdict(int8 <= most)} <= x{most}), fp8-rowwise x{fp8:.2f}."
        )
    if "quality" in results:
        q = results["quality"]
        parts = [
            f"{v} relative error {q['logits'][v]['relative_error']:.4f}, top-1 {q['logits'][v]['top1_agreement']:.3f}"
            for v in VARIANTS[1:]
        ]
        lines.append("Logits vs fp32: " + "; ".join(parts) + ".")
        for method, row in q["tasks"].items():
            accuracies = ", ".join(f"{v} {row[v]['accuracy_after']:.2f}" for v in VARIANTS)
            lines.append(
                f"Task accuracy after fine-tuning ({method}, {row['fp32']['task']}): {accuracies}; the int8-trained "
                f"adapter on the fp32 monolithic model (plain peft): {row['int8_adapter_on_fp32_monolithic']:.2f}."
            )
    if "jobs" in results and "skipped" not in results["jobs"]:
        j = results["jobs"]
        fits = [f"{v} {j[v]['jobs_in_budget']} (executor peak {j[v]['executor_peak_gib']:.2f} GiB)" for v in VARIANTS]
        hf = f"; HF PEFT {j['hf_peft_jobs_in_budget']}" if "hf_peft_jobs_in_budget" in j else ""
        lines.append(f"~1B-model fine-tuning jobs in {BUDGET_GIB:g} GiB: {', '.join(fits)}{hf}.")
    return lines


def plot(path: Path, results: dict[str, Any], preset: str) -> None:
    panels = []
    if "bytes" in results:
        panels.append(
            Panel(
                "stored weight bytes",
                "MiB",
                list(VARIANTS),
                {"bytes": [results["bytes"][v]["weights_bytes"] / 2**20 for v in VARIANTS]},
            )
        )
    if "decode" in results:
        panels.append(
            Panel(
                "decode, 8 clients",
                "tokens/s",
                list(VARIANTS),
                {"tokens/s": [results["decode"][v]["tokens_per_s"] for v in VARIANTS]},
            )
        )
    if "train" in results:
        panels.append(
            Panel("training step", "s", list(VARIANTS), {"step": [results["train"][v]["step_s"] for v in VARIANTS]})
        )
    if "kernels" in results:
        rows = list(results["kernels"]["forward"])
        panels.append(
            Panel(
                "forward products of every layer, by rows",
                "ms",
                rows,
                {
                    name: [results["kernels"]["forward"][r][name] for r in rows]
                    for name in results["kernels"]["forward"][rows[0]]
                },
                kind="line",
                log_y=True,
            )
        )
    if "quality" in results and results["quality"]["tasks"]:
        methods = list(results["quality"]["tasks"])
        panels.append(
            Panel(
                "task accuracy after fine-tuning",
                "exact match",
                methods,
                {v: [results["quality"]["tasks"][m][v]["accuracy_after"] for m in methods] for v in VARIANTS},
            )
        )
    if "jobs" in results and "skipped" not in results["jobs"]:
        panels.append(
            Panel(
                f"~1B fine-tuning jobs in {BUDGET_GIB:g} GiB",
                "jobs",
                list(VARIANTS),
                {"jobs": [results["jobs"][v]["jobs_in_budget"] for v in VARIANTS]},
            )
        )
    if panels:  # a run of sections that were all skipped has nothing to draw
        plot_panels(path, f"Quantized base ({preset} preset) vs fp32", panels)


if __name__ == "__main__":
    main()
