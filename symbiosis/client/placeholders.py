"""What a VirtLayer holds in place of its base tensors: placeholders that have no data.

A :class:`BaseWeightPlaceholder` has the real shape, dtype and device of a base tensor and no
storage. An operation that would read or write a base weight raises ``BaseWeightAccessError``
(merging an adapter, DoRA's weight norm, assigning ``weight.data``) instead of computing on
nothing. Two kinds of use are served anyway:

- The bias may be read: the forward product of a zero row is the bias, exactly, so any client can
  read it anyway, and methods that compute with it (BOFT scales ``result - bias``) need it. Its
  placeholder fetches it from the executor at the first operation that reads it.
- A weight derived from ``W`` and used only in ``F.linear`` is computed without ``W``, from the
  layer's own product: ``W·H`` (HRA: ``F.linear(x, W·H, b)`` is the layer's product of ``x·Hᵀ``),
  ``W + Δ`` (ShiRA: the layer's product plus ``x·Δᵀ``), ``W`` with some rows replaced (peft's
  trainable tokens on a tied lm_head: those output columns computed here). The derived weight is a
  placeholder too, remembering how it was derived (:class:`Derivation`); anything else done with it
  is refused.
- ``x @ W`` of a weight in ``[in, out]`` form (Conv1D's; a transposed MoE expert's, plus its LoRA
  terms) is the layer's product too, when the layer has no bias (``client/experts.py``).

And :class:`DeviceProbe`: the empty frozen Parameter a VirtLayer holds so that code walking a
model's parameters finds one, refusing to be made trainable; a biased layer's :class:`BiasProbe`
stands for its bias, and made trainable it becomes the bias, a parameter of the client (as the
bias placeholder does).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._pytree import tree_map_only

from symbiosis.errors import BaseWeightAccessError

if TYPE_CHECKING:
    from symbiosis.client.virt import _VirtLayerMixin

WHY = (
    "its weights live only in the base executor, which serves forward/backward products but never "
    "ships weights to clients. Operations that read or write base weights (merge_and_unload, "
    "merge_adapter, DoRA's weight norm, weight surgery) are not possible on a split model; keep "
    "adapters unmerged, or merge on a monolithic copy of the model"
)


@dataclasses.dataclass(frozen=True)
class Derivation:
    """A weight derived from a layer's ``W`` (its ``[out, in]`` form; ``[in, out]`` for a transposed
    expert's, which is only ever added to): ``W·right + Σ added``, then the rows of ``replaced``
    ((index, rows) pairs) written over it, in that order."""

    right: torch.Tensor | None = None
    added: tuple[torch.Tensor | LowRank, ...] = ()
    replaced: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()


_NOT_DERIVED = Derivation()


@dataclasses.dataclass(frozen=True)
class LowRank:
    """An added term ``α·L·R`` kept as its factors (peft's LoRA on MoE experts folds ``W + α·L·R``
    into one ``baddbmm``): its product with rows costs their rank, not the weight's size."""

    left: torch.Tensor
    right: torch.Tensor
    alpha: float = 1.0


def times_added(x: torch.Tensor, delta, layout: str) -> torch.Tensor:
    """``x·Δᵀ`` for an added ``Δ`` in ``[out, in]`` form (``layout`` "out_in"), ``x·Δ`` in ``[in, out]``
    form ("in_out"); ``Δ`` dense, sparse or :class:`LowRank`."""
    if isinstance(delta, LowRank):
        left, right = delta.left.to(x.dtype), delta.right.to(x.dtype)
        product = F.linear(F.linear(x, right), left) if layout == "out_in" else (x @ left) @ right
        return product * delta.alpha
    delta = (delta.to_dense() if delta.is_sparse else delta).to(x.dtype)
    return F.linear(x, delta) if layout == "out_in" else x @ delta


class BaseWeightPlaceholder(torch.Tensor):
    """Shape, dtype and device of a base-layer tensor, without its data."""

    @staticmethod
    def __new__(
        cls,
        shape: tuple[int, ...],
        *,
        dtype: torch.dtype,
        device: torch.device,
        name: str,
        read: Callable[[], torch.Tensor] | None = None,
        layer: _VirtLayerMixin | None = None,
        derivation: Derivation | None = None,
        make_trainable: Callable[[], torch.Tensor] | None = None,
    ):
        """``read``: where the values come from when an operation reads them (the bias); None: nowhere.
        ``layer``: the VirtLayer whose weight this is; ``derivation``: how this weight was derived
        from that layer's (None: it is the layer's own). ``make_trainable``: what making it trainable
        does instead of being refused (the bias: becomes a client parameter, which it returns)."""
        placeholder = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        placeholder.base_tensor_name = name
        placeholder._read = read
        placeholder._values = None  # what ``read`` returned, on this placeholder's device and dtype
        placeholder._layer = layer
        placeholder._derivation = derivation
        placeholder._make_trainable = make_trainable
        placeholder._stale = False  # changed in place (``add_``): its successor holds the change
        return placeholder

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """Derived weights (module docstring) are made and used here; making a placeholder trainable
        or assigning its ``.data`` is refused. Anything else goes on to ``__torch_dispatch__``:
        computed on a bias's values, else refused. A bias made trainable (peft's ``bias="lora_only"``)
        becomes a parameter of the client (``VirtLayer.bias`` from then on)."""
        kwargs = kwargs or {}
        if _makes_trainable(func, args, kwargs):
            make_trainable = args[0]._make_trainable
            if make_trainable is None:
                raise BaseWeightAccessError(not_trainable(args[0].base_tensor_name))
            trained = make_trainable()
            return trained if func is torch.Tensor.requires_grad_ else None
        if func == _SET_DATA:
            raise BaseWeightAccessError(
                f"cannot assign the data of base-layer tensor {args[0].base_tensor_name!r}: {WHY}"
            )
        stale = next((a for a in (*args, *kwargs.values()) if _is_stale(a)), None)
        if stale is not None:
            raise BaseWeightAccessError(
                f"a weight derived from base-layer tensor {stale.base_tensor_name!r} was changed in place (add_): "
                "only the result of that change can be used (``w += delta`` binds it), not the weight before it"
            )
        handler = _DERIVED_WEIGHT_OPS.get(func)
        if handler is not None and _takes(handler, args, kwargs):
            result = handler(*args, **kwargs)
            if result is not None:
                return result
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.set_.source_Tensor and len(args) == 2 and args[0] is args[1]:
            return args[0]  # ``W.set_(W)``: nothing (torch's parametrize does it; set_ skips __torch_function__)
        placeholders: list[BaseWeightPlaceholder] = []
        tree_map_only(cls, placeholders.append, (args, kwargs or {}))
        unreadable = [p for p in placeholders if p._read is None]
        if unreadable or _writes_or_aliases(func, args, kwargs or {}):
            name = (unreadable or placeholders)[0].base_tensor_name
            layer = name.rsplit(".", 1)[0]
            raise BaseWeightAccessError(
                f"{func.__name__} on base-layer tensor {name!r} is not possible: {WHY}. (Where the model's own "
                f"code reads it, keep such layers in the client: client_layers=['*.{layer.rsplit('.', 1)[-1]}'])"
            )
        # A functional op on readable tensors: computed on their values (its result is a new tensor,
        # so nothing can write into the values kept here).
        args, kwargs = tree_map_only(cls, cls.values, (args, kwargs or {}))
        return func(*args, **kwargs)

    def values(self) -> torch.Tensor:
        """The tensor's values (fetched once); only for a placeholder given ``read``."""
        if self._values is None:
            self._values = self._read().to(device=self.device, dtype=self.dtype)
        return self._values

    def __repr__(self) -> str:
        derived = ", derived" if self._derivation is not None else ""
        return f"BaseWeightPlaceholder({self.base_tensor_name}, shape={tuple(self.shape)}, dtype={self.dtype}{derived})"

    def __reduce_ex__(self, protocol):
        raise BaseWeightAccessError(f"cannot serialize base-layer tensor {self.base_tensor_name!r}: {WHY}")

    def __deepcopy__(self, memo):
        return self  # no data to copy; a copied model shares the same placeholder


_SET_DATA = torch.Tensor.data.__set__  # (a fresh method-wrapper each time; they compare equal)
_GET_DATA = torch.Tensor.data.__get__
_SET_REQUIRES_GRAD = torch.Tensor.requires_grad.__set__


_signature = functools.cache(inspect.signature)


def _takes(handler, args: tuple, kwargs: dict) -> bool:
    """Whether ``handler`` takes these arguments (an op called with a keyword for its first, say):
    if not, the op goes on as if it had no handler (refused)."""
    try:
        _signature(handler).bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def _is_stale(value) -> bool:
    return isinstance(value, BaseWeightPlaceholder) and value._stale


def _derivable(weight) -> bool:
    """A weight of a VirtLayer in ``[out, in]`` form (nn.Linear's), or one derived from it, still current."""
    return (
        isinstance(weight, BaseWeightPlaceholder)
        and weight._layer is not None
        and weight._layer._weight_layout == "out_in"
        and not weight._stale
    )


def _derived(weight: BaseWeightPlaceholder, dtype: torch.dtype | None = None, **changes) -> BaseWeightPlaceholder:
    """A new placeholder for ``weight`` derived further (``changes`` to its Derivation), or cast."""
    return BaseWeightPlaceholder(
        tuple(weight.shape),
        dtype=dtype or weight.dtype,
        device=weight.device,
        name=weight.base_tensor_name,
        layer=weight._layer,
        derivation=dataclasses.replace(_derivation_of(weight), **changes),
    )


def _derivation_of(weight: BaseWeightPlaceholder) -> Derivation:
    return weight._derivation or _NOT_DERIVED


def _plain(tensor, shape) -> bool:
    return isinstance(tensor, torch.Tensor) and not isinstance(tensor, BaseWeightPlaceholder) and tensor.shape == shape


def _data(weight):
    """``weight.data``, ``weight.detach()``: the weight itself (a placeholder has nothing to detach;
    any write into it is refused)."""
    return weight if _derivable(weight) else None


def _clone(weight, *, memory_format=None):
    """``weight.clone()``: a new placeholder, derived as this one is (a later in-place change, refused
    on the layer's own weight, is allowed on a clone)."""
    return _derived(weight) if _derivable(weight) else None


def _cast_with(func):
    """``weight.to(dtype)`` (``.float()``, ...): the same weight in another dtype, as a derived one
    (HRA casts ``W`` to its adapter's float32), in a dtype rows can travel in and on the same
    device. (Its products are still the executor's, in the executor's dtype.)"""

    def cast(weight, *args, **kwargs):
        if not _derivable(weight):
            return None
        target = func(torch.empty(0, dtype=weight.dtype, device=weight.device), *args, **kwargs)
        if target.device != weight.device or target.dtype not in _ROW_DTYPES:
            return None
        if target.dtype == weight.dtype and not kwargs.get("copy", False):
            return weight  # (as Tensor.to: the tensor itself)
        return _derived(weight, dtype=target.dtype)

    return cast


_ROW_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _times(weight, right, **other):
    """``W·H`` (``torch.mm``, ``@``) for an ``[in, in]`` matrix ``H``, on a weight not derived yet;
    or ``A·W`` (``right`` the layer's own weight), computed at once (``_left_times``); or ``x·W``
    for a weight in ``[in, out]`` form (Conv1D's), the layer's product (``_input_times``)."""
    if not other and not isinstance(weight, BaseWeightPlaceholder) and _derivable(right):
        return _left_times(weight, right)
    if not other and not isinstance(weight, BaseWeightPlaceholder) and _in_out_weight(right):
        return _input_times(weight, right)
    if other or not _derivable(weight) or not _plain(right, torch.Size((weight.shape[1], weight.shape[1]))):
        return None
    derivation = _derivation_of(weight)
    if derivation.right is not None or derivation.added or derivation.replaced:
        return None
    return _derived(weight, right=right.clone())  # (as W·H would be: later changes to H do not reach it)


def _in_out_weight(weight) -> bool:
    """The weight of a VirtLayer in ``[in, out]`` form (Conv1D's; a transposed expert's), or that
    weight plus added terms (LoRA on transposed experts)."""
    return (
        isinstance(weight, BaseWeightPlaceholder)
        and weight._layer is not None
        and weight._layer._weight_layout == "in_out"
        and not weight._stale
        and _derivation_of(weight).right is None
        and not _derivation_of(weight).replaced
    )


def _input_times(x, weight):
    """``x·W`` of an ``[in, out]`` weight: the layer's product (when the layer has no bias: its
    product would add it), plus ``x·Δ`` for each ``Δ`` added. As ``F.linear`` of the layer's weight,
    through its ``forward``."""
    layer = weight._layer
    autocast = torch.is_autocast_enabled(x.device.type)
    if layer._has_bias or not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != weight.shape[0]:
        return None
    if not autocast and x.dtype != weight.dtype:
        return None  # (matmul refuses mixed dtypes too)
    out = layer.forward(x)
    for delta in _derivation_of(weight).added:
        out = out + times_added(x.to(out.dtype), delta, "in_out")
    return out if autocast else out.to(weight.dtype)


def _left_times(rows, weight):
    """``A·W`` for ``[k, out]`` rows ``A`` without a gradient: the executor's backward product of
    ``A`` (DEFT's init: ``R = rightᵀ·W``). Exact as any product of ``W``; the rows, the adapter's
    own values, carry nothing of the client's data."""
    if weight._derivation is not None or not _plain(rows, rows.shape) or rows.dim() != 2:
        return None
    if rows.shape[1] != weight.shape[0] or rows.dtype != weight.dtype:
        return None
    if rows.requires_grad and torch.is_grad_enabled():
        return None  # (A's gradient, G·Wᵀ, is a forward product less the bias: not done here)
    return weight._layer._rows_times_weight(rows.to(weight.device)).to(rows.device)


def _plus(weight, other, *, alpha=1, **unknown):
    """``W + Δ`` for a tensor ``Δ`` of the weight's shape (dense or sparse), before any row is replaced
    (not with ``out=``: that writes into a tensor)."""
    if isinstance(other, BaseWeightPlaceholder) and not isinstance(weight, BaseWeightPlaceholder):
        if alpha != 1:
            return None  # (Δ + α·W: not a weight derived from W as these are)
        weight, other = other, weight  # Δ + W
    if unknown or not _derivable(weight) or not _plain(other, weight.shape) or _derivation_of(weight).replaced:
        return None
    delta = other.clone() if alpha == 1 else other * alpha  # (a copy: later changes to Δ do not reach it)
    dtype = torch.promote_types(weight.dtype, delta.dtype)
    return _derived(weight, dtype=dtype, added=(*_derivation_of(weight).added, delta))


def _plus_in_place(weight, other, *, alpha=1, **unknown):
    """``W += Δ`` (``add_``) on a derived weight, never the layer's own: the change goes into a new
    placeholder (the result, which ``+=`` binds), and this one is stale from now on, refused by
    every use, so code that kept a name for it cannot silently use it without the change."""
    if not isinstance(weight, BaseWeightPlaceholder) or weight._derivation is None:
        return None
    result = _plus(weight, other, alpha=alpha, **unknown)
    if result is not None:
        weight._stale = True
    return result


def _rows_replaced(weight, dim, index, source):
    """``weight.index_copy(dim, index, source)``: those rows replaced."""
    if not _derivable(weight) or dim not in (0, -weight.dim()):
        return None
    return _derived(weight, replaced=(*_derivation_of(weight).replaced, (index.clone(), source.clone())))


def _linear(input, weight, bias=None):  # noqa: A002 (F.linear's names)
    """``F.linear(x, W, b)`` of the layer's weight, or of one derived from it, from the layer's
    product, ``b`` being the layer's own bias (or a cast of it; or both None): ``layer(x·Hᵀ)``
    (``= x·(W·H)ᵀ + b``), plus ``x·Δᵀ`` for each ``Δ`` added, then the replaced rows' output
    columns computed here (exact: the other columns never read a replaced row, and autograd sends
    each column's gradient where it came from). Equal to the monolithic product up to the order of
    its sums (in float32; in bf16, the monolithic model rounds ``W·H`` or ``W + Δ`` first). The
    layer's ``forward``, not its ``__call__``: ``F.linear`` runs no hook of the base layer.

    A layer whose bias is trained on the client (peft's ``bias="all"``): its product without a bias
    (``layer.product_forward``) plus the ``b`` given -- the layer's trained bias, or a function of
    it -- so that ``b`` is added, and given its gradient, once (``layer.forward`` adds the trained
    bias itself)."""
    if not _derivable(weight) or not _is_the_layers_bias(bias, weight._layer):
        return None
    layer, derivation = weight._layer, _derivation_of(weight)
    autocast = torch.is_autocast_enabled(input.device.type)
    if derivation.replaced and layer._has_bias:  # (a replaced row's column would need its own bias entry)
        return None
    if not autocast and input.dtype != weight.dtype:
        return None  # (F.linear refuses mixed dtypes too)
    trained = layer.trained_bias()
    rows = input if derivation.right is None else F.linear(input, derivation.right.to(input.dtype))
    out = layer.forward(rows) if trained is None else layer.product_forward(rows)
    for delta in derivation.added:
        out = out + times_added(input.to(out.dtype), delta, "out_in")
    for index, rows in derivation.replaced:
        out = out.index_copy(-1, index.to(out.device), F.linear(input.to(out.dtype), rows.to(out.dtype)))
    if trained is not None:  # (the product alone: the bias given is added here, once, with its gradient)
        out = out + (bias.values() if isinstance(bias, BaseWeightPlaceholder) else bias).to(out.dtype)
    elif bias is not None and not isinstance(bias, BaseWeightPlaceholder):
        if bias.requires_grad:
            out = out + (bias - bias.detach())  # (zero, exactly: the bias's gradient, where it came from)
    return out if autocast else out.to(weight.dtype)


def _is_the_layers_bias(bias, layer) -> bool:
    """Whether ``bias`` is the layer's bias placeholder, or its values (in some dtype, perhaps a
    function of trainable tensors, as ``b * s`` at ``s = 1``) -- the trained bias's values where the
    client trains it; or both are None."""
    if not layer._has_bias:
        return bias is None
    if bias is None or isinstance(bias, BaseWeightPlaceholder):
        return bias is layer._bias  # (the served bias, whether or not it is trained)
    values = layer.trained_bias()
    values = layer.served_bias() if values is None else values.detach()
    return bias.shape == values.shape and torch.equal(bias, values.to(bias.device, bias.dtype))


_CASTS = (torch.Tensor.to, torch.Tensor.float, torch.Tensor.bfloat16, torch.Tensor.half)
_DERIVED_WEIGHT_OPS = {
    _GET_DATA: _data,
    torch.Tensor.detach: _data,
    torch.Tensor.clone: _clone,
    torch.clone: _clone,
    torch.mm: _times,
    torch.Tensor.mm: _times,
    torch.matmul: _times,
    torch.Tensor.matmul: _times,
    torch.Tensor.__matmul__: _times,
    torch.add: _plus,
    torch.Tensor.add: _plus,
    torch.Tensor.__add__: _plus,
    torch.Tensor.add_: _plus_in_place,
    torch.Tensor.__iadd__: _plus_in_place,
    torch.Tensor.index_copy: _rows_replaced,
    F.linear: _linear,
    **{cast: _cast_with(cast) for cast in _CASTS},
}


def _writes_or_aliases(func, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` writes into a placeholder or returns a view of one (``add_``, ``out=``,
    ``detach``, ``view``): on a base tensor, a write the executor would never see. Writing a
    placeholder's values into another tensor (``y += bias``) only reads them."""
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None:  # neither written nor aliased by the result
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        values = value if isinstance(value, (list, tuple)) else (value,)
        if any(isinstance(v, BaseWeightPlaceholder) for v in values):
            return True
    return False


def _makes_trainable(func, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` is ``t.requires_grad_()`` or ``t.requires_grad = True`` (with a true value)."""
    if func is torch.Tensor.requires_grad_:
        return bool(args[1] if len(args) > 1 else kwargs.get("requires_grad", True))
    return func == _SET_REQUIRES_GRAD and bool(args[1])


def not_trainable(name: str) -> str:
    return (
        f"base-layer tensor {name!r} cannot be trained: its weights live only in the base executor, which keeps "
        "them frozen and shared by every client. Train an adapter instead (LoRA, IA3, ...; peft's bias='all' or "
        "'lora_only' train the base layers' biases, which the client then holds), or keep the layer on the client "
        "(client_layers=[...])"
    )


class DeviceProbe(nn.Parameter):
    """A VirtLayer's empty frozen Parameter (``_VirtLayerMixin._init_virt`` says why it exists).
    It stands for the layer's weight wherever code walks a model's parameters, so making it
    trainable -- ``model.requires_grad_()`` for full fine-tuning -- is refused: it would train what
    the monolithic model trains there, the base weight, but nothing would change on the executor,
    silently."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if _makes_trainable(func, args, kwargs or {}):
            trained = args[0].made_trainable()
            return trained if func is torch.Tensor.requires_grad_ else None
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def made_trainable(self) -> torch.Tensor:
        """What making it trainable does: refused (a bias probe: the bias becomes the client's)."""
        raise BaseWeightAccessError(not_trainable(self.base_tensor_name))

    def __deepcopy__(self, memo):
        copied = super().__deepcopy__(memo)
        copied.base_tensor_name = self.base_tensor_name
        return copied


class BiasProbe(DeviceProbe):
    """A biased VirtLayer's second empty frozen Parameter, named ``bias``: where code walks a model's
    parameters, it stands for the layer's bias. Made trainable -- peft's ``bias="all"`` makes every
    parameter named ``*.bias`` trainable -- it is not refused: the layer's bias becomes a parameter
    of the client, the served bias's values (``VirtLayer.train_bias``), which takes this probe's
    place, trainable (the weight stays served). ``layer``: a weak reference to that layer (set by
    the layer: again on a copy of it)."""

    layer: weakref.ref | None = None

    def made_trainable(self) -> torch.Tensor:
        layer = self.layer() if self.layer is not None else None
        if layer is None:
            return super().made_trainable()
        return layer.train_bias(requires_grad=True)


def refuses_training(tensor) -> bool:
    """Whether ``tensor`` is a base-layer tensor held as a parameter (a VirtLayer's weight probe, a
    served experts tensor): one that refuses to be made trainable. (Not a bias probe: made trainable,
    it becomes a bias of the client.)"""
    return isinstance(tensor, (DeviceProbe, BaseWeightPlaceholder)) and not isinstance(tensor, BiasProbe)


def refuse_training_before_any_change() -> None:
    """Make ``nn.Module.requires_grad_(True)`` refuse before it changes anything on a module holding
    a base-layer tensor (once per process; ``load_client_model`` calls it).

    Without it, ``requires_grad_`` set the flags one parameter at a time and the refusal came at the
    first base-layer tensor: the client's tensors before it (the embeddings) were left trainable, a
    model half changed. Here those tensors are asked first, and the first of them refuses with its
    own message (an experts tensor's says more), before any flag has changed. On ``nn.Module`` itself,
    not on the split model: ``requires_grad_`` is not forwarded by what wraps the model (peft's
    ``PeftModel`` and tuner, DDP) nor called by a parent on its children -- each walks the
    parameters below it -- so an override on the split model would miss ``peft_model.requires_grad_()``
    and ``model.model.requires_grad_()``. A module without base-layer tensors pays one more walk of
    its parameters, and only for ``requires_grad_(True)``; ``requires_grad_(False)`` is unchanged
    (a base-layer tensor takes it: it is frozen already)."""
    current = nn.Module.requires_grad_
    if getattr(current, "_refuses_base_tensors_first", False):
        return

    @functools.wraps(current)
    def requires_grad_(module: nn.Module, requires_grad: bool = True) -> nn.Module:
        if requires_grad:
            for parameter in module.parameters():
                if refuses_training(parameter) and not parameter.requires_grad:
                    parameter.requires_grad_(True)  # refused: raises, and nothing has changed yet
        return current(module, requires_grad)

    requires_grad_._refuses_base_tensors_first = True
    nn.Module.requires_grad_ = requires_grad_
