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
import weakref

import torch
from torch import nn

from symbiosis.checkpoint import Conv1D
from symbiosis.client.placeholders import WHY, BaseWeightPlaceholder, BiasProbe, DeviceProbe
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


def _a_bias_for(layer, value) -> bool:
    return isinstance(value, nn.Parameter) and tuple(value.shape) == (layer.link.out_features,)


class _ProductLink:
    """A layer's link whose forward is the product alone, ``x·Wᵀ`` without the bias (``Op.NOISE``):
    for a layer whose bias the client holds. Backward is the layer's own."""

    def __init__(self, inner: ExecutorLink):
        self.inner = inner
        self.layer_id, self.in_features, self.out_features = inner.layer_id, inner.in_features, inner.out_features

    def call(self, op: Op, rows: torch.Tensor, latency_class: LatencyClass) -> torch.Tensor:
        return self.inner.call(Op.NOISE if op is Op.FORWARD else op, rows, latency_class)


#: The key of a VirtLayer's weight probe in its ``_parameters``; its bias's is ``bias``.
WEIGHT_PROBE = "device_probe"


class _ProbeParameters(dict):
    """A VirtLayer's ``_parameters``: its weight probe, first, and on a biased layer its bias (a probe
    while the executor's bias serves; a parameter of the client once trained). The weight probe's
    slot takes only an empty tensor: code that swaps a module's tensors through ``_parameters``
    would otherwise put a real weight where the layer never reads it, silently. The bias's slot
    takes a real one (``torch.func.functional_call`` with a new bias): the layer computes with it."""

    def __init__(self, parameters: dict, layer_id: str = ""):
        super().__init__(parameters)  # (dict's own init: not through __setitem__)
        self.layer_id = layer_id

    def __setitem__(self, key: str, value) -> None:
        if key == WEIGHT_PROBE and value is not None and value.numel() != 0:
            raise BaseWeightAccessError(f"cannot assign the weight of base layer {self.layer_id!r}: {WHY}")
        super().__setitem__(key, value)

    def __reduce__(self):  # (copy and pickle: rebuilt through __init__, then its attributes)
        return (type(self), (dict(self),), {"layer_id": self.layer_id})

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


def _probe(kind: type[DeviceProbe], name: str, device: torch.device, dtype: torch.dtype) -> DeviceProbe:
    probe = kind(torch.empty(0, device=device, dtype=dtype), requires_grad=False)
    probe.base_tensor_name = name
    return probe


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
        # The probes: empty frozen Parameters that stand for the layer's tensors where code walks a
        # model's parameters. The weight's (``DeviceProbe``, first) finds one (peft's adaption prompt
        # reads a block's device and dtype from ``next(block.parameters())``: none in a block of base
        # layers alone, StopIteration), and making it trainable is refused (``model.requires_grad_()``).
        # A biased layer's bias has one named ``bias`` (``BiasProbe``; the attribute is a property):
        # peft's ``bias="all"`` trains every parameter named ``*.bias``, so it finds this one, as it
        # finds the monolithic layer's bias, and made trainable it becomes the bias, a parameter of
        # the client (``train_bias``). In the layer itself, not in a child module: peft matches regex
        # ``target_modules`` against every module name, and ``".*proj.*"`` would match a child of a
        # proj. Out of state dicts, which keep the monolithic model's names.
        parameters = _ProbeParameters({}, spec.layer_id)
        parameters[WEIGHT_PROBE] = _probe(DeviceProbe, f"{spec.layer_id}.weight", device, dtype)
        if spec.has_bias:  # (not register_parameter: "bias" is a property)
            parameters["bias"] = _probe(BiasProbe, f"{spec.layer_id}.bias", device, dtype)
        object.__setattr__(self, "_parameters", parameters)
        self._link_probes()
        self.count_base_parameters(spec.in_features * spec.out_features + (spec.out_features if spec.has_bias else 0))

    def _link_probes(self) -> None:
        """The bias probe's way back to its layer (again on a copy, and after ``_apply``, which may
        swap a parameter for another)."""
        probe = self._parameters.get("bias")
        if type(probe) is BiasProbe:
            probe.layer = weakref.ref(self)

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
                (spec.out_features,),
                dtype=dtype,
                device=device,
                name=f"{self.layer_id}.bias",
                read=self._read_bias,
                make_trainable=self._train_bias_placeholder,
            )
            if self._has_bias
            else None
        )
        object.__setattr__(self, "_bias", bias)

    def _train_bias_placeholder(self) -> nn.Parameter:
        return self.train_bias(requires_grad=True)

    def train_bias(self, requires_grad: bool) -> nn.Parameter:
        """The layer's bias as a parameter of the client, made once: a copy of the served bias (read
        from the executor: the product of a zero row) that takes the bias probe's place, its
        ``requires_grad`` set. What peft's ``bias="all"`` (the probe made trainable) and
        ``"lora_only"`` (the ``bias`` placeholder made trainable) do, and loading a trained bias.
        The weight stays served; the forward asks the executor for ``x·Wᵀ`` and adds this bias
        (``_forward``)."""
        current = self._parameters.get("bias")
        if type(current) is not BiasProbe:  # trained already (or swapped in by functional_call)
            if current.is_leaf:
                current.requires_grad_(requires_grad)
            return current
        bias = nn.Parameter(self.served_bias().clone(), requires_grad=requires_grad)
        self._parameters["bias"] = bias
        self.base_parameter_count -= bias.numel()  # counted as the client's parameter now
        return bias

    def trained_bias(self) -> torch.Tensor | None:
        """The bias the client holds (trained, or given by ``functional_call``); None where the
        executor's serves."""
        bias = self._parameters.get("bias")
        return None if bias is None or type(bias) is BiasProbe else bias

    def served_bias(self) -> torch.Tensor:
        """The executor's bias (read once a placeholder; a placeholder is made anew on a copy and by ``_apply``)."""
        return self._bias.values()

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
    def bias(self) -> BaseWeightPlaceholder | torch.Tensor | None:
        trained = self.trained_bias()
        return self._bias if trained is None else trained

    def __setattr__(self, name: str, value) -> None:
        # nn.Module.__setattr__ would register a Parameter under the name (or fail with a bare
        # KeyError); either way the client would silently stop using the executor's weight. A bias
        # the client holds takes a new tensor of its shape (``load_state_dict(assign=True)``, which
        # peft's ``low_cpu_mem_usage`` loading does, assigns each loaded parameter).
        if name == "bias" and self.trained_bias() is not None and _a_bias_for(self, value):
            self._parameters["bias"] = value
            return
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
        copied._link_probes()  # (a trained bias is the copy's own: copied with its parameters)
        return copied

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # A trained bias is saved under the layer's ``bias`` (peft saves it for bias="all" and
        # "lora_only", as the monolithic layer's); the probes are not.
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for key, value in self._parameters.items():
            if isinstance(value, DeviceProbe):
                destination.pop(prefix + key, None)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A state dict's bias that differs from the served one was trained (an adapter saved with
        # peft's bias="all" or "lora_only", loaded by PeftModel.from_pretrained or load_adapter): the
        # layer's bias becomes the client's, frozen unless made trainable, and takes it. One equal to
        # the served bias (a monolithic model's state dict) leaves the bias served.
        key = prefix + "bias"
        if self._has_bias and key in state_dict and self.trained_bias() is None:
            if not self._is_served_bias(state_dict[key]):
                self.train_bias(requires_grad=False)
        # The probes out of the way: not missing keys, and a monolithic state dict's ``bias`` (where
        # served) stays an unexpected key, as its ``weight``, instead of a size mismatch with a probe.
        parameters = self._parameters
        held = list(parameters.items())
        for name, value in held:
            if isinstance(value, DeviceProbe):
                dict.__delitem__(parameters, name)
        try:
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        finally:
            now = dict(parameters)
            dict.clear(parameters)
            dict.update(parameters, {name: now.get(name, value) for name, value in held})  # (in their order)

    def _is_served_bias(self, bias) -> bool:
        """Whether a state dict's bias for this layer is the one the executor serves (rounded to a wire
        dtype at most, as an executor in that dtype serves it): a monolithic model's state dict's is.
        One of another shape counts as served (torch reports it as an unexpected key, as before)."""
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != tuple(self._bias.shape):
            return True
        served = self.served_bias()
        value = bias.detach().to(device=served.device)
        return any(
            torch.equal(value.to(dtype).to(served.dtype), served) for dtype in (served.dtype, *WIRE_DTYPES.values())
        )

    def _apply(self, fn, recurse: bool = True):
        # model.to(device/dtype) must move the placeholders' metadata like it moves real weights (a
        # trained bias moves as any parameter; the served one is read again, in the new dtype).
        probe = fn(torch.empty(0, device=self._weight.device, dtype=self._weight.dtype))
        self._set_placeholders(probe.device, probe.dtype)
        result = nn.Module._apply(self, fn, recurse)
        self._link_probes()
        return result

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # (a constant to the tracer, ~0.1 us a call otherwise)
            return _forward_untraced(self, x)
        return self._forward(x)

    def product_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x·Wᵀ`` without a bias, for a layer whose bias the client holds (``forward`` adds it):
        what ``F.linear`` of a weight derived from this one adds its bias to (``placeholders._linear``)."""
        if torch.compiler.is_compiling():
            return _forward_untraced(self, x, False)
        return self._forward(x, False)

    def _forward(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        # Fusion serves only plain links: a wrapped one (activation noise) must see its own calls.
        fusion = self.fusion if type(self.link) is ExecutorLink else None
        if _any_autocast() and torch.is_autocast_enabled(x.device.type):
            # As nn.Linear's product under autocast: rows in its dtype, the result in it too (so the
            # ops after the layer run in it, as in the monolithic model). The executor multiplies
            # them by weights in its own dtype: bit for bit the monolithic product when it is the
            # autocast dtype (serve --dtype bf16 for bf16 autocast) and siblings are not fused.
            dtype = torch.get_autocast_dtype(x.device.type)
            x = fusion.cast(x, dtype) if fusion is not None else x.to(dtype)
        # A bias the client holds (trained, or given by functional_call; one dict lookup where the
        # executor's bias serves): the executor's product without its bias (Op.NOISE, ``x·Wᵀ``) plus
        # the client's, as nn.Linear adds it -- the served bias added and taken away again would round
        # twice. Not fused (a group's request holds its members' served biases). A wrapped link
        # (activation noise) must see its forward rows: there the served bias's change is added.
        bias = self._parameters.get("bias")
        if bias is not None and type(bias) is not BiasProbe:
            if type(self.link) is ExecutorLink:
                out = frozen_linear(x, _ProductLink(self.link), self.training)
                return out + bias.to(out.dtype) if with_bias else out
            out = frozen_linear(x, self.link, self.training)
            served = self.served_bias().to(bias.device, bias.dtype)
            return out + ((bias - served) if with_bias else -served).to(out.dtype)
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
