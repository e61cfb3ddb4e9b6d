"""VirtLayers: stand-ins for base layers that send their rows to the executor.

A VirtLayer must look enough like the layer it replaces that `peft` wraps it unchanged — peft
dispatches on ``isinstance(layer, nn.Linear | Conv1D)`` and reads ``in_features``,
``out_features`` and ``weight.device/dtype/shape`` — while holding no weight. Its ``weight`` is
a :class:`BaseWeightPlaceholder`: a tensor with the real shape, device and dtype but no storage,
whose every operation raises ``BaseWeightAccessError``. So code that would read or write real
base weights (merging an adapter, DoRA's weight norm, ``weight.data``) fails loudly instead of
silently computing on a placeholder.

The bias is the exception for reading: a forward product of a zero row is the bias, exactly, so
any client can read it anyway, and methods that compute with it (BOFT scales ``result - bias``)
need it. Its placeholder fetches it from the executor at the first operation that reads it (one
zero row) and computes on those values; writes, views and ``.data`` are refused as for weights.
One use of a weight is computed without it: ``F.linear`` of a weight with some rows replaced
(peft's trainable tokens on a tied lm_head; ``BaseWeightPlaceholder.__torch_function__``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._pytree import tree_map_only

from symbiosis.checkpoint import Conv1D
from symbiosis.errors import BaseWeightAccessError
from symbiosis.ops import frozen_linear
from symbiosis.transport.base import Transport
from symbiosis.vocabulary import LatencyClass, LayerSpec, Op

_WHY = (
    "its weights live only in the base executor, which serves forward/backward products but never "
    "ships weights to clients. Operations that read or write base weights (merge_and_unload, "
    "merge_adapter, DoRA's weight norm, weight surgery) are not possible on a split model; keep "
    "adapters unmerged, or merge on a monolithic copy of the model"
)


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
        replaced: tuple[tuple[torch.Tensor, torch.Tensor], ...] = (),
    ):
        """``read``: where the values come from when an operation reads them (the bias); None: nowhere.
        ``layer``: the VirtLayer whose weight this is; ``replaced``: (index, rows) pairs of an
        ``index_copy`` of its rows (see ``__torch_function__``)."""
        placeholder = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        placeholder.base_tensor_name = name
        placeholder._read = read
        placeholder._values = None  # what ``read`` returned, on this placeholder's device and dtype
        placeholder._layer = layer
        placeholder._replaced = replaced
        return placeholder

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """Two operations on a weight are computed without it: ``W.index_copy(0, index, rows)``
        (some rows replaced) and ``F.linear(x, W)``, as the layer's product with those output
        columns replaced by ``x · rowsᵀ``. That is peft's trainable tokens on an lm_head tied to
        the embeddings (``get_merged_weights``, then ``F.linear``). Making one trainable is
        refused (peft's ``bias="lora_only"``). Anything else goes on to ``__torch_dispatch__``:
        computed on a bias's values, else refused."""
        kwargs = kwargs or {}
        if _makes_trainable(func, args, kwargs):
            raise BaseWeightAccessError(_not_trainable(args[0].base_tensor_name))
        if func is torch.Tensor.index_copy:
            replaced = _rows_replaced(*args, **kwargs)
            if replaced is not None:
                return replaced
        elif func is F.linear:
            product = _linear_of_replaced_rows(*args, **kwargs)
            if product is not None:
                return product
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        placeholders: list[BaseWeightPlaceholder] = []
        tree_map_only(cls, placeholders.append, (args, kwargs or {}))
        unreadable = [p for p in placeholders if p._read is None]
        if unreadable or _writes_or_aliases(func, args, kwargs or {}):
            name = (unreadable or placeholders)[0].base_tensor_name
            raise BaseWeightAccessError(f"{func.__name__} on base-layer tensor {name!r} is not possible: {_WHY}")
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
        return f"BaseWeightPlaceholder({self.base_tensor_name}, shape={tuple(self.shape)}, dtype={self.dtype})"

    def __reduce_ex__(self, protocol):
        raise BaseWeightAccessError(f"cannot serialize base-layer tensor {self.base_tensor_name!r}: {_WHY}")

    def __deepcopy__(self, memo):
        return self  # no data to copy; a copied model shares the same placeholder


def _rows_replaced(weight, dim, index, source) -> BaseWeightPlaceholder | None:
    """``weight.index_copy(dim, index, source)`` of a VirtLayer's weight (or of such a copy) as a
    placeholder that remembers the replaced rows; None for anything else (refused later)."""
    if not isinstance(weight, BaseWeightPlaceholder) or weight._layer is None or dim not in (0, -weight.dim()):
        return None
    return BaseWeightPlaceholder(
        tuple(weight.shape),
        dtype=weight.dtype,
        device=weight.device,
        name=weight.base_tensor_name,
        layer=weight._layer,
        replaced=(*weight._replaced, (index, source)),
    )


def _linear_of_replaced_rows(input, weight, bias=None) -> torch.Tensor | None:  # noqa: A002 (F.linear's names)
    """``F.linear(input, weight)`` for a weight with replaced rows and a layer without a bias: the
    layer's product, the replaced rows' output columns computed here. Exact: the other columns
    never read a replaced row, and autograd sends each column's gradient where it came from."""
    if not isinstance(weight, BaseWeightPlaceholder) or not weight._replaced or bias is not None:
        return None
    layer = weight._layer
    if layer._has_bias or layer._weight_layout != "out_in":
        return None
    out = layer(input)
    for index, rows in weight._replaced:
        out = out.index_copy(-1, index.to(out.device), F.linear(input.to(out.dtype), rows.to(out.dtype)))
    return out


_SET_REQUIRES_GRAD = torch.Tensor.requires_grad.__set__  # (a fresh method-wrapper each time; they compare equal)


def _makes_trainable(func, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` is ``t.requires_grad_()`` or ``t.requires_grad = True`` (with a true value)."""
    if func is torch.Tensor.requires_grad_:
        return bool(args[1] if len(args) > 1 else kwargs.get("requires_grad", True))
    return func == _SET_REQUIRES_GRAD and bool(args[1])


def _not_trainable(name: str) -> str:
    return (
        f"base-layer tensor {name!r} cannot be trained: its weights live only in the base executor, which keeps "
        "them frozen and shared by every client. Train an adapter instead (LoRA, IA3, ...; with peft's bias='none', "
        "as biases of base layers are base weights too), or keep the layer on the client (client_layers=[...])"
    )


class _DeviceProbe(nn.Parameter):
    """A VirtLayer's empty frozen Parameter (``_VirtLayerMixin._init_virt`` says why it exists).
    It stands for the layer's weights wherever code walks a model's parameters, so making it
    trainable -- ``model.requires_grad_()`` for full fine-tuning, peft's ``bias="all"`` (which
    trains every parameter named ``*bias*``) -- is refused: it would train what the monolithic
    model trains there, the base weights, but nothing would change on the executor, silently."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if _makes_trainable(func, args, kwargs or {}):
            raise BaseWeightAccessError(_not_trainable(args[0].base_tensor_name))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def __deepcopy__(self, memo):
        copied = super().__deepcopy__(memo)
        copied.base_tensor_name = self.base_tensor_name
        return copied


#: One C call (~0.15 us) that is False unless some autocast is on: a base layer's every forward asks.
_any_autocast = torch._C._is_any_autocast_enabled


def _writes_or_aliases(func, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` writes into a placeholder or returns a view of one (``add_``, ``out=``,
    ``detach``, ``view``, ``.data``): on a base tensor, a write the executor would never see.
    Writing a placeholder's values into another tensor (``y += bias``) only reads them."""
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None:  # neither written nor aliased by the result
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        values = value if isinstance(value, (list, tuple)) else (value,)
        if any(isinstance(v, BaseWeightPlaceholder) for v in values):
            return True
    return False


class ExecutorLink:
    """One base layer of one client's connection: what the autograd Function calls."""

    def __init__(self, spec: LayerSpec, transport: Transport):
        self.layer_id = spec.layer_id
        self.in_features = spec.in_features
        self.out_features = spec.out_features
        self.transport = transport

    def call(self, op: Op, rows: torch.Tensor, latency_class: LatencyClass) -> torch.Tensor:
        return self.transport.call(self.layer_id, op, rows, latency_class)

    def __deepcopy__(self, memo) -> ExecutorLink:
        return self


#: Kept alive so that its id, a key of ``copy.deepcopy``'s memo (ids are its keys), is no object's
#: being copied: under it, whether this deepcopy copies a whole model (``_VirtLayerMixin.__deepcopy__``),
#: found by the first VirtLayer copied, not by every one.
_WHOLE_MODEL_COPY_SENTINEL = object()
_WHOLE_MODEL_COPY = id(_WHOLE_MODEL_COPY_SENTINEL)


#: The name of a VirtLayer's probe Parameter (``_VirtLayerMixin._init_virt``): ``bias`` on a layer
#: with a bias, so that code finding biases by name (peft's ``bias="all"``) finds it.
_PROBE_NAMES = ("device_probe", "bias")


def _probe_name(has_bias: bool) -> str:
    return _PROBE_NAMES[has_bias]


class _VirtLayerMixin:
    """What both VirtLayer types share; the concrete classes only fix the base class and layout."""

    _weight_layout: str  # "out_in" (nn.Linear) or "in_out" (Conv1D)

    def _init_virt(self, spec: LayerSpec, transport: Transport, device: torch.device, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: that would allocate the weight
        self.layer_id = spec.layer_id
        self.link = ExecutorLink(spec, transport)
        self.fusion = None  # a SiblingFusion shared with this layer's siblings (client/fusion.py)
        self._has_bias = spec.has_bias
        self._set_placeholders(device, dtype)
        # No data, but a Parameter: code that finds a module's device and dtype from its first
        # parameter (``next(attn.parameters())``, peft's adaption prompt) found none in a block of
        # base layers alone (StopIteration). Frozen, empty, moved by ``model.to`` as weights are;
        # not in state dicts, which keep the monolithic model's names. On a layer with a bias it is
        # registered as ``bias`` (the attribute stays the placeholder, a property): peft's
        # ``bias="all"`` trains every parameter named ``*.bias``, so it finds this one, as it finds
        # the monolithic layer's bias, and is refused (_DeviceProbe) instead of training nothing.
        probe = _DeviceProbe(torch.empty(0, device=device, dtype=dtype), requires_grad=False)
        probe.base_tensor_name = f"{spec.layer_id}.{'bias' if spec.has_bias else 'weight'}"
        self._parameters[_probe_name(spec.has_bias)] = probe  # (register_parameter: "bias" is taken)
        self.count_base_parameters(spec.in_features * spec.out_features + (spec.out_features if spec.has_bias else 0))

    def count_base_parameters(self, count: int) -> None:
        """The parameters the executor holds for this layer, for the model's ``num_parameters``
        (``client.surgery``); less a tied weight, counted as the client tensor it is tied to. (Not
        the probe's ``ds_numel``, which peft would count too: it marks a DeepSpeed ZeRO-3
        parameter, and peft then gathers it with deepspeed.)"""
        self.base_parameter_count = count

    def _set_placeholders(self, device: torch.device, dtype: torch.dtype) -> None:
        spec = self.link
        shape = (
            (spec.out_features, spec.in_features)
            if self._weight_layout == "out_in"
            else (spec.in_features, spec.out_features)
        )
        # object.__setattr__: nn.Module would otherwise try to register these as parameters.
        weight = BaseWeightPlaceholder(shape, dtype=dtype, device=device, name=f"{self.layer_id}.weight", layer=self)
        object.__setattr__(self, "_weight", weight)
        bias = (
            BaseWeightPlaceholder(
                (spec.out_features,), dtype=dtype, device=device, name=f"{self.layer_id}.bias", read=self._read_bias
            )
            if self._has_bias
            else None
        )
        object.__setattr__(self, "_bias", bias)

    @torch.compiler.disable  # a call to the executor, as a forward's is (see _forward_untraced)
    def _read_bias(self) -> torch.Tensor:
        """The bias: the forward product of a zero row (0·Wᵀ + b), asked of the executor itself --
        past any link wrapper, whose noise would blur it (the row carries nothing of the client's)."""
        link = self.link
        while not isinstance(link, ExecutorLink):
            link = link.inner  # privacy.NoisyLink
        zero_row = torch.zeros(1, link.in_features, dtype=self._weight.dtype, device=self._weight.device)
        with torch.no_grad():
            return link.call(Op.FORWARD, zero_row, LatencyClass.PREFILL)[0]

    @property
    def weight(self) -> BaseWeightPlaceholder:
        return self._weight

    @property
    def bias(self) -> BaseWeightPlaceholder | None:
        return self._bias

    def __setattr__(self, name: str, value) -> None:
        # nn.Module.__setattr__ would register a Parameter under the name (or fail with a bare
        # KeyError); either way the client would silently stop using the executor's weight.
        if name in ("weight", "bias"):
            raise BaseWeightAccessError(f"cannot assign the {name} of base layer {self.layer_id!r}: {_WHY}")
        super().__setattr__(name, value)

    def __deepcopy__(self, memo: dict):
        """A copy of a whole model copies its VirtLayers: proxies of the same base layers, sharing
        the link (a frozen reference model, say). A base layer copied as part of anything less --
        peft's ``modules_to_save`` of the layer or of a block holding it, LN tuning -- is a copy
        made to be trained: with no weight to train, it would train and save nothing, and the run
        would silently drift from the monolithic one. ``memo`` holds what this deepcopy copied
        before: a whole model's copy went through its ``PreTrainedModel`` first."""
        from transformers import PreTrainedModel  # (loaded already: this layer replaced one of its modules)

        whole = memo.get(_WHOLE_MODEL_COPY)  # the first VirtLayer of this deepcopy looked; the others read it
        if whole is None:
            whole = memo[_WHOLE_MODEL_COPY] = any(isinstance(copied, PreTrainedModel) for copied in memo.values())
        if not whole:
            raise BaseWeightAccessError(
                f"a copy of base layer {self.layer_id!r} outside a copy of the whole model (peft's modules_to_save "
                f"or LN tuning make such copies to train them) is not possible: {_WHY}; adapt it with a method that "
                "keeps the base frozen (LoRA, IA3, ...), or keep the module on the client (client_layers=[...])"
            )
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__getstate__(), memo))  # as the default deepcopy of a Module
        return copied

    @contextlib.contextmanager
    def _probe_hidden(self):
        """The probe out of ``_parameters`` for a while (state dicts leave it out), then back in place."""
        parameters = self._parameters
        kept = dict(parameters)
        del parameters[_probe_name(self._has_bias)]
        try:
            yield
        finally:
            parameters.clear()
            parameters.update(kept)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        with self._probe_hidden():
            super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Not a missing key; and a monolithic state dict's ``bias`` stays an unexpected key, as its
        # ``weight``, instead of a size mismatch with the probe.
        with self._probe_hidden():
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn, recurse: bool = True):
        # model.to(device/dtype) must move the placeholders' metadata like it moves real weights.
        probe = fn(torch.empty(0, device=self._weight.device, dtype=self._weight.dtype))
        self._set_placeholders(probe.device, probe.dtype)
        return nn.Module._apply(self, fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # (a constant to the tracer, ~0.1 us a call otherwise)
            return _forward_untraced(self, x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        # Fusion serves only plain links: a wrapped one (activation noise) must see its own calls.
        fusion = self.fusion if type(self.link) is ExecutorLink else None
        if _any_autocast() and torch.is_autocast_enabled(x.device.type):
            # As nn.Linear's product under autocast: rows in its dtype, the result in it too (so the
            # ops after the layer run in it, as in the monolithic model). The executor multiplies
            # them by weights in its own dtype: bit for bit the monolithic product when it is the
            # autocast dtype (serve --dtype bf16 for bf16 autocast) and siblings are not fused.
            dtype = torch.get_autocast_dtype(x.device.type)
            x = fusion.cast(x, dtype) if fusion is not None else x.to(dtype)
        if fusion is not None:
            return fusion.forward(self.layer_id, x, self.training, self._call_alone)
        return frozen_linear(x, self.link, self.training)

    def _call_alone(self, x: torch.Tensor) -> torch.Tensor:
        return frozen_linear(x, self.link, self.training)

    def extra_repr(self) -> str:
        return (
            f"{self.layer_id!r}, in_features={self.link.in_features}, out_features={self.link.out_features}, "
            f"bias={self._has_bias}, served by the base executor"
        )


#: What ``torch.compile`` sees of a base layer: a graph break. Traced, the call to the executor
#: would be compiled into the client's graph -- an in-process executor's packed-weight product (which
#: inductor cannot lower), a transport's sockets -- and run once at trace time.
_forward_untraced = torch.compiler.disable(_VirtLayerMixin._forward)


class VirtLinear(_VirtLayerMixin, nn.Linear):
    """Stand-in for an ``nn.Linear`` base layer."""

    _weight_layout = "out_in"

    def __init__(self, spec: LayerSpec, transport: Transport, *, device: torch.device, dtype: torch.dtype):
        self._init_virt(spec, transport, device, dtype)
        self.in_features = spec.in_features
        self.out_features = spec.out_features


class VirtConv1D(_VirtLayerMixin, Conv1D):
    """Stand-in for a `transformers` ``Conv1D`` base layer (GPT-2 style, weight stored [in, out])."""

    _weight_layout = "in_out"

    def __init__(self, spec: LayerSpec, transport: Transport, *, device: torch.device, dtype: torch.dtype):
        self._init_virt(spec, transport, device, dtype)
        self.nf = spec.out_features
        self.nx = spec.in_features


def make_virt_layer(original: nn.Module, spec: LayerSpec, transport: Transport, *, device, dtype) -> nn.Module:
    """The VirtLayer type matching ``original``'s type (ordered: Conv1D is checked first)."""
    if isinstance(original, Conv1D):
        return VirtConv1D(spec, transport, device=device, dtype=dtype)
    if isinstance(original, nn.Linear):
        return VirtLinear(spec, transport, device=device, dtype=dtype)
    raise TypeError(f"no VirtLayer for {type(original).__name__}; supported: nn.Linear, transformers Conv1D")
