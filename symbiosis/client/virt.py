"""VirtLayers: stand-ins for base layers that send their rows to the executor.

A VirtLayer must look enough like the layer it replaces that `peft` wraps it unchanged — peft
dispatches on ``isinstance(layer, nn.Linear | Conv1D)`` and reads ``in_features``,
``out_features`` and ``weight.device/dtype/shape`` — while holding no weight. Its ``weight`` is
a :class:`BaseWeightPlaceholder`: a tensor with the real shape, device and dtype but no storage,
whose operations raise ``BaseWeightAccessError``. So code that would read or write real base
weights (merging an adapter, DoRA's weight norm, assigning ``weight.data``) fails loudly instead of
silently computing on a placeholder; a bias can be read, and ``F.linear`` of a weight derived
from ``W`` is computed from the layer's product (``client/placeholders.py`` says which).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from symbiosis.checkpoint import Conv1D
from symbiosis.client.placeholders import WHY, BaseWeightPlaceholder, DeviceProbe
from symbiosis.errors import BaseWeightAccessError
from symbiosis.ops import frozen_linear
from symbiosis.protocol import WIRE_DTYPES
from symbiosis.transport.base import Transport
from symbiosis.vocabulary import LatencyClass, LayerSpec, Op

#: One C call (~0.15 us) that is False unless some autocast is on: a base layer's every forward asks.
_any_autocast = torch._C._is_any_autocast_enabled


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


class _ProbeParameters(dict):
    """A VirtLayer's ``_parameters``, holding its probe only. The probe's slot takes only an empty
    tensor: code that swaps a module's tensors through ``_parameters`` (``torch.func.functional_call``
    with a new bias) would otherwise put a real bias where the layer never reads it, silently."""

    def __init__(self, parameters: dict, probe_key: str = "", layer_id: str = ""):
        super().__init__(parameters)  # (dict's own init: not through __setitem__)
        self.probe_key, self.layer_id = probe_key, layer_id

    def __setitem__(self, key: str, value) -> None:
        if key == self.probe_key and value is not None and value.numel() != 0:
            raise BaseWeightAccessError(f"cannot assign the {key} of base layer {self.layer_id!r}: {WHY}")
        super().__setitem__(key, value)

    def __reduce__(self):  # (copy and pickle: rebuilt through __init__, then its attributes)
        return (type(self), (dict(self),), {"probe_key": self.probe_key, "layer_id": self.layer_id})

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


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
        # The probe: an empty frozen Parameter (``DeviceProbe``) that stands for the layer's weights
        # where code walks a model's parameters. It finds one (peft's adaption prompt reads a block's
        # device and dtype from ``next(block.parameters())``: none in a block of base layers alone,
        # StopIteration), and making it trainable is refused. On a layer with a bias it is named
        # ``bias`` (the attribute stays the placeholder, a property): peft's ``bias="all"`` trains
        # every parameter named ``*.bias``, so it finds this one, as it finds the monolithic layer's
        # bias, and is refused instead of silently training nothing. In the layer itself, not in a
        # child module: peft matches regex ``target_modules`` against every module name, and
        # ``".*proj.*"`` would match a child of a proj. Out of state dicts, which keep the
        # monolithic model's names.
        probe_key = "bias" if spec.has_bias else "device_probe"
        probe = DeviceProbe(torch.empty(0, device=device, dtype=dtype), requires_grad=False)
        probe.base_tensor_name = f"{spec.layer_id}.{'bias' if spec.has_bias else 'weight'}"
        parameters = _ProbeParameters({}, probe_key, spec.layer_id)
        parameters[probe_key] = probe  # (not register_parameter: "bias" is the placeholder's property)
        object.__setattr__(self, "_parameters", parameters)
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
        past any link wrapper (privacy.NoisyLink), whose noise would blur it (the row carries
        nothing of the client's)."""
        link = self.link
        while not isinstance(link, ExecutorLink):
            link = link.inner
        zero_row = torch.zeros(1, link.in_features, dtype=self._weight.dtype, device=self._weight.device)
        with torch.no_grad():
            return link.call(Op.FORWARD, zero_row, LatencyClass.PREFILL)[0]

    @torch.compiler.disable
    def _rows_times_weight(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows · W`` for ``[k, out]`` rows (no gradient): the executor's backward product of them,
        through the layer's link as any of its products (with activation noise where it has some)."""
        with torch.no_grad():
            return self.link.call(Op.BACKWARD, rows, LatencyClass.PREFILL)

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
            raise BaseWeightAccessError(f"cannot assign the {name} of base layer {self.layer_id!r}: {WHY}")
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
                f"or LN tuning make such copies to train them) is not possible: {WHY}; adapt it with a method that "
                "keeps the base frozen (LoRA, IA3, ...), or keep the module on the client (client_layers=[...])"
            )
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__getstate__(), memo))  # as the default deepcopy of a Module
        # Placeholders of its own: derived weights compute through their layer (the copy's link, hooks, mode).
        copied._set_placeholders(self._weight.device, self._weight.dtype)
        return copied

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination.pop(prefix + self._parameters.probe_key, None)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # The probe out of the way: not a missing key, and a monolithic state dict's ``bias`` stays an
        # unexpected key, as its ``weight``, instead of a size mismatch with the probe.
        if self._has_bias and prefix + "bias" in state_dict:
            self._check_bias_is_served(state_dict[prefix + "bias"])
        key = self._parameters.probe_key
        probe = self._parameters.pop(key)
        try:
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        finally:
            self._parameters[key] = probe

    def _check_bias_is_served(self, bias) -> None:
        """A state dict's bias for this layer must be the one the executor serves (rounded to a wire
        dtype at most, as an executor in that dtype serves it): a monolithic model's state dict passes.
        One that differs was trained -- an adapter saved with peft's ``bias="all"`` or
        ``"lora_only"`` loaded as a second adapter (``load_adapter``), where peft does not apply
        that option -- and was dropped as an unexpected key, the split model then computing with
        the base bias while the monolithic one computes with the trained one: silently different."""
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (self.link.out_features,):
            return  # (torch reports a size mismatch, as for any state dict)
        served = self._read_bias()
        value = bias.detach().to(device=served.device)
        if any(
            torch.equal(value.to(dtype).to(served.dtype), served) for dtype in (served.dtype, *WIRE_DTYPES.values())
        ):
            return
        raise BaseWeightAccessError(
            f"the state dict's bias of base layer {self.layer_id!r} differs from the one the executor serves "
            f"(max |difference| {(value.to(served.dtype) - served).abs().max().item():.3g}): it was trained -- "
            "an adapter saved with peft's bias='all' or 'lora_only', or a fine-tuned model. A split model computes "
            "with the executor's bias and cannot take it; train adapters with bias='none', or serve the changed "
            "model from an executor of its own"
        )

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
        return frozen_linear(x, self.link, self.training)  # (not through _call_alone: one call less a layer)

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
