"""The CUDA paths against monolithic ``transformers`` + ``peft`` on the same GPU.

Skipped where torch sees no CUDA device (CI has none). On a machine with one:

    python -m pytest tests/test_cuda.py -q

What runs: the split client on CUDA with an executor on CUDA in its own process (every transport
a single GPU supports) and in-process; a CPU client of a CUDA executor; greedy generation; the
API server's engine (mixed LoRA adapters, continuous batching); and the quantized executors on
the GPU (fp8-rowwise through ``torch._scaled_mm`` on compute capability >= 8.9).

Tolerances. Products run in float32 with TF32 off (``torch.backends.cuda.matmul.allow_tf32``
false, checked below), but cuBLAS picks its kernel, and with it the summation order, by shape, and
the split computes each layer's product as a product of its own (or of a sibling group) where the
monolithic model may be fused differently: the two differ by float32 rounding, ~1e-6 relative on
these tiny models. ``assert_matches_reference``'s bounds (rtol 1e-4, atol 1e-5), the same as the
CPU matrix's, hold that with room. A CPU client of a CUDA executor is compared with the CPU
monolithic model: GPU and CPU kernels round differently (same order of magnitude), same bounds.
Greedy tokens are compared with ``==``.

Not covered on one GPU: ``dist+tcp`` with NCCL (NCCL refuses two ranks on one device; the
client and the executor would both be on ``cuda:0``).
"""

from __future__ import annotations

import copy
import socket
import threading
import warnings
from pathlib import Path

import pytest
import torch

import symbiosis
from tests.reference import assert_matches_reference, close_client, loss_and_grads, make_pair
from tests.service_helpers import start_executor, stop

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = "cuda"
ARCHS = ("llama", "gpt2", "falcon", "phi3", "gpt_neox", "gemma2")
METHODS = ("lora", "ia3", "prefix", "adalora")


@pytest.fixture(autouse=True)
def full_float32_products():
    """float32 products in full precision: TF32 would move results by ~1e-3 and hide real bugs."""
    assert not torch.backends.cuda.matmul.allow_tf32
    assert torch.get_float32_matmul_precision() == "highest"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _ids(vocab: int = 200, shape: tuple[int, int] = (2, 7)) -> torch.Tensor:
    return torch.randint(3, vocab, shape, generator=torch.Generator().manual_seed(2))


def _cuda_pair(path: Path, executor, method: str, arch: str, client_device: str = CUDA):
    return make_pair(path, executor, method, arch, device=client_device)


def _check(path: Path, executor, method: str, arch: str, client_device: str = CUDA) -> None:
    reference, split = _cuda_pair(path, executor, method, arch, client_device)
    ids = _ids().to(client_device)
    try:
        got = loss_and_grads(split, ids)
        expected = loss_and_grads(reference, ids)
    finally:
        close_client(split)
    assert got[0].device.type == torch.device(client_device).type
    assert_matches_reference(got, expected)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ARCHS)
def test_split_on_cuda_matches_monolithic_on_cuda(tiny_checkpoint, arch, method):
    path = tiny_checkpoint(arch)
    executor = symbiosis.BaseExecutor.from_pretrained(path, device=CUDA)
    try:
        assert executor.device.type == "cuda"
        _check(path, executor, method, arch)
    finally:
        executor.close()


@pytest.mark.parametrize("arch", ("llama", "falcon"))
def test_cpu_client_of_a_cuda_executor_matches_monolithic_on_cpu(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    executor = symbiosis.BaseExecutor.from_pretrained(path, device=CUDA)
    try:
        _check(path, executor, "lora", arch, client_device="cpu")
    finally:
        executor.close()


@pytest.mark.slow
@pytest.mark.parametrize("transport", ("ipc", "shm+ipc", "tcp"))
@pytest.mark.parametrize(("arch", "method"), [("llama", "lora"), ("falcon", "adalora"), ("gpt2", "prefix")])
def test_cuda_client_of_a_cuda_executor_process(tiny_checkpoint, tmp_path, transport, arch, method):
    path = tiny_checkpoint(arch)
    if transport == "tcp":
        bind = address = f"tcp://127.0.0.1:{_free_port()}"
    else:
        bind = f"ipc://{tmp_path}/executor.sock"
        address = bind if transport == "ipc" else f"shm+{bind}"
    process = start_executor(path, bind, "--device", CUDA)
    try:
        _check(path, address, method, arch)
    finally:
        stop(process)


@pytest.mark.parametrize("arch", ("llama", "gpt2", "gemma2"))
def test_greedy_generation_on_cuda_equals_monolithic(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    executor = symbiosis.BaseExecutor.from_pretrained(path, device=CUDA)
    reference, split = _cuda_pair(path, executor, "lora", arch)
    prompt = _ids(shape=(3, 5)).to(CUDA)
    options = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0, "attention_mask": torch.ones_like(prompt)}
    try:
        with torch.no_grad():
            expected = reference.generate(input_ids=prompt, **options)
            got = split.generate(input_ids=prompt, **options)
    finally:
        close_client(split)
        executor.close()
    assert torch.equal(got, expected)


@pytest.mark.parametrize("quantization", ("int8", "fp8-rowwise"))
def test_quantized_executor_on_cuda(tiny_checkpoint, quantization):
    """Against the dequantized monolithic model on the GPU, with the bounds ``test_quantization``
    states (fp8 on a GPU with fp8 units also rounds activations: W8A8, bounded there too)."""
    from symbiosis.executor import quantized as Q
    from tests.test_quantization import VS_FP32, _flat, _rel, dequantize_base_layers

    arch = "llama"
    path = tiny_checkpoint(arch)
    executor = symbiosis.BaseExecutor.from_pretrained(path, device=CUDA, quantization=quantization)
    kernels = executor.weights.kernels()
    if quantization == "fp8-rowwise" and Q.hardware_fp8(executor.device):
        assert kernels.get("scaled_mm", 0) > 0, kernels
    reference, split = _cuda_pair(path, executor, "lora", arch)
    dequantized = copy.deepcopy(reference)
    dequantize_base_layers(dequantized.get_base_model(), quantization)
    ids = torch.randint(3, 1000, (2, 16), generator=torch.Generator().manual_seed(0)).to(CUDA)
    try:
        got = loss_and_grads(split, ids)
        fp32 = loss_and_grads(reference, ids)
        exact = loss_and_grads(dequantized, ids)
    finally:
        close_client(split)
        executor.close()
    bound = VS_FP32[quantization]
    assert _rel(exact[0], fp32[0]) > 1e-4, "quantization changed nothing: the comparison could not fail"
    # Against Ŵ itself: int8 dequantizes before a float32 matmul off CPU; fp8 with fp8 units adds
    # the activations' e4m3 rounding (<= 2**-4 relative per element, so ~3% on the logits here).
    # Measured on an H200 (2026-11-27): int8 5.9e-7 to Ŵ, 6.9e-3 to fp32; fp8 2.7e-2 to Ŵ, 3.9e-2 to fp32.
    to_dequantized = 1e-4 if quantization == "int8" else 0.06
    assert _rel(got[0], exact[0]) <= to_dequantized
    assert _rel(got[0], fp32[0]) <= bound["logits_rel"]
    assert (got[0].argmax(-1) == fp32[0].argmax(-1)).float().mean() >= bound["top1"]
    assert _rel(_flat(got[2]), _flat(fp32[2])) <= bound["grads_rel"]


def test_api_engine_on_cuda_serves_mixed_adapters_exactly(tiny_checkpoint, tmp_path):
    """The API server's engine (continuous batching, a mixed-adapter batch) with its client model
    and an embedded executor on the GPU: each sequence's greedy tokens are those of the monolithic
    model with that request's adapter, on the same GPU."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from symbiosis.serving.adapters import AdapterPool
    from symbiosis.serving.engine import Delta, GenerationEngine, GenerationRequest
    from symbiosis.serving.lora import AdapterContext, install_multi_lora, load_lora_adapter
    from symbiosis.serving.sampling import SamplingParams
    from tests.serving.conftest import ADAPTER_SHAPES, make_lora_adapter

    path = tiny_checkpoint("llama")
    adapters = {
        name: make_lora_adapter(path, tmp_path / name, rank, alpha, targets, seed)
        for seed, (name, (rank, alpha, targets)) in enumerate(ADAPTER_SHAPES.items())
    }
    tokenizer = AutoTokenizer.from_pretrained(path)
    executor = symbiosis.BaseExecutor.from_pretrained(path, device=CUDA)
    model = symbiosis.load_client_model(path, executor=executor, device=CUDA)
    output = model.get_output_embeddings()
    context = AdapterContext()
    shapes = install_multi_lora(model, context, {n for n, m in model.named_modules() if m is output})
    pool = AdapterPool(
        lambda name, folder: load_lora_adapter(name, folder, shapes, dtype=torch.float32, device=torch.device(CUDA)),
        adapters=adapters,
        max_loaded=8,
    )
    engine = GenerationEngine(model, tokenizer, pool, context)
    prompts = [[5 + i, 17, 42 + 3 * i, 9, 100 + i][: 3 + i % 3] for i in range(8)]
    names = [list(adapters)[i % 4] if i % 5 else None for i in range(8)]
    results: dict[int, list[int]] = {i: [] for i in range(8)}
    finished = threading.Semaphore(0)

    def sink_for(index: int):
        def sink(event) -> None:
            assert isinstance(event, Delta), event
            results[index].extend(event.token_ids)
            if event.finish_reason is not None:
                finished.release()

        return sink

    try:
        for index, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
            params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
            engine.submit(GenerationRequest(prompt, name, params, sink_for(index)))
        for _ in prompts:
            assert finished.acquire(timeout=120)
    finally:
        engine.close()
        model.symbiosis_transport.close()
        executor.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for index, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
            monolithic = AutoModelForCausalLM.from_pretrained(path)
            if name is not None:
                monolithic = PeftModel.from_pretrained(monolithic, adapters[name])
            monolithic = monolithic.to(CUDA).eval()
            monolithic.generation_config.eos_token_id = None  # exactly max_new_tokens, like ignore_eos
            ids = torch.tensor([prompt], device=CUDA)
            with torch.no_grad():
                expected = monolithic.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, pad_token_id=0
                )
            assert results[index] == expected[0, ids.shape[1] :].tolist(), f"request {index} (adapter {name})"
