"""The demo in --quick mode: executor in its own process over ipc://, four fine-tuning clients
with different PEFT methods and the OpenAI-compatible server (two request streams, one of them
answered by the LoRA adapter published while it trains) run at once, and every figure of the final
table is measured (accuracy before and after, losses, tokens, executor batches)."""

from __future__ import annotations

import json

import pytest

from symbiosis.jobs.demo import TUNERS, DemoOptions, run_demo


@pytest.mark.slow
def test_quick_demo_runs_every_client_and_measures(tmp_path):
    output = tmp_path / "out"
    results = run_demo(DemoOptions(quick=True, cache_dir=tmp_path / "cache", output=output))

    assert results["executor_in_own_process"]
    clients = results["clients"]
    tuners = [c for c in clients if c["kind"] == "fine-tune"]
    generators = [c for c in clients if c["kind"] == "inference"]
    assert [c["method"] for c in tuners] == [t.method for t in TUNERS]
    assert len({c["task"] for c in tuners}) == 4, "each fine-tuning client has its own task"
    assert len(generators) == 2
    for c in clients:
        assert c["error"] is None and c["status"] == "done", c
    for c in tuners:
        assert len(c["losses"]) == c["total_steps"] == 8
        assert c["accuracy_before"] is not None and c["accuracy_after"] is not None
        assert c["trainable_parameters"] > 0 and c["tokens_per_s"] > 0
        assert (output / "adapters" / c["method"] / "adapter_config.json").is_file()
    assert all(g["generated_tokens"] > 0 and g["requests"] > 0 for g in generators)
    assert {g["method"] for g in generators} == {"base", "lora-live"}
    lora = next(c for c in tuners if c["method"] == "lora")
    assert lora["published_steps"] and lora["published_steps"][-1] == 8  # published mid-run and at the end
    figures = results["executor"]
    assert figures["batches"] > 0 and figures["mean_rows_per_batch"] > 0 and figures["peak_rss_mb"] > 0
    # Rows from different clients shared batches: on average more than one request per batch.
    assert figures["requests"] >= figures["batches"]
    assert (output / "loss_curves.png").stat().st_size > 0
    assert json.loads((output / "results.json").read_text())["preset"] == "tiny"

    again = run_demo(
        DemoOptions(quick=True, cache_dir=tmp_path / "cache", output=tmp_path / "out2", steps=2, in_process=True)
    )
    assert again["model"] == results["model"], "the cached model is reused"
    assert not again["executor_in_own_process"]
