"""Smoke test of the benchmark suite (issue 6): every scenario writes its files with the documented keys.

Runs ``benchmarks.suite.run`` with the quick profile cut to its smallest sizes (one job, one
client level, two adapters) on the tiny model, in a temporary folder. Numbers are not checked
(timings on a shared machine); the shape of the results is, since ``benchmarks/report.py`` and
the README section read these keys. Also renders the report from them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from benchmarks import report, suite
from benchmarks.results import usable_cpus

SMALLEST = dataclasses.replace(
    suite.QUICK,
    finetune_ks=(1,),
    memory_levels=(0, 1),
    inference_ks=(2,),
    decode_tokens=4,
    prompt_len=8,
    step_repeats=2,
    efficiency_clients=2,
    efficiency_repeats=2,
    split_systems=("inproc", "ipc"),  # every transport: tests/test_benchmarks_quick.py's split-overhead smoke
)
TOP_KEYS = {"scenario", "command", "machine", "config", "results", "headline", "losses", "wall_s"}
RESULT_KEYS = {
    "multi_job_finetune": {"runs", "per_k", "per_process_gib", "budget", "large_model", "mlora", "target"},
    "executor_memory": {"levels", "executor_rss_growth"},
    "multi_adapter_inference": {"runs", "per_k", "targets"},
    "split_overhead": {"train_step", "decode_step", "check", "dist"},
    "executor_efficiency": {"phases", "matmul_ceiling_gflops"},
}
TIMING_KEYS = {"median_ms", "p95_ms", "mean_ms", "min_ms", "n"}


@pytest.mark.slow
def test_suite_smallest_run_writes_every_scenario(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMBIOSIS_BENCH_CACHE", str(tmp_path / "cache"))
    output = tmp_path / "out"
    lines: list[str] = []

    returned = suite.run(
        suite.SCENARIOS, quick=True, output=output, cache=tmp_path / "cache", profile=SMALLEST, log=lines.append
    )

    assert set(returned) == set(suite.SCENARIOS) == set(RESULT_KEYS)
    assert lines[0] == suite.QUICK_CAVEAT  # a quick run's PASS/MISS lines are not the system's verdicts
    for name, keys in RESULT_KEYS.items():
        folder = output / name
        written = json.loads((folder / f"{name}.json").read_text())
        assert TOP_KEYS <= written.keys(), name
        assert written["scenario"] == name
        assert keys <= written["results"].keys(), name
        assert written["headline"] and all(isinstance(line, str) for line in written["headline"])
        assert (folder / f"{name}.png").stat().st_size > 0
        assert "|---" in (folder / f"{name}.md").read_text()
        assert any(line.startswith("[") and name in line and "done" in line for line in lines), (
            name
        )  # progress per scenario

    finetune = json.loads((output / "multi_job_finetune" / "multi_job_finetune.json").read_text())["results"]
    assert [row["k"] for row in finetune["per_k"]] == [1]
    assert {"throughput_ratio", "memory_ratio", "symbiosis_tokens_per_s", "hf_peft_tokens_per_s"} <= finetune["per_k"][
        0
    ].keys()
    assert {"symbiosis_jobs", "hf_peft_jobs"} <= finetune["budget"]["model"].keys()
    assert finetune["runs"]["symbiosis"]["1"]["peak_rss_gib_by_role"].keys() == {
        "executor",
        "client",
    }  # the executor process was sampled
    assert "skipped" in finetune["large_model"]  # quick runs leave the ~1B model out, saying so
    assert {"runs_here", "why"} <= finetune["mlora"].keys()
    assert (
        finetune["target"]["target_k"] == 8 and finetune["target"]["k"] == 1
    )  # judged at the largest K run, saying so
    finetune_json = json.loads((output / "multi_job_finetune" / "multi_job_finetune.json").read_text())
    assert any(("PASS" in line or "MISS" in line) and "K=8" in line for line in finetune_json["headline"])
    assert finetune_json["config"]["env"]["symbiosis_client"]["OMP_WAIT_POLICY"] == os.environ.get(
        "OMP_WAIT_POLICY", "PASSIVE"
    )

    # the executor, the process every client waits on, gets the host's cores unless told otherwise
    assert finetune_json["config"]["executor_threads"] == usable_cpus()
    assert finetune_json["config"]["env"]["symbiosis_executor"]["OMP_NUM_THREADS"] == str(usable_cpus())

    memory = json.loads((output / "executor_memory" / "executor_memory.json").read_text())["results"]
    assert [level["clients"] for level in memory["levels"]] == [0, 1]

    inference_json = json.loads((output / "multi_adapter_inference" / "multi_adapter_inference.json").read_text())
    inference = inference_json["results"]
    assert set(inference["runs"]) == {"symbiosis", "symbiosis_mixed_batch", "hf_mixed_batch", "hf_per_adapter"}
    for system in inference["runs"]:
        assert {"latency_ms_p50", "latency_ms_p95", "tokens_per_s"} <= inference["runs"][system]["2"].keys(), system
    assert {"symbiosis_mixed_vs_hf_mixed", "throughput_ratio_vs_per_adapter"} <= inference["per_k"][0].keys()
    assert set(inference["targets"]) == {"symbiosis_mixed_vs_hf_mixed", "throughput_ratio_vs_per_adapter"}
    assert sum(("PASS" in line or "MISS" in line) for line in inference_json["headline"]) == 2
    systems = inference_json["config"]["systems"]
    assert systems["symbiosis"]["env"]["OMP_WAIT_POLICY"] == os.environ.get(
        "OMP_WAIT_POLICY", "PASSIVE"
    )  # split clients: the shared-host setting
    assert systems["hf_mixed_batch"]["env"]["OMP_WAIT_POLICY"] == os.environ.get(
        "OMP_WAIT_POLICY"
    )  # baselines: the defaults

    overhead = json.loads((output / "split_overhead" / "split_overhead.json").read_text())["results"]
    assert overhead["train_step"]["ratio_over_monolithic"].keys() == {"inproc", "ipc"}  # the profile's systems
    assert TIMING_KEYS <= overhead["decode_step"]["monolithic"].keys()

    efficiency = json.loads((output / "executor_efficiency" / "executor_efficiency.json").read_text())["results"]
    assert set(efficiency["phases"]) == {"train", "decode"}
    assert efficiency["phases"]["train"]["batches"] > 0  # the executor's products were really recorded

    text = report.render(output, output / "RESULTS.md")
    for name in suite.SCENARIOS:
        assert f"{name}/{name}.png" in text
    assert "Not run: no `transport/transport.json`" in text


@pytest.mark.slow
def test_bench_command_lists_scenarios_and_rejects_unknown_ones():
    env = dict(os.environ, COLUMNS="200")  # rich wraps help to the terminal width
    help_text = subprocess.run(
        [sys.executable, "-m", "symbiosis", "bench", "--help"], capture_output=True, text=True, check=True, env=env
    ).stdout
    for name in suite.SCENARIOS:
        assert name in help_text
    for flag in ("--quick", "--output"):
        assert flag in help_text
    bad = subprocess.run(
        [sys.executable, "-m", "symbiosis", "bench", "no_such_scenario"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "no_such_scenario" in bad.stderr
