"""Per-layer batching policies under many concurrent clients (paper §4.4-4.5, Table 5).

Clients are threads of this process, each a plain ``transformers`` model with its own PEFT
adapter and KV cache, all served by one ``BaseExecutor`` (in-process transport; with
``--executor ADDRESS`` they connect to a running executor there instead, whose policy is fixed
and whose stats are not visible, so only one "remote" run is made and rows per batch are null).
With ``--clients-as processes`` each client and the executor run in their own process, over
``ipc://`` (``batching_processes.py``), so the clients' Python no longer shares one GIL.
Every run starts a fresh executor over the same loaded weights and fresh clients; each client
warms up (prefill + 2 decode steps, or 1 training step), all start together at a barrier, and
the run measures a window of ``--window-s`` seconds. Runs of different policies are interleaved
(order rotated each repeat) and each metric is the median over ``--repeats`` runs.

(a) ``inference``: 8 inference clients with batch sizes 1, 2, 4, 8, 16, 32, 64, 1 and alternating
    adapters (LoRA r=8 on q_proj; LoRA r=64 on q,k,v,o_proj) decode greedily, one token per
    sequence per step, for each policy (``VARIANTS``: immediate, lockstep, opportunistic, and
    opportunistic-fixed, the opportunistic policy as first built). Reported:
    aggregate tokens/s (tokens of steps finished inside the window / window), mean, median and
    p95 per-token latency (time of one decode step of one client, pooled over clients), mean rows
    per executor batch (scheduler ``rows_served / batches`` over the window), per-client latency,
    the scheduler's mean wait per latency class (arrival -> first rows handed out) and why
    groups became ready (``ready_reasons``).
(b) ``mixed``: the first 6 of those inference clients alone, the same 6 plus 2 fine-tuning clients
    (LoRA r=16 on q,k,v,o; AdamW; ``--ft-batch`` x ``--ft-seq-len`` tokens per step), and the 2
    fine-tuning clients alone, for each policy. Reported: inference latency alone vs mixed (and
    their ratio: the cost of mixing in fine-tuning) and fine-tuning tokens/s mixed vs alone.

Baselines: ``immediate`` (no waiting, paper's "no lockstep") and ``lockstep`` (one batch per layer
across all clients, as a monolithic server would) for (a); inference alone for (b).

Threads share one Python interpreter: the GIL serializes client-side Python (attention, PEFT,
sampling) and the executor thread; torch releases it inside its kernels. On a 2-core machine
this bounds what any policy can gain, and stretches every wait by GIL hand-offs; the numbers
are what this machine gives.

JSON (``batching.json`` in ``--output``) keys: ``benchmark, command, machine, config, inference,
mixed, summary, wall_s``. ``inference[policy]``: ``tokens_per_s, latency_ms_mean,
latency_ms_median, latency_ms_p95, mean_rows_per_batch, batches, per_client, runs`` (each run
also has ``mean_first_wait_ms`` per class and ``ready_reasons``).
``mixed[policy]``: ``inference_alone, inference_with_finetune, finetune_alone`` (each with
``tokens_per_s, latency_ms_mean, latency_ms_p95, finetune_tokens_per_s, mean_rows_per_batch``),
``latency_mean_ratio_mixed_over_alone, latency_p95_ratio_mixed_over_alone,
finetune_tokens_ratio_mixed_over_alone``. ``summary`` adds ``inference_ratios_vs_immediate`` and,
per policy, the scheduler's mean wait of fine-tuning and decode requests when mixed. Plot: ``batching.png``.

Run: ``python -m benchmarks.batching [--quick] [--preset base] [--clients-as processes] --output DIR``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import peft
import torch
from transformers import AutoConfig

import symbiosis
from benchmarks import common
from symbiosis.executor.scheduler import SchedulerConfig

NAME = "batching"
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ADAPTERS: dict[str, Callable[[], peft.LoraConfig]] = {
    "lora_r8_q": lambda: peft.LoraConfig(task_type=peft.TaskType.CAUSAL_LM, r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj"]),
    "lora_r64_qkvo": lambda: peft.LoraConfig(task_type=peft.TaskType.CAUSAL_LM, r=64, lora_alpha=128, lora_dropout=0.0, target_modules=ATTENTION),
    "lora_r16_qkvo": lambda: peft.LoraConfig(task_type=peft.TaskType.CAUSAL_LM, r=16, lora_alpha=32, lora_dropout=0.0, target_modules=ATTENTION),
}
INFERENCE_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 1)
MIXED_INFERENCE_CLIENTS = 6
FINETUNE_CLIENTS = 2
FINETUNE_ADAPTER = "lora_r16_qkvo"
SCENARIOS = ("inference", "inference_alone", "inference_with_finetune", "finetune_alone")
# What is compared: a name -> the SchedulerConfig fields that make it. "opportunistic-fixed" is the
# opportunistic policy as first built (no predicted arrivals: it always holds a group for its whole
# wait budget; and its original, shorter budgets), kept as knobs so both run side by side.
VARIANTS: dict[str, dict] = {
    "immediate": {"policy": "immediate"},
    "lockstep": {"policy": "lockstep"},
    "opportunistic": {"policy": "opportunistic", "predict_arrivals": True},
    # Before: fixed waits with the budgets first shipped (decode 0.25 ms, prefill 1 ms, fine-tuning 2 ms).
    "opportunistic-fixed": {
        "policy": "opportunistic",
        "predict_arrivals": False,
        "decode_base_wait_ms": 0.25,
        "prefill_base_wait_ms": 1.0,
        "finetune_base_wait_ms": 2.0,
    },
}


@dataclass(frozen=True)
class ClientSpec:
    kind: str  # "inference" or "finetune"
    adapter: str
    batch_size: int  # sequences per step
    seq_len: int = 0  # fine-tuning tokens per sequence


def inference_specs(count: int) -> list[ClientSpec]:
    adapters = ("lora_r8_q", "lora_r64_qkvo")
    return [ClientSpec("inference", adapters[i % 2], INFERENCE_BATCH_SIZES[i]) for i in range(count)]


def clients_for(scenario: str, args: argparse.Namespace) -> list[ClientSpec]:
    finetune = [ClientSpec("finetune", FINETUNE_ADAPTER, args.ft_batch, args.ft_seq_len)] * FINETUNE_CLIENTS
    return {
        "inference": inference_specs(len(INFERENCE_BATCH_SIZES)),
        "inference_alone": inference_specs(MIXED_INFERENCE_CLIENTS),
        "inference_with_finetune": inference_specs(MIXED_INFERENCE_CLIENTS) + finetune,
        "finetune_alone": finetune,
    }[scenario]


# ---- one client thread ---------------------------------------------------------------------------


@dataclass
class Window:
    """Shared between the threads of one run: when the measured window ends, and when to stop."""

    stop: threading.Event = field(default_factory=threading.Event)
    start_s: float = 0.0
    end_s: float = float("inf")


@dataclass
class ClientRecord:
    spec: ClientSpec
    step_s: list[float] = field(default_factory=list)  # steps that finished inside the window
    tokens: int = 0
    error: BaseException | None = None


class InferenceClient:
    """Greedy decoding with a KV cache; re-prefills a new prompt after ``segment_tokens`` tokens."""

    def __init__(self, model, spec: ClientSpec, prompt_len: int, segment_tokens: int, seed: int):
        self.model, self.spec = model, spec
        self.prompt_len, self.segment_tokens = prompt_len, segment_tokens
        self.generator = torch.Generator().manual_seed(seed)
        self.vocab = model.config.vocab_size
        self.generated = segment_tokens  # forces a prefill first

    def step(self) -> bool:
        """Advance one step; True when it was a decode step (one new token per sequence)."""
        with torch.no_grad():
            if self.generated >= self.segment_tokens:
                prompt = torch.randint(0, self.vocab, (self.spec.batch_size, self.prompt_len), generator=self.generator)
                out = self.model(input_ids=prompt, use_cache=True)
                self.generated, decoded = 0, False
            else:
                out = self.model(input_ids=self.next_tokens, past_key_values=self.cache, use_cache=True)
                self.generated, decoded = self.generated + 1, True
        self.cache = out.past_key_values
        self.next_tokens = out.logits[:, -1:].argmax(-1)
        return decoded


class FinetuneClient:
    def __init__(self, model, spec: ClientSpec, seed: int):
        self.model, self.spec = model, spec
        generator = torch.Generator().manual_seed(seed)
        self.batch = torch.randint(0, model.config.vocab_size, (spec.batch_size, spec.seq_len), generator=generator)
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step(self) -> bool:
        loss = self.model(input_ids=self.batch, labels=self.batch).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True


def client_thread(client, record: ClientRecord, barrier: threading.Barrier, window: Window, warmup_steps: int, close: Callable[[], None]) -> None:
    try:
        for _ in range(warmup_steps):
            client.step()
        barrier.wait()
        tokens_per_step = record.spec.batch_size * max(1, record.spec.seq_len)
        while not window.stop.is_set():
            started = time.perf_counter()
            counted = client.step()
            finished = time.perf_counter()
            if counted and finished <= window.end_s:
                record.step_s.append(finished - started)
                record.tokens += tokens_per_step
    except BaseException as exc:  # reported by the main thread
        record.error = exc
        barrier.abort()
    finally:
        close()  # unregister at once, so that lockstep stops waiting for this client


# ---- one run -------------------------------------------------------------------------------------


def scheduler_counters(executor) -> dict:
    """Counters read at the window's start and end; waits and reasons are since the executor started."""
    if executor is None:
        return {"batches": 0, "rows": 0}
    return counters_from_stats(executor.stats()["scheduler"])


def counters_from_stats(stats: dict) -> dict:
    return {
        "batches": stats["batches"],
        "rows": stats["rows_served"],
        "mean_first_wait_ms": stats["mean_first_wait_ms"],
        "ready_reasons": stats["ready_reasons"],
    }


def run_once(path: Path, target, specs: Sequence[ClientSpec], args: argparse.Namespace, seed: int) -> dict:
    """Start the clients of ``specs`` against ``target`` (executor or address), measure one window."""
    clients, records, closers = [], [], []
    for index, spec in enumerate(specs):
        base = symbiosis.load_client_model(path, executor=target)
        model = peft.get_peft_model(base, ADAPTERS[spec.adapter]())
        if spec.kind == "inference":
            model.eval()
            clients.append(InferenceClient(model, spec, args.prompt_len, args.segment_tokens, seed=seed + index))
        else:
            model.train()
            clients.append(FinetuneClient(model, spec, seed=seed + index))
        records.append(ClientRecord(spec))
        closers.append(base.symbiosis_transport.close)

    executor = target if isinstance(target, symbiosis.BaseExecutor) else None
    window = Window()
    counters: dict[str, dict] = {}

    def start_window() -> None:  # runs once, when every client is warm and waiting
        counters["start"] = scheduler_counters(executor)
        window.start_s = time.perf_counter()
        window.end_s = window.start_s + args.window_s

    barrier = threading.Barrier(len(clients), action=start_window)
    threads = [
        threading.Thread(
            target=client_thread,
            args=(client, record, barrier, window, 3 if spec.kind == "inference" else 1, closer),
            name=f"client-{i}",
            daemon=True,
        )
        for i, (client, record, spec, closer) in enumerate(zip(clients, records, specs, closers))
    ]
    for thread in threads:
        thread.start()
    while "start" not in counters and not any(r.error for r in records):
        time.sleep(0.005)
    if "start" in counters:
        time.sleep(max(0.0, window.end_s - time.perf_counter()))
        counters["end"] = scheduler_counters(executor)
    window.stop.set()
    for thread in threads:
        thread.join(timeout=120)
    errors = [r.error for r in records if r.error is not None and not isinstance(r.error, threading.BrokenBarrierError)]
    if errors or any(t.is_alive() for t in threads):
        raise RuntimeError(f"a client failed or hung: {errors[:1]!r}") from (errors[0] if errors else None)
    return summarize_run(records, counters, args.window_s, executor is not None)


def summarize_run(records: Sequence[ClientRecord], counters: dict, window_s: float, have_stats: bool) -> dict:
    inference = [r for r in records if r.spec.kind == "inference"]
    finetune = [r for r in records if r.spec.kind == "finetune"]
    latencies = [s for r in inference for s in r.step_s]
    batches = counters["end"]["batches"] - counters["start"]["batches"]
    rows = counters["end"]["rows"] - counters["start"]["rows"]
    return {
        "tokens_per_s": sum(r.tokens for r in inference) / window_s if inference else None,
        "latency_ms_mean": 1e3 * statistics.fmean(latencies) if latencies else None,
        "latency_ms_median": 1e3 * statistics.median(latencies) if latencies else None,
        "latency_ms_p95": 1e3 * common.percentile(latencies, 95) if latencies else None,
        "finetune_tokens_per_s": sum(r.tokens for r in finetune) / window_s if finetune else None,
        "finetune_step_ms_median": 1e3 * statistics.median([s for r in finetune for s in r.step_s]) if any(r.step_s for r in finetune) else None,
        "mean_rows_per_batch": rows / batches if have_stats and batches else None,
        "batches": batches if have_stats else None,
        # Time from arrival to first rows handed out, per latency class (whole run, warm-up included).
        "mean_first_wait_ms": counters["end"].get("mean_first_wait_ms") if have_stats else None,
        "ready_reasons": counters["end"].get("ready_reasons") if have_stats else None,
        "per_client": [
            {
                "kind": r.spec.kind,
                "adapter": r.spec.adapter,
                "batch_size": r.spec.batch_size,
                "steps": len(r.step_s),
                "step_ms_mean": 1e3 * statistics.fmean(r.step_s) if r.step_s else None,
                "step_ms_p95": 1e3 * common.percentile(r.step_s, 95) if r.step_s else None,
            }
            for r in records
        ],
    }


# ---- aggregation and output ----------------------------------------------------------------------

SCALARS = ("tokens_per_s", "latency_ms_mean", "latency_ms_median", "latency_ms_p95", "finetune_tokens_per_s", "finetune_step_ms_median", "mean_rows_per_batch", "batches")


def aggregate(runs: Sequence[dict]) -> dict:
    """Median over repeated runs of every scalar, and of every client's numbers."""
    # None (not applicable, or nothing finished inside the window) is skipped; all None gives null.
    result = {key: common.median_or_nan([run[key] for run in runs]) for key in SCALARS}
    per_client = []
    for index, first in enumerate(runs[0]["per_client"]):
        client = {k: first[k] for k in ("kind", "adapter", "batch_size")}
        for key in ("steps", "step_ms_mean", "step_ms_p95"):
            client[key] = common.median_or_nan([run["per_client"][index][key] for run in runs])
        per_client.append(client)
    result["per_client"] = per_client
    result["runs"] = runs
    return result


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser, default_repeats=3, quick_repeats=1)
    parser.add_argument("--executor", default=None, metavar="ADDRESS", help="Connect clients to a running executor at ADDRESS (e.g. tcp://127.0.0.1:7000) instead of an in-process one; needs --model with its checkpoint.")
    parser.add_argument("--policies", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), help="Policies to compare (default: all); 'opportunistic-fixed' is opportunistic without predicted arrivals.")
    parser.add_argument(
        "--clients-as",
        choices=("threads", "processes"),
        default="threads",
        help="Run each client as a thread of this process with an in-process executor (default; one GIL for all), "
        "or each client and the executor as its own process, connected over ipc:// (benchmarks/batching_processes.py).",
    )
    parser.add_argument("--max-wait-ms", type=float, default=None, help="Executor max_wait_ms (default: SchedulerConfig's).")
    parser.add_argument("--window-s", type=float, default=None, help="Measured seconds per run (default 6; 0.6 with --quick).")
    parser.add_argument("--prompt-len", type=int, default=16, help="Prompt tokens per inference sequence (default: %(default)s).")
    parser.add_argument("--ft-batch", type=int, default=None, help="Sequences per fine-tuning step (default 4; 2 with --quick).")
    parser.add_argument("--ft-seq-len", type=int, default=None, help="Tokens per fine-tuning sequence (default 64; 16 with --quick).")
    args = common.resolve_common(parser.parse_args(argv))
    if args.clients_as == "processes" and args.quick:
        parser.error("--clients-as processes is for full runs; --quick uses threads")
    if args.executor and args.model is None:
        parser.error("--executor needs --model DIR: the checkpoint the executor at ADDRESS serves")
    args.window_s = args.window_s or (0.6 if args.quick else 6.0)
    args.ft_batch = args.ft_batch or (2 if args.quick else 4)
    args.ft_seq_len = args.ft_seq_len or (16 if args.quick else 64)
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    started = time.perf_counter()
    args = parse_args(argv)
    path = common.checkpoint_path(args)
    max_positions = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", 1024)
    args.segment_tokens = max(8, min(512, max_positions - args.prompt_len - 8))

    weights = None
    policies = ["remote"] if args.executor else list(args.policies)
    options = {} if args.max_wait_ms is None else {"max_wait_ms": args.max_wait_ms}
    configs = {p: SchedulerConfig(**VARIANTS.get(p, {}), **options) for p in policies}
    pool = None
    if args.clients_as == "processes":
        from benchmarks.batching_processes import ProcessPool

        pool = ProcessPool(path, len(INFERENCE_BATCH_SIZES), args)
    elif args.executor is None:
        weights = symbiosis.BaseExecutor.from_pretrained(path).weights  # loaded once, shared by every run

    runs: dict[tuple[str, str], list[dict]] = {(s, p): [] for s in SCENARIOS for p in policies}
    try:
        for repeat in range(args.repeats):
            for scenario in SCENARIOS:
                shift = repeat % len(policies)
                for policy in policies[shift:] + policies[:shift]:
                    specs, seed = clients_for(scenario, args), 100 * repeat
                    if pool is not None:
                        runs[scenario, policy].append(pool.run_once(None if args.executor else configs[policy], specs, seed))
                        continue
                    target = args.executor or symbiosis.BaseExecutor(weights, configs[policy])
                    try:
                        runs[scenario, policy].append(run_once(path, target, specs, args, seed=seed))
                    finally:
                        if not isinstance(target, str):
                            target.close()
    finally:
        if pool is not None:
            pool.close()

    inference = {p: aggregate(runs["inference", p]) for p in policies}
    mixed = {}
    for p in policies:
        alone, with_ft, ft_alone = (aggregate(runs[s, p]) for s in SCENARIOS[1:])
        mixed[p] = {
            "inference_alone": alone,
            "inference_with_finetune": with_ft,
            "finetune_alone": ft_alone,
            "latency_mean_ratio_mixed_over_alone": common.ratio(with_ft["latency_ms_mean"], alone["latency_ms_mean"]),
            "latency_p95_ratio_mixed_over_alone": common.ratio(with_ft["latency_ms_p95"], alone["latency_ms_p95"]),
            "finetune_tokens_ratio_mixed_over_alone": common.ratio(with_ft["finetune_tokens_per_s"], ft_alone["finetune_tokens_per_s"]),
        }
    summary = {
        "benchmark": NAME,
        "preset": args.preset,
        "transport": args.executor or ("ipc" if pool else "inproc"),
        "clients_as": args.clients_as,
        "window_s": args.window_s,
        "repeats": args.repeats,
        "inference": {p: {k: inference[p][k] for k in ("tokens_per_s", "latency_ms_mean", "latency_ms_p95", "mean_rows_per_batch")} for p in policies},
        "inference_ratios_vs_immediate": {
            p: {
                k: common.ratio(inference[p][k], inference["immediate"][k])
                for k in ("tokens_per_s", "latency_ms_mean", "latency_ms_p95")
            }
            for p in policies
            if "immediate" in inference
        },
        "mixed": {
            p: {
                "inference_latency_ms_mean_alone": mixed[p]["inference_alone"]["latency_ms_mean"],
                "inference_latency_ms_mean_with_finetune": mixed[p]["inference_with_finetune"]["latency_ms_mean"],
                "latency_mean_ratio_mixed_over_alone": mixed[p]["latency_mean_ratio_mixed_over_alone"],
                "finetune_tokens_per_s_alone": mixed[p]["finetune_alone"]["finetune_tokens_per_s"],
                "finetune_tokens_per_s_mixed": mixed[p]["inference_with_finetune"]["finetune_tokens_per_s"],
                "finetune_mean_first_wait_ms_mixed": median_wait(runs["inference_with_finetune", p], "finetune"),
                "decode_mean_first_wait_ms_mixed": median_wait(runs["inference_with_finetune", p], "decode"),
            }
            for p in policies
        },
    }
    result = {
        "benchmark": NAME,
        "command": common.command_line(argv, f"benchmarks.{NAME}"),
        "machine": common.machine_info(),
        "config": {
            "model": str(path),
            "arch": args.arch,
            "preset": args.preset,
            "quick": args.quick,
            "transport": args.executor
            or ("ipc (executor and each client in its own process)" if pool else "inproc (client threads in this process)"),
            "clients_as": args.clients_as,
            "policies": policies,
            "scheduler": None if args.executor else {p: dataclasses.asdict(configs[p]) for p in policies},
            "window_s": args.window_s,
            "repeats": args.repeats,
            "prompt_len": args.prompt_len,
            "segment_tokens": args.segment_tokens,
            "clients": {s: [vars(c) for c in clients_for(s, args)] for s in SCENARIOS},
            "baselines": "(a) immediate and lockstep policies; (b) the same inference clients without fine-tuning",
        },
        "inference": inference,
        "mixed": mixed,
        "summary": summary,
    }
    result["wall_s"] = summary["wall_s"] = time.perf_counter() - started
    output = Path(args.output)
    common.write_json(output / f"{NAME}.json", result)
    plot(output / f"{NAME}.png", result, policies)
    common.print_summary(summary)
    return result


def median_wait(runs: Sequence[dict], latency_class: str) -> float:
    """Median over runs of the scheduler's mean wait (arrival -> first rows handed out) for a class."""
    return common.median_or_nan([(r["mean_first_wait_ms"] or {}).get(latency_class) for r in runs])


def plot(path: Path, result: dict, policies: list[str]) -> None:
    inference, mixed = result["inference"], result["mixed"]
    sizes = [str(c["batch_size"]) for c in inference[policies[0]]["per_client"]]
    common.plot_panels(
        path,
        f"Batching policies, {result['config']['arch']} {result['config']['preset']}, clients as {result['config']['clients_as']}, "
        f"{result['config']['window_s']} s windows, median of {result['config']['repeats']}",
        [
            common.Panel("(a) 8 inference clients: aggregate throughput", "tokens/s", policies, {"tokens/s": [inference[p]["tokens_per_s"] for p in policies]}),
            common.Panel(
                "(a) per-token latency",
                "ms",
                policies,
                {"mean": [inference[p]["latency_ms_mean"] for p in policies], "p95": [inference[p]["latency_ms_p95"] for p in policies]},
            ),
            common.Panel("(a) mean rows per executor batch", "rows", policies, {"rows/batch": [inference[p]["mean_rows_per_batch"] for p in policies]}),
            common.Panel(
                "(a) per-client mean step latency by batch size",
                "ms",
                sizes,
                {p: [c["step_ms_mean"] for c in inference[p]["per_client"]] for p in policies},
                kind="line",
            ),
            common.Panel(
                "(b) 6 inference clients: mean per-token latency",
                "ms",
                policies,
                {
                    "alone": [mixed[p]["inference_alone"]["latency_ms_mean"] for p in policies],
                    "+2 fine-tuning": [mixed[p]["inference_with_finetune"]["latency_ms_mean"] for p in policies],
                },
            ),
            common.Panel(
                "(b) 2 fine-tuning clients: throughput",
                "tokens/s",
                policies,
                {
                    "alone": [mixed[p]["finetune_alone"]["finetune_tokens_per_s"] for p in policies],
                    "+6 inference": [mixed[p]["inference_with_finetune"]["finetune_tokens_per_s"] for p in policies],
                },
            ),
        ],
        columns=3,
    )


if __name__ == "__main__":
    main()
