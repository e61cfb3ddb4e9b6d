"""What does splitting a model cost one client? Split in-process vs monolithic transformers+peft.

Measures, on one random-weight checkpoint (default: the ``small`` LLaMA preset, ~14M params):

* **training step**: forward + backward + AdamW step of a LoRA adapter (r=8 on q/k/v/o) on a
  batch of ``--train-batch`` sequences of ``--seq-len`` tokens;
* **decode step**: one new token for each of ``--decode-batch`` sequences, with a KV cache,
  after a ``--prompt-len``-token prefill (no gradient).

Baseline: the monolithic model, ``peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path))``,
with the same adapter weights. Candidate: the split model,
``peft.get_peft_model(symbiosis.load_client_model(path, executor=ex))`` with ``ex`` a
``BaseExecutor`` in the same process (in-process transport, ``--policy``; one client, so batching
never waits). Both step kinds are timed interleaved (one monolithic sample, one split sample, ...),
after a warm-up, and reported as medians with p95; ``split_over_monolithic`` is the ratio of
medians (> 1 means splitting costs time).

Next to them, ``gemm_floor``: the executor's products alone — every (layer, op, rows) call the
split step made, recorded once and replayed back to back with ``symbiosis.executor.runner.apply_op``
on random rows. ``gemm_share_of_split`` is ``gemm_floor / split`` (what fraction of a split step is
base-layer math; the rest is client work plus the thread hand-off per layer), and
``matmul_ceiling_gflops`` is plain ``torch.matmul`` on a 1024² product (the hardware ceiling),
timed interleaved with the steps so it sees the same background load.
``check`` holds both models' loss on the training batch before any step, to show that the two
candidates do the same work.

JSON (``split_overhead.json`` in ``--output``) keys: ``benchmark, command, machine, config,
train_step, decode_step, check, matmul_ceiling_gflops, executor, wall_s``; ``train_step`` and
``decode_step`` each hold ``monolithic, split, gemm_floor`` (``median_ms, p95_ms, mean_ms, min_ms,
n``), ``split_over_monolithic``, ``gemm_share_of_split``, ``executor_calls``, ``gemm_gflop``,
``gemm_floor_gflops``, ``matmul_ceiling_gflops``. Plot: ``split_overhead.png``.

Run: ``python -m benchmarks.split_overhead [--preset base] [--quick] --output DIR``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import peft
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import symbiosis
from benchmarks import common
from symbiosis.executor.runner import apply_op
from symbiosis.vocabulary import Op

NAME = "split_overhead"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def lora_config() -> peft.LoraConfig:
    return peft.LoraConfig(task_type=peft.TaskType.CAUSAL_LM, r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser, default_repeats=30, quick_repeats=4)
    parser.add_argument("--policy", default="opportunistic", choices=("immediate", "lockstep", "opportunistic"), help="Executor batching policy (default: %(default)s).")
    parser.add_argument("--train-batch", type=int, default=None, help="Sequences per training step (default 4; 2 with --quick).")
    parser.add_argument("--seq-len", type=int, default=None, help="Tokens per training sequence (default 128; 32 with --quick).")
    parser.add_argument("--decode-batch", type=int, default=4, help="Sequences decoded together (default: %(default)s).")
    parser.add_argument("--prompt-len", type=int, default=32, help="Prefill length before decoding (default: %(default)s).")
    args = common.resolve_common(parser.parse_args(argv))
    args.train_batch = args.train_batch or (2 if args.quick else 4)
    args.seq_len = args.seq_len or (32 if args.quick else 128)
    return args


# ---- executor call recording and replay (the GEMM floor) -----------------------------------------


@dataclass(frozen=True)
class RecordedCall:
    layer_id: str
    op: Op
    rows: int


def record_calls(executor: symbiosis.BaseExecutor, step: Callable[[], None]) -> list[RecordedCall]:
    """Run ``step`` once and return every call it made to ``executor`` (shapes only)."""
    calls: list[RecordedCall] = []
    submit = executor.submit

    def recording_submit(client_id, layer_id, op, rows, latency_class):
        calls.append(RecordedCall(layer_id, Op(op), rows.shape[0]))
        return submit(client_id, layer_id, op, rows, latency_class)

    executor.submit = recording_submit  # the in-process transport looks the method up per call
    try:
        step()
    finally:
        del executor.submit
    return calls


def gemm_replay(executor: symbiosis.BaseExecutor, calls: Sequence[RecordedCall]) -> tuple[Callable[[], None], float]:
    """A function running the recorded products back to back on random rows, and their GFLOP."""
    layers = executor.weights.layers
    specs = executor.weights.specs
    inputs = []
    flop = 0.0
    for call in calls:
        spec = specs[call.layer_id]
        width = call.op.input_width(spec)
        inputs.append((layers[call.layer_id], call.op, torch.randn(call.rows, width, dtype=executor.dtype, device=executor.device)))
        flop += 2.0 * call.rows * spec.in_features * spec.out_features

    def replay() -> None:
        for layer, op, rows in inputs:
            apply_op(layer, op, rows)

    return replay, flop / 1e9


# ---- the two candidates --------------------------------------------------------------------------


def build_models(path: Path, executor: symbiosis.BaseExecutor, seed: int = 0):
    """Monolithic and split PEFT models with identical, non-trivial adapter weights."""
    torch.manual_seed(seed)
    monolithic = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path), lora_config())
    with torch.no_grad():  # LoRA B starts at zero; make it count so both models really use it
        for name, parameter in monolithic.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.02)
    split = peft.get_peft_model(symbiosis.load_client_model(path, executor=executor), lora_config())
    peft.set_peft_model_state_dict(split, peft.get_peft_model_state_dict(monolithic))
    return monolithic, split


def train_step_fn(model, batch: torch.Tensor) -> Callable[[], None]:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step() -> None:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


class Decoder:
    """Greedy decoding state of one model: each ``step()`` adds one token to every sequence."""

    def __init__(self, model, prompt: torch.Tensor):
        self.model = model
        with torch.no_grad():
            out = model(input_ids=prompt, use_cache=True)
        self.cache = out.past_key_values
        self.next_tokens = out.logits[:, -1:].argmax(-1)

    def step(self) -> None:
        with torch.no_grad():
            out = self.model(input_ids=self.next_tokens, past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self.next_tokens = out.logits[:, -1:].argmax(-1)


def compare(
    monolithic_step: Callable[[], None], split_step: Callable[[], None], executor, *, warmup: int, repeats: int
) -> dict:
    calls = record_calls(executor, split_step)
    monolithic_step()  # keep both candidates at the same step (same KV-cache length when decoding)
    replay, gflop = gemm_replay(executor, calls)
    ceiling_probe, ceiling_gflop = common.square_matmul()
    samples = common.time_interleaved(
        {"monolithic": monolithic_step, "split": split_step, "gemm_floor": replay, "matmul_1024": ceiling_probe},
        warmup=warmup,
        repeats=repeats,
    )
    result = {name: common.summarize(values) for name, values in samples.items() if name != "matmul_1024"}
    split_ms, monolithic_ms, floor_ms = (result[k]["median_ms"] for k in ("split", "monolithic", "gemm_floor"))
    result["split_over_monolithic"] = common.ratio(split_ms, monolithic_ms)
    result["gemm_share_of_split"] = common.ratio(floor_ms, split_ms)
    result["executor_calls"] = len(calls)
    result["executor_rows"] = sum(c.rows for c in calls)
    result["gemm_gflop"] = gflop
    result["gemm_floor_gflops"] = common.ratio(gflop * 1e3, floor_ms)
    # Ceiling under the same load: median of 1024² matmuls interleaved with the steps above.
    result["matmul_ceiling_gflops"] = common.ratio(ceiling_gflop * 1e3, common.summarize(samples["matmul_1024"])["median_ms"])
    return result


def main(argv: Sequence[str] | None = None) -> dict:
    started = time.perf_counter()
    args = parse_args(argv)
    path = common.checkpoint_path(args)
    max_positions = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", 1024)
    warmup = 1 if args.quick else 3
    # Every decode sample extends the same KV cache: keep the total within the position table.
    decode_repeats = max(1, min(4 * args.repeats, max_positions - args.prompt_len - warmup - 2))

    executor = symbiosis.BaseExecutor.from_pretrained(path, device="cpu", dtype=torch.float32, policy=args.policy)
    try:
        monolithic, split = build_models(path, executor)
        generator = torch.Generator().manual_seed(1)
        vocab = monolithic.config.vocab_size
        train_batch = torch.randint(0, vocab, (args.train_batch, args.seq_len), generator=generator)
        prompt = torch.randint(0, vocab, (args.decode_batch, args.prompt_len), generator=generator)

        for model in (monolithic, split):
            model.train()
        with torch.no_grad():
            losses = [float(m(input_ids=train_batch, labels=train_batch).loss) for m in (monolithic, split)]
        check = {"loss_monolithic": losses[0], "loss_split": losses[1], "loss_abs_diff": abs(losses[0] - losses[1])}

        train = compare(
            train_step_fn(monolithic, train_batch), train_step_fn(split, train_batch), executor, warmup=warmup, repeats=args.repeats
        )

        for model in (monolithic, split):
            model.eval()
        decoders = Decoder(monolithic, prompt), Decoder(split, prompt)
        decode = compare(decoders[0].step, decoders[1].step, executor, warmup=warmup, repeats=decode_repeats)

        stats = executor.stats()
        split.base_model.model.symbiosis_transport.close()
    finally:
        executor.close()

    result = {
        "benchmark": NAME,
        "command": common.command_line(argv, f"benchmarks.{NAME}"),
        "machine": common.machine_info(),
        "config": {
            "model": str(path),
            "arch": args.arch,
            "preset": args.preset,
            "quick": args.quick,
            "policy": args.policy,
            "adapter": f"LoRA r=8 alpha=16 on {LORA_TARGETS}",
            "train_batch": args.train_batch,
            "seq_len": args.seq_len,
            "decode_batch": args.decode_batch,
            "prompt_len": args.prompt_len,
            "warmup": warmup,
            "train_repeats": args.repeats,
            "decode_repeats": decode_repeats,
            "baseline": "monolithic transformers+peft, same checkpoint and adapter weights, same process",
        },
        "train_step": train,
        "decode_step": decode,
        "check": check,
        "matmul_ceiling_gflops": max(train["matmul_ceiling_gflops"], decode["matmul_ceiling_gflops"]),
        "executor": {
            "mean_rows_per_batch": stats["scheduler"]["mean_batch_rows"],
            "batches": stats["scheduler"]["batches"],
            "weights_bytes": stats["weights_bytes"],
        },
        "wall_s": time.perf_counter() - started,
    }
    output = Path(args.output)
    common.write_json(output / f"{NAME}.json", result)
    labels = ["monolithic", "split", "gemm_floor"]
    common.plot_panels(
        output / f"{NAME}.png",
        f"Split in-process vs monolithic ({args.arch} {args.preset}, medians)",
        [
            common.Panel(
                f"training step (B={args.train_batch}, T={args.seq_len}); split/mono = {train['split_over_monolithic']:.2f}",
                "ms",
                labels,
                {"median": [train[k]["median_ms"] for k in labels], "p95": [train[k]["p95_ms"] for k in labels]},
            ),
            common.Panel(
                f"decode step (B={args.decode_batch}); split/mono = {decode['split_over_monolithic']:.2f}",
                "ms",
                labels,
                {"median": [decode[k]["median_ms"] for k in labels], "p95": [decode[k]["p95_ms"] for k in labels]},
            ),
        ],
    )
    common.print_summary(
        {
            "benchmark": NAME,
            "preset": args.preset,
            "train_step_ms": {k: train[k]["median_ms"] for k in labels},
            "train_split_over_monolithic": train["split_over_monolithic"],
            "train_gemm_share_of_split": train["gemm_share_of_split"],
            "decode_step_ms": {k: decode[k]["median_ms"] for k in labels},
            "decode_split_over_monolithic": decode["split_over_monolithic"],
            "decode_gemm_share_of_split": decode["gemm_share_of_split"],
            "gemm_floor_gflops": {"train": train["gemm_floor_gflops"], "decode": decode["gemm_floor_gflops"]},
            "matmul_ceiling_gflops": result["matmul_ceiling_gflops"],
            "loss_abs_diff": check["loss_abs_diff"],
            "torch_threads": result["machine"]["torch_threads"],
            "wall_s": result["wall_s"],
            "output": str(output / f"{NAME}.json"),
        }
    )
    return result


if __name__ == "__main__":
    main()
