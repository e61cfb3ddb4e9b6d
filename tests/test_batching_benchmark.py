"""Smoke test of ``benchmarks.batching --quick``: it runs every scenario and writes the documented JSON.

Numbers are not checked (timings on a shared machine); the shape of the result is, since the
report (``benchmarks/report.py``) and the plot read these keys.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import batching, batching_clients, report

SUMMARY_KEYS = {"inference", "mixed", "flood", "targets", "load_average_1min_start_end", "clients_as", "wall_s"}


@pytest.mark.slow
def test_batching_quick_writes_documented_json(tmp_path):
    out = tmp_path / "batching" / "threads"
    batching.main(["--quick", "--output", str(out), "--cache", str(tmp_path / "cache"), "--window-s", "0.3"])

    written = json.loads((out / "batching.json").read_text())
    assert (out / "batching.png").stat().st_size > 0
    assert {"benchmark", "command", "machine", "config", "runs_by_scenario", "summary", "wall_s"} <= written.keys()
    summary = written["summary"]
    assert SUMMARY_KEYS <= summary.keys()
    runs = written["runs_by_scenario"]
    assert set(runs) == set(batching.SCENARIOS)
    for scenario, by_variant in runs.items():
        assert set(by_variant) == {v for v in batching.VARIANTS if batching.runs_in(v, scenario)}, scenario
    inference = runs["inference"]["opportunistic"][0]
    assert [c["batch_size"] for c in inference["per_client"]] == list(batching.INFERENCE_BATCH_SIZES)
    assert inference["batches"] is not None and inference["wait_rule"]["rule"] in ("none", "predicted", "convoy")
    mixed = runs["inference_with_finetune"][batching.SLO_VARIANT][0]
    assert mixed["config"]["decode_slo_ms"] > 0  # derived from opportunistic's inference-alone p95
    assert runs["flood_decode"]["opportunistic"][0]["flood_rows_per_s"] is not None
    cpus = written["machine"]["cpu_count"]  # the host's counters count every core
    assert 0 < inference["cpu_cores_busy"] <= cpus + 0.5  # (the host's counters tick at 100 Hz)
    assert summary["mixed"]["opportunistic"]["cpu_cores_busy_finetune_alone"] > 0
    assert {t["name"] for t in summary["targets"]} >= {
        "heterogeneous: opportunistic tokens/s / immediate >= 1",
        "heterogeneous: opportunistic mean per-token latency / lockstep <= 1",
    }
    # The README's results block renders from this file.
    lines = report.batching_section(tmp_path, tmp_path)
    assert any("Batching" in line for line in lines) and any("PASS" in line or "MISS" in line for line in lines)


def _write_inference_run(
    results: Path, mode: str, transport: str, targets: list[dict], decode_interval_ms: float | None = None
) -> None:
    """A client-process run of the heterogeneous scenario alone, as ``batching.json`` in ``results/batching/mode``."""
    figures = {"tokens_per_s": 100.0, "latency_ms_mean": 50.0, "latency_ms_p95": 60.0, "mean_rows_per_batch": 9.0}
    summary = {
        "decode_interval_ms": decode_interval_ms,
        "inference": {"opportunistic": figures, "immediate": figures},
        "mixed": {},
        "flood": {},
        "targets": targets,
        "preset": "small",
        "repeats": 3,
        "clients_as": "processes",
        "transport": transport,
    }
    data = {"command": f"cmd-{mode}", "wall_s": 1.0, "config": {"window_s": 6.0}, "machine": {}, "summary": summary}
    (results / "batching" / mode).mkdir(parents=True)
    (results / "batching" / mode / "batching.json").write_text(json.dumps(data))


def test_the_readme_renders_client_processes_over_tcp_as_a_setting_of_their_own(tmp_path):
    """Remote clients (issue 11's third setting) are measured as client processes over tcp://
    (``--scheme tcp``) and kept in ``batching/tcp``: a section of their own, not one mistaken for
    the ipc:// run."""
    met = [{"name": "heterogeneous: x", "value": 1.0, "target": 1.0, "met": True}]
    _write_inference_run(tmp_path, "processes", "ipc", met)
    _write_inference_run(tmp_path, "tcp", "tcp", met)
    _write_inference_run(tmp_path, "processes_open_loop", "ipc", met, decode_interval_ms=200.0)
    headings = [line for line in report.batching_section(tmp_path, tmp_path) if line.startswith("### ")]
    assert headings == [
        "### Batching and sharing between clients, clients as processes (issues 4, 11)",
        "### Batching and sharing between clients, clients as processes over tcp://, as remote clients connect"
        " (issues 4, 11)",
        "### Batching and sharing between clients, clients as processes, decoders stepping every 200 ms (open loop)"
        " (issues 4, 11)",
    ]


def test_a_target_missed_by_a_hair_is_not_printed_as_its_bound(tmp_path):
    """Rounded to three significant figures, a latency ratio of 1.002 against "<= 1" read "(1)"
    among the misses (the threads run of 2026-11-30): the value is printed with three decimals."""
    missed = [{"name": "heterogeneous: y <= 1", "value": 1.0021, "target": 1.0, "met": False}]
    _write_inference_run(tmp_path, "processes", "ipc", missed)
    lines = report.batching_section(tmp_path, tmp_path)
    assert [line for line in lines if line.startswith("- **Where we lose")] == [
        "- **Where we lose (target missed):** heterogeneous: y <= 1 (1.002)."
    ]


def test_busy_cores_are_over_the_time_between_the_readings_not_the_nominal_window():
    # The window's end is read late when the reader waits (for the GIL, for the executor's stats
    # while a batch runs): 2 cores busy for 0.45 s of a nominal 0.3 s window read 3 cores (CI,
    # 2026-11-30). Two cores' worth between readings 0.45 s apart is 2 cores.
    start = {"cpu_busy_s": 100.0, "cpu_read_at_s": 10.0}
    end = {"cpu_busy_s": 100.9, "cpu_read_at_s": 10.45}
    assert batching_clients.cores_busy(start, end) == pytest.approx(2.0)
    reading = batching_clients.remote_counters()
    assert {"cpu_busy_s", "cpu_read_at_s"} <= reading.keys()
    assert batching_clients.cores_busy(reading, batching_clients.remote_counters()) >= 0


def test_the_step_under_way_at_the_windows_end_counts_for_its_share_inside(monkeypatch):
    # A fine-tuning client whose steps take 0.4 s, in a window that ends at 1.0 s: two steps
    # finished, and half of the third was done inside. Counting whole steps only read 2 steps'
    # tokens (x0.8 of the client's rate); the share counts 2.5. Times are those of finished steps.
    clock = {"now": 0.0}
    monkeypatch.setattr(batching_clients.time, "perf_counter", lambda: clock["now"])

    class FourTenthsOfASecondAStep:
        steps = 0

        def step(self) -> bool:
            clock["now"] += 0.4
            self.steps += 1
            return True

    client = FourTenthsOfASecondAStep()
    record = batching_clients.ClientRecord(batching_clients.ClientSpec("finetune", batch_size=2, seq_len=128))
    batching_clients.run_measured(client, record, end_s=1.0, stop=lambda: clock["now"] > 1.5)
    assert client.steps == 4  # the last one began after the window: none of it counts
    assert record.tokens == pytest.approx(2.5 * 256)
    assert record.step_s == pytest.approx([0.4, 0.4])


def test_an_open_loop_decoder_steps_once_an_interval_from_its_phase_and_times_its_steps_only(monkeypatch):
    # A stream read every 100 ms whose steps take 10 ms, starting half an interval late: it steps
    # at 50, 150, ... ms and sleeps between; its latency is the 10 ms of each step, not the interval.
    # A step that takes longer than the interval is followed by the next at once (it fell behind).
    clock = {"now": 0.0}
    monkeypatch.setattr(batching_clients.time, "perf_counter", lambda: clock["now"])
    monkeypatch.setattr(batching_clients.time, "sleep", lambda s: clock.__setitem__("now", clock["now"] + s))

    class Decoder:
        def __init__(self, step_s: float) -> None:
            self.step_s, self.starts = step_s, []

        def step(self) -> bool:
            self.starts.append(clock["now"])
            clock["now"] += self.step_s
            return True

    spec = batching_clients.ClientSpec("inference", batch_size=2, interval_s=0.1, phase=0.5)
    client, record = Decoder(0.01), batching_clients.ClientRecord(spec)
    batching_clients.run_measured(client, record, end_s=0.5, stop=lambda: clock["now"] > 0.5)
    assert client.starts == pytest.approx([0.05, 0.15, 0.25, 0.35, 0.45])  # then it waits past the end
    assert record.step_s == pytest.approx([0.01] * 5)
    assert record.tokens == pytest.approx(5 * 2)

    clock["now"] = 0.0
    slow = Decoder(0.25)
    batching_clients.run_measured(slow, batching_clients.ClientRecord(spec), end_s=0.5, stop=lambda: clock["now"] > 0.5)
    assert slow.starts == pytest.approx([0.05, 0.30])

    closed = batching_clients.ClientSpec("inference", batch_size=2)  # closed loop: back to back, no phase
    clock["now"] = 0.0
    back_to_back = Decoder(0.1)
    batching_clients.run_measured(back_to_back, batching_clients.ClientRecord(closed), 0.3, lambda: clock["now"] >= 0.3)
    assert back_to_back.starts == pytest.approx([0.0, 0.1, 0.2])


def test_open_loop_streams_are_spread_over_the_interval_and_their_verdicts_say_so():
    args = batching.parse_args(["--quick", "--decode-interval-ms", "200"])
    specs = batching.clients_for("inference_with_finetune", args)
    streams = [s for s in specs if s.kind == "inference"]
    assert [s.interval_s for s in streams] == [0.2] * batching.MIXED_INFERENCE_CLIENTS
    assert [s.phase for s in streams] == pytest.approx([i / len(streams) for i in range(len(streams))])
    assert all(s.interval_s == 0 for s in specs if s.kind == "finetune")
    assert all(s.interval_s == 0 for s in batching.clients_for("inference", batching.parse_args(["--quick"])))
    summary = {"inference": {}, "mixed": {}, "flood": {"opportunistic": {"p95_ratio_flood_decode": 1.5}}}
    (verdict,) = batching.targets(summary, decode_interval_ms=200)
    assert verdict["name"].startswith("decoders open loop, a step every 200 ms: flood labelled decode")
    (closed,) = batching.targets(summary)
    assert closed["name"].startswith("flood labelled decode")
    with pytest.raises(SystemExit):
        batching.parse_args(["--quick", "--decode-interval-ms", "0"])


def test_serve_flags_give_serve_the_same_scheduler_config():
    """``--clients-as processes`` starts ``symbiosis serve`` with ``serve_flags(config)``: parsed by
    serve's own options, the flags must make exactly the config the thread mode uses."""
    import dataclasses

    import click
    import typer

    from benchmarks.batching_processes import executor_flags, serve_flags
    from symbiosis.cli import _register_optional_commands, app
    from symbiosis.executor.scheduler import SchedulerConfig

    _register_optional_commands()
    group = typer.main.get_command(app)
    serve = group.get_command(click.Context(group), "serve")
    names = [f.name for f in dataclasses.fields(SchedulerConfig)]
    configs = [SchedulerConfig(**fields, max_wait_ms=3.0) for fields in batching.VARIANTS.values()]
    configs.append(SchedulerConfig(decode_slo_ms=40.0))
    for config in configs:
        parsed = serve.make_context("serve", ["model", *serve_flags(config)]).params
        assert SchedulerConfig(**{name: parsed[name] for name in names}) == config, serve_flags(config)
    # --executor-device reaches serve's own --device, beside the config
    parsed = serve.make_context("serve", ["model", *executor_flags(configs[-1], "cuda:1")]).params
    assert parsed["device"] == "cuda:1"
    assert SchedulerConfig(**{name: parsed[name] for name in names}) == configs[-1]


def test_fine_tuning_client_processes_run_in_the_background_class_unless_told_otherwise():
    from benchmarks.batching_clients import ClientSpec
    from benchmarks.batching_processes import runs_in_background

    args = batching.parse_args(["--clients-as", "processes"])
    assert args.finetune_cpu_priority == "background"  # as `symbiosis finetune --executor` runs a job
    kinds = {kind: ClientSpec(kind) for kind in ("inference", "finetune", "flood")}
    assert [k for k, spec in kinds.items() if runs_in_background(spec, args)] == ["finetune"]
    normal = batching.parse_args(["--clients-as", "processes", "--finetune-cpu-priority", "normal"])
    assert not any(runs_in_background(spec, normal) for spec in kinds.values())


def test_the_executor_device_is_for_client_processes_only():
    args = batching.parse_args(["--clients-as", "processes", "--executor-device", "cuda"])
    assert args.executor_device == "cuda"
    assert batching.parse_args([]).executor_device == "cpu"
    with pytest.raises(SystemExit):
        batching.parse_args(["--executor-device", "cuda"])  # threads: one in-process CPU executor
    assert batching.parse_args(["--clients-as", "processes", "--scheme", "shm+ipc"]).scheme == "shm+ipc"


def test_profiles_are_for_client_processes_only(tmp_path, monkeypatch):
    import benchmarks.window_profile as window_profile

    monkeypatch.setattr(window_profile.shutil, "which", lambda name: f"/usr/bin/{name}")
    args = batching.parse_args(["--clients-as", "processes", "--profile", str(tmp_path)])
    assert args.profile == tmp_path
    with pytest.raises(SystemExit):
        batching.parse_args(["--profile", str(tmp_path)])  # threads: one process, py-spy it directly
    monkeypatch.setattr(window_profile.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match="pip install py-spy"):
        batching.parse_args(["--clients-as", "processes", "--profile", str(tmp_path)])


def test_a_window_profile_says_where_each_thread_waited_and_worked(tmp_path):
    from benchmarks.window_profile import summarize

    # py-spy's raw format (``record --threads --idle --format raw``), as 0.4.3 writes it.
    serving = "thread (1038): ZmqServer(ipc:///tmp/x.sock);Thread.run (threading.py:982);ZmqServer._serve (z.py:798)"
    lines = [
        f"{serving};Poller.poll (zmq/sugar/poll.py:106) 25",
        f"{serving};ExecutionEngine._compute (engine.py:701);linear (packed_weights.py:124) 60",
        f"{serving};ZmqServer._queue_routed (z.py:667) 15",
        "thread (962): symbiosis-bulk-0;ExecutionEngine._bulk_loop (engine.py:612);Condition.wait (t.py:327) 100",
        "thread (677): MainThread;ClientLane.exchange (lane.py:520);ClientLane._receive_into (lane.py:554) 80",
        "thread (677): MainThread;Module._call_impl (module.py:1789);Linear.forward (linear.py:125) 20",
        "garbage without a count",
    ]
    path = tmp_path / "run-executor.txt"
    path.write_text("\n".join(lines) + "\n")
    text = summarize(path)
    assert "ZmqServer(ipc:///tmp/x.sock): 100 samples, waiting 25%" in text
    assert "60.0%  linear < ExecutionEngine._compute" in text
    assert "symbiosis-bulk-0: 100 samples, waiting 100%" in text
    assert "MainThread: 100 samples, waiting 80%" in text  # a client waiting on its lane's reply
    serving_part = text.split("symbiosis-bulk-0")[0]
    assert serving_part.index("linear <") < serving_part.index("Poller.poll <") < serving_part.index("_queue_routed")


def test_the_serving_breakdown_reads_what_the_serving_thread_did(tmp_path):
    import gzip

    from benchmarks.window_profile import serving_breakdown

    serving = "thread (9): ZmqServer(ipc:///tmp/x.sock);ZmqServer._serve (z.py:798)"
    lines = [
        f"{serving};try_for (spin.py:173);ZmqServer._serve.<locals>.<lambda> (z.py:781);Poller.poll (poll.py:106) 30",
        f"{serving};ExecutionEngine._compute (engine.py:701);run_batch (runner.py:116);linear (p.py:124) 40",
        f"{serving};ZmqServer._submit (z.py:1061);ExecutionEngine.submit (engine.py:275) 20",
        f"{serving};ZmqServer._reply (z.py:1109);ZmqServer._lane_send (z.py:700);ExecutorLane.send (lane.py:417) 10",
        "thread (3): symbiosis-bulk-0;ExecutionEngine._bulk_loop (engine.py:612);run_batch (runner.py:116) 500",
    ]
    path = tmp_path / "executor.txt.gz"
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    shares = serving_breakdown(path)  # the serving thread's samples only, not the bulk thread's
    assert shares["idle (spinning or polling for the next message)"] == pytest.approx(0.3)
    assert shares["products (run_batch)"] == pytest.approx(0.4)
    assert shares["rows copied or cast for the executor (submit)"] == pytest.approx(0.2)
    assert shares["replies sent"] == pytest.approx(0.1)
    assert sum(shares.values()) == pytest.approx(1.0)


def test_the_committed_h200_profiles_give_the_table_the_docs_print(capsys):
    # docs/benchmarks/batching_h200/README.md's table comes from these files through the command line.
    from pathlib import Path

    from benchmarks import window_profile

    folder = Path(__file__).resolve().parents[1] / "docs/benchmarks/batching_h200/profiles"
    window_profile.main(["--serving", str(folder / "profiled_cpu_executor_mixed.txt.gz")])
    table = capsys.readouterr().out
    assert " 15.5% idle (spinning or polling for the next message)" in table
    assert " 10.4% rows cloned out of the lane buffer" in table
    assert " 29.6% other Python (routing, bookkeeping)" in table


def test_a_window_profile_of_a_file_that_is_not_there_is_a_usage_error(tmp_path, capsys):
    # A shell glob that matched nothing (``DIR/*executor.txt`` before a run) arrives as the pattern itself.
    from benchmarks import window_profile

    with pytest.raises(SystemExit) as exited:
        window_profile.main(["--serving", str(tmp_path / "*executor.txt")])
    assert exited.value.code == 2
    assert "no such file" in capsys.readouterr().err


def _run(**figures: float | None) -> dict:
    """One run's record as ``summarize`` reads it: every scalar (None where not given), no clients."""
    return {key: figures.get(key) for key in batching.SCALARS} | {"per_client": []}


def test_each_target_keeps_its_ratio_in_every_repeat_paired_side_by_side(tmp_path):
    """The targets compare medians; beside each, the ratio of every repeat's side-by-side runs
    (``per_repeat``), in repeat order, so that a miss smaller than the host's round-to-round noise
    reads as one (five repeats of client threads on 2026-12-06: the adaptive rule, the fixed convoy
    and lockstep within 1-3% of each other's medians, each policy x1.2 from round to round)."""
    runs = {
        ("inference", "opportunistic"): [
            _run(tokens_per_s=110.0, latency_ms_mean=90.0),
            _run(tokens_per_s=80.0, latency_ms_mean=120.0),
        ],
        ("inference", "immediate"): [
            _run(tokens_per_s=100.0, latency_ms_mean=95.0),
            _run(tokens_per_s=100.0, latency_ms_mean=95.0),
        ],
        ("inference", "lockstep"): [
            _run(tokens_per_s=100.0, latency_ms_mean=100.0),
            _run(tokens_per_s=100.0, latency_ms_mean=100.0),
        ],
        ("inference_alone", "opportunistic"): [_run(latency_ms_p95=100.0), _run(latency_ms_p95=50.0)],
        ("finetune_alone", "opportunistic"): [_run(finetune_tokens_per_s=1000.0), _run(finetune_tokens_per_s=None)],
        ("inference_with_finetune", "opportunistic"): [
            _run(latency_ms_p95=150.0, finetune_tokens_per_s=300.0),
            _run(latency_ms_p95=100.0, finetune_tokens_per_s=200.0),
        ],
        ("inference_with_finetune", batching.SLO_VARIANT): [
            _run(latency_ms_p95=120.0, finetune_tokens_per_s=100.0),
            _run(latency_ms_p95=90.0, finetune_tokens_per_s=100.0),
        ],
        ("bystander_alone", "opportunistic"): [_run(latency_ms_p95=10.0), _run(latency_ms_p95=20.0)],
        ("flood_decode", "opportunistic"): [_run(latency_ms_p95=15.0), _run(latency_ms_p95=50.0)],
    }
    variants = ["opportunistic", "immediate", "lockstep", batching.SLO_VARIANT]
    summary = batching.summarize(runs, variants, [100.0, 80.0])  # the target set in each repeat
    by_name = {t["name"]: t for t in summary["targets"]}
    throughput = by_name["heterogeneous: opportunistic tokens/s / immediate >= 1"]
    assert throughput["value"] == pytest.approx(95.0 / 100.0)  # a ratio of medians, as before
    assert throughput["per_repeat"] == pytest.approx([1.1, 0.8])
    latency = by_name["heterogeneous: opportunistic mean per-token latency / lockstep <= 1"]
    assert latency["per_repeat"] == pytest.approx([0.9, 1.2])
    assert by_name["mixed (opportunistic): inference p95 mixed / alone <= 1.2"]["per_repeat"] == pytest.approx(
        [1.5, 2.0]
    )
    slo = by_name[f"mixed ({batching.SLO_VARIANT}): inference p95 / the set target <= 1"]
    assert slo["per_repeat"] == pytest.approx([1.2, 1.125]) and slo["value"] == pytest.approx(1.1625)
    # A repeat without the figure (fine-tuning alone finished nothing) is left out, not paired with the next.
    assert by_name["mixed (opportunistic): fine-tuning kept >= 85% of solo"]["per_repeat"] == pytest.approx([0.3])
    assert by_name["flood labelled decode (opportunistic): bystander p95 / alone <= 3"]["per_repeat"] == pytest.approx(
        [1.5, 2.5]
    )

    # The README renders them after the value (from a run of several repeats only).
    _write_inference_run(tmp_path, "processes", "ipc", [throughput, latency])
    lines = report.batching_section(tmp_path, tmp_path)
    assert [line for line in lines if line.startswith("- **Where we lose")] == [
        "- **Where we lose (target missed):** heterogeneous: opportunistic tokens/s / immediate >= 1"
        " (0.950; per repeat 1.10, 0.80); heterogeneous: opportunistic mean per-token latency / lockstep <= 1"
        " (1.050; per repeat 0.90, 1.20)."
    ]
