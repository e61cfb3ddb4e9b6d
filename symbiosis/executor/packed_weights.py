"""Forward products against weights kept a second time in oneDNN's blocked layout.

Why. A base layer's forward on CPU is a GEMM of a few to a few thousand rows against a weight
that a decode step streams from memory, and torch hands it to MKL, whose kernels for a few rows
run far below what the memory allows: on this project's 2-core AMD EPYC host (torch 2.13 CPU,
2026-11-29, a loop over ~200 MB of the hidden-512 llama's weight shapes, fastest of 5 passes) 16
rows read the weights at 5.6 GB/s on one thread, while one row reads them at 11-18 GB/s. oneDNN's
linear primitive run against the weight reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the layout ``torch.jit.freeze`` and inductor use)
took, against MKL's ``rows @ weight.T``:

=======  =========================  =========================
rows     one thread                 two threads
=======  =========================  =========================
1        x0.87 (16.4 vs 18.8 ms)    x0.55 (10.5 vs 19.0)
4        x0.54                      x0.37
16       x0.60 (21.9 vs 36.2 ms)    x0.51 (13.0 vs 25.7)
64       x0.76                      x0.66
1024     x0.87                      x0.81
=======  =========================  =========================

At 1-2 rows MKL's other form, ``(W @ rows.T).T``, beat it here, so which of them runs is timed
there (``matmul_forms.py``); above, a packed layer runs the packed product. The unpacked oneDNN
call and MKL's own prepacked weights gained little here (both measured in earlier sessions,
``docs/performance.md``): the layout is what pays.

Exactness. A packed product is deterministic and gives the same bits at any input alignment
(both checked in ``tests/test_packed_weights.py``); here it also gave a row the same bits whatever
rows shared its batch and whatever batch size the layout was made for (seen on this host, not
relied on). Against a float64 reference its error is ~2x MKL's (1.2-2.3e-6 against 0.4-1e-6 on
outputs of ~0.5): float tolerance, as ``matmul_forms``' second form already is, not
``nn.Linear``'s bits.

Cost. The packed copy is as large as the weight, and the plain weight stays: backward products
(``g @ W``) and everything else read it, and unpacking per backward would cost ~8% of a
1,024-row backward product here. A layer is packed the first time a forward runs against it, so
only the layers (or sibling groups) that forwards use hold a copy: about the model's weights once
more for an executor that serves forwards. Packed copies stop at ``budget_bytes`` (a quarter of
the machine's memory by default: a model too large for that keeps torch's ``mm`` on the layers
past it, so packing never turns a model that fits into one that does not; each layer keeps the
choice for the life of the process, so its products never change). ``SYMBIOSIS_PACK_WEIGHTS=0`` (read at import;
``symbiosis serve --no-pack-weights`` sets it) keeps every product on torch's ``mm`` and the memory
at one copy. Only float32 CPU weights are packed (what was measured); CUDA, bfloat16 and quantized
weights keep their own paths.
"""

from __future__ import annotations

import os
import threading
import weakref

import psutil
import torch

PACK_VARIABLE = "SYMBIOSIS_PACK_WEIGHTS"
#: The batch size the layout is reordered for: a hint only (results and speed were the same for
#: hints 1-1024 here), a decode batch's.
LAYOUT_BATCH_HINT = 16
PACKED_DTYPES = (torch.float32,)
#: The share of the machine's memory packed copies may take in one process (module doc).
BUDGET_SHARE_OF_MEMORY = 0.25


def _enabled_by_environment() -> bool:
    return os.environ.get(PACK_VARIABLE, "1").strip().lower() not in ("0", "false", "no", "off")


def _supported() -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


class WeightPacking:
    """Whether weights get packed, and the packing itself (module doc)."""

    def __init__(self, enabled: bool | None = None, budget_bytes: int | None = None) -> None:
        self.supported = _supported()
        self.enabled = (_enabled_by_environment() if enabled is None else enabled) and self.supported
        if budget_bytes is None:
            budget_bytes = int(BUDGET_SHARE_OF_MEMORY * psutil.virtual_memory().total)
        self.budget_bytes = budget_bytes
        self.packed_bytes = 0  # packed so far in this process (the budget's use)
        self._lock = threading.Lock()

    def applies_to(self, weight: torch.Tensor) -> bool:
        return self.enabled and weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES and weight.dim() == 2

    def pack(self, weight: torch.Tensor) -> torch.Tensor | None:
        """``weight`` [out, in] in the blocked layout, or None where packing does not apply or
        the budget is spent."""
        if not self.applies_to(weight) or weight.numel() == 0:
            return None
        nbytes = weight.numel() * weight.element_size()
        with self._lock:
            if self.packed_bytes + nbytes > self.budget_bytes:
                return None
            self.packed_bytes += nbytes
        packed = reorder(weight)
        weakref.finalize(packed, self._give_back, nbytes)  # an executor closed and dropped frees its share
        return packed

    def _give_back(self, nbytes: int) -> None:
        with self._lock:
            self.packed_bytes -= nbytes


WEIGHT_PACKING = WeightPacking()


def reorder(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] copied into oneDNN's blocked layout (no budget, no checks: the
    mechanism under ``WeightPacking.pack``, and what a form trial times peers with)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), LAYOUT_BATCH_HINT)


def linear(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``rows @ weight.T (+ bias)`` against ``packed`` (``WeightPacking.pack(weight)``)."""
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


def packed_nbytes(packed: torch.Tensor) -> int:
    """Bytes a packed weight holds (its elements; the blocked layout may pad a little more)."""
    return packed.numel() * packed.element_size()
