"""The executor's math: one matrix product per batch of rows gathered from many requests.

Base layers are row-independent (a token's output depends only on that token's input), so rows
from any clients, sequences and phases can be stacked into one matrix without padding and split
back afterwards; this is what makes cross-client batching exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from symbiosis.executor.matmul_forms import MATMUL_FORMS, Form, forward, timed_rows
from symbiosis.executor.weights import LayerWeights, StoredLayer
from symbiosis.vocabulary import Op

#: Byte alignment of every torch CPU allocation, which the products' input is given (``aligned``).
ALIGNMENT = 64


def aligned(rows: torch.Tensor) -> torch.Tensor:
    """``rows``, or a copy of them at an address aligned like every torch allocation when they are
    not (a ZeroMQ frame's bytes never are: libzmq puts its own header before them).

    Why: a kernel may take another path for data at another alignment (a peeled first vector,
    another blocking), and so round differently; an aligned input gives the product the bits it
    has on a tensor made in-process. Why here and not where the bytes arrive: the copy is as long
    as the payload (tens of MiB for a training or flood request), and the server's socket thread
    made it for every request as it arrived, while every other client's call waited. Here it is
    made by whoever runs the product: the bulk lane's thread for bulk work, the latency runner
    (often that same socket thread) for the rest, as before for a lone client."""
    return rows if rows.data_ptr() % ALIGNMENT == 0 else rows.clone()


def apply_op(
    layer: StoredLayer, op: Op, rows: torch.Tensor, out: torch.Tensor | None = None, out_fits: bool | None = None
) -> torch.Tensor:
    """``rows`` [n, width] in the weights' dtype/device -> result [n, out_width].

    forward ``x Wᵀ + b``; backward ``g W`` (∂(xWᵀ+b)/∂x = W, so no saved input is needed);
    noise ``n Wᵀ`` without bias, so a client can subtract the noise's effect exactly.

    ``out``: where to write the result (e.g. a transport's reply region), used only when it is a
    contiguous tensor of the result's shape in the weights' dtype and device that does not
    overlap ``rows``; then the result *is* ``out``. The same kernel runs either way (``@`` on
    matrices is ``mm``; a packed product is copied into ``out``), so the numbers are the same
    bits. A forward runs oneDNN's product against the layer's packed copy (``packed_weights.py``,
    made on its first forward), or, at 1-2 rows (1-64 where weights are not packed), the form
    timed fastest on this host for its shape and row count (``matmul_forms.py``).

    A quantized layer (``quantized.py``) computes the same ops against its dequantized weight
    with its own kernels, and never writes into ``out`` (the caller copies, as for any result
    that is not ``out``).

    ``out_fits``: whether ``out`` suits (``out_fits(layer, op, rows, out)``), when the caller
    already knows it for these very tensors; None: checked here.
    """
    if type(layer) is not LayerWeights:
        return layer.apply(op, rows)
    weight = layer.weight
    if out is not None and not (out_fits if out_fits is not None else out_fits_product(layer, op, rows, out)):
        out = None
    if op is Op.BACKWARD:
        return rows @ weight if out is None else torch.mm(rows, weight, out=out)
    if op is Op.FORWARD or op is Op.NOISE:
        bias = layer.bias if op is Op.FORWARD else None  # noise: no bias, see above
        packed = layer.packed
        if packed is None:
            packed = layer.pack()
        packed = packed if packed is not False else None
        n = rows.shape[0]
        if n <= timed_rows(packed):  # remembered per layer: the lookup costs a small dict's get
            key = (bias is not None, n, torch.get_num_threads())
            form = layer.forms.get(key)
            if form is None:
                form = layer.forms[key] = MATMUL_FORMS.form(weight, bias, n, packed)
        else:
            form = Form.ROWS_BY_WEIGHT if packed is None else Form.PACKED
        return forward(form, weight, bias, rows, out, layer.weight_t, packed)
    raise ValueError(f"unknown op {op!r}")


def out_fits_product(layer: StoredLayer, op: Op, rows: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``apply_op`` may write the product of ``rows`` into ``out``: a fact of these
    tensors' dtypes, devices, shapes and memory, so a caller passing the same tensors again may
    pass it back as ``out_fits`` (the checks are ~15 torch calls)."""
    if type(layer) is not LayerWeights:
        return False
    weight = layer.weight
    return _fits(out, rows, weight, weight.shape[1] if op is Op.BACKWARD else weight.shape[0])


def _fits(out: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, width: int) -> bool:
    """Whether the product of ``rows`` may be written into ``out`` (see ``apply_op``)."""
    if out.dtype != weight.dtype or out.device != weight.device or tuple(out.shape) != (rows.shape[0], width):
        return False
    if not out.is_contiguous() or rows.dim() != 2 or out.requires_grad or rows.requires_grad or weight.requires_grad:
        return False
    if out.numel() == 0 or rows.numel() == 0 or out.untyped_storage().data_ptr() != rows.untyped_storage().data_ptr():
        return True
    # Same storage (a shared-memory segment holds both): only if the byte spans are disjoint.
    return out.data_ptr() >= rows.data_ptr() + _span(rows) or rows.data_ptr() >= out.data_ptr() + _span(out)


def _span(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to just past its last (``t`` not empty)."""
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def run_batch(layer: StoredLayer, op: Op, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Concatenate ``inputs`` by rows, run one product, and split the result back in order (a
    lone input is aligned like the concatenation of several would be: ``aligned``)."""
    if len(inputs) == 1:
        return [apply_op(layer, op, aligned(inputs[0]))]
    stacked = torch.cat(list(inputs), dim=0)
    result = apply_op(layer, op, stacked)
    return list(result.split_with_sizes([t.shape[0] for t in inputs]))  # torch.split's Python wrapper costs more
