"""Smoke test of the benchmark scripts: ``--quick`` runs write their JSON with the documented keys.

Numbers are not checked (they are timings on a shared machine); the shape of the result is, since
reports and plots read these keys.
"""

from __future__ import annotations

import json

from benchmarks import batching, split_overhead

STEP_KEYS = {"monolithic", "split", "gemm_floor", "split_over_monolithic", "gemm_share_of_split", "executor_calls", "gemm_gflop", "gemm_floor_gflops"}
TIMING_KEYS = {"median_ms", "p95_ms", "mean_ms", "min_ms", "n"}
MACHINE_KEYS = {"cpu_count", "torch", "torch_threads"}
INFERENCE_KEYS = {"tokens_per_s", "latency_ms_mean", "latency_ms_median", "latency_ms_p95", "mean_rows_per_batch", "batches", "per_client", "runs"}
MIXED_KEYS = {
    "inference_alone",
    "inference_with_finetune",
    "finetune_alone",
    "latency_mean_ratio_mixed_over_alone",
    "latency_p95_ratio_mixed_over_alone",
    "finetune_tokens_ratio_mixed_over_alone",
}


def test_split_overhead_quick_writes_documented_json(tmp_path):
    returned = split_overhead.main(["--quick", "--output", str(tmp_path / "out"), "--cache", str(tmp_path / "cache"), "--repeats", "2"])

    written = json.loads((tmp_path / "out" / "split_overhead.json").read_text())
    assert (tmp_path / "out" / "split_overhead.png").stat().st_size > 0
    assert {"benchmark", "command", "machine", "config", "train_step", "decode_step", "check", "matmul_ceiling_gflops", "executor", "wall_s"} <= written.keys()
    assert written["benchmark"] == "split_overhead" == returned["benchmark"]
    assert MACHINE_KEYS <= written["machine"].keys()
    assert written["config"]["preset"] == "tiny"
    for step in ("train_step", "decode_step"):
        assert STEP_KEYS <= written[step].keys()
        for candidate in ("monolithic", "split", "gemm_floor"):
            assert TIMING_KEYS <= written[step][candidate].keys()
            assert written[step][candidate]["n"] >= 2
        assert written[step]["executor_calls"] > 0  # the split step really went through the executor


def test_batching_quick_writes_documented_json(tmp_path):
    batching.main(["--quick", "--output", str(tmp_path / "out"), "--cache", str(tmp_path / "cache"), "--window-s", "0.3"])

    written = json.loads((tmp_path / "out" / "batching.json").read_text())
    assert (tmp_path / "out" / "batching.png").stat().st_size > 0
    assert {"benchmark", "command", "machine", "config", "inference", "mixed", "summary", "wall_s"} <= written.keys()
    assert MACHINE_KEYS <= written["machine"].keys()
    assert set(written["inference"]) == set(written["mixed"]) == set(batching.VARIANTS)
    for policy, result in written["inference"].items():
        assert INFERENCE_KEYS <= result.keys(), policy
        assert [c["batch_size"] for c in result["per_client"]] == list(batching.INFERENCE_BATCH_SIZES)
        assert result["batches"] is not None  # in-process runs read the executor's stats
    for policy, result in written["mixed"].items():
        assert MIXED_KEYS <= result.keys(), policy
        assert len(result["inference_with_finetune"]["per_client"]) == batching.MIXED_INFERENCE_CLIENTS + batching.FINETUNE_CLIENTS
        assert result["finetune_alone"]["tokens_per_s"] is None  # no inference client in that run
