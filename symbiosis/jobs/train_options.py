"""``TrainOptions``: how a fine-tuning job trains. Kept apart from ``finetune.py`` (which needs torch
and peft) so the command line can build its ``--help`` from these fields without importing either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from symbiosis.jobs.base import JobError, _help, flag

SCHEDULES: tuple[str, ...] = ("constant", "linear", "cosine")


@dataclass
class TrainOptions:
    """How to train; each field's ``metadata["help"]`` is the CLI help text."""

    steps: int = field(default=0, metadata=_help("Optimizer steps to run; 0: derive from --epochs."))
    epochs: float = field(default=1.0, metadata=_help("Passes over the training split (used when --steps is 0)."))
    lr: float = field(default=1e-3, metadata=_help("Peak learning rate of AdamW."))
    lr_schedule: str = field(
        default="cosine",
        metadata=_help("Learning-rate schedule after warmup: constant, linear or cosine (decay to 0)."),
    )
    warmup_steps: int = field(default=0, metadata=_help("Steps of linear warmup from 0 to --lr."))
    weight_decay: float = field(default=0.0, metadata=_help("AdamW weight decay."))
    batch_size: int = field(default=8, metadata=_help("Examples per micro-batch."))
    grad_accum: int = field(default=1, metadata=_help("Micro-batches accumulated per optimizer step."))
    seq_len: int = field(
        default=512,
        metadata=_help("Longest example in tokens; longer ones are cut. Capped to the model's context length."),
    )
    max_grad_norm: float = field(
        default=1.0, metadata=_help("Clip the adapter gradient norm to this (0: no clipping).")
    )
    eval_fraction: float = field(default=0.0, metadata=_help("Fraction of the data held out for evaluation (0: none)."))
    eval_every: int = field(
        default=0,
        metadata=_help("Evaluate the held-out loss every N steps (0: only at the end, if there is an eval split)."),
    )
    save_every: int = field(default=0, metadata=_help("Write a resumable checkpoint every N steps (0: never)."))
    keep_checkpoints: int = field(default=2, metadata=_help("How many of the newest checkpoints to keep."))
    seed: int = field(default=0, metadata=_help("Seed of adapter init, data order and dropout."))
    bf16: bool = field(
        default=False,
        metadata=_help(
            "Mixed precision, as transformers' Trainer(bf16=True): forward passes under torch.autocast in "
            "bfloat16; adapters and optimizer stay in --dtype. The base products then travel in bfloat16; "
            "an executor in bfloat16 (serve --dtype bfloat16) computes them as the monolithic run does."
        ),
    )

    def __post_init__(self) -> None:
        problems = []
        if self.lr_schedule not in SCHEDULES:
            problems.append(f"--lr-schedule must be one of {', '.join(SCHEDULES)}, got {self.lr_schedule!r}")
        for name in ("batch_size", "grad_accum", "seq_len"):
            if getattr(self, name) < 1:
                problems.append(f"{flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("steps", "warmup_steps", "eval_every", "save_every"):
            if getattr(self, name) < 0:
                problems.append(f"{flag(name)} must be >= 0, got {getattr(self, name)}")
        if self.steps == 0 and self.epochs <= 0:
            problems.append("give --steps N or a positive --epochs")
        if problems:
            raise JobError("; ".join(problems))


__all__ = ["SCHEDULES", "TrainOptions"]
