"""``symbiosis demo``: one base executor, four fine-tuning clients and an OpenAI-compatible server at once.

What it shows, in a few minutes on a laptop CPU: one copy of the base weights (in the executor's
own process, served over ZeroMQ ``ipc://``) serves five independent clients — four PEFT methods
(LoRA, IA3, prefix tuning, LoHa), each learning its own synthetic task, and ``symbiosis api``
answering two streams of OpenAI completions requests — and the adapters really learn: each
one's exact-match accuracy on held-out inputs is measured before and after fine-tuning, never
assumed. The LoRA tuner publishes its adapter to the server as ``lora-live`` while it trains;
one request stream asks for ``lora-live`` and is answered by the newest published weights
(something no serving system that loads adapters only from finished runs can show).

The clients are threads of this process, each with its own model copy (embeddings, norms,
adapters, KV cache) and its own connection; the executor batches their rows together. The
hyperparameters below were measured on the random-weight model: IA3 and prefix tuning have far
fewer parameters than LoRA and need much larger learning rates to move a random network, and
prefix tuning (which adds attention entries but cannot re-route attention between the input's
tokens) gets a task whose every answer letter follows from the letter just before it; on tasks
that need to look back several tokens it only learns a constant guess (~1/6 accuracy).
"""

from __future__ import annotations

import json
import os
import resource
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from symbiosis.jobs.artifacts import check_output_folder, save_adapter, save_loss_plot
from symbiosis.jobs.client import load_tokenizer
from symbiosis.jobs.data import tokenize_all
from symbiosis.jobs.finetune import FinetuneRun, StepRecord, TrainOptions
from symbiosis.jobs.methods import MethodOptions, build_peft_config
from symbiosis.jobs.publish import AdapterPublisher, PublishOptions
from symbiosis.jobs.tasks import exact_match_accuracy, get_task, make_split
from symbiosis.threads import with_torch_threads


@dataclass(frozen=True)
class TunerSpec:
    """One fine-tuning client of the demo: a PEFT method, its task and its training recipe."""

    method: str
    task: str
    lr: float
    steps: int
    method_options: MethodOptions = field(default_factory=MethodOptions)


TUNERS: tuple[TunerSpec, ...] = (
    TunerSpec("lora", "reverse", 3e-3, 300, MethodOptions(rank=8, alpha=16)),
    TunerSpec("ia3", "first", 1.0, 300),
    TunerSpec("prefix", "next", 0.3, 300, MethodOptions(num_virtual_tokens=8)),
    TunerSpec("loha", "sort", 1e-2, 300, MethodOptions(rank=8, alpha=16)),
)
INFERENCE_PROMPTS = ("The executor ", "Once upon a time", "def main():", "Shared base weights ")
LIVE_ADAPTER = "lora-live"  # the name the LoRA tuner publishes its adapter under
BASE_NAME = "base"


@dataclass
class DemoOptions:
    quick: bool = False
    preset: str | None = None
    steps: int | None = None
    cache_dir: Path | None = None
    output: Path = Path("symbiosis-demo")
    in_process: bool = False
    seed: int = 0
    batch_size: int = 16
    quantization: str | None = None  # the executor's base weights: None, "int8" or "fp8-rowwise"

    @property
    def model_preset(self) -> str:
        return self.preset or "tiny"

    def cache_folder(self) -> Path:
        if self.cache_dir is not None:
            return Path(self.cache_dir)
        root = os.environ.get("SYMBIOSIS_CACHE")
        return Path(root) / "demo" if root else Path.home() / ".cache" / "symbiosis" / "demo"


# ---- the executor in its own process --------------------------------------------------------


def _executor_figures(stats: dict, peak_rss_bytes: int) -> dict:
    layers = stats["layers"].values()
    batches = sum(layer["batches"] for layer in layers)
    rows = sum(layer["mean_rows_per_batch"] * layer["batches"] for layer in layers)
    return {
        "requests": sum(layer["requests"] for layer in layers),
        "batches": batches,
        "mean_rows_per_batch": rows / batches if batches else 0.0,
        "weights_mb": stats["weights_bytes"] / 2**20,
        "peak_rss_mb": peak_rss_bytes / 2**20,
    }


class ExecutorHandle:
    """The demo's executor: ``symbiosis serve`` in its own process over ``ipc://`` (or an object in
    this process, with ``--in-process``)."""

    def __init__(self, model_dir: Path, in_process: bool, quantization: str | None = None) -> None:
        self.in_process = in_process
        if in_process:
            from symbiosis import BaseExecutor

            self.executor = BaseExecutor.from_pretrained(model_dir, quantization=quantization)
            self.target = self.executor
            return
        from symbiosis.executor.process import ExecutorProcess

        self._socket_dir = tempfile.mkdtemp(prefix="symbiosis-demo-")
        address = f"ipc://{self._socket_dir}/executor.sock"
        extra_args = ["--quantization", quantization] if quantization else []
        self.process = ExecutorProcess(
            model_dir, [address], extra_args=extra_args, threads=1, metrics=True, timeout_s=120
        )
        self.target = self.process.address

    def figures(self) -> dict:
        if self.in_process:  # this process's peak: the clients' memory is in it too
            return _executor_figures(self.executor.stats(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        stats = self.process.stats()
        return _executor_figures(stats, stats["peak_rss_bytes"])

    def close(self) -> None:
        if self.in_process:
            self.executor.close()
            return
        self.process.close()
        try:
            os.rmdir(self._socket_dir)
        except OSError:
            pass


# ---- clients ----------------------------------------------------------------------------------


@dataclass
class ClientState:
    """What the live table and the final table show for one client (written by its thread)."""

    name: str
    kind: str
    method: str = "-"
    task: str = "-"
    status: str = "loading"
    step: int = 0
    total_steps: int = 0
    trainable_parameters: int = 0
    losses: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0
    accuracy_before: float | None = None
    accuracy_after: float | None = None
    generated_tokens: int = 0
    requests: int = 0
    published_steps: list[int] = field(default_factory=list)  # the LoRA tuner's publications to the API server
    error: str | None = None


def _load_client(model_dir: Path, target, name: str):
    import symbiosis

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return symbiosis.load_client_model(model_dir, executor=target, client_id=f"demo-{name}", timeout_s=120.0)


class Tuner:
    """A fine-tuning client: measure held-out accuracy, train, measure again, save the adapter."""

    def __init__(
        self, spec: TunerSpec, model_dir: Path, target, tokenizer, options: DemoOptions, publish_to: str | None = None
    ) -> None:
        import peft

        self.spec = spec
        self.tokenizer = tokenizer
        self.options = options
        self.state = ClientState(name=f"{spec.method}", kind="fine-tune", method=spec.method, task=spec.task)
        steps = options.steps or (8 if options.quick else spec.steps)
        self.split = make_split(get_task(spec.task), n_held_out=12 if options.quick else 48, seed=options.seed)
        self.model = _load_client(model_dir, target, spec.method)
        torch.manual_seed(options.seed)
        config = build_peft_config(spec.method, self.model, spec.method_options, None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.peft_model = peft.get_peft_model(self.model, config)
        train_set = tokenize_all(tokenizer, self.split.train, 32)
        train_options = TrainOptions(
            steps=steps,
            lr=spec.lr,
            lr_schedule="cosine",
            warmup_steps=min(10, steps // 5),
            batch_size=options.batch_size,
            seed=options.seed,
        )
        self.run = FinetuneRun(self.peft_model, train_set, [], train_options, pad_token_id=tokenizer.pad_token_id)
        self.state.total_steps = self.run.total_steps
        self.state.trainable_parameters = sum(p.numel() for _, p in self.run.params)
        self.publisher = None
        if publish_to is not None:  # new requests to `lora-live` get the newest weights
            every = max(1, self.run.total_steps // 6)
            publish = PublishOptions(publish_to, LIVE_ADAPTER, every)
            self.publisher = AdapterPublisher(publish, self.peft_model, options.output / "published" / spec.method)
        self.state.status = "ready"

    def __call__(self) -> None:
        state = self.state
        state.status = "measuring"
        state.accuracy_before = exact_match_accuracy(self.peft_model, self.tokenizer, self.split.held_out)
        state.status = "training"

        def on_step(record: StepRecord) -> None:
            state.step = record.step
            state.losses.append(record.loss)
            state.tokens_per_s = record.tokens_per_s
            if self.publisher is not None:
                self.publisher(record)
                state.published_steps = list(self.publisher.published)

        self.run.train(on_step)
        state.status = "measuring"
        state.accuracy_after = exact_match_accuracy(self.peft_model, self.tokenizer, self.split.held_out)
        save_adapter(self.peft_model, self.options.output / "adapters" / self.spec.method)
        state.status = "done"

    def close(self) -> None:
        self.model.symbiosis_transport.close()


class ApiGenerator:
    """An inference user of the demo's OpenAI-compatible server: sends completions until told to stop.

    One asks the base model; the other asks for ``lora-live``, the LoRA tuner's adapter as the
    tuner publishes it while training: it gets 404 until the first publication, then answers
    from the newest weights published so far.
    """

    def __init__(self, index: int, url: str, model: str, options: DemoOptions, stop: threading.Event) -> None:
        self.state = ClientState(name=f"api-{model}", kind="inference", method=model, task="api")
        self.url = url
        self.model = model
        self.stop = stop
        self.index = index
        self.max_new_tokens = 8 if options.quick else 24
        self.state.status = "ready"

    def _complete(self, prompt: str) -> dict | None:
        """One completion (None: the model does not exist yet)."""
        import urllib.error
        import urllib.request

        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": self.max_new_tokens,
            "temperature": 0.8,
            "top_k": 50,
            "seed": self.state.requests,
        }
        request = urllib.request.Request(
            self.url + "/v1/completions", json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise RuntimeError(f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:200]}") from None

    def __call__(self) -> None:
        state = self.state
        state.status = "requesting"
        started = time.perf_counter()
        prompts = INFERENCE_PROMPTS[self.index % 2 :: 2]
        stopped_at = None
        # Keep going after stop until at least one request was answered (at most 60 s more).
        while not self.stop.is_set() or (
            state.requests == 0 and time.perf_counter() - (stopped_at or time.perf_counter()) < 60
        ):
            if self.stop.is_set() and stopped_at is None:
                stopped_at = time.perf_counter()
            answer = self._complete(prompts[state.requests % len(prompts)])
            if answer is None:
                state.status = "waiting for the adapter"
                time.sleep(0.1)
                continue
            state.status = "requesting"
            state.generated_tokens += answer["usage"]["completion_tokens"]
            state.requests += 1
            state.tokens_per_s = state.generated_tokens / (time.perf_counter() - started)
        state.status = "done"

    def close(self) -> None:
        pass


def _start_api(model_dir: Path, executor: ExecutorHandle):
    """``symbiosis api`` on a free loopback port, as one more client of the demo's executor."""
    from symbiosis.jobs.client import ClientOptions
    from symbiosis.serving.server import ApiOptions, ApiServer

    client = (
        ClientOptions(executor=executor.target) if isinstance(executor.target, str) else ClientOptions(embedded=True)
    )
    options = ApiOptions(
        model=model_dir, client=client, port=0, served_model_name=BASE_NAME, allow_adapter_updates=True
    )
    server = ApiServer(options, executor=None if isinstance(executor.target, str) else executor.target)
    try:
        server.start()
    except BaseException:
        server.close()  # its socket and engine: the demo goes on without it, or stops
        raise
    return server


def _run_thread(target, state: ClientState) -> threading.Thread:
    def body() -> None:
        try:
            target()
        except Exception as exc:  # shown in the table; the other clients go on
            state.status = "failed"
            state.error = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=with_torch_threads(body), name=f"demo-{state.name}", daemon=True)
    thread.start()
    return thread


# ---- display ----------------------------------------------------------------------------------


def _fmt_acc(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _loss_span(losses: list[float]) -> str:
    if not losses:
        return "-"
    tail = losses[-10:]
    return f"{losses[0]:.2f} → {sum(tail) / len(tail):.2f}"


def live_table(states: list[ClientState], elapsed_s: float):
    from rich.table import Table

    table = Table(title=f"symbiosis demo — {elapsed_s:.0f} s", title_justify="left")
    for column in ("client", "task", "status", "progress", "loss", "tok/s", "accuracy"):
        table.add_column(column)
    for s in states:
        if s.kind == "fine-tune":
            progress = f"{s.step}/{s.total_steps}"
            loss = f"{s.losses[-1]:.3f}" if s.losses else "-"
            accuracy = f"{_fmt_acc(s.accuracy_before)} → {_fmt_acc(s.accuracy_after)}"
        else:
            progress, loss, accuracy = f"{s.requests} requests", "-", "-"
        status = s.status if s.error is None else f"[red]failed: {s.error[:60]}"
        table.add_row(s.name, s.task, status, progress, loss, f"{s.tokens_per_s:,.0f}", accuracy)
    return table


def final_tables(states: list[ClientState], figures: dict, wall_s: float):
    from rich.table import Table

    clients = Table(title="clients (accuracy: exact match on held-out inputs, greedy)", title_justify="left")
    for column in (
        "client",
        "method",
        "task",
        "trainable",
        "tokens/s",
        "loss first → last 10",
        "accuracy before → after",
    ):
        clients.add_column(column)
    for s in states:
        if s.kind == "fine-tune":
            improved = (
                s.accuracy_after is not None and s.accuracy_before is not None and s.accuracy_after > s.accuracy_before
            )
            mark = "[green]✓" if improved else "[red]✗"
            acc = f"{_fmt_acc(s.accuracy_before)} → {_fmt_acc(s.accuracy_after)} {mark}"
            clients.add_row(
                s.name,
                s.method,
                s.task,
                f"{s.trainable_parameters:,}",
                f"{s.tokens_per_s:,.0f}",
                _loss_span(s.losses),
                acc,
            )
        else:
            answered = f"{s.requests} requests answered, {s.generated_tokens} tokens"
            if s.method == LIVE_ADAPTER:
                published = next(
                    (t.published_steps for t in states if t.kind == "fine-tune" and t.method == "lora"), []
                )
                answered += f", by the LoRA adapter published mid-run (steps {', '.join(map(str, published))})"
            clients.add_row(s.name, s.method, "OpenAI API", "-", f"{s.tokens_per_s:,.0f}", "-", answered)
    executor = Table(title="executor", title_justify="left")
    for column in ("requests", "batches", "mean rows/batch", "base weights", "peak RSS", "wall time"):
        executor.add_column(column)
    executor.add_row(
        f"{figures['requests']:,}",
        f"{figures['batches']:,}",
        f"{figures['mean_rows_per_batch']:.1f}",
        f"{figures['weights_mb']:.1f} MiB",
        f"{figures['peak_rss_mb']:.0f} MiB",
        f"{wall_s:.0f} s",
    )
    return clients, executor


# ---- the job ----------------------------------------------------------------------------------


def run_demo(options: DemoOptions) -> dict:
    """Run the demo end to end; returns the results (also written to OUTPUT/results.json)."""
    from rich.console import Console
    from rich.live import Live

    from symbiosis.modelzoo import make_model

    console = Console()
    if not console.is_terminal:
        console = Console(width=120)  # logs and pipes: keep the tables readable
    started = time.perf_counter()
    torch.set_num_threads(1)  # six clients share the cores; one BLAS thread each avoids oversubscription
    preset = "tiny" if options.quick and options.preset is None else options.model_preset
    cache = options.cache_folder()
    model_dir = cache / f"llama-{preset}-seed{options.seed}"
    reused = model_dir.is_dir()
    model_dir = make_model("llama", preset, model_dir, seed=options.seed)
    console.print(f"model: llama/{preset} at {model_dir} ({'reused' if reused else 'made'})")
    options.output.mkdir(parents=True, exist_ok=True)
    for spec in TUNERS:  # refuse an adapter folder we may not replace now, not after training
        check_output_folder(options.output / "adapters" / spec.method, "demo adapter folder")

    # The executor runs in its own process and serves over ZeroMQ ipc://; --in-process keeps it
    # in this process instead (debugging, or where ipc:// is unavailable).
    in_process = options.in_process
    executor = ExecutorHandle(model_dir, in_process, options.quantization)
    where = "in this process" if in_process else f"process {executor.process.pid}, serving {executor.target}"
    if options.quantization:
        where += f", {options.quantization} base weights"
    console.print(f"executor: {where}")
    stop = threading.Event()
    tuners: list[Tuner] = []
    generators: list[ApiGenerator] = []
    api = None
    try:
        tokenizer = load_tokenizer(model_dir)
        api = _start_api(model_dir, executor)
        console.print(f"OpenAI-compatible server: {api.url}/v1 (a client of the same executor)")
        tuners = [
            Tuner(spec, model_dir, executor.target, tokenizer, options, api.url if spec.method == "lora" else None)
            for spec in TUNERS
        ]
        generators = [ApiGenerator(i, api.url, name, options, stop) for i, name in enumerate((BASE_NAME, LIVE_ADAPTER))]
        states = [t.state for t in tuners] + [g.state for g in generators]
        tuner_threads = [_run_thread(t, t.state) for t in tuners]
        generator_threads = [_run_thread(g, g.state) for g in generators]
        with Live(live_table(states, 0), console=console, refresh_per_second=4, transient=False) as live:
            while any(t.is_alive() for t in tuner_threads):
                time.sleep(0.25)
                live.update(live_table(states, time.perf_counter() - started))
            stop.set()
            for thread in generator_threads:
                thread.join(timeout=60)
            live.update(live_table(states, time.perf_counter() - started))
        figures = executor.figures()
    finally:
        stop.set()
        for client in [*tuners, *generators]:
            client.close()
        if api is not None:
            api.close()
        executor.close()

    wall_s = time.perf_counter() - started
    console.print()
    for table in final_tables(states, figures, wall_s):
        console.print(table)
    curves = {f"{s.method} ({s.task})": list(enumerate(s.losses, start=1)) for s in states if s.kind == "fine-tune"}
    plot = save_loss_curves(curves, options.output / "loss_curves.png")
    results = {
        "model": str(model_dir),
        "preset": preset,
        "executor_in_own_process": not in_process,
        "quantization": options.quantization or "none",
        "wall_s": wall_s,
        "executor": figures,
        "clients": [asdict(s) for s in states],
    }
    (options.output / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    console.print(
        f"loss curves: {plot}; results: {options.output / 'results.json'}; adapters: {options.output / 'adapters'}"
    )
    failed = [s.name for s in states if s.error]
    if failed:
        console.print(f"[red]clients failed: {', '.join(failed)}")
    return results


def save_loss_curves(curves: dict[str, list[tuple[int, float]]], path: Path) -> Path:
    return save_loss_plot(curves, path, "demo: fine-tuning clients sharing one base executor")
