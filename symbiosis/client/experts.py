"""MoE experts served by the executor: each expert's matrix is a base layer of its own.

`transformers` 5 holds an MoE block's experts as 3-D tensors (``gate_up_proj``: ``[experts, out,
in]``). On a split model each such tensor is an :class:`ExpertWeights` placeholder holding one
VirtLayer per expert, and the experts module runs transformers' own grouped forward
(``grouped_mm_experts_forward``, the monolithic model's default): tokens sorted by expert, then one
grouped product per tensor, ``grouped_mm(x, W.transpose(-2, -1), offs)``. That product is one
executor request for every expert the tokens chose (``expert_rows``: the executor serves each
expert's rows with its own layer, batched with other clients' rows for it), where a request per
expert cost a round trip each (a 128-expert, top-8 model: ~16 per layer and decoded token); an
executor that does not take such requests (a sharded one) gets one request per expert. The eager
forward's ``F.linear(x, W[e])`` (``x @ W[e]`` for transposed ones: gpt-oss) works too: ``W[e]`` is
that expert's layer's weight placeholder (``placeholders._linear``, ``_input_times``). llama4's
experts (not the standard module) keep their own forward, ``torch.bmm(x, W)`` with every expert
given every row: the rows each expert's router chose are one expert-rows request
(``every_row_product``).

Which modules qualify: ``checkpoint.served_experts``. The experts' layers are not registered
modules (peft's ``all-linear`` or a regex ``target_modules`` would adapt them, where the
monolithic model has no layer to adapt), so this module does for them what the module tree does
for registered layers: device and dtype moves, train/eval, copies, state dicts, and the graph
break ``torch.compile`` needs.
"""

from __future__ import annotations

import contextlib
import copy
import types
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from symbiosis.checkpoint import ExpertTensor, every_row_experts
from symbiosis.client.placeholders import BaseWeightPlaceholder, LowRank, _derived, _plain, _takes, times_added
from symbiosis.client.virt import ExecutorLink, VirtConv1D, VirtLinear
from symbiosis.errors import BaseWeightAccessError
from symbiosis.ops import frozen_linear
from symbiosis.transport.base import Transport
from symbiosis.vocabulary import LatencyClass, LayerSpec, Op, expert_parts

try:  # transformers' grouped experts forward (5.x); without it, the eager one
    from transformers.integrations.moe import grouped_mm_experts_forward as _grouped_forward
except ImportError:  # pragma: no cover - an older transformers
    _grouped_forward = None


class ExpertWeights(BaseWeightPlaceholder):
    """A served ``[experts, out, in]`` tensor (or ``[experts, in, out]``, transposed). Indexing one
    expert (``W[e]``, ``e`` an int or a 0-d integer tensor) gives its layer's weight placeholder.
    ``W + Δ`` and ``torch.baddbmm(W, L, R, alpha=α)`` (peft's LoRA on experts, a parametrization of
    this tensor) give experts weights with the term added, whose ``W[e]`` adds ``Δ[e]`` (kept as
    ``L[e]``, ``R[e]``: ``placeholders.LowRank``) to expert ``e``'s products. Anything else is
    refused, as on any base-layer tensor."""

    @staticmethod
    def __new__(
        cls,
        tensor: ExpertTensor,
        layers: list[VirtLinear | VirtConv1D],
        owner: nn.Module,
        added: tuple[torch.Tensor | LowRank, ...] = (),
        flipped: bool = False,
    ):
        weight = layers[0].weight
        shape = (tensor.experts, *(reversed(weight.shape) if flipped else weight.shape))
        placeholder = BaseWeightPlaceholder.__new__(
            cls, shape, dtype=weight.dtype, device=weight.device, name=tensor.name
        )
        placeholder.expert_tensor = tensor
        placeholder.expert_layers = layers
        placeholder.owner = owner  # the experts module: its train/eval mode is the layers'
        placeholder.added = added  # terms added to every expert ([experts, ...] each, in the tensor's layout)
        # ``W.transpose(-2, -1)``: each expert's matrix the other way round (what the grouped product
        # takes of a [experts, out, in] tensor); only multiplied (grouped) or transposed back.
        placeholder.flipped = flipped
        return placeholder

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # As a VirtLayer's forward: the check costs ~0.2 us a call, the disable wrapper ~0.6.
        if torch.compiler.is_compiling():
            return _experts_function_untraced(cls, func, types, args, kwargs)
        return _experts_function(cls, func, types, args, kwargs)

    def expert_weight(self, index) -> BaseWeightPlaceholder | None:
        """``W[e]``: expert ``e``'s layer's weight, with this tensor's added terms' slices."""
        if isinstance(index, torch.Tensor) and index.dim() == 0 and not index.is_floating_point():
            index = int(index)
        if not isinstance(index, int) or isinstance(index, bool) or self.flipped:
            return None
        layer = self.expert_layers[index]
        layer.training = self.owner.training  # (its latency class: a fine-tuning product or a decode one)
        if not self.added:
            return layer.weight
        return _derived(layer.weight, added=tuple(_expert_term(d, index) for d in self.added))

    def plus(self, term) -> ExpertWeights | None:
        if self.flipped:
            return None
        return ExpertWeights(self.expert_tensor, self.expert_layers, self.owner, (*self.added, term))

    def transposed(self, dim0: int, dim1: int) -> ExpertWeights | None:
        """``W.transpose(-2, -1)`` (either way round): each expert's matrix transposed."""
        if sorted(d % 3 if -3 <= d < 3 else -1 for d in (dim0, dim1)) != [1, 2]:
            return None
        return ExpertWeights(self.expert_tensor, self.expert_layers, self.owner, self.added, not self.flipped)

    def grouped_product(self, rows: torch.Tensor, offs=None, bias=None, out_dtype=None) -> torch.Tensor | None:
        """``grouped_mm(x, W, offs)`` (transformers' grouped experts forward): rows sorted by
        expert, ``offs[e]`` the end of expert ``e``'s; each expert's rows times its matrix taken
        ``[in, out]`` (this tensor as transformers passes it: flipped, unless the served tensor is
        stored transposed). The experts' base products are one executor request (``expert_rows``),
        or one per expert where the executor does not take those; added terms (peft's LoRA on
        experts) are computed here, per expert. Rows past ``offs[-1]`` (expert parallelism's
        sentinels, never a client's) come back as zeros."""
        tensor = self.expert_tensor
        if self.flipped == tensor.transposed or bias is not None or out_dtype not in (None, rows.dtype):
            return None
        if not isinstance(offs, torch.Tensor) or offs.shape != (tensor.experts,) or rows.dim() != 2:
            return None
        ends = offs.tolist()
        counts = [end - start for start, end in zip([0, *ends], ends)]
        used = ends[-1]
        x = rows[:used]
        out = _base_products(self, x, counts)
        if self.added:
            out = out + _added_products(self, x, counts)
        if used < rows.shape[0]:
            out = torch.cat([out, out.new_zeros((rows.shape[0] - used, out.shape[1]))])
        return out

    def every_row_product(self, rows: torch.Tensor) -> torch.Tensor | None:
        """``torch.bmm(x, W)``, ``x`` ``[experts, rows, in]`` (llama4's experts: every expert given
        every row, scaled by its router weight, so zeros where the router did not choose it). A
        row of zeros has a product of zeros (the experts' matrices have no bias): each way -- the
        rows forward, their gradients backward -- only the other rows go to the executor, in one
        ``expert_rows`` request (``_NonzeroRowsLink``). A top-1-of-16 model's decoded token: 1 row
        where the monolithic model multiplies 16. Added terms (peft's LoRA on experts) are
        computed here for every row, as the monolithic model computes them."""
        tensor = self.expert_tensor
        if self.flipped == tensor.transposed or rows.dim() != 3 or rows.shape[0] != tensor.experts:
            return None
        if rows.shape[2] != tensor.in_features or isinstance(rows, BaseWeightPlaceholder):
            return None
        experts, per_expert, width = rows.shape
        flat = rows.reshape(experts * per_expert, width)
        out = frozen_linear(flat, _NonzeroRowsLink(self, per_expert), self.owner.training)
        if self.added:
            out = out + _added_products(self, flat, [per_expert] * experts)
        return out.view(experts, per_expert, out.shape[1])

    def __deepcopy__(self, memo):
        """A copy of the whole model gets layers of its own, as its registered VirtLayers do (a copy
        of the experts module alone is refused there: ``VirtLayer.__deepcopy__``)."""
        layers = copy.deepcopy(self.expert_layers, memo)
        copied = ExpertWeights(self.expert_tensor, layers, copy.deepcopy(self.owner, memo), self.added, self.flipped)
        copied._is_param = getattr(self, "_is_param", False)  # (a parameter stays one: serve_experts says why)
        return copied

    def __repr__(self) -> str:
        added = f", {len(self.added)} added" if self.added else ""
        added += ", transposed" if self.flipped else ""
        return f"ExpertWeights({self.base_tensor_name}, shape={tuple(self.shape)}, dtype={self.dtype}{added}, served)"


class _ExpertsLink:
    """The link (``ops.LayerLink``) of one grouped product's base part: the rows of several
    experts of one tensor, ``counts[e]`` of them expert ``e``'s, in one request each way (its
    backward, ``∂L/∂x``, is one request too): ``_base_calls``."""

    def __init__(self, weights: ExpertWeights, counts: list[int]):
        self.weights = weights
        self.counts = counts
        first = weights.expert_layers[0].link
        self.layer_id = weights.expert_tensor.name
        self.in_features, self.out_features = first.in_features, first.out_features

    def call(self, op: Op, rows: torch.Tensor, latency_class: LatencyClass) -> torch.Tensor:
        return _base_calls(self.weights, op, rows, self.counts, latency_class)


class _NonzeroRowsLink(_ExpertsLink):
    """The link of an every-row product (``ExpertWeights.every_row_product``): ``per_expert`` rows
    for each expert, in expert order. Each call -- the rows forward, their gradients backward --
    sends the rows that are not all zeros (a NaN row is sent: its product is NaN, as the
    monolithic one) and fills in zeros for the others, exactly their product. Backward saves
    less: a gradient row is zero only where the row's output is not used (llama4 sums every
    expert's output, chosen or not, so its down projection's gradient has every row; its gate/up
    projection's, only the chosen ones: silu(0)·0)."""

    def __init__(self, weights: ExpertWeights, per_expert: int):
        super().__init__(weights, [])
        self.per_expert = per_expert

    def call(self, op: Op, rows: torch.Tensor, latency_class: LatencyClass) -> torch.Tensor:
        sent = rows.ne(0).any(dim=1)
        counts = sent.view(self.weights.expert_tensor.experts, self.per_expert).sum(dim=1).tolist()
        index = sent.nonzero().squeeze(1)
        products = _base_calls(self.weights, op, rows.index_select(0, index), counts, latency_class)
        return rows.new_zeros((rows.shape[0], op.output_width(self))).index_copy_(0, index, products)


def _base_calls(weights: ExpertWeights, op: Op, x: torch.Tensor, counts: list[int], latency_class) -> torch.Tensor:
    """The executor's products (``op``) of each expert's rows of ``x``: one expert-rows request,
    or one per expert where the transport takes none (or a link is wrapped: activation noise)."""
    layers = weights.expert_layers
    parts = expert_parts(counts)
    links = [layers[e].link for e, _, _ in parts]
    transport = getattr(links[0], "transport", None) if links else None
    if (
        len(parts) > 1
        and getattr(transport, "serves_expert_rows", False)
        and all(type(k) is ExecutorLink for k in links)
    ):  # (a wrapped link, activation noise's, must see its own calls: one request per expert then)
        last = parts[-1][0] + 1
        return transport.call_expert_rows(weights.expert_tensor.name, counts[:last], op, x, latency_class)
    pieces = [link.call(op, x[start:stop], latency_class) for (_, start, stop), link in zip(parts, links)]
    if not pieces:
        return x.new_zeros((0, op.output_width(layers[0].link)))  # (a link has a spec's widths)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _expert_term(term: torch.Tensor | LowRank, expert: int) -> torch.Tensor | LowRank:
    """Expert ``expert``'s slice of a term added to every expert (``[experts, ...]``)."""
    if isinstance(term, LowRank):
        return LowRank(term.left[expert], term.right[expert], term.alpha)
    return term[expert]


def _base_products(weights: ExpertWeights, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each expert's rows of ``x`` times its base matrix (the executor's products)."""
    return frozen_linear(x, _ExpertsLink(weights, counts), weights.owner.training)


def _added_products(weights: ExpertWeights, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each expert's rows of ``x`` times the terms added to its matrix (peft's LoRA on experts)."""
    layout = "in_out" if weights.expert_tensor.transposed else "out_in"
    pieces = []
    for e, start, stop in expert_parts(counts):
        terms = [times_added(x[start:stop], _expert_term(d, e), layout) for d in weights.added]
        pieces.append(sum(terms[1:], terms[0]))
    if not pieces:
        return x.new_zeros((0, weights.expert_layers[0].link.out_features))
    return torch.cat(pieces)


def _experts_function(cls, func, types, args=(), kwargs=None):
    """``ExpertWeights.__torch_function__``: the experts' own uses, else the base placeholder's."""
    kwargs = kwargs or {}
    handler = _EXPERTS_OPS.get(func)
    if handler is not None and args and isinstance(args[0], ExpertWeights) and _takes(handler, args, kwargs):
        result = handler(*args, **kwargs)
        if result is not None:
            return result
    grouped = _GROUPED_OPS.get(func)
    if grouped is not None and len(args) > 1 and isinstance(args[1], ExpertWeights) and _takes(grouped, args, kwargs):
        result = grouped(*args, **kwargs)
        if result is not None:
            return result
    try:
        return BaseWeightPlaceholder.__torch_function__.__func__(cls, func, types, args, kwargs)
    except BaseWeightAccessError as exc:
        name = next((a.base_tensor_name for a in args if isinstance(a, ExpertWeights)), "?")
        raise BaseWeightAccessError(
            f"{getattr(func, '__name__', func)} on served experts tensor {name!r} is not possible: a split model "
            "uses its experts in transformers' grouped experts forward (grouped_mm(x, W.transpose(-2, -1), offs): "
            "the executor's products of the experts the tokens chose) or its eager one (F.linear(x, W[e]) or "
            "x @ W[e]), and with peft's LoRA on them; any other use would read the weights, which never leave "
            f"the executor. ({exc})"
        ) from None


#: What ``torch.compile`` sees of an experts placeholder's ops: a graph break (its tracer cannot
#: take a tensor without data; peft's LoRA on experts, a parametrization, runs outside the experts'
#: forward, so the forward's break is not enough).
_experts_function_untraced = torch.compiler.disable(_experts_function)


def _plus(weights: ExpertWeights, other, *, alpha=1):
    """``W + Δ`` (peft's ``_LoraParameterProxy``), ``Δ`` a tensor of W's shape."""
    if not _plain(other, weights.shape):
        return None
    return weights.plus(other.clone() if alpha == 1 else other * alpha)  # (a copy, as placeholders._plus)


def _plus_product(weights: ExpertWeights, left, right, *, beta=1, alpha=1):
    """``torch.baddbmm(W, L, R, alpha=α)``: ``W + α·L·R`` (peft's ``_LoraFactorsProxy``)."""
    if beta != 1 or not (_plain(left, left.shape) and _plain(right, right.shape)):
        return None
    if left.dim() != 3 or right.dim() != 3 or (left.shape[0], left.shape[1], right.shape[2]) != weights.shape:
        return None
    return weights.plus(LowRank(left.clone(), right.clone(), alpha))


def _grouped(mat_a, mat_b: ExpertWeights, offs=None, bias=None, out_dtype=None):
    """``torch._grouped_mm`` / ``F.grouped_mm`` / transformers' fallback op of rows and experts."""
    if isinstance(mat_a, BaseWeightPlaceholder) or not isinstance(mat_a, torch.Tensor):
        return None
    return mat_b.grouped_product(mat_a, offs, bias, out_dtype)


def _every_row(rows, weights: ExpertWeights):
    """``torch.bmm(x, W)`` / ``x.bmm(W)`` / ``x @ W`` of 3-D rows and experts (llama4's experts)."""
    if not isinstance(rows, torch.Tensor):
        return None
    return weights.every_row_product(rows)


def _grouped_ops() -> dict:
    ops = {torch._grouped_mm: _grouped}
    for op in (torch.bmm, torch.Tensor.bmm, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__):
        ops[op] = _every_row
    if hasattr(torch.nn.functional, "grouped_mm"):
        ops[torch.nn.functional.grouped_mm] = _grouped
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if fallback is not None:  # (registered when transformers' moe integration is imported: above)
        ops[fallback] = ops[fallback.default] = _grouped
    return ops


_GROUPED_OPS = _grouped_ops()

_EXPERTS_OPS = {
    torch.Tensor.__getitem__: ExpertWeights.expert_weight,
    torch.Tensor.transpose: ExpertWeights.transposed,
    torch.transpose: ExpertWeights.transposed,
    torch.add: _plus,
    torch.Tensor.add: _plus,
    torch.Tensor.__add__: _plus,
    torch.baddbmm: _plus_product,
    torch.Tensor.baddbmm: _plus_product,
}


def serve_experts(
    model: nn.Module,
    tensors: Mapping[str, ExpertTensor],
    specs: Mapping[str, LayerSpec],
    transport: Transport,
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Replace each of ``tensors`` (``checkpoint.expert_tensors``) in ``model`` by an
    :class:`ExpertWeights`, and run transformers' grouped experts forward on them
    (``_served_forward``: its products become executor requests).

    Each stays a parameter of its module, frozen (``isinstance(w, nn.Parameter)`` holds through
    torch's ``_is_param`` flag): peft finds it where it looks for ``target_parameters`` (its
    ``all-linear`` adapts an MoE model's experts through them), torch's parametrization keeps it
    one, and the model's parameter count is the monolithic one. The module's ``_apply`` and state
    dict pass it by, as a VirtLayer's do its placeholders."""
    for tensor in tensors.values():
        module_name, _, param_name = tensor.name.rpartition(".")
        module = model.get_submodule(module_name)
        # A transposed tensor's expert is ``[in, out]``: Conv1D's layout, whose product is ``x @ W``.
        layer_type = VirtConv1D if tensor.transposed else VirtLinear
        layers = [layer_type(specs[layer_id], transport, device=device, dtype=dtype) for layer_id in tensor.layer_ids]
        module._parameters[param_name] = _as_parameter(ExpertWeights(tensor, layers, module))
        module._apply = types.MethodType(_apply_with_experts, module)
        module.forward = types.MethodType(_served_forward, module)
        module._save_to_state_dict = types.MethodType(_save_without_experts, module)
        module._load_from_state_dict = types.MethodType(_load_without_experts, module)
    standard = [t for t in tensors.values() if not every_row_experts(model.get_submodule(t.name.rpartition(".")[0]))]
    if standard:
        model.config._experts_implementation = "grouped_mm" if _grouped_forward is not None else "eager"
    if tensors:
        model._ddp_params_and_buffers_to_ignore = _PlaceholderNames(model)


class _PlaceholderNames:
    """The split model's ``_ddp_params_and_buffers_to_ignore``: DistributedDataParallel broadcasts
    every parameter from rank 0 when it wraps a model, and an experts placeholder has no data to
    broadcast (refused: DDP failed). It reads this attribute of the module it wraps (a PeftModel
    finds it on the split model through its ``__getattr__``), so the names are given as seen from
    either, and listed when DDP asks (peft's wrappers rename what they wrap)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __iter__(self) -> Iterator[str]:
        for name, parameter in self.model.named_parameters():
            if isinstance(parameter, ExpertWeights):
                yield name
                yield f"base_model.model.{name}"  # (as a PeftModel names it)


def _served_forward(module: nn.Module, *args, **kwargs):
    """transformers' grouped experts forward (module docstring), whatever
    ``set_experts_implementation`` chose later (the others read the weights: ``batched_mm``
    gathers ``W[expert_ids]``, kernels take the tensor itself); the eager one with a transformers
    that has none; llama4's experts their own forward (``every_row_product``). A graph break under
    ``torch.compile``, as each VirtLayer's forward is: its tracer cannot take a tensor without
    data."""
    if torch.compiler.is_compiling():
        return _served_forward_untraced(module, *args, **kwargs)
    if _grouped_forward is not None and not every_row_experts(module):
        return _grouped_forward(module, *args, **kwargs)
    forward = type(module).forward
    eager = getattr(forward, "__wrapped__", forward)  # (under use_experts_implementation's dispatch)
    return eager(module, *args, **kwargs)


_served_forward_untraced = torch.compiler.disable(_served_forward)


def _as_parameter(weights: ExpertWeights) -> ExpertWeights:
    weights._is_param = True  # (isinstance(weights, nn.Parameter) from now on)
    return weights


def _expert_weights(module: nn.Module) -> dict[str, ExpertWeights]:
    return {name: value for name, value in module._parameters.items() if isinstance(value, ExpertWeights)}


def _apply_with_experts(module: nn.Module, fn, recurse: bool = True):
    """The experts module's ``_apply`` (``model.to(...)``, ``.half()``): its experts' layers and
    placeholders move, as registered layers' would; the rest as torch moves it."""
    with _experts_set_aside(module) as experts:
        for name, weights in experts.items():
            for layer in weights.expert_layers:
                layer._apply(fn)
            moved = ExpertWeights(weights.expert_tensor, weights.expert_layers, module, weights.added)
            experts[name] = _as_parameter(moved)
        return type(module)._apply(module, fn, recurse)


def _save_without_experts(module: nn.Module, destination, prefix, keep_vars):
    with _experts_set_aside(module):
        type(module)._save_to_state_dict(module, destination, prefix, keep_vars)


def _load_without_experts(module: nn.Module, state_dict, prefix, *args, **kwargs):
    # Set aside: not a missing key, and a monolithic state dict's experts stay unexpected keys.
    with _experts_set_aside(module):
        type(module)._load_from_state_dict(module, state_dict, prefix, *args, **kwargs)


@contextlib.contextmanager
def _experts_set_aside(module: nn.Module) -> Iterator[dict[str, ExpertWeights]]:
    """The module without its experts' placeholders while the body runs (torch's own handling of
    parameters would read them), then with them (or what the body put in their place, in the
    dict it is given) back in their places: its parameters keep the monolithic model's order."""
    order = list(module._parameters)
    experts = _expert_weights(module)
    for name in experts:
        del module._parameters[name]
    try:
        yield experts
    finally:
        others = dict(module._parameters)
        module._parameters.clear()
        for name in order:
            if name in experts or name in others:
                module._parameters[name] = experts[name] if name in experts else others.pop(name)
        module._parameters.update(others)  # (any the body added)


def expert_layers(model: nn.Module) -> Iterator[VirtLinear | VirtConv1D]:
    """Every served expert's layer in ``model`` (not among its modules: module docstring)."""
    for module in model.modules():
        for weights in _expert_weights(module).values():
            yield from weights.expert_layers
