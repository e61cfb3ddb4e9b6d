"""Smoke test of the benchmark scripts: ``--quick`` runs write their JSON with the documented keys.

Numbers are not checked (they are timings on a shared machine); the shape of the result is, since
reports and plots read these keys.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import split_overhead

TIMING_KEYS = {"median_ms", "p95_ms", "mean_ms", "min_ms", "n"}
MACHINE_KEYS = {"cpu_count", "torch", "torch_threads"}

SPLIT_KEYS = {
    "benchmark",
    "command",
    "machine",
    "config",
    "targets",
    "results",
    "verdicts",
    "check",
    "calls_per_token",
    "processes",
    "unavailable",
    "dist",
    "wall_s",
}
SPLIT_TIMING_KEYS = TIMING_KEYS | {"ratio_over_monolithic", "target", "verdict"}


@pytest.mark.slow
def test_split_overhead_quick_writes_documented_json(tmp_path):
    from symbiosis.modelzoo import ARCHS

    # --shared-executor: two executor processes (one per model) instead of eight (one per remote
    # system and model), which is most of this test's time; it also covers that option.
    returned = split_overhead.main(
        [
            "--quick",
            "--shared-executor",
            "--output",
            str(tmp_path / "out"),
            "--cache",
            str(tmp_path / "cache"),
            "--repeats",
            "2",
        ]
    )

    written = json.loads((tmp_path / "out" / "split_overhead.json").read_text())
    assert (tmp_path / "out" / "split_overhead.png").stat().st_size > 0
    assert SPLIT_KEYS <= written.keys()
    assert written["benchmark"] == "split_overhead" == returned["benchmark"]
    assert MACHINE_KEYS <= written["machine"].keys()
    assert written["config"]["preset"] == "tiny"
    assert written["config"]["executors"] == "one per model, shared by the remote systems"
    measured = set(written["config"]["systems"])
    assert {"monolithic", "inproc", "shm+ipc", "ipc", "tcp"} <= measured
    assert measured | set(written["unavailable"]) == set(split_overhead.SYSTEMS)  # a system not measured says why
    assert set(written["processes"]) == measured
    assert len(written["results"]) == 2  # the custom LLaMA (at quick size) and the preset
    for model, steps in written["results"].items():
        assert set(steps) == set(written["config"]["steps"]) == {"decode_b1", "decode_b16", "train"}
        for step, row in steps.items():
            assert set(row) == measured
            for system, timing in row.items():
                assert SPLIT_TIMING_KEYS <= timing.keys(), (model, step, system)
                assert timing["n"] >= 2
                if system == "monolithic":
                    assert timing["verdict"] is None
                else:
                    assert timing["target"] == split_overhead.TARGETS[system][split_overhead.step_kind(step)]
                    assert timing["verdict"] in {"PASS", "MISS"}
                    assert timing["calls_per_step"] > 0  # the split step really went through the executor
        assert written["check"][model]["max_abs_diff_vs_monolithic"] < 1e-3  # same adapter weights everywhere
    assert len(written["verdicts"]) == len(written["results"]) * 3 * (len(measured) - 1)
    calls = written["calls_per_token"]
    assert set(calls["archs"]) == set(ARCHS) and set(calls["models"]) == set(written["results"])
    for breakdown in [*calls["archs"].values(), *calls["models"].values()]:
        assert breakdown["layers"] == 2 and breakdown["outside_layers"] >= 1
        assert (
            abs(
                breakdown["calls_per_token"]
                - (breakdown["per_layer"] * breakdown["layers"] + breakdown["outside_layers"])
            )
            < 1e-9
        )


@pytest.mark.slow
def test_serving_quick_writes_documented_json(tmp_path):
    from benchmarks import report, serving

    serving.main(["--quick", "--output", str(tmp_path / "serving"), "--cache", str(tmp_path / "cache")])

    written = json.loads((tmp_path / "serving" / "serving.json").read_text())
    assert (tmp_path / "serving" / "serving.png").stat().st_size > 0
    summary = written["summary"]
    assert set(summary["tokens_per_s"]) == {
        "hf_peft_mixed",
        "api_embedded",
        "api_shared",
        "api_shm",
        "api_many_warm",
        "api_many_cold",
    }
    assert all(v > 0 for v in summary["tokens_per_s"].values())
    assert summary["cold_loads_in_warm_rounds"] == 0 and summary["cold_load_ms_per_adapter"] > 0
    assert {"inference_alone", "inference_with_finetune", "finetune_steps_per_s_alone"} <= summary["coserve"].keys()
    assert len(summary["coserve"]["pairs"]) == 1  # --quick: one pair of co-serving phases
    assert summary["coserve_shared"]["finetune_steps_per_s_with_inference"] > 0  # jobs trained on the shared one
    for co in (summary["coserve"], summary["coserve_shared"]):  # long prompts timed in every phase
        assert co["long_prompt_ttft_ms_alone"] > 0 and co["long_prompt_ttft_ms_with_finetune"] > 0
    assert {"coserve_long_ttft", "coserve_shared_long_ttft"} <= summary["ratios"].keys()
    section = "\n".join(report.serving_section(written, tmp_path, tmp_path))
    assert "Serving" in section and "--executor-bind" in section and "long prompt's first token" in section


def test_coserving_figures_are_medians_over_pairs_of_phases():
    """Each co-serving figure is its median over the pairs, figure by figure (one pair moved the
    p95 ratio x1.2-2.4 between runs of the same code)."""
    from benchmarks.serving import median_of_pairs

    def pair(alone_p95: float, together_p95: float, kept: tuple[float, float]) -> dict:
        return {
            "inference_alone": {"itl_p95_ms": alone_p95, "tokens_per_s": 10.0},
            "inference_with_finetune": {"itl_p95_ms": together_p95, "tokens_per_s": 9.0},
            "finetune_steps_per_s_alone": kept[0],
            "finetune_steps_per_s_with_inference": kept[1],
        }

    merged = median_of_pairs([pair(50, 120, (3.0, 2.0)), pair(40, 60, (3.5, 2.5)), pair(45, 70, (3.2, 1.0))])
    assert merged["inference_alone"] == {"itl_p95_ms": 45, "tokens_per_s": 10.0}
    assert merged["inference_with_finetune"] == {"itl_p95_ms": 70, "tokens_per_s": 9.0}
    assert merged["finetune_steps_per_s_alone"] == 3.2 and merged["finetune_steps_per_s_with_inference"] == 2.0


@pytest.mark.slow
def test_roundtrip_times_cases_with_another_client_joined(tmp_path, capsys):
    """``ipc+joined``: the measured client shares the executor with another, active client;
    ``ipc+idle``: with another, idle one; ``ipc+queued``: with an active one, on an executor whose
    rule queues every call (the scheduler's path instead of the lone-client one); ``inproc+queued``:
    that rule in-process, without a transport; an unknown transport is refused up front."""
    from benchmarks import roundtrip

    cases = (
        "--transports ipc,ipc+joined,ipc+idle,ipc+queued,inproc+queued --hiddens 64 --calls 40 --blocks 2 --warmup 2"
    )
    cases = [*cases.split(), "--gap-us", "20"]
    written = roundtrip.main([*cases, "--output", str(tmp_path)])
    assert written["config"]["gap_us"] == 20  # the client worked between its calls
    assert json.loads((tmp_path / "roundtrip.json").read_text())["results"] == written["results"]
    kinds = ("ipc", "ipc+joined", "ipc+idle", "ipc+queued", "inproc+queued")
    assert set(written["results"]) == {f"{t}/h64/r{r}" for t in kinds for r in (1, 16)}
    timings = [entry["current"] for entry in written["results"].values()]
    assert all(t["n"] == 40 and t["median_us"] > 0 for t in timings)
    with pytest.raises(SystemExit):
        roundtrip.main(["--transports", "inproc+joined"])
    assert "unknown transports ['inproc+joined']" in capsys.readouterr().err
