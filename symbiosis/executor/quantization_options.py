"""The ``--quantization`` flag's choices and help (no torch here: the CLI imports it to build its help,
and libgomp reads its thread settings once, when torch loads)."""

from __future__ import annotations

#: The stored formats ``symbiosis.executor.quantized`` implements, by the name the flag takes.
FORMAT_NAMES: tuple[str, ...] = ("int8", "fp8-rowwise")
#: What ``--quantization`` accepts ("none" is full precision).
QUANTIZATION_CHOICES: tuple[str, ...] = ("none", *FORMAT_NAMES)
QUANTIZATION_HELP = (
    "Store the base weights quantized, with one scale per output row: int8 (fbgemm int8 kernel on CPU) or "
    "fp8-rowwise (float8_e4m3fn; hardware fp8 matmul on GPUs that have it, dequantize-then-matmul elsewhere). "
    "none: the full-precision --dtype. Clients need no change."
)
