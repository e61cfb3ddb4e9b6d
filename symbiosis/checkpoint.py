"""Which modules are base layers, and where their tensors live in a checkpoint folder.

Both sides of the split start from the same *skeleton*: the `transformers` model built from the
checkpoint's config with every parameter on the meta device (no memory) but buffers real, so
computed buffers such as rotary ``inv_freq`` are correct. From the skeleton we

- discover the base layers (every ``nn.Linear`` and ``transformers`` ``Conv1D``, ``lm_head``
  included), keyed by qualified module name, and each expert's matrix of MoE experts
  (``served_experts``: ``...experts.gate_up_proj.3``);
- map each module tensor to the checkpoint key that holds it, using `transformers`' own loading
  rules (its key renamings and converters, base-model prefix handling and tied-weight
  declarations) rather than string guesses, so the executor can read only the base layers and
  the client only the rest.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import hashlib
import json
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from symbiosis.errors import CheckpointError, UnsupportedModuleError
from symbiosis.vocabulary import LayerSpec

try:  # transformers >= 5 moved Conv1D's home more than once; import it where it is.
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover
    from transformers.modeling_utils import Conv1D  # type: ignore[no-redef]

CLIENT_MODULE_NOTE = (
    "Symbiosis serves nn.Linear and transformers Conv1D layers and transformers' standard MoE experts from the "
    "executor; other modules may stay in the client only if they hold embeddings or 1-D parameters (norms, "
    "biases, scales)"
)


@dataclass(frozen=True)
class TensorSource:
    """Where one module tensor is stored: a safetensors file and the key inside it."""

    file: Path
    key: str


@dataclass(frozen=True)
class ConvertedSource:
    """A module tensor that the checkpoint stores as several (an MoE's experts as one 3-D tensor in
    `transformers` 5 and one matrix per expert in the checkpoint, as ``save_pretrained`` writes
    them): its parts, in `transformers`' order, and the `transformers` converter that joins them."""

    name: str
    converter: object  # transformers.core_model_loading.WeightConverter (a template: copied per use)
    parts: tuple[tuple[str, TensorSource], ...]  # (the converter's source pattern, where the part is)


#: Config entries that name where a checkpoint was loaded from, not what it is (``fingerprint``).
PATH_DEPENDENT_CONFIG_KEYS = frozenset({"_name_or_path"})


def adapter_hint(folder: Path) -> str:
    """For a folder given as a base model that holds a PEFT adapter instead: what to pass."""
    config = folder / "adapter_config.json"
    if not config.is_file():
        return ""
    try:
        base = json.loads(config.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    made_for = f" (it was made for {base!r})" if isinstance(base, str) and base else ""
    return f"; it holds a PEFT adapter (adapter_config.json): pass the base model's checkpoint{made_for}"


class Checkpoint:
    """A local Hugging Face checkpoint folder: ``config.json`` plus ``*.safetensors``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint folder {str(self.path)!r} does not exist or is not a folder")
        if not (self.path / "config.json").is_file():
            raise CheckpointError(f"checkpoint folder {str(self.path)!r} has no config.json{adapter_hint(self.path)}")
        self.files = self._find_weight_files()

    def _find_weight_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                shard_names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError) as exc:
                raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from exc
            files = [self.path / name for name in shard_names]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"checkpoint {str(self.path)!r} is missing shard files {missing}")
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            other = [p.name for p in self.path.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".ckpt"}]
            hint = f" (found {other}; convert them to safetensors first)" if other else ""
            raise CheckpointError(f"checkpoint folder {str(self.path)!r} has no *.safetensors weights{hint}")
        return files

    @cached_property
    def config(self):
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(self.path, local_files_only=True)
        except Exception as exc:  # transformers raises many types for a bad config
            raise CheckpointError(f"cannot read config.json of {str(self.path)!r}: {exc}") from exc

    @cached_property
    def key_locations(self) -> dict[str, Path]:
        """Every tensor key stored in the checkpoint, with the file holding it."""
        locations: dict[str, Path] = {}
        for file in self.files:
            try:
                with safe_open(file, framework="pt") as handle:
                    for key in handle.keys():
                        locations[key] = file
            except Exception as exc:
                raise CheckpointError(f"cannot read safetensors file {str(file)!r}: {exc}") from exc
        return locations

    def read(self, sources: Mapping[str, TensorSource | ConvertedSource]) -> dict[str, torch.Tensor]:
        """Read only the named tensors (``name -> source``); each file is opened once."""
        return dict(self.iter_tensors(sources))

    def iter_tensors(self, sources: Mapping[str, TensorSource | ConvertedSource]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for the named tensors, one at a time: a caller that keeps only a
        converted form (a quantized executor) never holds them all at once. Each tensor is read
        through its own opening of the file: an open handle maps the whole file, and every page
        read through it counts in the process's resident memory until the handle closes (a 4 GiB
        checkpoint read through one handle added 4 GiB to the executor's peak)."""
        for name, source in sources.items():
            if isinstance(source, ConvertedSource):
                yield name, _convert(source, self.config)
                continue
            with safe_open(source.file, framework="pt") as handle:
                yield name, handle.get_tensor(source.key)

    def fingerprint(self, specs: Mapping[str, LayerSpec]) -> str:
        """Identity of the checkpoint as the executor sees it, compared when a client connects.

        Hashes the config, the base-layer shapes, each safetensors header (names, dtypes, shapes,
        offsets) and the first 4 KiB of tensor data: cheap (no full read), and two checkpoints of
        one architecture with different weights still differ because their data bytes do.
        """
        digest = hashlib.sha256()
        # Not where the folder is: ``_name_or_path`` is the path as typed, and one checkpoint named
        # by another path (absolute, relative from elsewhere, a copy, another host) is the same.
        config = {k: v for k, v in self.config.to_dict().items() if k not in PATH_DEPENDENT_CONFIG_KEYS}
        digest.update(json.dumps(config, sort_keys=True, default=str).encode())
        for layer_id in sorted(specs):
            spec = specs[layer_id]
            digest.update(f"{layer_id}:{spec.in_features}:{spec.out_features}:{spec.has_bias};".encode())
        for file in self.files:
            with open(file, "rb") as handle:
                header_len = int.from_bytes(handle.read(8), "little")
                digest.update(handle.read(header_len))
                digest.update(handle.read(4096))  # a sample of the weights themselves
        return digest.hexdigest()[:32]


#: Two threads inside ``init_empty_weights`` at once can leave ``nn.Module.register_parameter``
#: patched for good (each restores what it found), and every model built later gets meta
#: parameters: found running the ranks of a sharded executor as threads (tests/test_sharded.py).
_SKELETON_LOCK = threading.Lock()


def build_skeleton(config) -> nn.Module:
    """The model class `AutoModelForCausalLM` would build, with parameters on meta, buffers real.

    ``include_buffers=False`` matters: buffers such as rotary ``inv_freq`` are computed in
    ``__init__`` and are not in the checkpoint, so they must be built on a real device.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    try:  # one at a time: init_empty_weights patches nn.Module for the whole process while it runs
        with _SKELETON_LOCK, init_empty_weights(include_buffers=False), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoModelForCausalLM.from_config(config)
    except ValueError as exc:
        raise CheckpointError(f"transformers cannot build a causal LM from this config: {exc}") from exc


def kept_modules(model: nn.Module, client_layers: Iterable[str] | str | None = ()) -> set[str]:
    """The modules ``client_layers`` names: qualified names, or ``fnmatch`` patterns (``"*.mixer"``).
    Each entry must name a base layer or a module holding a weight matrix: keeping any other module
    (``"*.self_attn"``) would keep nothing, its layers being modules of their own."""
    if isinstance(client_layers, str):
        client_layers = [client_layers]
    modules = dict(model.named_modules())
    keepable = [name for name, module in modules.items() if is_base_layer(module) or _first_matrix(module) is not None]
    kept: set[str] = set()
    unknown, empty = [], []
    for entry in client_layers or ():  # (None: none, as the default)
        named = _matching(modules, entry)
        matched = _matching(keepable, entry)
        if not named:
            unknown.append(entry)
        elif not matched:
            empty.append(entry)
        kept.update(matched)
    if unknown:
        raise CheckpointError(f"client_layers names modules the model does not have: {sorted(unknown)}")
    if empty:
        raise CheckpointError(
            f"client_layers entries {sorted(empty)} name modules that hold no weights of their own: keeping a "
            "module keeps its own tensors, not its layers'; name the layers (e.g. '*.self_attn.*_proj')"
        )
    return kept


def _matching(names: Iterable[str], entry: str) -> list[str]:
    if any(c in entry for c in "*?["):
        return [name for name in names if fnmatch.fnmatchcase(name, entry)]  # (fnmatch.filter would normcase)
    return [name for name in names if name == entry]


#: ``nn.Linear`` subclasses whose forward is another spelling of nn.Linear's.
_LINEAR_EQUIVALENTS = {"FalconLinear"}


def is_base_layer(module: nn.Module) -> bool:
    """An ``nn.Linear`` or ``Conv1D`` computing nothing but its product: its class keeps the
    forward, or spells it otherwise (``_LINEAR_EQUIVALENTS``). A subclass with a forward of its own
    (an MoE router returning its top-k) is not one: a VirtLayer would return the product alone."""
    if isinstance(module, nn.Linear):
        return type(module).forward is nn.Linear.forward or type(module).__name__ in _LINEAR_EQUIVALENTS
    return isinstance(module, Conv1D) and type(module).forward is Conv1D.forward


def _first_matrix(module: nn.Module) -> torch.Tensor | None:
    """The first parameter of ``module`` itself (not its children's) with two or more dimensions."""
    return next((p for p in module.parameters(recurse=False) if p.dim() >= 2), None)


#: Experts modules that are not `transformers`' standard ones but use their tensors only as
#: ``torch.bmm(x.view(experts, -1, in), W)``, ``W`` ``[experts, in, out]``: every expert given
#: every row, scaled by its router weight (zero where the router did not choose it).
_EVERY_ROW_EXPERTS = {"Llama4TextExperts"}


def every_row_experts(module: nn.Module) -> bool:
    """Whether ``module`` is one of ``_EVERY_ROW_EXPERTS`` (llama4's), or a subclass (torch's
    parametrizations, peft's LoRA on experts, make one): served, its own forward kept
    (``client/experts.py``: ``ExpertWeights.every_row_product``)."""
    return any(cls.__name__ in _EVERY_ROW_EXPERTS for cls in type(module).__mro__)


def served_experts(module: nn.Module) -> bool:
    """Whether ``module`` is an MoE experts module the executor serves, one base layer per expert
    and tensor: `transformers`' standard experts (``use_experts_implementation``), ``[experts, out,
    in]`` tensors or ``[experts, in, out]`` transposed ones (gpt-oss), whose grouped forward a
    split model runs (``client/experts.py``), and llama4's (``every_row_experts``, transposed).
    Their 2-D tensors (per-expert biases) stay on the client. Not experts with a norm after each
    expert (no model to test them on: muse_spark has no causal-LM class), kept with
    ``client_layers``."""
    standard = getattr(module, "is_transposed", None) in (False, True) and hasattr(module, "has_gate")
    if not (standard or every_row_experts(module)) or getattr(module, "has_post_expert_norm", False):
        return False
    matrices = [p for p in module.parameters(recurse=False) if p.dim() == 3]
    return bool(matrices) and all(p.shape[0] == matrices[0].shape[0] for p in matrices)


@dataclass(frozen=True)
class ExpertTensor:
    """A 3-D tensor of served experts (``served_experts``), ``[experts, out, in]`` or, transposed,
    ``[experts, in, out]``: expert ``e``'s matrix is base layer ``expert_layer_id(name, e)``."""

    name: str  # its state-dict name: "model.layers.0.mlp.experts.gate_up_proj"
    experts: int
    out_features: int
    in_features: int
    transposed: bool = False

    @property
    def layer_ids(self) -> list[str]:
        return [expert_layer_id(self.name, e) for e in range(self.experts)]


def expert_layer_id(tensor_name: str, expert: int) -> str:
    return f"{tensor_name}.{expert}"


def expert_tensors(model: nn.Module, client_layers: Iterable[str] | str | None = ()) -> dict[str, ExpertTensor]:
    """The tensors of every served experts module (``served_experts``) not kept in the client."""
    keep = kept_modules(model, client_layers)
    tensors: dict[str, ExpertTensor] = {}
    for module_name, module in model.named_modules():
        if module_name in keep or not served_experts(module):
            continue
        transposed = every_row_experts(module) or bool(module.is_transposed)
        for param_name, param in module.named_parameters(recurse=False):
            if param.dim() == 3:
                name = f"{module_name}.{param_name}"
                experts, rows, columns = param.shape
                out_features, in_features = (columns, rows) if transposed else (rows, columns)
                tensors[name] = ExpertTensor(name, experts, out_features, in_features, transposed)
    return tensors


def expert_routers(model: nn.Module, client_layers: Iterable[str] | str | None = ()) -> set[str]:
    """The routers of served experts: modules beside them (children of the same parent, or their
    children: afmoe's router holds its ``gate``, an ``nn.Linear``) whose matrices are all 2-D with a
    row per expert. They stay on the client with no ``client_layers`` needed: small (``experts x
    hidden``), the top-k choice computed there exactly as the monolithic model computes it, and a
    router's weight a parameter where peft looks for it (its ``all-linear`` adapts ``gate.weight``
    on MoE models)."""
    experts_of_parent = {  # (a tensor's name: "<parent>.<experts module>.<tensor>")
        tensor.name.rsplit(".", 2)[0]: (tensor.name.rsplit(".", 1)[0], tensor.experts)
        for tensor in expert_tensors(model, client_layers).values()
    }
    modules = dict(model.named_modules())
    found = set()
    for name, module in modules.items():
        parent, _, _ = name.rpartition(".")
        grandparent = parent.rpartition(".")[0]
        experts_module, experts = experts_of_parent.get(parent) or experts_of_parent.get(grandparent) or ("", 0)
        beside = experts_module and not (name == experts_module or name.startswith(f"{experts_module}."))
        if not beside or not _router_like(module, experts):
            continue
        if parent not in experts_of_parent:  # (a child's child: only if all its parent holds is router-like)
            holding = [m for m in modules[parent].modules() if _first_matrix(m) is not None]
            if not all(_router_like(m, experts) for m in holding):
                continue  # (a shared expert whose width happens to be the number of experts)
        found.add(name)
    return found


def _router_like(module: nn.Module, experts: int) -> bool:
    """Whether ``module``'s own matrices are all 2-D with a row per expert (and it has one)."""
    matrices = [p for p in module.parameters(recurse=False) if p.dim() >= 2]
    return bool(matrices) and all(p.dim() == 2 and p.shape[0] == experts for p in matrices)


def discover_base_layers(model: nn.Module, client_layers: Iterable[str] | str | None = ()) -> dict[str, LayerSpec]:
    """Every base layer of ``model`` (``is_base_layer``) by qualified name, and each expert's matrix
    of served experts (``expert_tensors``), except those kept in the client, in the model's module
    order. Other modules are not the executor's concern (``check_client_modules``)."""
    keep = kept_modules(model, client_layers) | expert_routers(model, client_layers)  # (an nn.Linear router too)
    experts_of_module: dict[str, list[ExpertTensor]] = {}
    for tensor in expert_tensors(model, client_layers).values():
        experts_of_module.setdefault(tensor.name.rpartition(".")[0], []).append(tensor)
    specs: dict[str, LayerSpec] = {}
    for name, module in model.named_modules():
        for tensor in experts_of_module.get(name, ()):
            specs.update({i: LayerSpec(i, tensor.in_features, tensor.out_features, False) for i in tensor.layer_ids})
        if name in keep or not is_base_layer(module):
            continue
        if isinstance(module, Conv1D):
            in_features, out_features = module.weight.shape  # Conv1D stores W as [in, out]
            specs[name] = LayerSpec(name, in_features, out_features, module.bias is not None)
        else:
            specs[name] = LayerSpec(name, module.in_features, module.out_features, module.bias is not None)
    return specs


def check_client_modules(model: nn.Module, client_layers: Iterable[str] | str | None = ()) -> None:
    """Refuse a client model with modules that own a weight matrix but are neither base layers nor
    embeddings, unless ``client_layers`` keeps them: a client loads every tensor the executor does
    not serve, so each would silently load a large weight into every client (MoE experts held as
    one 3-D tensor, Mamba's mixer and its conv1d). ``UnsupportedModuleError`` names them all and the
    ``client_layers`` that keep them."""
    keep = kept_modules(model, client_layers) | expert_routers(model, client_layers)
    offending: dict[str, str] = {}  # name -> what it holds
    for name, module in model.named_modules():
        if name in keep or is_base_layer(module) or served_experts(module) or isinstance(module, nn.Embedding):
            continue
        matrix = _first_matrix(module)
        if matrix is not None:
            offending[name] = f"{name} ({type(module).__name__}, {tuple(matrix.shape)})"
    if offending:
        patterns = sorted({f"*.{name.rsplit('.', 1)[1]}" if "." in name else name for name in offending})
        described = list(offending.values())
        shown = ", ".join(described[:3]) + (f" and {len(described) - 3} more" if len(described) > 3 else "")
        raise UnsupportedModuleError(
            f"{len(offending)} module(s) hold a weight matrix and are not base layers: {shown}. "
            f"{CLIENT_MODULE_NOTE}; pass client_layers={patterns} to keep them (and their weights) in the client."
        )


def locate_tensors(
    checkpoint: Checkpoint, model: nn.Module, names: Iterable[str], optional: Iterable[str] = ()
) -> dict[str, TensorSource | ConvertedSource]:
    """Map module tensor names (``model.state_dict()`` keys) to where the checkpoint stores them.

    Names in ``optional`` (e.g. persistent buffers the model computes itself) may be absent.

    Applies `transformers`' own rules in its own order: checkpoint keys are renamed with the
    model's conversion mapping and base-model prefix handling (``rename_source_key``); a name not
    stored under its own key may be tied to another (``get_expanded_tied_weights_keys``).
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    converter_of_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    meta_state = model.state_dict()
    model_key_to_source: dict[str, TensorSource | ConvertedSource] = {}
    parts: dict[str, list[tuple[str, TensorSource]]] = {}  # converted model key -> its parts
    split_from: dict[str, str] = {}  # model key -> the checkpoint key it would be split from
    # In transformers' order (natural, so expert 10 after expert 9): the parts are joined in it.
    for ckpt_key in sorted(checkpoint.key_locations, key=dot_natural_key):
        file = checkpoint.key_locations[ckpt_key]
        model_key, pattern = rename_source_key(ckpt_key, renamings, converters, model.base_model_prefix, meta_state)
        if model_key not in meta_state and ckpt_key in meta_state:  # (as transformers: a renaming too broad,
            # deepseek_v4's ".norm." -> ".kv_norm.", leaves a key the model has as it is)
            model_key, pattern = rename_source_key(ckpt_key, [], [], model.base_model_prefix, meta_state)
        targets = converter_of_pattern[pattern].target_patterns if pattern is not None else ()
        if len(targets) > 1:  # one stored tensor split into several (a fused q/k/v): not done here
            split_from.update({model_key.replace(targets[0], target): ckpt_key for target in targets})
        elif pattern is not None:
            parts.setdefault(model_key, []).append((pattern, TensorSource(file, ckpt_key)))
        else:
            model_key_to_source[model_key] = TensorSource(file, ckpt_key)
    for model_key, pieces in parts.items():
        converter = converter_of_pattern[pieces[0][0]]
        model_key_to_source[model_key] = ConvertedSource(model_key, converter, tuple(pieces))
    tied = (
        model.get_expanded_tied_weights_keys(all_submodels=True)
        if hasattr(model, "get_expanded_tied_weights_keys")
        else {}
    )

    optional = set(optional)
    sources: dict[str, TensorSource | ConvertedSource] = {}
    missing: list[str] = []
    for name in names:
        source = model_key_to_source.get(name) or model_key_to_source.get(tied.get(name, ""))
        if source is not None:
            sources[name] = source
        elif name in split_from:
            raise CheckpointError(
                f"tensor {name!r} is stored with others in {split_from[name]!r}, and splitting it needs "
                "transformers' weight conversion, which Symbiosis's selective loader does not do (it joins "
                "tensors, as MoE experts stored one per expert, but does not split them)"
            )
        elif name not in optional:
            missing.append(name)
    if missing:
        raise CheckpointError(
            f"checkpoint {str(checkpoint.path)!r} lacks tensors the model needs: {missing[:8]}"
            + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        )
    return sources


def _read_one(source: TensorSource) -> torch.Tensor:
    with safe_open(source.file, framework="pt") as handle:
        return handle.get_tensor(source.key)


def _convert(source: ConvertedSource, config) -> torch.Tensor:
    """The tensor ``source`` names, joined from its parts by `transformers`' own converter (its
    operations, in its order, given the model's config as transformers' loader gives it: some
    operations read it), each part read only when the converter asks for it."""
    converter = copy.deepcopy(source.converter)  # (it collects its parts: one instance per tensor)
    for pattern, part in source.parts:
        converter.add_tensor(source.name, part.key, pattern, functools.partial(_read_one, part))
    converted = converter.convert(source.name, config=config)
    if len(converted) != 1:
        raise CheckpointError(f"transformers' conversion of {source.name!r} made {sorted(converted)}, not one tensor")
    return next(iter(converted.values()))


def base_layer_tensor_names(
    specs: Mapping[str, LayerSpec], experts: Mapping[str, ExpertTensor] | None = None
) -> dict[str, str]:
    """``state_dict`` names of every base-layer tensor, mapped to their layer id; the layers of
    ``experts`` left out (their tensors are the experts', one for all of them: ``experts`` itself)."""
    per_expert = {layer_id for tensor in (experts or {}).values() for layer_id in tensor.layer_ids}
    names = {f"{layer_id}.weight": layer_id for layer_id in specs if layer_id not in per_expert}
    names.update({f"{layer_id}.bias": layer_id for layer_id, spec in specs.items() if spec.has_bias})
    return names
