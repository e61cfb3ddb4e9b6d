"""Fine-tuning job: a split client model + a PEFT adapter + a plain AdamW loop, resumable exactly.

Why a plain loop and not ``transformers.Trainer``: the loop is ~100 lines, shows what runs where
(the base layers' products in the executor, everything else here), and makes exact resumption
easy to state. A split model also trains under ``Trainer`` unchanged (see the tests); nothing
here depends on the loop being ours.

Exact resume: a checkpoint holds the adapter, the optimizer, the LR scheduler, the RNG states,
the data position (epoch, index) and the log so far, written at a step boundary. A resumed run
restores all of them and so computes the same batches with the same dropout masks and the same
optimizer moments: its loss curve equals the uninterrupted one.

Output: ``--output DIR`` becomes a standard PEFT adapter folder (``adapter_config.json`` +
``adapter_model.safetensors``, plus ``log.jsonl`` and ``loss.png``), written into a temporary
sibling folder and renamed into place, so a failed save (a full disk) never leaves a folder that
looks complete. Checkpoints, the live log and plot go to ``DIR.run/`` next to it. Both are checked
before anything else runs: a job replaces or clears only folders it wrote (``artifacts.py``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch

from symbiosis.jobs.artifacts import (
    check_output_folder,
    check_run_folder,
    prepare_run_folder,
    save_adapter,
    save_loss_plot,
    write_atomically,
)
from symbiosis.jobs.base import JobError
from symbiosis.jobs.client import (
    ClientOptions,
    SplitClient,
    executor_restart_hint,
    load_tokenizer,
    require_model_dir,
)
from symbiosis.jobs.context import cap_seq_len, note_cut_to_context, read_context_length
from symbiosis.jobs.data import BatchOrder, TokenizedExample, collate, read_jsonl, split_eval, tokenize_all
from symbiosis.jobs.interrupts import JobInterrupted, StopAtStepBoundary
from symbiosis.jobs.methods import MethodOptions, build_peft_config, read_peft_config_file
from symbiosis.jobs.publish import AdapterPublisher, PublishOptions
from symbiosis.jobs.train_options import TrainOptions

TRAINER_STATE = "trainer_state.pt"

# Options that must be equal for a checkpoint to be resumed exactly.
_RESUME_KEYS = (
    "steps",
    "epochs",
    "lr",
    "lr_schedule",
    "warmup_steps",
    "weight_decay",
    "batch_size",
    "grad_accum",
    "seq_len",
    "seed",
    "bf16",
)
#: What a checkpoint written before an option existed ran with.
_RESUME_DEFAULTS = {"bf16": False}


@dataclass(frozen=True)
class StepRecord:
    """What one optimizer step reports (to the progress bar, the log, and callers such as the demo)."""

    step: int
    total_steps: int
    loss: float
    lr: float
    tokens: int
    tokens_per_s: float
    elapsed_s: float
    eval_loss: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass
class FinetuneResult:
    steps: int
    losses: list[float]
    eval_losses: list[tuple[int, float]]
    tokens_per_s: float
    trainable_parameters: int
    output: Path | None


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the peak LR at step ``s`` (0-based): linear warmup, then the schedule."""

    def factor(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / (warmup_steps + 1)
        if schedule == "constant":
            return 1.0
        progress = (s - warmup_steps) / max(1, total_steps - warmup_steps)
        progress = min(1.0, progress)
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


class FinetuneRun:
    """One training run of a PEFT model on tokenized examples, with checkpoints and a log."""

    def __init__(
        self,
        peft_model,
        train_set: list[TokenizedExample],
        eval_set: list[TokenizedExample],
        options: TrainOptions,
        *,
        pad_token_id: int,
        run_dir: Path | None = None,
    ) -> None:
        self.model = peft_model
        self.train_set = train_set
        self.eval_set = eval_set
        self.options = options
        self.pad_token_id = pad_token_id
        self.run_dir = run_dir
        self.order = BatchOrder(len(train_set), options.batch_size, options.seed)
        self.total_steps = options.steps or max(
            1, math.ceil(options.epochs * self.order.steps_per_epoch(options.grad_accum))
        )
        self.params = trainable_parameters(peft_model)
        if not self.params:
            raise JobError("the model has no trainable parameters (was a PEFT adapter applied?)")
        self.optimizer = torch.optim.AdamW(
            [p for _, p in self.params], lr=options.lr, weight_decay=options.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(options.lr_schedule, options.warmup_steps, self.total_steps)
        )
        self.step = 0
        self.tokens = 0
        self.log: list[dict[str, Any]] = []
        # AdaLoRA reallocates ranks from the gradients after each step (peft's documented loop).
        self._update_and_allocate = getattr(getattr(peft_model, "base_model", None), "update_and_allocate", None)

    # ---- the loop ------------------------------------------------------------------------------

    def train(
        self, on_step: Callable[[StepRecord], None] | None = None, stop: Callable[[], bool] | None = None
    ) -> FinetuneResult:
        """Run from ``self.step`` to ``total_steps``; ``on_step`` sees every step (may raise to stop).
        ``stop`` is asked after each step: when it says so (Ctrl-C, ``interrupts.py``), the run
        saves a checkpoint there and raises ``JobInterrupted``, which says how to go on."""
        self.model.train()
        started = time.perf_counter()
        tokens_at_start = self.tokens
        while self.step < self.total_steps:
            loss, tokens = self._one_step()
            self.step += 1
            self.tokens += tokens
            elapsed = time.perf_counter() - started
            eval_loss = self._maybe_eval()
            record = StepRecord(
                step=self.step,
                total_steps=self.total_steps,
                loss=loss,
                lr=self.scheduler.get_last_lr()[0],
                tokens=self.tokens,
                tokens_per_s=(self.tokens - tokens_at_start) / max(elapsed, 1e-9),
                elapsed_s=elapsed,
                eval_loss=eval_loss,
            )
            self.log.append(record.as_dict())
            self._append_log(record)
            saved = None
            if self.options.save_every and self.step % self.options.save_every == 0 and self.step < self.total_steps:
                saved = self.save_checkpoint()
            if on_step is not None:
                on_step(record)
            if stop is not None and self.step < self.total_steps and stop():
                self._stop_here(saved)
        self.model.eval()
        elapsed = time.perf_counter() - started
        return FinetuneResult(
            steps=self.step,
            losses=[r["loss"] for r in self.log],
            eval_losses=[(r["step"], r["eval_loss"]) for r in self.log if "eval_loss" in r],
            tokens_per_s=(self.tokens - tokens_at_start) / max(elapsed, 1e-9),
            trainable_parameters=sum(p.numel() for _, p in self.params),
            output=None,
        )

    def _stop_here(self, saved: Path | None) -> NoReturn:
        """Stopped at a step boundary: keep what ran (a checkpoint, unless this step's is saved)."""
        where = f"stopped after step {self.step} of {self.total_steps}"
        if self.run_dir is None:
            raise JobInterrupted(f"{where}; nothing was saved (no run folder)")
        saved = saved or self.save_checkpoint()
        raise JobInterrupted(f"{where}; checkpoint saved in {saved}; the same command with --resume goes on from there")

    def _one_step(self) -> tuple[float, int]:
        accum = self.options.grad_accum
        total_loss = 0.0
        tokens = 0
        for _ in range(accum):
            batch = collate([self.train_set[i] for i in self.order.next_indices()], self.pad_token_id)
            with self._autocast():
                loss = self.model(**batch).loss / accum
            loss.backward()
            total_loss += loss.item()
            tokens += int(batch["attention_mask"].sum())
        if self.options.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_([p for _, p in self.params], self.options.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        if self._update_and_allocate is not None:
            self._update_and_allocate(self.step)
        self.optimizer.zero_grad(set_to_none=True)
        return total_loss, tokens

    def _autocast(self) -> torch.autocast:
        """Where a forward pass runs: under bfloat16 autocast with ``--bf16`` (off otherwise)."""
        return torch.autocast(self.model.device.type, dtype=torch.bfloat16, enabled=self.options.bf16)

    def _maybe_eval(self) -> float | None:
        if not self.eval_set:
            return None
        every = self.options.eval_every
        if not ((every and self.step % every == 0) or self.step == self.total_steps):
            return None
        return self.evaluate()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean held-out loss over the eval split (token-weighted across batches)."""
        was_training = self.model.training
        self.model.eval()
        total, count = 0.0, 0
        for start in range(0, len(self.eval_set), self.options.batch_size):
            batch = collate(self.eval_set[start : start + self.options.batch_size], self.pad_token_id)
            n = int((batch["labels"][:, 1:] != -100).sum())
            with self._autocast():
                total += self.model(**batch).loss.item() * n
            count += n
        self.model.train(was_training)
        return total / max(count, 1)

    # ---- log and checkpoints -------------------------------------------------------------------

    def _append_log(self, record: StepRecord) -> None:
        if self.run_dir is None:
            return
        with open(self.run_dir / "log.jsonl", "a") as f:
            f.write(json.dumps(record.as_dict()) + "\n")

    def _checkpoints(self) -> list[Path]:
        folder = self.run_dir / "checkpoints" if self.run_dir else None
        if folder is None or not folder.is_dir():
            return []
        done = [p for p in folder.glob("step-*") if (p / TRAINER_STATE).is_file()]
        return sorted(done, key=lambda p: int(p.name.split("-")[1]))

    def save_checkpoint(self) -> Path:
        """Adapter + optimizer + scheduler + RNG + data position + log, as one atomic folder."""
        assert self.run_dir is not None, "checkpoints need a run folder"
        folder = self.run_dir / "checkpoints"
        folder.mkdir(parents=True, exist_ok=True)
        state = {
            "step": self.step,
            "tokens": self.tokens,
            "options": {k: getattr(self.options, k) for k in _RESUME_KEYS},
            "trainable": {name: p.detach().clone() for name, p in self.params},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "order": self.order.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                "python": random.getstate(),
            },
            "log": list(self.log),
        }
        final = folder / f"step-{self.step:07d}"
        write_atomically(final, lambda tmp: (self.model.save_pretrained(tmp), torch.save(state, tmp / TRAINER_STATE)))
        for old in self._checkpoints()[: -max(1, self.options.keep_checkpoints)]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def resume(self) -> int:
        """Load the newest checkpoint in the run folder; returns its step."""
        found = self._checkpoints()
        if not found:
            raise JobError(
                f"--resume: no checkpoint in {self.run_dir / 'checkpoints' if self.run_dir else '(no run folder)'}"
            )
        state = torch.load(found[-1] / TRAINER_STATE, weights_only=True)  # plain containers and tensors only
        mine = {k: getattr(self.options, k) for k in _RESUME_KEYS}
        recorded = {k: state["options"].get(k, _RESUME_DEFAULTS.get(k)) for k in _RESUME_KEYS}
        changed = {k: (recorded[k], mine[k]) for k in _RESUME_KEYS if recorded[k] != mine[k]}
        if changed:
            raise JobError(f"--resume: options differ from the checkpoint's (was, now): {changed}")
        _check_same_adapter(dict(self.params), state["trainable"])
        params = dict(self.params)
        with torch.no_grad():
            for name, value in state["trainable"].items():
                params[name].copy_(value)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.order.load_state_dict(state["order"])
        torch.set_rng_state(state["rng"]["torch"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        random.setstate(state["rng"]["python"])
        self.step, self.tokens, self.log = state["step"], state["tokens"], list(state["log"])
        if self.run_dir is not None:  # the log restarts from the checkpoint: later lines are redone
            (self.run_dir / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in self.log))
        return self.step


def _check_same_adapter(params: dict[str, torch.nn.Parameter], saved: dict[str, torch.Tensor]) -> None:
    """Refuse a checkpoint whose adapter has other tensors or other shapes than this run's: it was
    trained with another method, rank or target modules, or on another base model."""
    missing = set(params) ^ set(saved)
    if missing:
        raise JobError(
            f"--resume: the checkpoint's adapter does not match this model, method and options ({sorted(missing)[:3]})"
        )
    for name, value in saved.items():
        if value.shape != params[name].shape:
            raise JobError(
                "--resume: the checkpoint's adapter does not match this model, method and options "
                f"({name}: {list(value.shape)} in the checkpoint, {list(params[name].shape)} now)"
            )


# ---- saving -------------------------------------------------------------------------------------


@dataclass
class FinetuneOptions:
    """Everything ``symbiosis finetune`` needs; the CLI builds it from flags."""

    model: Path
    data: Path
    output: Path
    client: ClientOptions
    method: str = "lora"
    method_options: MethodOptions = field(default_factory=MethodOptions)
    peft_config: Path | None = None
    train: TrainOptions = field(default_factory=TrainOptions)
    resume: bool = False
    progress: bool = True
    publish: PublishOptions | None = None  # publish the adapter to a running `symbiosis api` while training

    @property
    def run_dir(self) -> Path:
        """Checkpoints, live log and plot: ``OUTPUT.run`` next to the output folder."""
        return self.output.parent / f"{self.output.name}.run"


def _progress_printer(total: int, label: str) -> tuple[Callable[[StepRecord], None], Callable[[], None]]:
    """A rich progress bar on stderr showing step, loss and tokens/s; returns (update, stop)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[tps]} tok/s"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )
    task = progress.add_task(label, total=total, loss="-", tps="-")
    progress.start()

    def update(record: StepRecord) -> None:
        progress.update(task, completed=record.step, loss=f"{record.loss:.4f}", tps=f"{record.tokens_per_s:,.0f}")

    return update, progress.stop


def finetune(options: FinetuneOptions, on_step: Callable[[StepRecord], None] | None = None) -> FinetuneResult:
    """Train a PEFT adapter on a split client of the executor and save it as a PEFT folder."""
    # Outputs first: a refused --output must cost no training and must not touch anything.
    check_output_folder(options.output)
    check_run_folder(options.run_dir, options.resume)
    if options.publish is not None and options.method != "lora":
        raise JobError(f"--publish-to needs --method lora (the api server serves LoRA adapters), not {options.method}")
    records = read_jsonl(options.data)  # bad data fails before any connection is made
    tokenizer = load_tokenizer(require_model_dir(options.model))
    train = cap_seq_len(options.train, read_context_length(options.model))
    train_records, eval_records = split_eval(records, train.eval_fraction, train.seed)
    train_set = tokenize_all(tokenizer, train_records, train.seq_len, str(options.data))
    eval_set = tokenize_all(tokenizer, eval_records, train.seq_len, str(options.data)) if eval_records else []
    if train.seq_len < options.train.seq_len:
        note_cut_to_context(options.train.seq_len, train.seq_len, options.model, train_set + eval_set)
    overrides = read_peft_config_file(options.peft_config) if options.peft_config else None

    with SplitClient(options.model, options.client) as client:
        torch.manual_seed(train.seed)
        order = BatchOrder(len(train_set), train.batch_size, train.seed)
        total = train.steps or max(1, math.ceil(train.epochs * order.steps_per_epoch(train.grad_accum)))
        method_options = dataclasses.replace(options.method_options, total_steps=total)
        peft_model = _apply_method(options, client.model, method_options, overrides)
        run_dir = prepare_run_folder(options.run_dir, options.resume)
        # The options as they ran (--seq-len cut to the context), as training_options.json records
        # them: a resume with the recorded flags, or with the flags as first given, compares equal.
        run = FinetuneRun(peft_model, train_set, eval_set, train, pad_token_id=tokenizer.pad_token_id, run_dir=run_dir)
        if options.resume:
            step = run.resume()
            print(
                f"resuming at step {step} of {run.total_steps} (checkpoint in {run_dir / 'checkpoints'})",
                file=sys.stderr,
            )
        publisher = AdapterPublisher(options.publish, peft_model, run_dir / "published") if options.publish else None
        update, stop = (
            _progress_printer(run.total_steps, f"{options.method}") if options.progress else (None, lambda: None)
        )
        if update is not None:
            update_start = run.step
            update(StepRecord(update_start, run.total_steps, float("nan"), 0.0, run.tokens, 0.0, 0.0))

        def report(record: StepRecord) -> None:
            if update is not None:
                update(record)
            if publisher is not None:
                publisher(record)
            if on_step is not None:
                on_step(record)

        try:
            with StopAtStepBoundary() as interrupt, executor_restart_hint(options.client):
                result = run.train(report, stop=lambda: interrupt.requested)
        finally:
            stop()
        points = [(r["step"], r["loss"]) for r in run.log]
        evals = [(r["step"], r["eval_loss"]) for r in run.log if "eval_loss" in r]
        save_loss_plot(
            {"train": points, **({"eval": evals} if evals else {})},
            run_dir / "loss.png",
            f"{options.method} on {options.data.name}",
        )
        # What ran: the real step count (adalora's schedule) and the cut to the context; no API key.
        recorded = dataclasses.replace(
            options,
            method_options=method_options,
            train=train,
            publish=dataclasses.replace(options.publish, api_key=None) if options.publish else None,
        )
        (run_dir / "training_options.json").write_text(json.dumps(_jsonable(recorded), indent=2) + "\n")
        extra = (run_dir / "log.jsonl", run_dir / "loss.png", run_dir / "training_options.json")
        result.output = save_adapter(peft_model, options.output, extra)
        result.losses = [r["loss"] for r in run.log]
        return result


def _apply_method(options: FinetuneOptions, model, method_options: MethodOptions, overrides: dict[str, Any] | None):
    """``model`` with the adapter of ``options.method`` (peft's errors on the options reworded)."""
    import peft

    source = f"--peft-config {str(options.peft_config)!r}" if options.peft_config else None
    config = build_peft_config(options.method, model, method_options, overrides, source=source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            peft_model = peft.get_peft_model(model, config)
        except ValueError as exc:  # peft's word on the options, e.g. --target-modules naming no module
            where = f" with {source}" if source else ""
            raise JobError(f"cannot apply {options.method} to {str(options.model)!r}{where}: {exc}") from None
        except TypeError as exc:  # a value of the wrong kind that slipped past build_peft_config's check
            if source is None:
                raise  # our own options always have the right types: a bug
            raise JobError(f"cannot apply {options.method} with {source}: a value has the wrong type ({exc})") from None
    return peft_model


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value
