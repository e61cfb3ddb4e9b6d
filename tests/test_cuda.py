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

import threading
import warnings
from pathlib import Path

import pytest
import torch

import symbiosis
from tests.reference import assert_matches_reference, close_client, loss_and_grads, make_pair
from tests.service_helpers import loopback_address, start_executor, stop

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


def _ids(vocab: int = 200, shape: tuple[int, int] = (2, 7)) -> torch.Tensor:
    return torch.randint(3, vocab, shape, generator=torch.Generator().manual_seed(2))


def _check(path: Path, executor, method: str, arch: str, client_device: str = CUDA) -> None:
    reference, split = make_pair(path, executor, method, arch, device=client_device)
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
        # its products leave the clients' cores alone: the decoders' free time counts whole
        assert not executor._engine.scheduler.products_share_client_cores
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
    bind = loopback_address("tcp" if transport == "tcp" else "ipc", tmp_path)
    address = f"shm+{bind}" if transport == "shm+ipc" else bind
    process = start_executor(path, bind, "--device", CUDA)
    try:
        _check(path, address, method, arch)
    finally:
        stop(process)


@pytest.mark.parametrize("arch", ("llama", "gpt2", "gemma2"))
def test_greedy_generation_on_cuda_equals_monolithic(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    executor = symbiosis.BaseExecutor.from_pretrained(path, device=CUDA)
    reference, split = make_pair(path, executor, "lora", arch, device=CUDA)
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
    from tests.test_quantization import _rel, assert_near_fp32, quantized_split_outputs

    path = tiny_checkpoint("llama")
    executor = symbiosis.BaseExecutor.from_pretrained(path, device=CUDA, quantization=quantization)
    if quantization == "fp8-rowwise" and Q.hardware_fp8(executor.device):
        assert executor.weights.kernels().get("scaled_mm", 0) > 0, executor.weights.kernels()
    got, fp32, exact = quantized_split_outputs(path, executor, "llama", quantization, device=CUDA)
    # Against Ŵ itself: int8 dequantizes before a float32 matmul off CPU; fp8 with fp8 units adds
    # the activations' e4m3 rounding (<= 2**-4 relative per element, so ~3% on the logits here).
    # Measured on an H200 (2026-11-27): int8 5.9e-7 to Ŵ, 6.9e-3 to fp32; fp8 2.7e-2 to Ŵ, 3.9e-2 to fp32.
    assert _rel(got[0], exact[0]) <= (1e-4 if quantization == "int8" else 0.06)
    assert_near_fp32(got, fp32, exact, quantization)


def test_api_engine_on_cuda_serves_mixed_adapters_exactly(tiny_checkpoint, tmp_path):
    """The API server's engine as ``symbiosis api --embedded --device cuda`` builds it
    (``server.build_engine``: continuous batching, a mixed-adapter batch): each sequence's greedy
    tokens are those of the monolithic model with that request's adapter, on the same GPU."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from symbiosis.jobs.client import ClientOptions, ExecutorTarget, load_tokenizer
    from symbiosis.serving.engine import Delta, GenerationRequest
    from symbiosis.serving.sampling import SamplingParams
    from symbiosis.serving.server import ApiOptions, build_engine
    from tests.serving.conftest import ADAPTER_SHAPES, make_lora_adapter

    path = tiny_checkpoint("llama")
    adapters = {
        name: make_lora_adapter(path, tmp_path / name, rank, alpha, targets, seed)
        for seed, (name, (rank, alpha, targets)) in enumerate(ADAPTER_SHAPES.items())
    }
    options = ApiOptions(model=path, client=ClientOptions(embedded=True, device=CUDA), adapters=adapters)
    target = ExecutorTarget(path, options.client)
    engine = build_engine(options, target, None, load_tokenizer(path), None).engine
    prompts = [[5 + i, 17, 42 + 3 * i, 9, 100 + i][: 3 + i % 3] for i in range(8)]
    names = [list(adapters)[i % 4] if i % 5 else None for i in range(8)]
    events: dict[int, list] = {i: [] for i in range(8)}
    finished = threading.Semaphore(0)

    def sink_for(index: int):
        def sink(event) -> None:
            events[index].append(event)
            if not isinstance(event, Delta) or event.finish_reason is not None:
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
        target.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for index, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
            assert all(isinstance(event, Delta) for event in events[index]), events[index]
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
            got = [token for event in events[index] for token in event.token_ids]
            assert got == expected[0, ids.shape[1] :].tolist(), f"request {index} (adapter {name})"
