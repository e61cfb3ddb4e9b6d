"""``load_client_model``: a `transformers` model whose base layers are served by an executor.

One function does the surgery: build the skeleton (parameters on meta), swap
every base layer for a VirtLayer, read only the client-side tensors from the checkpoint, and
check that the executor serves the same checkpoint. The model code of `transformers` is never
edited, so any architecture made of supported modules works.
"""

from __future__ import annotations

import functools
import logging
import sys
import types
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from symbiosis.checkpoint import (
    Checkpoint,
    base_layer_tensor_names,
    build_skeleton,
    check_client_modules,
    discover_base_layers,
    expert_tensors,
    locate_tensors,
)
from symbiosis.client.experts import serve_experts
from symbiosis.client.fusion import SiblingFusion
from symbiosis.client.placeholders import refuse_training_before_any_change
from symbiosis.client.virt import VirtConv1D, VirtLinear, make_virt_layer
from symbiosis.errors import BaseWeightAccessError, CheckpointError, ConfigurationError, ModelMismatchError
from symbiosis.executor.executor import DTYPES_BY_NAME, parse_device, parse_dtype
from symbiosis.threads import one_thread_for_small_forwards, small_forward_tokens, warn_if_client_spins
from symbiosis.transport.base import ExecutorService, Transport
from symbiosis.transport.inproc import InProcTransport
from symbiosis.transport.security import CurveClientKeys

log = logging.getLogger(__name__)


def open_connection(
    executor: ExecutorService | Transport | str,
    *,
    client_id: str | None = None,
    timeout_s: float = 300.0,
    expected_fingerprint: str | None = None,
    curve: CurveClientKeys | None = None,
) -> Transport:
    """A transport to ``executor``: an executor object (in-process), an address, or a transport."""
    if isinstance(executor, str):
        from symbiosis.transport.schemes import open_transport

        return open_transport(
            executor, client_id=client_id, timeout_s=timeout_s, expected_fingerprint=expected_fingerprint, curve=curve
        )
    if isinstance(executor, ExecutorService):
        from symbiosis.transport.inproc import InProcTransport

        return InProcTransport(executor, client_id=client_id, timeout_s=timeout_s)
    if isinstance(executor, Transport):
        return executor
    raise TypeError(
        "executor must be a BaseExecutor, an address like 'tcp://127.0.0.1:7000', 'ipc:///path' or "
        f"'shm+ipc:///path', or a Transport; got {type(executor).__name__}"
    )


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(value, requires_grad=module._parameters[attr].requires_grad)
    else:
        module._buffers[attr] = value


def load_client_model(
    path: str | Path,
    executor: ExecutorService | Transport | str,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    client_layers: Iterable[str] = (),
    client_id: str | None = None,
    timeout_s: float = 300.0,
    curve: CurveClientKeys | None = None,
    fuse_siblings: bool | None = None,
):
    """Load the checkpoint at ``path`` as a client of ``executor``.

    Returns the class ``AutoModelForCausalLM.from_pretrained(path)`` would return, in eval mode,
    on ``device`` in ``dtype`` (default: the checkpoint's dtype, else float32). Base layers are
    VirtLayers; their weights are never read into this process. ``client_layers`` names base
    layers to keep (with their weights) in the client instead, and modules holding a weight
    matrix that are not linear layers (a Mamba mixer): names or ``fnmatch`` patterns
    (``"*.mixer"``). ``curve``: ``CurveClientKeys`` for an executor address that requires CURVE
    (default: the ``SYMBIOSIS_CURVE_*`` environment).
    ``fuse_siblings``: serve base layers that read the same input (q/k/v, gate/up) with one
    request each time (``client/fusion.py``); results are the same either way. Default (None):
    on for executors in another process, where it saves round trips (decode over ipc +10-14%),
    off in-process, where a call costs ~16 µs and splitting the fused result costs more (-4-8%).
    """
    refuse_training_before_any_change()  # (``model.requires_grad_()``: refused before any flag changes)
    count_served_parameters_in_peft()
    checkpoint = Checkpoint(path)
    config = checkpoint.config
    client_dtype = parse_dtype(dtype) if dtype is not None else _checkpoint_dtype(config)
    if client_dtype not in DTYPES_BY_NAME.values():  # rows travel in it: it failed at the first product
        raise ConfigurationError(f"unsupported client dtype {client_dtype}; use one of {list(DTYPES_BY_NAME)}")
    device = parse_device(device)

    model = build_skeleton(config)
    check_client_modules(model, client_layers)
    all_specs = discover_base_layers(model)
    served_specs = discover_base_layers(model, client_layers)
    served_experts = expert_tensors(model, client_layers)
    fingerprint = checkpoint.fingerprint(all_specs)
    transport = open_connection(
        executor, client_id=client_id, timeout_s=timeout_s, expected_fingerprint=fingerprint, curve=curve
    )
    if transport.fingerprint != fingerprint:
        transport.close()
        raise ModelMismatchError(
            f"the executor serves a different model (fingerprint {transport.fingerprint}) than the "
            f"checkpoint {str(path)!r} (fingerprint {fingerprint}); start the client from the executor's checkpoint "
            "(with the same checkpoint, the two run Symbiosis versions that split it differently: MoE experts are "
            "served since 2026-12-07)"
        )
    # A quantized executor of this checkpoint has its fingerprint (the fingerprint is the
    # checkpoint's): accepted, and said, since its products differ from full precision by the
    # quantization error (transport.quantization; executor/quantized.py).
    quantization = getattr(transport, "quantization", None)
    if quantization:
        log.info("executor serves checkpoint %s with %s-quantized base weights: accepted", fingerprint, quantization)

    # Which tensors the client reads: everything the skeleton holds except served base layers.
    served_names = base_layer_tensor_names(served_specs, served_experts)
    wanted = [name for name in model.state_dict() if name not in served_names and name not in served_experts]
    # Persistent buffers absent from the checkpoint keep the values the model computed.
    buffers = {name for name, _ in model.named_buffers()}
    sources = locate_tensors(checkpoint, model, wanted, optional=buffers)
    tensors = checkpoint.read(sources)

    if fuse_siblings is None:
        fuse_siblings = not isinstance(transport, InProcTransport)
    fusion = SiblingFusion(all_specs, transport, served_specs) if fuse_siblings else None
    expert_layer_ids = {layer_id for tensor in served_experts.values() for layer_id in tensor.layer_ids}
    for layer_id, spec in served_specs.items():
        if layer_id in expert_layer_ids:
            continue  # (below)
        parent_name, _, child = layer_id.rpartition(".")
        parent = model.get_submodule(parent_name)
        original = getattr(parent, child)
        virt = make_virt_layer(original, spec, transport, device=device, dtype=client_dtype)
        virt.fusion = fusion
        setattr(parent, child, virt)
    serve_experts(model, served_experts, served_specs, transport, device=device, dtype=client_dtype)
    for name, tensor in tensors.items():
        _set_tensor(model, name, tensor)
    # A tied lm_head is tied still: the executor serves it from the embedding's stored tensor. The
    # declaration stays, for peft finds by it the layers tied to the embeddings (trainable tokens
    # and LoRA on the embeddings adapt them too; without it they silently did not), but
    # transformers' tie_weights must leave the VirtLayers alone (they take no Parameter).
    model._symbiosis_served_tensors = frozenset(served_names)
    model.tie_weights = types.MethodType(_tie_weights_of_client_tensors, model)  # (a copy's binds the copy)
    model.tie_weights()  # a tied lm_head kept on the client (client_layers) shares the embedding's Parameter
    for target, source in model.all_tied_weights_keys.items():
        # A tied pair is one tensor, counted once: as the client's side, or as the target's if served.
        served = target if target in served_names else source if source in served_names else None
        if served is not None and served.endswith(".weight"):
            layer = model.get_submodule(served_names[served])
            spec = served_specs[layer.layer_id]
            layer.count_base_parameters(layer.base_parameter_count - spec.in_features * spec.out_features)
    model.num_parameters = types.MethodType(_num_parameters_with_served, model)
    model.resize_token_embeddings = types.MethodType(_resize_token_embeddings_unless_served, model)

    still_meta = [name for name, p in model.named_parameters() if p.is_meta]
    if still_meta:
        raise CheckpointError(f"checkpoint {str(path)!r} did not provide client tensors {still_meta[:8]}")
    model.to(device=device, dtype=client_dtype)
    model.eval()
    model.symbiosis_transport = transport
    model.save_pretrained = _refuse_to_save_without_the_base(model)  # PeftModel's saves the adapter alone
    _load_generation_config(model, checkpoint.path)
    if not isinstance(transport, InProcTransport):  # the executor computes in another process
        one_thread_for_small_forwards(model, small_forward_tokens())
        warn_if_client_spins(getattr(transport, "address", None))
    return model


def _tie_weights_of_client_tensors(model, *args, **kwargs) -> None:
    """``model.tie_weights`` without the ties whose target or source is a served base layer's
    tensor (the executor keeps those tied): for the split model's own load, and for the rare
    callers (Trainer on TPU, a checkpoint reload) that tie again."""
    served = model._symbiosis_served_tensors

    def client_side(ties: dict[str, str]) -> dict[str, str]:
        return {target: source for target, source in ties.items() if not served & {target, source}}

    declared, expanded = model._tied_weights_keys, model.all_tied_weights_keys
    model._tied_weights_keys, model.all_tied_weights_keys = client_side(declared or {}), client_side(expanded)
    try:
        type(model).tie_weights(model, *args, **kwargs)
    finally:
        model._tied_weights_keys, model.all_tied_weights_keys = declared, expanded


def served_parameter_count(model: nn.Module) -> int:
    """The frozen parameters the executor holds for ``model``'s layers (``VirtLayer.count_base_parameters``;
    served experts are counted as the parameters they are)."""
    return sum(getattr(m, "base_parameter_count", 0) for m in model.modules())


def _num_parameters_with_served(model, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
    """``num_parameters``, counting the frozen parameters the executor holds as the monolithic
    model's count does."""
    count = type(model).num_parameters(model, only_trainable=only_trainable, exclude_embeddings=exclude_embeddings)
    if only_trainable:
        return count
    return count + served_parameter_count(model)


def count_served_parameters_in_peft() -> None:
    """Make peft's ``get_nb_trainable_parameters`` (what ``print_trainable_parameters`` prints) count
    the parameters the executor holds, as the monolithic model's count does (once per process;
    ``load_client_model`` calls it). peft counts with a loop of its own over the parameters, not
    with ``num_parameters``, and a split model's base layers hold none: its "all params" was the
    client's alone, its percentage trainable several times the monolithic one. On peft's classes,
    as peft's wrappers are made after the split model; only where peft is imported already (a
    client that does not use it is not made to import it: ~1 s): import peft before
    ``load_client_model``, as a script does at its top."""
    peft = sys.modules.get("peft")
    for cls in (getattr(peft, "PeftModel", None), getattr(peft, "PeftMixedModel", None)):
        current = getattr(cls, "get_nb_trainable_parameters", None)
        if current is None or getattr(current, "_counts_served_parameters", False):
            continue

        @functools.wraps(current)
        def get_nb_trainable_parameters(self, _current=current) -> tuple[int, int]:
            trainable, total = _current(self)
            return trainable, total + served_parameter_count(self)

        get_nb_trainable_parameters._counts_served_parameters = True
        cls.get_nb_trainable_parameters = get_nb_trainable_parameters


def _resize_token_embeddings_unless_served(model, *args, **kwargs):
    """``resize_token_embeddings``, refused before it changes anything when the executor serves the
    output layer (transformers resized the embeddings first, then failed on the lm_head, leaving a
    model whose vocabulary sizes disagree)."""
    output = model.get_output_embeddings()
    if isinstance(output, (VirtLinear, VirtConv1D)):
        raise BaseWeightAccessError(
            f"cannot resize the vocabulary of a split model: its output layer {output.layer_id!r} is served by the "
            "base executor from the checkpoint's weights. Resize a monolithic copy and serve that checkpoint, or "
            "keep the output layer on the client (client_layers=[...])"
        )
    return type(model).resize_token_embeddings(model, *args, **kwargs)


def _refuse_to_save_without_the_base(model) -> Callable[..., None]:
    """``save_pretrained`` of a split client: it would write the client's tensors alone, a
    checkpoint that ``from_pretrained`` loads with random base layers after a warning (and so
    would ``Trainer.save_model`` and ``push_to_hub``, which call it). A ``PeftModel`` of the client
    has its own ``save_pretrained``, which writes the adapter alone, as peft does everywhere."""
    name = type(model).__name__

    def save_pretrained(*args, **kwargs) -> None:
        raise BaseWeightAccessError(
            f"save_pretrained on a split {name} would write a checkpoint without its base layers, which live only "
            "in the base executor; save the adapter instead (PeftModel.save_pretrained writes the adapter alone, "
            "and it loads on the monolithic model), or save the monolithic model"
        )

    return save_pretrained


def _checkpoint_dtype(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    # A checkpoint stored in a dtype rows do not travel in (float64) gets the default.
    return dtype if isinstance(dtype, torch.dtype) and dtype in DTYPES_BY_NAME.values() else torch.float32


def _load_generation_config(model, path: Path) -> None:
    if not (path / "generation_config.json").is_file():
        return
    from transformers import GenerationConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.generation_config = GenerationConfig.from_pretrained(path)
