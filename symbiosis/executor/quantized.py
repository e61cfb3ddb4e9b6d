"""Quantized base layers: int8 or fp8 (e4m3) weights with one float32 scale per output row.

``W ≈ Ŵ = diag(scale) · Q``: ``Q`` [out, in] is int8 in [-127, 127] (``"int8"``) or float8_e4m3fn
in [-448, 448] (``"fp8-rowwise"``); ``scale`` [out] is the row's largest ``|w|`` over 127 (or 448).
A scale per output row rather than per tensor is what kept quality in production FP8 serving: one
outlier row no longer coarsens every other row. ``weights.py`` quantizes one tensor at a time as it
reads the checkpoint, so the full-precision base never sits in memory.

Every op keeps its full-precision meaning against ``Ŵ``: forward ``x Ŵᵀ + b``, backward ``g Ŵ``
(QLoRA-style: the adapter's gradient flows through the quantized base), noise ``n Ŵᵀ``. Which
kernel computes it (each choice measured in ``benchmarks/quantization.py``):

- **int8 on CPU, up to ``FBGEMM_MAX_ROWS`` rows** (decode, prefill): fbgemm, PyTorch's x86 int8
  GEMM, which reads each int8 weight once; that is where int8 decode beats fp32 (decode is
  memory-bound). fbgemm quantizes the activations too, and on AVX2 to 7 bits (``vpmaddubsw`` sums
  pairs of u8·s8 products in int16, so 8-bit activations can saturate). To keep weight-only
  meaning, each row is scaled to [-63, 63] and written as two integer digits ``hi + lo/126``,
  stacked as two rows of one call; the int32 accumulation is exact, so the product is ``x Ŵᵀ`` up
  to the second digit's rounding, ≤ 0.5/(63·126) ≈ 6.3e-5 of the row's largest ``|x|`` per
  element, and a row's result does not depend on the other rows of its batch (bit for bit).
  Rejected after measuring on this AVX2 CPU: ``aten._weight_int8pack_mm`` (8× slower than fp32 on
  one row), torchao's int8 weight-only tensor (eager mode converts the whole weight to float each
  call: slower than fp32), ``torch._int_mm`` (slower than fp32 at these shapes).
- **int8 on CPU, more rows, and every backward**: ``Q`` is unpacked from fbgemm (which keeps only
  its packed layout; holding ``Q`` as well would double the bytes), converted chunk by chunk and
  multiplied with BLAS: compute dominates there, not bytes.
- **fp8 on a GPU with fp8 units** (compute capability ≥ 8.9) and both widths multiples of 16:
  forward and noise with ``torch._scaled_mm``, activations quantized to fp8 per row (W8A8, as in
  production FP8 serving); backward dequantizes. Checked for accuracy on an H200
  (``tests/test_cuda.py``: logits within 2.7% of the dequantized model's), not timed.
- **otherwise** (fp8 on CPU, int8 off CPU, or no fbgemm): dequantize chunk by chunk, then BLAS.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from symbiosis.errors import CheckpointError, UnsupportedQuantizationError
from symbiosis.executor.quantization_options import FORMAT_NAMES, QUANTIZATION_CHOICES
from symbiosis.vocabulary import Op

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuantFormat:
    name: str
    storage_dtype: torch.dtype
    max_code: float  # largest |Q|: a row's largest |w| maps to it


FORMATS: dict[str, QuantFormat] = {
    f.name: f for f in (QuantFormat("int8", torch.int8, 127.0), QuantFormat("fp8-rowwise", torch.float8_e4m3fn, 448.0))
}
assert tuple(FORMATS) == FORMAT_NAMES, "quantization_options.FORMAT_NAMES lists the formats defined here"
#: Row counts up to this use fbgemm for int8 forward/noise on CPU; above it, dequantize + BLAS. The
#: crossover measured with ``python -m benchmarks.quantization --kernels`` (fbgemm's cost grows
#: with rows at about twice BLAS's because of the two digits; unpacking costs a fixed ~4 ns/weight).
FBGEMM_MAX_ROWS = 256
#: Weights converted to float at once (16 MiB of float32): bounds the temporaries of quantizing
#: and of dequantizing products, whatever the layer's size.
CHUNK_ELEMENTS = 1 << 22

_DIGIT = 63.0  # |hi|, |lo| ≤ 63: 7-bit activations, so AVX2 cannot saturate (2·127·127 < 2**15)
_LOW = 2 * _DIGIT  # lo = round((x - hi) · 126): the second digit weighs 1/126 of the first
_ZERO_POINT = 64  # fbgemm's uint8 activations: digit + 64 in [1, 127]
_ENGINE_LOCK = threading.Lock()


def parse_quantization(name: str | None) -> str | None:
    """``None``/"none" -> None; a supported name -> itself; anything else -> ``UnsupportedQuantizationError``."""
    if name is None:
        return None
    key = name.strip().lower() if isinstance(name, str) else name
    if key in ("", "none"):
        return None
    if key not in FORMATS:
        raise UnsupportedQuantizationError(
            f"unknown quantization {name!r}; supported: {', '.join(QUANTIZATION_CHOICES)}"
        )
    return key


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def quantize_rows(layer_id: str, weight: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] (any float dtype) -> (``Q`` [out, in] in ``fmt``'s dtype, ``scale`` [out]
    float32), on ``weight``'s device, converting at most ``CHUNK_ELEMENTS`` weights to float32 at once.
    Non-finite weights cannot be quantized: ``CheckpointError`` naming the layer."""
    out_features, in_features = weight.shape
    codes = torch.empty((out_features, in_features), dtype=fmt.storage_dtype, device=weight.device)
    scale = torch.ones(out_features, dtype=torch.float32, device=weight.device)
    if weight.numel() == 0:
        return codes, scale
    step = max(1, CHUNK_ELEMENTS // in_features)
    for start in range(0, out_features, step):
        w = weight[start : start + step].to(torch.float32)
        row_max = w.abs().amax(1)
        if not bool(torch.isfinite(row_max).all()):
            raise CheckpointError(f"weight of {layer_id!r} holds inf or nan values; it cannot be quantized")
        s = row_max / fmt.max_code
        s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero row: any scale will do, Q = 0
        q = w / s[:, None]
        q = (
            q.round_().clamp_(-fmt.max_code, fmt.max_code)
            if fmt.storage_dtype == torch.int8
            else q.clamp_(-fmt.max_code, fmt.max_code)
        )
        codes[start : start + step] = q.to(fmt.storage_dtype)
        scale[start : start + step] = s
    return codes, scale


# ---- products against Ŵ = diag(scale)·Q by dequantizing chunk by chunk -------------------------

# fp8 -> float32 by table: torch's elementwise fp8 conversion on CPU is scalar (~4 ns/weight),
# a 256-entry lookup is 2-4x faster. NaN codes are never produced by ``quantize_rows``.
_FP8_TABLE = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def _codes_as(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``Q`` (a chunk) as ``dtype``, exactly (every int8 and e4m3 code is a float32/bfloat16 value)."""
    if codes.dtype == torch.float8_e4m3fn and codes.is_cpu:
        flat = _FP8_TABLE.index_select(0, codes.reshape(-1).view(torch.uint8).to(torch.int32))
        return flat.view(codes.shape).to(dtype)
    return codes.to(dtype)


def _chunks(out_features: int, in_features: int) -> Iterator[tuple[int, int]]:
    step = max(1, CHUNK_ELEMENTS // max(1, in_features))
    for start in range(0, out_features, step):
        yield start, min(out_features, start + step)


def dequantized_forward(codes: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` [n, in] · Ŵᵀ as ``(rows · Qᵀ) · diag(scale)``, a chunk of Q's rows at a time."""
    out_features, in_features = codes.shape
    result = rows.new_empty((rows.shape[0], out_features))
    for start, stop in _chunks(out_features, in_features):
        torch.mm(rows, _codes_as(codes[start:stop], rows.dtype).t(), out=result[:, start:stop])
    return result.mul_(scale.to(rows.dtype))


def dequantized_backward(codes: torch.Tensor, scale: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """``grads`` [n, out] · Ŵ as ``(grads · diag(scale)) · Q``, a chunk of Q's rows at a time."""
    out_features, in_features = codes.shape
    scaled = grads * scale.to(grads.dtype)
    result = None
    for start, stop in _chunks(out_features, in_features):
        part = _codes_as(codes[start:stop], grads.dtype)
        if result is None:
            result = scaled[:, start:stop] @ part
        else:
            result.addmm_(scaled[:, start:stop], part)
    return result if result is not None else grads.new_zeros((grads.shape[0], in_features))


def scaled_mm_forward(codes: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` · Ŵᵀ with ``torch._scaled_mm`` (fp8 ``codes``): each row quantized to e4m3 with its
    own scale (its largest |x| / 448), so the result carries fp8 activation rounding (≤ 2⁻⁴ relative
    per element) on top of the weight's."""
    x = rows.to(torch.float32)
    row_max = x.abs().amax(1, keepdim=True)
    x_scale = torch.where(row_max > 0, row_max / 448.0, torch.ones_like(row_max))
    x_codes = (x / x_scale).to(torch.float8_e4m3fn)
    out_dtype = torch.bfloat16 if rows.is_cuda else torch.float32  # GPUs' row-wise scaling wants bf16 out
    product = torch._scaled_mm(x_codes, codes.t(), scale_a=x_scale, scale_b=scale[None, :], out_dtype=out_dtype)
    return product.to(rows.dtype)


def hardware_fp8(device: torch.device) -> bool:
    """Whether ``device`` has fp8 matmul units (NVIDIA compute capability 8.9 or later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


# ---- the fbgemm int8 kernel ------------------------------------------------------------------


def fbgemm_pack(codes: torch.Tensor, scale: torch.Tensor):
    """Pack int8 ``codes`` with per-row ``scale`` for fbgemm (``LinearPackedParamsBase``). The
    engine is set to fbgemm while packing: the default x86 engine picks oneDNN on CPUs with VNNI,
    whose packed weight keeps a second copy of ``Q``."""
    with _ENGINE_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's quantized tensors warn that they are deprecated
        previous = torch.backends.quantized.engine
        torch.backends.quantized.engine = "fbgemm"
        try:
            zero_points = torch.zeros(codes.shape[0], dtype=torch.long)
            qweight = torch._make_per_channel_quantized_tensor(codes, scale.to(torch.float64), zero_points, 0)
            return torch.ops.quantized.linear_prepack(qweight, None)
        finally:
            torch.backends.quantized.engine = previous


def fbgemm_unpack(packed) -> tuple[torch.Tensor, torch.Tensor]:
    """(``Q`` int8 [out, in], ``scale`` float32 [out]) back from a pack (a copy, ~4 ns a weight)."""
    qweight, _ = torch.ops.quantized.linear_unpack(packed)
    return qweight.int_repr(), qweight.q_per_channel_scales().to(torch.float32)


def fbgemm_forward(packed, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` · Ŵᵀ with fbgemm, activations as two exact 7-bit digits (module docstring)."""
    x = rows.to(torch.float32)
    n = x.shape[0]
    row_max = x.abs().amax(1, keepdim=True)
    bad = ~torch.isfinite(row_max)
    row_max.masked_fill_(row_max == 0, 1.0)
    scaled = x * (_DIGIT / row_max)  # in [-63, 63]
    high = scaled.round()
    low = (scaled - high).mul_(_LOW).round_()  # (scaled - high) in [-0.5, 0.5] -> [-63, 63]
    digits = torch.cat([high, low]).mul_(1.0 / _DIGIT)  # integers times fbgemm's input scale
    product = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
        digits, 1.0 / _DIGIT, _ZERO_POINT, packed
    )
    result = torch.add(product[:n], product[n:], alpha=1.0 / _LOW).mul_(row_max)
    if bool(bad.any()):  # fbgemm would turn inf/nan into some integer: say what fp32 would
        result[bad[:, 0]] = float("nan")
    return result.to(rows.dtype)


# ---- stored layers: the same interface as weights.LayerWeights --------------------------------


def _add_bias(result: torch.Tensor, op: Op, bias: torch.Tensor | None) -> torch.Tensor:
    return result.add_(bias) if op is Op.FORWARD and bias is not None else result


@dataclass(frozen=True, eq=False)
class RowwiseQuantizedWeights:
    """A layer, or a run of a sibling block (row-slice views of the block's tensors), stored as
    ``Q`` and per-row scales; products dequantize, or use the fp8 hardware matmul (``scaled_mm``)."""

    codes: torch.Tensor  # Q [out, in]: int8 or float8_e4m3fn
    scale: torch.Tensor  # [out] float32
    bias: torch.Tensor | None  # [out] in the compute dtype
    dtype: torch.dtype  # compute dtype: rows arrive and results leave in it
    scaled_mm: bool = False

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def kernel(self) -> str:
        return "scaled_mm" if self.scaled_mm else "dequantize+matmul"

    def rows(self, start: int, stop: int) -> RowwiseQuantizedWeights:
        bias = None if self.bias is None else self.bias[start:stop]
        return replace(self, codes=self.codes[start:stop], scale=self.scale[start:stop], bias=bias)

    def apply(self, op: Op, rows: torch.Tensor) -> torch.Tensor:
        if op is Op.BACKWARD:
            return dequantized_backward(self.codes, self.scale, rows)
        product = scaled_mm_forward if self.scaled_mm else dequantized_forward
        return _add_bias(product(self.codes, self.scale, rows), op, self.bias)

    def storage_items(self) -> Iterator[tuple[object, int]]:
        for tensor in (self.codes, self.scale, self.bias):
            if tensor is not None:
                yield _storage_item(tensor)

    @classmethod
    def concatenate(cls, members: list[RowwiseQuantizedWeights]) -> RowwiseQuantizedWeights:
        """One block from its members (the caller replaces the members by row views of it)."""
        bias = None if members[0].bias is None else torch.cat([m.bias for m in members])
        scaled_mm = all(m.scaled_mm for m in members)
        return cls(
            torch.cat([m.codes for m in members]),
            torch.cat([m.scale for m in members]),
            bias,
            members[0].dtype,
            scaled_mm,
        )


@dataclass(frozen=True, eq=False)
class FbgemmInt8Weights:
    """One int8 layer packed for fbgemm (CPU). Backward, and forward of more than
    ``FBGEMM_MAX_ROWS`` rows, unpack ``Q`` for the call (fbgemm keeps only its packed layout)."""

    packed: object  # torch.classes.quantized.LinearPackedParamsBase
    out_features: int
    in_features: int
    bias: torch.Tensor | None
    dtype: torch.dtype

    device = torch.device("cpu")
    kernel = "fbgemm"

    def apply(self, op: Op, rows: torch.Tensor) -> torch.Tensor:
        if op is not Op.BACKWARD and rows.shape[0] <= FBGEMM_MAX_ROWS:
            return _add_bias(fbgemm_forward(self.packed, rows), op, self.bias)
        codes, scale = fbgemm_unpack(self.packed)
        if op is Op.BACKWARD:
            return dequantized_backward(codes, scale, rows)
        return _add_bias(dequantized_forward(codes, scale, rows), op, self.bias)

    def storage_items(self) -> Iterator[tuple[object, int]]:
        # fbgemm's pack: Q (1 byte a weight) plus a float scale, an int zero point and an int
        # column offset per row; its padding to kernel tiles is not counted (RSS is, in the benchmark).
        yield ("fbgemm", id(self.packed)), self.out_features * (self.in_features + 12)
        if self.bias is not None:
            yield _storage_item(self.bias)


@dataclass(frozen=True, eq=False)
class StackedWeights:
    """A run of a sibling block whose members are stored one by one (fbgemm packs cannot be
    concatenated or sliced): nothing is held twice, and a product runs member by member."""

    members: tuple

    @property
    def device(self) -> torch.device:
        return self.members[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.members[0].dtype

    @property
    def kernel(self) -> str:
        return self.members[0].kernel

    @property
    def out_features(self) -> int:
        return sum(m.out_features for m in self.members)

    def rows(self, start: int, stop: int):
        """The members covering rows [start, stop) (a group always starts and ends on members)."""
        picked, offset = [], 0
        for member in self.members:
            if start <= offset and offset + member.out_features <= stop:
                picked.append(member)
            offset += member.out_features
        if sum(m.out_features for m in picked) != stop - start:
            raise ValueError(f"rows [{start}, {stop}) do not fall on member boundaries")
        return picked[0] if len(picked) == 1 else StackedWeights(tuple(picked))

    def apply(self, op: Op, rows: torch.Tensor) -> torch.Tensor:
        if op is not Op.BACKWARD:
            return torch.cat([member.apply(op, rows) for member in self.members], dim=1)
        result, offset = None, 0
        for member in self.members:
            width = member.out_features
            part = member.apply(op, rows[:, offset : offset + width])
            result = part if result is None else result.add_(part)
            offset += width
        return result

    def storage_items(self) -> Iterator[tuple[object, int]]:
        for member in self.members:
            yield from member.storage_items()


def _storage_item(tensor: torch.Tensor) -> tuple[object, int]:
    storage = tensor.untyped_storage()
    return ("storage", storage.data_ptr()), storage.nbytes()


QuantizedWeights = RowwiseQuantizedWeights | FbgemmInt8Weights | StackedWeights


class Quantizer:
    """Turns one full-precision weight at a time into the stored form for ``quantization`` on
    ``device``, choosing the kernel per layer (and logging a layer that falls back)."""

    def __init__(self, quantization: str, device: torch.device, dtype: torch.dtype):
        name = parse_quantization(quantization)
        if name is None:
            raise UnsupportedQuantizationError(f"a Quantizer needs one of {', '.join(FORMATS)}")
        self.format = FORMATS[name]
        if self.format.storage_dtype == torch.float8_e4m3fn and device.type not in ("cpu", "cuda"):
            raise UnsupportedQuantizationError(
                f"fp8-rowwise needs a cpu or cuda device, not {device}; supported: int8 there"
            )
        self.device, self.dtype = device, dtype
        self.use_fbgemm = self.format.name == "int8" and device.type == "cpu" and fbgemm_available()
        if self.format.name == "int8" and device.type == "cpu" and not self.use_fbgemm:
            log.warning("this torch build has no fbgemm engine: int8 products dequantize before a float matmul")
        self.use_scaled_mm = self.format.name == "fp8-rowwise" and hardware_fp8(device)

    def __call__(self, layer_id: str, weight: torch.Tensor, bias: torch.Tensor | None) -> QuantizedWeights:
        codes, scale = quantize_rows(layer_id, weight, self.format)
        bias = None if bias is None else bias.to(device=self.device, dtype=self.dtype).contiguous()
        if self.use_fbgemm:
            return FbgemmInt8Weights(fbgemm_pack(codes, scale), codes.shape[0], codes.shape[1], bias, self.dtype)
        scaled_mm = self.use_scaled_mm and codes.shape[0] % 16 == 0 and codes.shape[1] % 16 == 0
        if self.use_scaled_mm and not scaled_mm:
            log.warning(
                "layer %s of shape %s: torch._scaled_mm takes widths that are multiples of 16 only; "
                "this layer dequantizes before a matmul instead",
                layer_id,
                tuple(codes.shape),
            )
        return RowwiseQuantizedWeights(codes.to(self.device), scale.to(self.device), bias, self.dtype, scaled_mm)
