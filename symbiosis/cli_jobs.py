"""``symbiosis finetune``, ``generate`` and ``demo``: thin typer shells over ``symbiosis.jobs``.

Help texts come from the option dataclasses' field metadata, so the library and the CLI describe
each option the same way. Errors the user can cause are ``SymbiosisError``s, which ``cli.main``
prints as one line (exit 2); ``--debug`` shows the traceback.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from symbiosis.jobs.client import ClientOptions
from symbiosis.jobs.methods import METHODS, MethodOptions
from symbiosis.jobs.publish import PublishOptions
from symbiosis.jobs.train_options import TrainOptions
from symbiosis.threads import CpuPriority


def count_of(number: int, noun: str) -> str:
    """``1 adapter``, ``2 adapters``: counts in what the commands print."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _help_of(options: type, name: str) -> str:
    """The ``--help`` text of an options dataclass field (its ``metadata["help"]``)."""
    return {f.name: f for f in dataclasses.fields(options)}[name].metadata["help"]


def _default_of(options: type, name: str):
    return {f.name: f for f in dataclasses.fields(options)}[name].default


_METHOD_HELP = "PEFT method: " + ", ".join(f"{name} ({m.summary})" for name, m in METHODS.items()) + "."


# Shared client flags.
ExecutorOpt = Annotated[str | None, typer.Option("--executor", help=_help_of(ClientOptions, "executor"))]
EmbeddedOpt = Annotated[bool, typer.Option("--embedded", help=_help_of(ClientOptions, "embedded"))]
DeviceOpt = Annotated[str, typer.Option(help=_help_of(ClientOptions, "device"))]
DtypeOpt = Annotated[str, typer.Option(help=_help_of(ClientOptions, "dtype"))]
TimeoutOpt = Annotated[float, typer.Option("--timeout", help=_help_of(ClientOptions, "timeout_s"))]
ConnectTimeoutOpt = Annotated[
    float, typer.Option("--connect-timeout", help=_help_of(ClientOptions, "connect_timeout_s"))
]
QuantizationOpt = Annotated[str | None, typer.Option(help=_help_of(ClientOptions, "quantization"))]
ModelOpt = Annotated[
    Path, typer.Option("--model", help="Checkpoint folder of the base model (config.json, *.safetensors, tokenizer).")
]


def finetune_command(
    model: ModelOpt,
    data: Annotated[
        Path,
        typer.Option(
            help=(
                'JSONL training data: {"text": …} per line, or {"prompt": …, "completion": …} (only the completion '
                "is trained on)."
            )
        ),
    ],
    output: Annotated[
        Path,
        typer.Option(
            help=(
                "Folder for the trained adapter (a standard PEFT adapter folder); checkpoints and the live log go "
                "to OUTPUT.run/. An existing folder is replaced only if empty or written by a previous run; nothing "
                "else is ever deleted."
            )
        ),
    ],
    executor: ExecutorOpt = None,
    embedded: EmbeddedOpt = False,
    method: Annotated[str, typer.Option(help=_METHOD_HELP)] = "lora",
    rank: Annotated[int, typer.Option("--rank", "-r", help=_help_of(MethodOptions, "rank"))] = _default_of(
        MethodOptions, "rank"
    ),
    alpha: Annotated[float, typer.Option(help=_help_of(MethodOptions, "alpha"))] = _default_of(MethodOptions, "alpha"),
    dropout: Annotated[float, typer.Option(help=_help_of(MethodOptions, "dropout"))] = _default_of(
        MethodOptions, "dropout"
    ),
    target_modules: Annotated[
        list[str] | None, typer.Option("--target-modules", help=_help_of(MethodOptions, "target_modules"))
    ] = None,
    num_virtual_tokens: Annotated[int, typer.Option(help=_help_of(MethodOptions, "num_virtual_tokens"))] = _default_of(
        MethodOptions, "num_virtual_tokens"
    ),
    peft_config: Annotated[
        Path | None,
        typer.Option(
            help="JSON object of extra keyword arguments for the method's peft config class (override the flags above)."
        ),
    ] = None,
    steps: Annotated[int, typer.Option(help=_help_of(TrainOptions, "steps"))] = _default_of(TrainOptions, "steps"),
    epochs: Annotated[float, typer.Option(help=_help_of(TrainOptions, "epochs"))] = _default_of(TrainOptions, "epochs"),
    lr: Annotated[float, typer.Option(help=_help_of(TrainOptions, "lr"))] = _default_of(TrainOptions, "lr"),
    lr_schedule: Annotated[str, typer.Option(help=_help_of(TrainOptions, "lr_schedule"))] = _default_of(
        TrainOptions, "lr_schedule"
    ),
    warmup_steps: Annotated[int, typer.Option(help=_help_of(TrainOptions, "warmup_steps"))] = _default_of(
        TrainOptions, "warmup_steps"
    ),
    weight_decay: Annotated[float, typer.Option(help=_help_of(TrainOptions, "weight_decay"))] = _default_of(
        TrainOptions, "weight_decay"
    ),
    batch_size: Annotated[int, typer.Option(help=_help_of(TrainOptions, "batch_size"))] = _default_of(
        TrainOptions, "batch_size"
    ),
    grad_accum: Annotated[int, typer.Option(help=_help_of(TrainOptions, "grad_accum"))] = _default_of(
        TrainOptions, "grad_accum"
    ),
    seq_len: Annotated[int, typer.Option(help=_help_of(TrainOptions, "seq_len"))] = _default_of(
        TrainOptions, "seq_len"
    ),
    max_grad_norm: Annotated[float, typer.Option(help=_help_of(TrainOptions, "max_grad_norm"))] = _default_of(
        TrainOptions, "max_grad_norm"
    ),
    eval_fraction: Annotated[float, typer.Option(help=_help_of(TrainOptions, "eval_fraction"))] = _default_of(
        TrainOptions, "eval_fraction"
    ),
    eval_every: Annotated[int, typer.Option(help=_help_of(TrainOptions, "eval_every"))] = _default_of(
        TrainOptions, "eval_every"
    ),
    save_every: Annotated[int, typer.Option(help=_help_of(TrainOptions, "save_every"))] = _default_of(
        TrainOptions, "save_every"
    ),
    bf16: Annotated[bool, typer.Option("--bf16", help=_help_of(TrainOptions, "bf16"))] = _default_of(
        TrainOptions, "bf16"
    ),
    keep_checkpoints: Annotated[int, typer.Option(help=_help_of(TrainOptions, "keep_checkpoints"))] = _default_of(
        TrainOptions, "keep_checkpoints"
    ),
    seed: Annotated[int, typer.Option(help=_help_of(TrainOptions, "seed"))] = _default_of(TrainOptions, "seed"),
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Continue from the newest checkpoint in OUTPUT.run/ (same options); the loss curve continues exactly.",
        ),
    ] = False,
    device: DeviceOpt = _default_of(ClientOptions, "device"),
    dtype: DtypeOpt = _default_of(ClientOptions, "dtype"),
    timeout: TimeoutOpt = _default_of(ClientOptions, "timeout_s"),
    connect_timeout: ConnectTimeoutOpt = _default_of(ClientOptions, "connect_timeout_s"),
    quantization: QuantizationOpt = None,
    progress: Annotated[
        bool, typer.Option("--progress/--no-progress", help="Show a progress bar (stderr) with loss and tokens/s.")
    ] = True,
    publish_to: Annotated[
        str | None,
        typer.Option(
            help=(
                "URL of a running `symbiosis api` (started with --allow-adapter-updates, same host): publish the "
                "LoRA adapter there while training, so new requests use the newest weights."
            )
        ),
    ] = None,
    publish_name: Annotated[
        str | None, typer.Option(help="Adapter name to publish under (default: the --output folder's name).")
    ] = None,
    publish_every: Annotated[int, typer.Option(help="Publish every N optimizer steps (and after the last).")] = 50,
    publish_key: Annotated[
        str | None,
        typer.Option(
            envvar="SYMBIOSIS_API_KEY",
            help="API key of the server (an unrestricted one); also read from SYMBIOSIS_API_KEY.",
        ),
    ] = None,
    cpu_priority: Annotated[
        CpuPriority,
        typer.Option(
            help=(
                "CPU priority of this job on its host. 'background' (SCHED_IDLE on Linux, else nice 19): "
                "serving clients and the executor on the same host get the cores the moment they need them, the "
                "job every cycle left over (it cannot be raised again). 'auto' (default): background with "
                "--executor, normal with --embedded. Set before torch starts its threads."
            ),
        ),
    ] = CpuPriority.AUTO,
) -> None:
    """Fine-tune a PEFT adapter on a split client of the base executor; writes a standard PEFT adapter folder."""
    del cpu_priority  # applied by cli.main before torch is imported (threads.configure_for_command)
    from symbiosis.jobs.finetune import FinetuneOptions, finetune

    options = FinetuneOptions(
        model=model,
        data=data,
        output=output,
        client=ClientOptions(executor, embedded, device, dtype, timeout, connect_timeout, quantization),
        method=method,
        method_options=MethodOptions(rank, alpha, dropout, tuple(target_modules or ()), num_virtual_tokens),
        peft_config=peft_config,
        train=TrainOptions(
            steps,
            epochs,
            lr,
            lr_schedule,
            warmup_steps,
            weight_decay,
            batch_size,
            grad_accum,
            seq_len,
            max_grad_norm,
            eval_fraction,
            eval_every,
            save_every,
            keep_checkpoints,
            seed,
            bf16,
        ),
        resume=resume,
        progress=progress,
        publish=PublishOptions(publish_to, publish_name or output.name, publish_every, publish_key)
        if publish_to
        else None,
    )
    from symbiosis.jobs.methods import get_method

    get_method(method)  # an unknown method fails before any data is read or connection made
    result = finetune(options)
    first, last = (result.losses[0], result.losses[-1]) if result.losses else (float("nan"), float("nan"))
    typer.echo(
        f"saved {method} adapter ({result.trainable_parameters:,} trainable parameters) to {result.output}; "
        f"{result.steps} steps, loss {first:.4f} -> {last:.4f}, {result.tokens_per_s:,.0f} tokens/s"
    )


def generate_command(
    model: ModelOpt,
    prompt: Annotated[list[str] | None, typer.Option("--prompt", help="Prompt text (repeat for several).")] = None,
    prompts: Annotated[
        Path | None,
        typer.Option(
            "--prompts", help="File of prompts: one per line, or JSONL with 'prompt' (and optionally 'adapter')."
        ),
    ] = None,
    adapter: Annotated[
        list[Path] | None,
        typer.Option(
            "--adapter",
            help=(
                "PEFT adapter folder (repeat to load several, each named after its folder); each prompt runs with "
                "each adapter."
            ),
        ),
    ] = None,
    executor: ExecutorOpt = None,
    embedded: EmbeddedOpt = False,
    max_new_tokens: Annotated[
        int,
        typer.Option(help="Most tokens to generate per prompt; prompt and new tokens must fit the model's context."),
    ] = 64,
    temperature: Annotated[float, typer.Option(help="Sampling temperature; 0 means greedy decoding.")] = 0.0,
    top_p: Annotated[
        float, typer.Option(help="Nucleus sampling: keep the smallest token set with this total probability (1: off).")
    ] = 1.0,
    top_k: Annotated[int, typer.Option(help="Sample only among the k most likely tokens (0: off).")] = 0,
    seed: Annotated[int, typer.Option(help="Random seed for sampling.")] = 0,
    device: DeviceOpt = _default_of(ClientOptions, "device"),
    dtype: DtypeOpt = _default_of(ClientOptions, "dtype"),
    timeout: TimeoutOpt = _default_of(ClientOptions, "timeout_s"),
    connect_timeout: ConnectTimeoutOpt = _default_of(ClientOptions, "connect_timeout_s"),
    quantization: QuantizationOpt = None,
) -> None:
    """Generate from prompts on a split client, with zero or more adapters; tokens stream to stdout as they come."""
    from symbiosis.jobs.generate import GenerateOptions, SamplingOptions, generate

    options = GenerateOptions(
        model=model,
        client=ClientOptions(executor, embedded, device, dtype, timeout, connect_timeout, quantization),
        prompts=list(prompt or ()),
        prompts_file=prompts,
        adapters=list(adapter or ()),
        sampling=SamplingOptions(max_new_tokens, temperature, top_p, top_k, seed),
    )
    generate(options)


#: ``symbiosis demo --help`` (typer keeps a docstring's line breaks, so the text lives here).
DEMO_HELP = (
    "The main job: one executor process, four fine-tuning clients (LoRA, IA3, prefix, LoHa) on learnable tasks "
    "and two inference clients, at once."
)


def demo_command(
    quick: Annotated[bool, typer.Option("--quick", help="A few steps on the tiny model (seconds; for tests).")] = False,
    preset: Annotated[
        str | None,
        typer.Option(
            help=(
                "Model size: tiny (default: the demo's learning rates and steps are tuned for it, ~1 minute on 2 "
                "cores) or small (~15M params; much slower on CPU)."
            )
        ),
    ] = None,
    steps: Annotated[
        int | None, typer.Option(help="Fine-tuning steps per client (default: 300, or 8 with --quick).")
    ] = None,
    cache_dir: Annotated[
        Path | None,
        typer.Option(
            help=(
                "Where the demo model is made once and reused (default: $SYMBIOSIS_CACHE/demo or "
                "~/.cache/symbiosis/demo)."
            )
        ),
    ] = None,
    output: Annotated[
        Path, typer.Option(help="Folder for the loss plot, results JSON and the trained adapters.")
    ] = Path("symbiosis-demo"),
    in_process: Annotated[
        bool,
        typer.Option("--in-process", help="Run the executor in this process instead of its own process (debugging)."),
    ] = False,
    seed: Annotated[int, typer.Option(help="Seed of the model, the tasks and training.")] = 0,
    quantization: Annotated[
        str, typer.Option(help="The executor's base weights: none, int8 or fp8-rowwise (see `symbiosis serve --help`).")
    ] = "none",
) -> None:
    """Run the demo (``--help`` shows ``DEMO_HELP``)."""
    from symbiosis.executor.quantized import parse_quantization
    from symbiosis.jobs.demo import DemoOptions, run_demo

    run_demo(
        DemoOptions(
            quick=quick,
            preset=preset,
            steps=steps,
            cache_dir=cache_dir,
            output=output,
            in_process=in_process,
            seed=seed,
            quantization=parse_quantization(quantization),
        )
    )


def register(app: typer.Typer) -> None:
    app.command("finetune")(finetune_command)
    app.command("generate")(generate_command)
    app.command("demo", help=DEMO_HELP)(demo_command)
