"""The clients of ``benchmarks.batching``, shared by its two modes (threads of one process, or processes).

- ``InferenceClient``: greedy decoding with a KV cache and its own LoRA adapter; re-prefills a new
  prompt after ``segment_tokens`` tokens. A decode step (one token per sequence) is what counts.
- ``FinetuneClient``: LoRA training steps (AdamW) on one fixed batch.
- ``FloodClient``: ``depth`` threads, each sending ``rows``-row requests for one base layer back to
  back, labelled with the latency class of its choice: a client that floods the executor.

``run_client`` is a client's whole measured life (warm-up, start together, run until the window's
end, count what finished inside the window) for either mode; ``summarize_run`` turns the records
of one run into the per-run figures both modes report.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import peft
import torch

from benchmarks.timing import percentile
from symbiosis.errors import ExecutorBusyError
from symbiosis.executor.host_load import host_cpu_busy_s
from symbiosis.vocabulary import LatencyClass, Op

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ADAPTERS: dict[str, Callable[[], peft.LoraConfig]] = {
    "lora_r8_q": lambda: peft.LoraConfig(
        task_type=peft.TaskType.CAUSAL_LM, r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj"]
    ),
    "lora_r64_qkvo": lambda: peft.LoraConfig(
        task_type=peft.TaskType.CAUSAL_LM, r=64, lora_alpha=128, lora_dropout=0.0, target_modules=ATTENTION
    ),
    "lora_r16_qkvo": lambda: peft.LoraConfig(
        task_type=peft.TaskType.CAUSAL_LM, r=16, lora_alpha=32, lora_dropout=0.0, target_modules=ATTENTION
    ),
}
FLOOD_LAYER_SUFFIX = "layers.0.self_attn.q_proj"


@dataclass(frozen=True)
class ClientSpec:
    kind: str  # "inference", "finetune" or "flood"
    adapter: str = "lora_r8_q"
    batch_size: int = 1  # sequences per step (flood: rows per request)
    seq_len: int = 0  # fine-tuning tokens per sequence
    depth: int = 0  # flood: requests kept outstanding
    label: str = "finetune"  # flood: the latency class it claims
    # inference: open loop, a step started at most every ``interval_s`` (0: closed loop, back to
    # back); ``phase``: the share of an interval the client waits before its first measured step,
    # so that streams read at one rate do not all step at the same instant (``pace``)
    interval_s: float = 0.0
    phase: float = 0.0


@dataclass
class ClientRecord:
    spec: ClientSpec
    step_s: list[float] = field(default_factory=list)  # steps that finished inside the window
    # tokens (flood: rows) done inside the window: the steps that finished in it, and the share
    # inside it of the step under way at its end (``run_measured``)
    tokens: float = 0
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


class FloodClient:
    """``depth`` threads sending ``rows``-row forward requests for one base layer, back to back."""

    def __init__(self, transport, spec: ClientSpec, seed: int):
        self.transport, self.spec = transport, spec
        specs = transport.layer_specs()
        self.layer_id = next(layer for layer in specs if layer.endswith(FLOOD_LAYER_SUFFIX))
        width = specs[self.layer_id].in_features
        self.rows = torch.randn(spec.batch_size, width, generator=torch.Generator().manual_seed(seed))
        self.latency_class = LatencyClass(spec.label)
        self.stop = threading.Event()
        self.end_s = float("inf")
        self.done_rows = 0
        self._lock = threading.Lock()
        self._replied = threading.Condition()  # notified whenever one of this flood's requests returns
        self._threads: list[threading.Thread] = []
        self.error: BaseException | None = None

    def step(self) -> bool:  # warm-up: one request
        self.transport.call(self.layer_id, Op.FORWARD, self.rows[:16], self.latency_class)
        return True

    def start(self, end_s: float) -> None:
        self.end_s = end_s
        self._threads = [
            threading.Thread(target=self._send, name=f"flood-{i}", daemon=True) for i in range(self.spec.depth)
        ]
        for thread in self._threads:
            thread.start()

    def _send(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    self.transport.call(self.layer_id, Op.FORWARD, self.rows, self.latency_class)
                except ExecutorBusyError:
                    # Over the executor's per-client byte cap (remote transports): the refused
                    # request was sent whole, so resend only once one of ours has come back, as a
                    # client honouring backpressure does; the flood stays at the cap.
                    with self._replied:
                        self._replied.wait(timeout=1.0)
                    continue
                with self._replied:
                    self._replied.notify_all()
                if time.perf_counter() <= self.end_s:
                    with self._lock:
                        self.done_rows += self.rows.shape[0]
        except BaseException as exc:  # reported by the caller
            if not self.stop.is_set():
                self.error = exc

    def finish(self) -> int:
        """Stop sending; the rows completed inside the window."""
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout=120)
        if self.error is not None:
            raise self.error
        return self.done_rows


def make_client(path, target, spec: ClientSpec, seed: int, prompt_len: int, segment_tokens: int):
    """A client of ``spec`` against ``target`` (an executor or an address); returns it and its closer."""
    import symbiosis

    base = symbiosis.load_client_model(path, executor=target)
    transport = base.symbiosis_transport
    if spec.kind == "flood":
        return FloodClient(transport, spec, seed), transport.close
    model = peft.get_peft_model(base, ADAPTERS[spec.adapter]())
    if spec.kind == "inference":
        model.eval()
        return InferenceClient(model, spec, prompt_len, segment_tokens, seed=seed), transport.close
    model.train()
    return FinetuneClient(model, spec, seed=seed), transport.close


def pace(spec: ClientSpec, step_started_s: float) -> None:
    """Open loop (``spec.interval_s``): wait until one interval after the last step started -- a
    stream read at a fixed rate, as a user reads tokens -- or go on at once when that step took
    longer (the stream falls behind; its step time says so). Closed loop: return at once.

    Why an open loop. Closed-loop decoders take every core they can (6 of them kept 1.67 of this
    host's 2 busy), so beside them fine-tuning can only take their time: the mixed figure then
    measures the host, not whether the scheduler leaves fine-tuning the rows the decoders do not
    need (issue 11's "every row the SLO leaves free"). Decoders read at a set rate leave idle time,
    as inference below its peak does (FlexLLM measures its co-serving over request rates)."""
    if spec.interval_s:
        delay_s = step_started_s + spec.interval_s - time.perf_counter()
        if delay_s > 0:
            time.sleep(delay_s)


def warm_up(client, spec: ClientSpec, seconds: float) -> None:
    """A few steps (prefill and 2 decode steps, or 1 training step), then more until ``seconds``
    have passed, so that the window measures a steady state: the executor has learned the
    clients' order and pace, and an adaptive policy its rule (the same warm-up for every policy).
    A flood sends one small request and starts flooding with the window. An open-loop client
    keeps its rate and its phase in the warm-up too (``pace``, ``spread_phases``).

    Why its phase: streams read at one rate are not in step, and the warm-up had every stream
    start at once. In step, 8 client threads of batch 1-16 reading a token every 200 ms each
    waited for all the others' Python (one interpreter lock) and stepped late, back to back; a
    convoy that formed there held them together for the window. Measured (2026-12-07, this 2-core
    host, ``--decode-interval-ms 200 --scenarios inference``, 3 repeats): opportunistic 260, 29 and
    229 ms mean per token, the fixed convoy 243, 78 and 25, immediate 83, 21 and 20 -- at 1.2
    cores busy where the streams out of step kept 0.8. With the phases here too: opportunistic
    19-22 ms in 3 of 3, immediate 17-19."""
    started = time.perf_counter()
    if spec.interval_s and spec.phase:  # out of step from the first step (docstring)
        time.sleep(spec.interval_s * spec.phase)
    first_steps = 3 if spec.kind == "inference" else 1
    steps = 0
    while steps < first_steps or (spec.kind != "flood" and time.perf_counter() - started < seconds):
        step_started = time.perf_counter()
        client.step()
        pace(spec, step_started)
        steps += 1


def run_measured(client, record: ClientRecord, end_s: float, stop: Callable[[], bool]) -> None:
    """Step ``client`` until ``stop()``; count what was done by ``end_s`` into ``record``: the steps
    that finished by then (their tokens and times), and of the step under way at ``end_s`` the share
    of its time inside the window (its tokens pro rata).

    Why the share: a window holds few steps of a slow client, and counting whole steps only
    undercounts it by half a step on average -- a fine-tuning step beside decoders took 0.8-2 s
    of a 6 s window (2026-12-06, 2 clients of 256 tokens a step: 512 tokens/s counted where the
    steps' median time gave 648, x0.79), alone 0.3 s (x0.95), so the share of fine-tuning a
    scheduler keeps read 10-20% low. Every client starts its first step with the window (a common
    start after its warm-up), so the window's start cuts no step."""
    if isinstance(client, FloodClient):
        client.start(end_s)
        while not stop():
            time.sleep(0.01)
        record.tokens = client.finish()
        return
    spec = record.spec
    tokens_per_step = spec.batch_size * max(1, spec.seq_len)
    if spec.interval_s and spec.phase:  # open loop: the streams' steps spread over an interval
        time.sleep(spec.interval_s * spec.phase)
    while not stop():
        started = time.perf_counter()
        counted = client.step()
        finished = time.perf_counter()
        if counted:
            if finished <= end_s:
                record.step_s.append(finished - started)
                record.tokens += tokens_per_step
            elif started < end_s:  # under way at the window's end: the share of it inside
                record.tokens += tokens_per_step * (end_s - started) / (finished - started)
        pace(spec, started)


def host_cpu_reading() -> dict:
    """The host's busy CPU seconds and the clock, read together: the busy cores over a window are the
    busy seconds between two readings over the time between those readings, not over the nominal
    window (the reader may wake late, or wait for the executor's stats while a batch runs)."""
    return {"cpu_busy_s": host_cpu_busy_s(), "cpu_read_at_s": time.perf_counter()}


def remote_counters() -> dict:
    """What a run reads at its window's start and end when the executor's stats are not visible."""
    return {"batches": 0, "rows": 0, **host_cpu_reading()}


def counters_from_stats(stats: dict) -> dict:
    """The scheduler counters a run reads at its window's start and end, and the host's busy CPU time."""
    return {
        **host_cpu_reading(),
        "batches": stats["batches"],
        "rows": stats["rows_served"],
        "mean_first_wait_ms": stats["mean_first_wait_ms"],
        "ready_reasons": stats["ready_reasons"],
        "wait_rule": stats.get("wait_rule"),
        "decode_guard": stats.get("decode_guard"),
        "chunks_cut_for_decode": stats.get("chunks_cut_for_decode"),
        "bulk_batches_in_free_time": stats.get("bulk_batches_in_free_time"),
    }


def cores_busy(start: dict, end: dict) -> float:
    """Cores the host kept busy between two ``host_cpu_reading``s."""
    return (end["cpu_busy_s"] - start["cpu_busy_s"]) / max(end["cpu_read_at_s"] - start["cpu_read_at_s"], 1e-9)


def summarize_run(records: Sequence[ClientRecord], counters: dict, window_s: float, have_stats: bool) -> dict:
    inference = [r for r in records if r.spec.kind == "inference"]
    finetune = [r for r in records if r.spec.kind == "finetune"]
    flood = [r for r in records if r.spec.kind == "flood"]
    latencies = [s for r in inference for s in r.step_s]
    batches = counters["end"]["batches"] - counters["start"]["batches"]
    rows = counters["end"]["rows"] - counters["start"]["rows"]
    end = counters["end"] if have_stats else {}
    return {
        "tokens_per_s": sum(r.tokens for r in inference) / window_s if inference else None,
        "latency_ms_mean": 1e3 * statistics.fmean(latencies) if latencies else None,
        "latency_ms_median": 1e3 * statistics.median(latencies) if latencies else None,
        "latency_ms_p95": 1e3 * percentile(latencies, 95) if latencies else None,
        "finetune_tokens_per_s": sum(r.tokens for r in finetune) / window_s if finetune else None,
        "finetune_step_ms_median": 1e3 * statistics.median([s for r in finetune for s in r.step_s])
        if any(r.step_s for r in finetune)
        else None,
        "flood_rows_per_s": sum(r.tokens for r in flood) / window_s if flood else None,
        "mean_rows_per_batch": rows / batches if have_stats and batches else None,
        # Cores the host kept busy over the window (of machine.cpu_count): what a closed-loop load
        # leaves idle is what background work could have without slowing it.
        "cpu_cores_busy": cores_busy(counters["start"], counters["end"]),
        "batches": batches if have_stats else None,
        # Time from arrival to first rows handed out, per latency class (whole run, warm-up included).
        "mean_first_wait_ms": end.get("mean_first_wait_ms"),
        "ready_reasons": end.get("ready_reasons"),
        "wait_rule": end.get("wait_rule"),
        "decode_guard": end.get("decode_guard"),
        "chunks_cut_for_decode": end.get("chunks_cut_for_decode"),
        "bulk_batches_in_free_time": end.get("bulk_batches_in_free_time"),
        "per_client": [
            {
                "kind": r.spec.kind,
                "adapter": r.spec.adapter,
                "batch_size": r.spec.batch_size,
                "steps": len(r.step_s),
                "step_ms_mean": 1e3 * statistics.fmean(r.step_s) if r.step_s else None,
                "step_ms_p95": 1e3 * percentile(r.step_s, 95) if r.step_s else None,
            }
            for r in records
        ],
    }
