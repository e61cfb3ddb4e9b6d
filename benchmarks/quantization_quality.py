"""The quality and memory sections of ``benchmarks/quantization.py``: fine-tuning the demo's tasks
against a quantized base, logits against fp32, and how many ~1B-model jobs fit in 24 GiB."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks.memory import GIB
from benchmarks.results import repo_root

VARIANTS = ("fp32", "int8", "fp8-rowwise")
BUDGET_GIB = 24.0


def quantization_of(variant: str) -> str | None:
    return None if variant == "fp32" else variant


def executor_of(path: Path, variant: str):
    import symbiosis

    return symbiosis.BaseExecutor.from_pretrained(path, quantization=quantization_of(variant))


def client_of(path: Path, executor, client_id: str | None = None):
    import symbiosis

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return symbiosis.load_client_model(path, executor=executor, client_id=client_id)


# ---- quality ---------------------------------------------------------------------------------------


def finetune_task(
    path: Path,
    method: str,
    *,
    quantization: str | None,
    steps: int | None = None,
    save_to: Path | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Train the demo's ``method`` client (its task, learning rate and options) against an
    in-process executor with ``quantization``; held-out exact-match accuracy before and after."""
    import peft

    import symbiosis
    from symbiosis.jobs.artifacts import save_adapter
    from symbiosis.jobs.client import load_tokenizer
    from symbiosis.jobs.data import tokenize_all
    from symbiosis.jobs.demo import TUNERS
    from symbiosis.jobs.finetune import FinetuneRun, TrainOptions
    from symbiosis.jobs.methods import build_peft_config
    from symbiosis.jobs.tasks import exact_match_accuracy, get_task, make_split

    spec = next(t for t in TUNERS if t.method == method)
    steps = steps or spec.steps
    executor = symbiosis.BaseExecutor.from_pretrained(path, quantization=quantization)
    tokenizer = load_tokenizer(path)
    split = make_split(get_task(spec.task), n_held_out=48, seed=seed)
    model = client_of(path, executor)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = peft.get_peft_model(model, build_peft_config(method, model, spec.method_options, None))
    options = TrainOptions(
        steps=steps, lr=spec.lr, lr_schedule="cosine", warmup_steps=min(10, steps // 5), batch_size=16, seed=seed
    )
    run = FinetuneRun(
        peft_model, tokenize_all(tokenizer, split.train, 32), [], options, pad_token_id=tokenizer.pad_token_id
    )
    before = exact_match_accuracy(peft_model, tokenizer, split.held_out)
    started = time.perf_counter()
    run.train()
    seconds = time.perf_counter() - started
    after = exact_match_accuracy(peft_model, tokenizer, split.held_out)
    if save_to is not None:
        save_adapter(peft_model, save_to)
    model.symbiosis_transport.close()
    executor.close()
    return {
        "method": method,
        "task": spec.task,
        "steps": steps,
        "accuracy_before": before,
        "accuracy_after": after,
        "train_s": seconds,
        "held_out": split.held_out,
    }


def section_quality(
    path: Path, tiny_path: Path, methods: list[str], steps: int | None, workdir: Path
) -> dict[str, Any]:
    import peft
    from transformers import AutoModelForCausalLM

    from symbiosis.jobs.client import load_tokenizer
    from symbiosis.jobs.tasks import exact_match_accuracy

    ids = torch.randint(3, 1000, (4, 64), generator=torch.Generator().manual_seed(0))
    logits = {}
    for v in VARIANTS:
        ex = executor_of(path, v)
        model = client_of(path, ex)
        with torch.no_grad():
            logits[v] = model(input_ids=ids).logits
        model.symbiosis_transport.close()
        ex.close()
    out: dict[str, Any] = {"logits": {}, "tasks": {}}
    for v in VARIANTS:
        out["logits"][v] = {
            "relative_error": float((logits[v] - logits["fp32"]).norm() / logits["fp32"].norm()),
            "top1_agreement": float((logits[v].argmax(-1) == logits["fp32"].argmax(-1)).float().mean()),
        }
    tokenizer = load_tokenizer(tiny_path)
    for method in methods:
        rows = {}
        for v in VARIANTS:
            folder = workdir / f"{method}-{v}"
            rows[v] = finetune_task(tiny_path, method, quantization=quantization_of(v), steps=steps, save_to=folder)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            monolithic = peft.PeftModel.from_pretrained(
                AutoModelForCausalLM.from_pretrained(tiny_path), str(workdir / f"{method}-int8")
            )
        on_fp32 = exact_match_accuracy(monolithic, tokenizer, rows["int8"]["held_out"])
        out["tasks"][method] = {
            v: {k: r[k] for k in ("task", "steps", "accuracy_before", "accuracy_after", "train_s")}
            for v, r in rows.items()
        }
        out["tasks"][method]["int8_adapter_on_fp32_monolithic"] = on_fp32
    return out


# ---- jobs in 24 GiB ----------------------------------------------------------------------------


_CLIENT_STEP = """
import json, resource, sys, warnings, peft, torch, symbiosis
warnings.simplefilter("ignore")
model = symbiosis.load_client_model(sys.argv[1], executor=sys.argv[2])
model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear"))
ids = torch.randint(3, 1000, (1, 32))
model(input_ids=ids, labels=ids).loss.backward()
model.get_base_model().symbiosis_transport.close()
print(json.dumps({"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def section_jobs(cache: Path, workdir: Path) -> dict[str, Any]:
    import psutil

    from benchmarks.scenarios.multi_job_finetune import LARGE_PARAMS, large_checkpoint
    from symbiosis.executor.process import ExecutorProcess

    available_gib = psutil.virtual_memory().available / GIB
    made = (cache / "llama-1b-seed0" / "bench_recipe.json").is_file()
    needed_gib = (1.5 if made else 2.5) * LARGE_PARAMS * 4 / GIB + 2.0  # making it holds ~2 copies
    if available_gib < needed_gib:
        return {"skipped": f"needs ~{needed_gib:.1f} GiB free, {available_gib:.1f} GiB available"}
    path = large_checkpoint(cache)
    out: dict[str, Any] = {"model": str(path), "params": LARGE_PARAMS, "budget_gib": BUDGET_GIB}
    for v in VARIANTS:
        address = f"ipc://{workdir}/jobs-{v}.sock"
        extra = ["--quantization", quantization_of(v)] if quantization_of(v) else []
        process = ExecutorProcess(path, [address], extra_args=extra, threads=2, metrics=True, timeout_s=600)
        try:
            env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
            done = subprocess.run(
                [sys.executable, "-c", _CLIENT_STEP, str(path), address],
                capture_output=True,
                text=True,
                check=True,
                env=env,
                timeout=1200,
            )
            client_peak = json.loads(done.stdout.strip().splitlines()[-1])["peak_rss_bytes"]
            executor_peak = process.stats()["peak_rss_bytes"]
        finally:
            process.close()
        per_process = {"executor": executor_peak / GIB, "client": client_peak / GIB, "hf_job": math.nan}
        fits = max(0, math.floor((BUDGET_GIB - per_process["executor"]) / per_process["client"]))
        out[v] = {
            "executor_peak_gib": per_process["executor"],
            "client_peak_gib": per_process["client"],
            "jobs_in_budget": fits,
        }
    previous = repo_root() / "docs" / "benchmarks" / "multi_job_finetune" / "multi_job_finetune.json"
    if previous.is_file():  # HF PEFT's count, from the multi-job scenario's measured job peak
        per_process = json.loads(previous.read_text())["results"]["large_model"].get("per_process_gib", {})
        if per_process.get("hf_job"):
            out["hf_peft_jobs_in_budget"] = math.floor(BUDGET_GIB / per_process["hf_job"])
            out["hf_peft_job_peak_gib"] = per_process["hf_job"]
    return out
