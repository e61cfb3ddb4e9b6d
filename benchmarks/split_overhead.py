"""What does splitting a model cost one client? Every transport vs monolithic transformers+peft, per process.

Measures the project's split-overhead targets side by side in one run (``TARGETS``: split step
median / monolithic step median, per transport):

==========  ===========  =============
transport   decode step  training step
==========  ===========  =============
inproc      <= 1.15      <= 1.05
shm+ipc     <= 1.5       <= 1.15
ipc, tcp    <= 1.8       <= 1.3
dist+tcp    <= 2.0       <= 1.5
==========  ===========  =============

**Models** (random weights): ``llama-h512-l6-v2048``, a LLaMA built here with ``LlamaConfig``
(hidden 512, 6 layers, 8 heads / 4 KV heads, MLP 4 x hidden, vocab 2048; cached in ``--cache``
with the project's tokenizer), and the ``symbiosis.modelzoo`` preset ``--preset`` (default
``base``, the ~105M LLaMA; ``--model DIR`` uses a checkpoint folder instead). ``--quick`` shrinks
them (hidden 64, 2 layers; the ``tiny`` preset).

**Steps** (``--decode-batches``, ``--train-batch``, ``--seq-len``): ``decode_b1`` and
``decode_b16``: one new token for each of 1 or 16 sequences with a KV cache, after a
``--prompt-len``-token prefill and one untimed decode step, no gradient; ``train``: forward +
backward + AdamW step of a LoRA adapter (r=8 on q/k/v/o) on 8 sequences x 128 tokens.

**Systems**: ``monolithic`` (``peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path))``,
the baseline) and the split client ``peft.get_peft_model(symbiosis.load_client_model(path, ...))``
over ``inproc`` (a ``BaseExecutor`` in the client's process), ``shm+ipc``, ``ipc``, ``tcp`` and
``dist+tcp`` (each to a ``symbiosis serve`` child of its own per model, serving tcp + ipc). All
systems carry the same LoRA weights (drawn from one seed), checked by their loss on the training
batch.

**One executor per remote system**, because the question is what splitting costs *one* client:
an executor that has other clients connected, even idle ones, cannot know that nothing will come
to batch with, so it queues every request through its scheduler instead of serving it at once
(``Scheduler.alone``); with the four remote systems on one executor each of them paid that (decode
about +0.2 in the ratio, measured). ``--shared-executor`` measures that setup: one executor per
model serving every remote system.

**How it is timed, and why that way.** Each system lives in its own process
(``python -m benchmarks.split_overhead worker SPEC``; the remote ones get the executors'
addresses on stdin once those serve), started once, which loads both models and warms them up:
a process that also hosts an executor, or another system's model, would share caches, allocator
and threads with the model being timed. The parent then runs ``--repeats`` *rounds*; in each
round it tells every system in turn (order rotated every round) to run one block: for each
model, ``--decode-steps`` timed steps of each decode batch (after a fresh prefill and one
untimed step) and ``--train-steps`` timed training steps. It waits for a block to finish before
telling the next system, so exactly one system computes at any moment while the other processes
sit blocked on their stdin (the executor children only serve the client of the moment). Samples
of all rounds are pooled into median and p95. We chose long-lived processes with a rotating
round-robin over a fresh process per system and round because (a) every system sees the same
background-load drift, round by round, as interleaved samples in one process would, so medians
stay comparable on a shared machine, and (b) start-up (imports, loading, first-call allocation,
~5 s per process) stays out of the timings and most of the wall time; the price is that
process-level luck (memory layout) is not re-drawn per round. Every process (workers and
executors) runs ``--threads`` torch threads (default 1: on a small shared machine a second
OpenMP thread mostly waits for a busy core; the split client and its executor take turns, they do
not compute at once). A split system that fails to start or breaks mid-run (a transport error)
is dropped and listed in ``unavailable`` with its error; the others go on.

**On a GPU** (``--device cuda``): every system computes there (the monolithic model, the split
clients and their executors, ``serve --device``), and each timed step ends with
``torch.cuda.synchronize()``. The in/outside split below then counts an in-process call's launch,
not its kernel. ``dist+tcp`` needs NCCL between the client and its executor, which one GPU cannot
hold: leave it out (``--systems``) there. The targets were set for CPU.

**Calls per decoded token.** For every architecture in ``symbiosis.modelzoo.ARCHS`` at the
``tiny`` preset, in the parent process (untimed, while the workers load): base-layer requests
the executor served (``BaseExecutor.stats()["layers"][id]["requests"]``, summed; a fused sibling
request counts once) during one decode step of one sequence, after ``WARM_DECODE_STEPS`` untimed
steps so the client has settled (sibling fusion learns from repeated passes). They are split
into requests of the decoder blocks (ids holding ``.<index>.``) and the rest (``lm_head``) and
printed as ``llama: 9 calls/token (2 layers → 4.00/layer + 1)``. The timed workers count the
calls of every block too: the ``inproc`` worker from its executor's stats (this gives the two
benchmark models' lines), every split worker on the client side (wrapping ``transport.call``).

JSON (``split_overhead.json`` in ``--output``) keys: ``benchmark, command, machine, config,
targets, results, verdicts, check, calls_per_token, processes, unavailable, dist, wall_s``.

* ``targets[system]``: ``{"decode": float, "train": float}`` for every split system.
* ``results[model][step][system]`` (``step`` in ``config.steps``, e.g. ``decode_b1``,
  ``decode_b16``, ``train``): ``median_ms, p95_ms, mean_ms, min_ms, n``, ``ratio_over_monolithic``
  (median / monolithic median), ``target`` and ``verdict`` (``"PASS"`` if ratio <= target,
  ``"MISS"`` otherwise; both null for ``monolithic``), and for split systems ``calls_per_step``
  (base-layer requests per step of the last round: the executor's count for ``inproc``, the
  client's otherwise) plus, for decode steps, ``calls_per_token`` (per sequence: per step / batch);
  for every system ``in_calls_ms`` and ``outside_calls_ms``: per step, the client's wall time
  inside base-layer calls (``transport.call``: the products and the boundary) and outside them
  (its own ops), medians over rounds (0 and the whole step for ``monolithic``). Against
  ``inproc``, a transport's extra ``in_calls_ms`` is what the boundary costs; extra
  ``outside_calls_ms`` is the client's own work running slower beside an executor process.
* ``verdicts``: one row per (model, step, split system): ``model, step, system, ratio, target,
  verdict``.
* ``check[model]``: ``{"loss": {system: float}, "max_abs_diff_vs_monolithic": float}``.
* ``calls_per_token``: ``{"archs": {arch: breakdown}, "models": {model: breakdown}}``, a
  breakdown being ``calls_per_token, layers, per_layer, outside_layers, by_layer_kind``.
* ``processes[system]``: ``{"pid", "max_rss_mib"}``; ``unavailable[system]``: why a system was not
  measured (e.g. ``dist+tcp`` cannot connect); ``dist``: ``{"available", "reason"}``.
* ``config``: ``models`` (key -> path and shape), ``systems``, ``steps`` (key -> kind, batch,
  tokens), ``rounds``, ``decode_steps``, ``train_steps``, ``prompt_len``, ``threads_per_process``,
  ``policy``, ``quick``, ``adapter``, ``baseline``, ``scheduling``.

Plot ``split_overhead.png``: per model, split / monolithic per system and step, and the same
divided by its target (<= 1 passes).

Run: ``python -m benchmarks.split_overhead --output DIR [--quick] [--threads N] [--repeats ROUNDS]``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import peft
import torch
from transformers import AutoModelForCausalLM

import symbiosis
from benchmarks.memory import MIB
from benchmarks.options import add_common_arguments, checkpoint_path, quiet_libraries, resolve_common
from benchmarks.plots import Panel, plot_panels
from benchmarks.results import command_line, machine_info, print_summary, write_json
from benchmarks.timing import ratio
from benchmarks.timing import summarize as summarize_samples
from benchmarks.workers import Worker, loopback_binds, serve_worker
from symbiosis.executor.process import ExecutorProcess
from symbiosis.threads import client_env
from symbiosis.vocabulary import GROUP_SEPARATOR, module_list_of

NAME = "split_overhead"
MODULE = f"benchmarks.{NAME}"  # the workers' entry point: ``python -m benchmarks.split_overhead worker SPEC``
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
MONOLITHIC = "monolithic"
SPLIT_SYSTEMS = ("inproc", "shm+ipc", "ipc", "tcp", "dist+tcp")
SYSTEMS = (MONOLITHIC, *SPLIT_SYSTEMS)
#: split / monolithic, medians: the most each transport may cost (decode step, training step).
TARGETS: dict[str, dict[str, float]] = {
    "inproc": {"decode": 1.15, "train": 1.05},
    "shm+ipc": {"decode": 1.5, "train": 1.15},
    "ipc": {"decode": 1.8, "train": 1.3},
    "tcp": {"decode": 1.8, "train": 1.3},
    "dist+tcp": {"decode": 2.0, "train": 1.5},
}
CUSTOM_LLAMA = {"hidden": 512, "layers": 6, "vocab": 2048}
QUICK_CUSTOM_LLAMA = {"hidden": 64, "layers": 2, "vocab": 2048}
WARM_DECODE_STEPS = 3  # untimed decode steps before calls are counted
BLOCK_INDEX = re.compile(r"\.(\d+)\.")  # a base layer inside decoder block N: "model.layers.N.mlp.up_proj"


# ---- models and steps (also used by benchmarks.transport and the suite's scenarios) -------------


def lora_config() -> peft.LoraConfig:
    return peft.LoraConfig(
        task_type=peft.TaskType.CAUSAL_LM, r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS
    )


def adapter_model(path: Path, executor: Any = None, seed: int = 0, device: str = "cpu"):
    """PEFT LoRA model on ``path`` on ``device``: monolithic when ``executor`` is None, else split
    (``executor``: a ``BaseExecutor`` or an address). Its LoRA weights depend on ``seed`` only,
    never on the process or the system, and B is non-zero so the adapter really takes part in
    every step."""
    base = (
        AutoModelForCausalLM.from_pretrained(path).to(device)
        if executor is None
        else symbiosis.load_client_model(path, executor=executor, device=device)
    )
    model = peft.get_peft_model(base, lora_config())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_A" in name:  # (r, in): the scale of the default Kaiming init
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * parameter.shape[1] ** -0.5)
            elif "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    return model


def build_models(path: Path, executor: symbiosis.BaseExecutor, seed: int = 0):
    """Monolithic and split PEFT models with identical, non-trivial adapter weights."""
    return adapter_model(path, None, seed), adapter_model(path, executor, seed)


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


def make_llama(folder: Path, *, hidden: int, layers: int, vocab: int, seed: int = 0) -> Path:
    """A random-weight LLaMA checkpoint of this shape in ``folder`` (made once; kept if the recipe matches).

    8 heads of 64 (fewer when ``hidden`` is small), half as many KV heads, MLP 4 x hidden like the
    ``symbiosis.modelzoo`` presets, untied ``lm_head``, the project's tokenizer (vocab 1024; the
    extra embedding rows are just never produced by it).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from symbiosis.modelzoo import SPECIAL_TOKEN_ID, make_tokenizer

    folder = Path(folder)
    recipe = {
        "arch": "llama",
        "hidden": hidden,
        "layers": layers,
        "vocab": vocab,
        "seed": seed,
        "maker": f"{MODULE}.make_llama v1",
    }
    marker = folder / "split_overhead_model.json"
    if marker.is_file() and json.loads(marker.read_text()) == recipe and (folder / "model.safetensors").is_file():
        return folder
    heads = max(2, min(8, hidden // 32))
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=SPECIAL_TOKEN_ID,
        eos_token_id=SPECIAL_TOKEN_ID,
        pad_token_id=SPECIAL_TOKEN_ID,
    )
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config).eval()
        model.save_pretrained(staging)
        make_tokenizer(staging, model_max_length=config.max_position_embeddings)
        (staging / marker.name).write_text(json.dumps(recipe, indent=2) + "\n")
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


# ---- calls per decoded token ---------------------------------------------------------------------


def executor_requests(executor: symbiosis.BaseExecutor) -> dict[str, int]:
    return {layer: counters["requests"] for layer, counters in executor.stats()["layers"].items()}


def calls_breakdown(calls: Mapping[str, float], layer_ids: Sequence[str], tokens: int) -> dict[str, Any]:
    """Calls per token of one decode step from the requests per layer id it made (``{id: calls}``).

    ``layer_ids``: every base layer the executor serves (to count the decoder blocks); a fused
    request's id joins its members' ids with ``GROUP_SEPARATOR``.
    """
    blocks = {m.group(1) for layer in layer_ids if (m := BLOCK_INDEX.search(layer))}
    inside = sum(n for layer, n in calls.items() if BLOCK_INDEX.search(layer))
    total = sum(calls.values())
    by_kind: dict[str, float] = {}
    for layer, n in calls.items():
        # "model.layers.3.mlp.gate_proj+model.layers.3.mlp.up_proj" -> "mlp.gate_proj+mlp.up_proj";
        # an MoE's experts count under their tensor: "model.layers.3.mlp.experts.down_proj.5" -> "mlp.experts.down_proj"
        kind = "+".join(_layer_kind(member) for member in layer.split(GROUP_SEPARATOR))
        by_kind[kind] = by_kind.get(kind, 0) + n
    return {
        "calls_per_token": total / tokens,
        "layers": len(blocks),
        "per_layer": ratio(inside / tokens, len(blocks)),
        "outside_layers": (total - inside) / tokens,
        "by_layer_kind": {k: v / tokens for k, v in sorted(by_kind.items())},
    }


def _layer_kind(layer_id: str) -> str:
    kind = BLOCK_INDEX.split(layer_id, maxsplit=1)[-1]
    return module_list_of(kind) or kind


def calls_line(name: str, breakdown: Mapping[str, Any]) -> str:
    return (
        f"{name}: {breakdown['calls_per_token']:g} calls/token ({breakdown['layers']} layers → "
        f"{breakdown['per_layer']:.2f}/layer + {breakdown['outside_layers']:g})"
    )


def requests_since(executor: symbiosis.BaseExecutor, before: Mapping[str, int], steps: int = 1) -> dict[str, float]:
    """Requests per layer id the executor served since ``before`` (``executor_requests``), per step."""
    after = executor_requests(executor)
    return {layer: (n - before.get(layer, 0)) / steps for layer, n in after.items() if n - before.get(layer, 0)}


def arch_calls_per_token(
    cache: Path, archs: Sequence[str] | None = None, *, prompt_len: int = 8
) -> dict[str, dict[str, Any]]:
    """Calls per decoded token of every ``symbiosis.modelzoo`` architecture at ``tiny``, in-process."""
    from symbiosis.modelzoo import ARCHS, make_model

    result = {}
    for arch in archs or ARCHS:
        path = make_model(arch, "tiny", Path(cache) / f"{arch}-tiny-seed0", seed=0)
        executor = symbiosis.BaseExecutor.from_pretrained(path, device="cpu", dtype=torch.float32, policy="immediate")
        try:
            # fused as a client of a remote executor is (in-process the default is unfused)
            model = symbiosis.load_client_model(path, executor=executor, fuse_siblings=True)
            prompt = torch.randint(
                1, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0)
            )
            decoder = Decoder(model, prompt)
            for _ in range(WARM_DECODE_STEPS):  # let the client settle (sibling fusion learns from repeated passes)
                decoder.step()
            before = executor_requests(executor)
            decoder.step()
            calls = requests_since(executor, before)
            result[arch] = calls_breakdown(calls, list(executor.layer_specs()), tokens=1)
            model.symbiosis_transport.close()
        finally:
            executor.close()
    return result


# ---- the worker: one system, every model, in its own process -------------------------------------


class _ModelRunner:
    """One model of a worker: its system's client (or the monolithic model), inputs and step blocks."""

    def __init__(self, spec: Mapping[str, Any], entry: Mapping[str, Any]) -> None:
        system, path, device = spec["system"], Path(entry["path"]), spec["device"]
        self.key = entry["key"]
        self.executor = None
        if system == "inproc":
            self.executor = symbiosis.BaseExecutor.from_pretrained(
                path, device=device, dtype=torch.float32, policy=spec["policy"]
            )
        target = None if system == MONOLITHIC else self.executor if self.executor is not None else entry["address"]
        self.model = adapter_model(path, target, seed=spec["seed"], device=device)
        self.transport = getattr(self.model.base_model.model, "symbiosis_transport", None)
        self.client_calls = 0
        self.seconds_in_calls = 0.0  # the client's wall time inside base-layer calls
        if self.transport is not None:
            # VirtLayers look ``call`` up on the transport per request; an MoE's experts
            # ``call_expert_rows`` (one request for every expert a layer's tokens chose).
            for name in ("call", "call_expert_rows"):
                if hasattr(self.transport, name):
                    setattr(self.transport, name, self._counting(getattr(self.transport, name)))
        generator = torch.Generator().manual_seed(spec["seed"] + 1)  # same inputs in every process
        vocab = self.model.config.vocab_size
        self.batch = torch.randint(1, vocab, (spec["train_batch"], spec["seq_len"]), generator=generator).to(device)
        prompt = torch.randint(1, vocab, (max(spec["decode_batches"]), spec["prompt_len"]), generator=generator)
        prompt = prompt.to(device)
        self.synchronize = torch.cuda.synchronize if torch.device(device).type == "cuda" else None
        self.prompts = {b: prompt[:b] for b in spec["decode_batches"]}
        self.decode_steps, self.train_steps = spec["decode_steps"], spec["train_steps"]
        self.model.train()
        with torch.no_grad():
            self.loss = float(self.model(input_ids=self.batch, labels=self.batch).loss)
        self.train_step = train_step_fn(self.model, self.batch)
        self.train_step()  # warm-up (allocates the optimizer state)
        for b in self.prompts:
            decoder = self._decoder(b)
            for _ in range(WARM_DECODE_STEPS):
                decoder.step()
        self.calls: dict[str, dict[str, Any]] = {}  # of the latest block, per step

    def _counting(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def counting_call(*args, **kwargs):
            self.client_calls += 1
            began = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds_in_calls += time.perf_counter() - began

        return counting_call

    def _decoder(self, batch: int) -> Decoder:
        self.model.eval()
        decoder = Decoder(self.model, self.prompts[batch])
        decoder.step()  # untimed: the first step after a prefill
        return decoder

    def _counted(self, key: str, step: Callable[[], None], repeats: int) -> list[float]:
        """``repeats`` timed calls of ``step``, and the base-layer calls they made (outside the timing)."""
        client_before, seconds_before = self.client_calls, self.seconds_in_calls
        executor_before = executor_requests(self.executor) if self.executor is not None else None
        samples = _timed(step, repeats, self.synchronize)
        calls: dict[str, Any] = {}
        # Where a step's time goes: inside base-layer calls (the executor's products plus the
        # boundary) or outside them (the client's own ops: attention, norms, adapters, optimizer).
        in_calls_ms = 1e3 * (self.seconds_in_calls - seconds_before) / repeats
        calls["in_calls_ms_per_step"] = in_calls_ms
        calls["outside_calls_ms_per_step"] = 1e3 * sum(samples) / repeats - in_calls_ms
        if self.transport is not None:
            calls["client_calls_per_step"] = (self.client_calls - client_before) / repeats
        if executor_before is not None:
            per_layer = requests_since(self.executor, executor_before, repeats)
            calls["executor_calls_per_step"] = sum(per_layer.values())
            if key.startswith("decode_b"):
                calls.update(
                    calls_breakdown(
                        per_layer, list(self.executor.layer_specs()), tokens=int(key.removeprefix("decode_b"))
                    )
                )
        self.calls[key] = calls
        return samples

    def block(self) -> dict[str, list[float]]:
        samples: dict[str, list[float]] = {}
        for b in self.prompts:
            samples[f"decode_b{b}"] = self._counted(f"decode_b{b}", self._decoder(b).step, self.decode_steps)
        if self.train_steps:  # --train-steps 0: decode only
            self.model.train()
            samples["train"] = self._counted("train", self.train_step, self.train_steps)
        return samples


def _timed(step: Callable[[], None], repeats: int, synchronize: Callable[[], None] | None = None) -> list[float]:
    """Wall time of each of ``repeats`` calls of ``step``; on a GPU (``synchronize``) up to the
    end of the work the step queued, not only its launch."""
    samples = []
    for _ in range(repeats):
        if synchronize is not None:
            synchronize()
        began = time.perf_counter()
        step()
        if synchronize is not None:
            synchronize()
        samples.append(time.perf_counter() - began)
    return samples


def worker_main(spec: Mapping[str, Any]) -> None:
    """Child process of one system: load every model, then run one block per ``go`` line."""
    quiet_libraries()
    torch.set_num_threads(spec["threads"])

    def setup() -> Callable[[], dict]:
        entries = spec["models"]
        if spec["system"] not in (MONOLITHIC, "inproc"):  # the parent sends the executors' addresses once they serve
            addresses = json.loads(sys.stdin.readline())
            if addresses is None:
                raise SystemExit(0)
            entries = [dict(entry, address=addresses[entry["key"]]) for entry in entries]
        runners = [_ModelRunner(spec, entry) for entry in entries]
        losses = {r.key: r.loss for r in runners}
        return lambda: {
            "samples": {r.key: r.block() for r in runners},
            "loss": losses,
            "calls": {r.key: r.calls for r in runners},
        }

    serve_worker(setup)


# ---- the parent: processes, rounds, results --------------------------------------------------------


def measure(
    models: Mapping[str, Path],
    *,
    systems: Sequence[str] = SYSTEMS,
    decode_batches: Sequence[int] = (1, 16),
    train_batch: int = 8,
    seq_len: int = 128,
    prompt_len: int = 16,
    rounds: int = 10,
    decode_steps: int = 8,
    train_steps: int = 1,
    threads: int = 1,
    policy: str = "opportunistic",
    seed: int = 0,
    shared_executor: bool = False,
    device: str = "cpu",
    while_loading: Callable[[], Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Time every system on every model, one process per system, round-robin (see the docstring).
    Remote systems get an executor process each (per model), or share one per model with
    ``shared_executor``.

    Returns ``samples[system][model][step]`` (seconds), ``info[system]`` (losses, calls),
    ``processes``, ``unavailable``, ``dist`` and, when given, ``while_loading``'s return value
    (run in this process while the children load).
    """
    from benchmarks.transport import dist_status, open_transports, split_addresses

    systems = [MONOLITHIC] + [s for s in systems if s != MONOLITHIC]
    remote = [s for s in systems if s not in (MONOLITHIC, "inproc")]
    spec = {
        "threads": threads,
        "device": device,
        "policy": policy,
        "seed": seed,
        "decode_batches": list(decode_batches),
        "train_batch": train_batch,
        "seq_len": seq_len,
        "prompt_len": prompt_len,
        "decode_steps": decode_steps,
        "train_steps": train_steps,
    }
    unavailable: dict[str, str] = {}
    dist = dist_status()
    servers: dict[tuple[str, str], ExecutorProcess] = {}  # (group of remote systems, model) -> serve child
    groups = {"shared": remote} if shared_executor else {system: [system] for system in remote}
    workers: dict[str, Worker] = {}

    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="symbiosis-split-") as folder:
        try:
            for group_index, group in enumerate(groups if remote else ()):
                for index, (key, path) in enumerate(models.items()):
                    sub = Path(folder) / f"{group_index}-{index}"
                    sub.mkdir()
                    binds = loopback_binds(sub)
                    servers[group, key] = ExecutorProcess(
                        path, binds, threads=threads, extra_args=["--policy", policy, "--device", device], wait=False
                    )
            for system in systems:  # all load at once; the remote ones wait for their addresses (below)
                entries = [{"key": key, "path": str(path)} for key, path in models.items()]
                # Clients of an executor in another process run with the setting the project documents
                # for them (symbiosis/threads.py); `symbiosis serve` applies it to the executor itself.
                env = client_env() if system in remote else None
                workers[system] = Worker(
                    MODULE, dict(spec, role=system, system=system, models=entries), threads=threads, env=env
                )
            targets: dict[str, dict[str, dict[str, str]]] = {}  # group -> model -> system -> address
            for (group, key), server in servers.items():
                server.wait_ready(600.0)  # several executors load at once next to the workers: give them time
                include_dist = "dist+tcp" in groups[group]
                targets.setdefault(group, {})[key], found = open_transports(
                    split_addresses(server.addresses), include_dist=include_dist
                )
                dist = found if include_dist else dist
            for system in remote:
                group = "shared" if shared_executor else system
                addresses = {key: t[system] for key, t in targets[group].items() if system in t}
                if len(addresses) < len(models):
                    addresses = None
                    unavailable[system] = (
                        dist["reason"] if system.startswith("dist") else f"the executor serves no {system} address"
                    )
                workers[system].process.stdin.write(json.dumps(addresses) + "\n")
                workers[system].process.stdin.flush()
                if addresses is None:
                    workers.pop(system).close()
            extra = while_loading() if while_loading else None
            log(f"  [{time.perf_counter() - began:.0f} s] waiting for {len(workers)} processes to load")
            processes: dict[str, dict[str, Any]] = {}
            for system in list(workers):
                try:
                    ready = workers[system].wait_ready()
                    processes[system] = {"pid": ready["pid"], "max_rss_mib": ready["max_rss_bytes"] / MIB}
                except RuntimeError as exc:  # a system that cannot start is reported, not fatal
                    if system == MONOLITHIC:
                        raise
                    unavailable[system] = _last_error_line(str(exc))
                    workers.pop(system).close()
            names = list(workers)
            log(
                f"  [{time.perf_counter() - began:.0f} s] {len(names)} processes ready ({', '.join(names)}); {rounds} "
                "rounds"
            )
            samples: dict[str, dict[str, dict[str, list[float]]]] = {s: {} for s in names}
            info: dict[str, dict[str, Any]] = {}
            for round_index in range(rounds):
                shift = round_index % len(names)
                for system in names[shift:] + names[:shift]:  # one system computes at a time
                    if system not in workers:
                        continue
                    workers[system].go()
                    try:
                        event = workers[system].wait_done(timeout_s=3600)
                    except RuntimeError as exc:  # e.g. a transport that breaks mid-run: report it, go on
                        if system == MONOLITHIC:
                            raise
                        unavailable[system] = f"failed in round {round_index + 1}: {_last_error_line(str(exc))}"
                        workers.pop(system).close()
                        samples.pop(system)
                        info.pop(system, None)
                        processes.pop(system)
                        log(f"  {system} dropped: {unavailable[system]}")
                        continue
                    split_times = info.get(system, {}).get("time_split", {})
                    for model, steps in event["calls"].items():
                        for step, calls in steps.items():
                            for part in ("in_calls_ms_per_step", "outside_calls_ms_per_step"):
                                split_times.setdefault(model, {}).setdefault(step, {}).setdefault(part, []).append(
                                    calls[part]
                                )
                    info[system] = {"loss": event["loss"], "calls": event["calls"], "time_split": split_times}
                    processes[system]["max_rss_mib"] = event["max_rss_bytes"] / MIB
                    for model, steps in event["samples"].items():
                        for step, values in steps.items():
                            samples[system].setdefault(model, {}).setdefault(step, []).extend(values)
                names = [n for n in names if n in workers]
                log(f"  [{time.perf_counter() - began:.0f} s] round {round_index + 1}/{rounds} done")
        finally:
            for worker in workers.values():
                worker.request_exit()
            for worker in workers.values():
                worker.close()
            for server in servers.values():
                server.close()
    return {
        "samples": samples,
        "info": info,
        "processes": processes,
        "unavailable": unavailable,
        "dist": dist,
        "while_loading": extra,
    }


def _last_error_line(text: str) -> str:
    """The exception line of a worker's traceback (``Worker`` appends its stderr tail after it)."""
    lines = [line for line in text.split("\nstderr tail:")[0].splitlines() if line.strip()]
    return lines[-1].strip()[:500] if lines else text[:500]


def step_kind(step: str) -> str:
    return "train" if step == "train" else "decode"


def summarize(measured: Mapping[str, Any], decode_batches: Sequence[int]) -> dict[str, Any]:
    """``results``, ``verdicts``, ``check`` and per-model calls from ``measure``'s output."""
    samples, info = measured["samples"], measured["info"]
    results: dict[str, Any] = {}
    verdicts: list[dict[str, Any]] = []
    for model, steps in samples[MONOLITHIC].items():
        results[model] = {}
        for step in steps:
            base = summarize_samples(steps[step])["median_ms"]
            row: dict[str, Any] = {}
            for system in samples:
                timing = summarize_samples(samples[system][model][step])
                split_ratio = ratio(timing["median_ms"], base)
                target = TARGETS.get(system, {}).get(step_kind(step))
                verdict = (
                    None if target is None or math.isnan(split_ratio) else ("PASS" if split_ratio <= target else "MISS")
                )
                timing.update(ratio_over_monolithic=split_ratio, target=target, verdict=verdict)
                parts = info[system]["time_split"][model][step]
                timing["in_calls_ms"] = statistics.median(parts["in_calls_ms_per_step"])
                timing["outside_calls_ms"] = statistics.median(parts["outside_calls_ms_per_step"])
                calls = info[system]["calls"][model].get(step, {})
                if "client_calls_per_step" in calls or "executor_calls_per_step" in calls:
                    # the executor's count where it is in this process, else the client's
                    timing["calls_per_step"] = calls.get("executor_calls_per_step", calls.get("client_calls_per_step"))
                    if step != "train":
                        timing["calls_per_token"] = timing["calls_per_step"] / int(step.removeprefix("decode_b"))
                row[system] = timing
                if target is not None:
                    verdicts.append(
                        {
                            "model": model,
                            "step": step,
                            "system": system,
                            "ratio": split_ratio,
                            "target": target,
                            "verdict": verdict,
                        }
                    )
            results[model][step] = row
    check = {}
    for model in results:
        losses = {system: info[system]["loss"][model] for system in samples}
        check[model] = {
            "loss": losses,
            "max_abs_diff_vs_monolithic": max(abs(v - losses[MONOLITHIC]) for v in losses.values()),
        }
    model_calls = {}
    if "inproc" in info:
        breakdown = ("calls_per_token", "layers", "per_layer", "outside_layers", "by_layer_kind")
        model_calls = {
            m: {k: info["inproc"]["calls"][m][f"decode_b{min(decode_batches)}"][k] for k in breakdown} for m in results
        }
    return {"results": results, "verdicts": verdicts, "check": check, "model_calls": model_calls}


def tables(results: Mapping[str, Any], models: Mapping[str, Mapping[str, Any]]) -> str:
    """One markdown table per model: median (p95) ms, ratio, target and verdict per system and step."""
    out = []
    for model, steps in results.items():
        out.append(f"\n{model} ({models[model]['describe']})\n")
        headers = ["system"] + [f"{step} ms median (p95) | x mono | target" for step in steps]
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * (1 + 3 * len(steps))]
        for system in next(iter(steps.values())):
            cells = [system]
            for row in steps.values():
                t = row[system]
                target = "–" if t["target"] is None else f"<= {t['target']:g} {t['verdict']}"
                cells += [f"{t['median_ms']:.2f} ({t['p95_ms']:.2f})", f"{t['ratio_over_monolithic']:.2f}", target]
            lines.append("| " + " | ".join(cells) + " |")
        out.append("\n".join(lines))
    return "\n".join(out)


def time_split_tables(results: Mapping[str, Any]) -> str:
    """Per model: ms per step inside base-layer calls / outside them, per system and step."""
    out = []
    for model, steps in results.items():
        out.append(f"\n{model}: ms per step inside base-layer calls / outside them (medians over rounds)\n")
        lines = ["| system | " + " | ".join(steps) + " |", "|" + "---|" * (1 + len(steps))]
        for system in next(iter(steps.values())):
            cells = [
                f"{row[system]['in_calls_ms']:.1f} / {row[system]['outside_calls_ms']:.1f}" for row in steps.values()
            ]
            lines.append(f"| {system} | " + " | ".join(cells) + " |")
        out.append("\n".join(lines))
    return "\n".join(out)


def plot(path: Path, results: Mapping[str, Any], title: str) -> None:
    panels = []
    for model, steps in results.items():
        systems = [s for s in next(iter(steps.values())) if s != MONOLITHIC]
        ratios = {step: [row[s]["ratio_over_monolithic"] for s in systems] for step, row in steps.items()}
        over_target = {
            step: [ratio(row[s]["ratio_over_monolithic"], row[s]["target"]) for s in systems]
            for step, row in steps.items()
        }
        panels.append(Panel(f"{model}: split / monolithic (medians, 1 = free)", "ratio", systems, ratios))
        panels.append(
            Panel(f"{model}: (split / monolithic) / target (<= 1 passes)", "ratio / target", systems, over_target)
        )
    plot_panels(path, title, panels, columns=2)


# ---- the script ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, default_repeats=10, quick_repeats=2)
    for flag, text in (
        ("--preset", "Size of the modelzoo model (default 'base', or 'tiny' with --quick)."),
        ("--repeats", "Rounds: each system runs one block of steps per round (default 10, 2 with --quick)."),
        ("--threads", "torch threads in every process, workers and executors (default 1)."),
    ):
        parser._option_string_actions[flag].help = text  # this script's defaults differ from the common ones
    parser.add_argument(
        "--systems",
        nargs="+",
        choices=SYSTEMS,
        default=list(SYSTEMS),
        help="Systems to time (monolithic always runs; default: all).",
    )
    parser.add_argument(
        "--policy",
        default="opportunistic",
        choices=("immediate", "lockstep", "opportunistic"),
        help="Executor batching policy (default: %(default)s).",
    )
    parser.add_argument(
        "--decode-batches",
        type=int,
        nargs="+",
        default=[1, 16],
        help="Sequences per decode step, one step kind each (default: %(default)s).",
    )
    parser.add_argument(
        "--train-batch", type=int, default=None, help="Sequences per training step (default 8; 2 with --quick)."
    )
    parser.add_argument(
        "--seq-len", type=int, default=None, help="Tokens per training sequence (default 128; 32 with --quick)."
    )
    parser.add_argument(
        "--prompt-len", type=int, default=None, help="Prefill length before decoding (default 16; 8 with --quick)."
    )
    parser.add_argument(
        "--decode-steps",
        type=int,
        default=None,
        help="Timed decode steps per batch size, system and round (default 8; 2 with --quick).",
    )
    parser.add_argument(
        "--train-steps",
        type=int,
        default=1,
        help="Timed training steps per system and round (default: %(default)s; 0 times decoding only).",
    )
    parser.add_argument(
        "--no-custom", action="store_true", help="Skip the hidden-512 LLaMA (only the preset / --model checkpoint)."
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="Where every system computes: the monolithic model, the split clients and their executors "
        "(cpu, cuda, cuda:N; default: %(default)s). The targets were set for cpu.",
    )
    parser.add_argument(
        "--shared-executor",
        action="store_true",
        help="One executor process per model for every remote system (default: one each, so each client is its "
        "executor's only one).",
    )
    args = parser.parse_args(argv)
    args.threads = 1 if args.threads is None else args.threads
    if args.preset is None and not args.quick:
        args.preset = "base"
    args = resolve_common(args)
    args.train_batch = args.train_batch or (2 if args.quick else 8)
    args.seq_len = args.seq_len or (32 if args.quick else 128)
    args.prompt_len = args.prompt_len or (8 if args.quick else 16)
    args.decode_steps = args.decode_steps or (2 if args.quick else 8)
    return args


def checkpoints(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The models of this run: key -> ``{"path", "describe", ...}``."""
    models: dict[str, dict[str, Any]] = {}
    if not args.no_custom:
        shape = QUICK_CUSTOM_LLAMA if args.quick else CUSTOM_LLAMA
        key = "llama-h{hidden}-l{layers}-v{vocab}".format(**shape)
        models[key] = {"path": make_llama(Path(args.cache) / f"{key}-seed0", **shape), **shape}
    key = Path(args.model).name if args.model else f"{args.arch}-{args.preset}"
    models[key] = {"path": checkpoint_path(args), "preset": None if args.model else args.preset}
    for entry in models.values():
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(entry["path"])
        with torch.device("meta"):
            params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        entry["params"] = params
        entry["describe"] = (
            f"{config.model_type}, hidden {config.hidden_size}, {config.num_hidden_layers} layers, vocab "
            f"{config.vocab_size}, {params / 1e6:.1f}M params"
        )
    return models


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        worker_main(json.loads(argv[1]))
        return {}
    started = time.perf_counter()
    args = parse_args(argv)
    models = checkpoints(args)
    steps = {
        f"decode_b{b}": {"kind": "decode", "batch": b, "tokens_per_sequence": 1, "prompt_len": args.prompt_len}
        for b in args.decode_batches
    }
    steps["train"] = {"kind": "train", "batch": args.train_batch, "seq_len": args.seq_len}
    print(
        f"{NAME}: {', '.join(models)}; systems {', '.join(args.systems)}; {args.threads} torch thread(s) per process",
        flush=True,
    )

    measured = measure(
        {key: entry["path"] for key, entry in models.items()},
        systems=args.systems,
        decode_batches=args.decode_batches,
        train_batch=args.train_batch,
        seq_len=args.seq_len,
        prompt_len=args.prompt_len,
        rounds=args.repeats,
        decode_steps=args.decode_steps,
        train_steps=args.train_steps,
        threads=args.threads,
        policy=args.policy,
        shared_executor=args.shared_executor,
        device=args.device,
        while_loading=lambda: arch_calls_per_token(args.cache),  # untimed, while the children load
    )
    summary = summarize(measured, args.decode_batches)
    results = summary["results"]
    calls = {"archs": measured["while_loading"], "models": summary["model_calls"]}
    result = {
        "benchmark": NAME,
        "command": command_line(argv, MODULE),
        "machine": machine_info(),
        "config": {
            "models": {key: {k: v for k, v in entry.items() if k != "describe"} for key, entry in models.items()},
            "systems": list(measured["samples"]),
            "steps": steps,
            "rounds": args.repeats,
            "decode_steps": args.decode_steps,
            "train_steps": args.train_steps,
            "prompt_len": args.prompt_len,
            "threads_per_process": args.threads,
            "device": args.device,
            "policy": args.policy,
            "executors": "one per model, shared by the remote systems"
            if args.shared_executor
            else "one per remote system and model",
            "quick": args.quick,
            "preset": args.preset,
            "adapter": f"LoRA r=8 alpha=16 on {LORA_TARGETS}, same weights in every system",
            "baseline": "monolithic transformers+peft in its own process, same checkpoint, adapter weights and inputs",
            "scheduling": "one long-lived process per system (each holding every model); rounds rotate the order; "
            "one system computes at a time",
        },
        "targets": {s: TARGETS[s] for s in measured["samples"] if s in TARGETS},
        "results": results,
        "verdicts": summary["verdicts"],
        "check": summary["check"],
        "calls_per_token": calls,
        "processes": measured["processes"],
        "unavailable": measured["unavailable"],
        "dist": measured["dist"],
        "wall_s": time.perf_counter() - started,
    }
    output = Path(args.output)
    write_json(output / f"{NAME}.json", result)
    plot(
        output / f"{NAME}.png",
        results,
        f"Split vs monolithic, one process per system ({args.threads} thread(s) each, medians of {args.repeats} "
        "rounds)",
    )

    print(tables(results, models), flush=True)
    print(time_split_tables(results), flush=True)
    print("\ncalls per decoded token (one sequence, in-process executor's requests):")
    for name, breakdown in {**calls["models"], **calls["archs"]}.items():
        print("  " + calls_line(name, breakdown))
    for system, reason in measured["unavailable"].items():
        print(f"\nnot measured: {system}: {reason}")
    missed = [
        f"{v['model']} {v['step']} {v['system']} x{v['ratio']:.2f} > {v['target']:g}"
        for v in summary["verdicts"]
        if v["verdict"] == "MISS"
    ]
    print_summary(
        {
            "benchmark": NAME,
            "pass": sum(v["verdict"] == "PASS" for v in summary["verdicts"]),
            "miss": missed,
            "loss_max_abs_diff": max(c["max_abs_diff_vs_monolithic"] for c in summary["check"].values()),
            "wall_s": result["wall_s"],
            "output": str(output / f"{NAME}.json"),
        }
    )
    return result


if __name__ == "__main__":
    main()
