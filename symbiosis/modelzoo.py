"""Random-weight checkpoints of real `transformers` architectures, made offline.

Why this exists: every reference test, demo and benchmark in Symbiosis compares a split model
(base layers served by an executor) with the monolithic `transformers` model loaded from the
same checkpoint folder. Nothing may come from a model hub, so we make those folders ourselves:
`config.json` + `model.safetensors` + tokenizer files, loadable with
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` like any real model.

Choices that matter to the tests built on top:

* The architectures are the real `transformers` classes (LLaMA, Mistral, Qwen2, Gemma2, GPT-2,
  GPTBigCode, OPT, Phi-3, Falcon, GPT-NeoX), picked to cover the layer shapes a split model must handle:
  plain `nn.Linear` without bias (LLaMA), q/k/v biases (Qwen2), `Conv1D` (GPT-2), multi-query
  fused QKV (GPTBigCode), fused qkv / gate_up projections (Phi-3), grouped-query fused QKV
  (Falcon's new decoder), biases everywhere plus learned positions (OPT), an untied output layer
  not called `lm_head` plus partial rotary and parallel residuals (GPT-NeoX's `embed_out`), tied
  and untied `lm_head`, logit soft-capping and sliding windows (Gemma2, Mistral).
* Weights are the library's own random init under `torch.manual_seed(seed)`, so a checkpoint is
  a pure function of (arch, preset, seed). After init, every 1-D parameter (each bias and each
  norm scale) gets a little noise: HF initializes biases to 0 and norm scales to 1, and a split
  model that silently dropped a bias or a norm would then still match the reference.
* One byte-level BPE (vocab 1024), trained in well under a second on `data/corpus.txt`, serves
  every preset, so embeddings stay small and token ids are stable across architectures.
* `make_model` is idempotent and atomic-ish: it builds in a temporary sibling folder, renames it
  into place, and records the recipe (arch, preset, seed, dtype, tying) in
  `symbiosis_model.json`; a second call with the same recipe returns the folder untouched.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerFast

from symbiosis.errors import ConfigurationError, OutputExistsError
from symbiosis.jobs.artifacts import share_files

__all__ = [
    "ARCHS",
    "PRESETS",
    "MARKER_FILE",
    "SPECIAL_TOKEN",
    "SPECIAL_TOKEN_ID",
    "TOKENIZER_VOCAB_SIZE",
    "make_model",
    "make_tokenizer",
    "preset_config",
]

CORPUS_PATH = pathlib.Path(__file__).parent / "data" / "corpus.txt"
MARKER_FILE = "symbiosis_model.json"
SPECIAL_TOKEN = "<|endoftext|>"
SPECIAL_TOKEN_ID = 0  # the trainer puts special tokens first
TOKENIZER_VOCAB_SIZE = 1024
# Bump when the recipe changes (shapes, noise, tokenizer) so stale cached folders are rebuilt.
_RECIPE_VERSION = 1
# Std of the noise added to biases (init 0) and norm scales (init 1, or 0 for Gemma's `1 + w`).
_BIAS_NOISE_STD = 0.05
_NORM_NOISE_STD = 0.1


@dataclass(frozen=True)
class _Shape:
    """Architecture-neutral size of a preset; each arch maps it onto its own config fields."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int  # used where the architecture supports grouped-query attention
    intermediate: int
    max_positions: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# tiny: a CPU forward pass in a few ms, for tests.  small: ~14M params (LLaMA).
# base: ~105M params (LLaMA), a GPT-2-small-sized model for benchmarks.
_SHAPES: dict[str, _Shape] = {
    "tiny": _Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, max_positions=256),
    "small": _Shape(hidden=384, layers=6, heads=6, kv_heads=2, intermediate=1536, max_positions=1024),
    "base": _Shape(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=3072, max_positions=2048),
}


def _llama(shape: _Shape) -> dict[str, Any]:
    return dict(
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=False,
    )


def _mistral(shape: _Shape) -> dict[str, Any]:
    # A window shorter than the context, so the sliding-window mask is really exercised.
    return dict(_llama(shape), sliding_window=shape.max_positions // 2)


def _qwen2(shape: _Shape) -> dict[str, Any]:
    # Qwen2 always has q/k/v biases; sliding window stays off (its default).
    return _llama(shape)


def _gemma2(shape: _Shape) -> dict[str, Any]:
    # Gemma2 alternates sliding-window and full attention layers and soft-caps attention and
    # final logits (library defaults kept). It has no SDPA kernel in transformers 5.x, so it
    # always loads with eager attention, where soft-capping is honoured.
    return dict(
        _llama(shape),
        head_dim=shape.head_dim,
        query_pre_attn_scalar=shape.head_dim,
        sliding_window=shape.max_positions // 2,
        tie_word_embeddings=True,
    )


def _gpt2(shape: _Shape) -> dict[str, Any]:
    return dict(
        n_embd=shape.hidden,
        n_layer=shape.layers,
        n_head=shape.heads,
        n_inner=shape.intermediate,
        n_positions=shape.max_positions,
    )


def _gpt_bigcode(shape: _Shape) -> dict[str, Any]:
    return dict(_gpt2(shape), multi_query=True)


def _opt(shape: _Shape) -> dict[str, Any]:
    return dict(
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        ffn_dim=shape.intermediate,
        max_position_embeddings=shape.max_positions,
        word_embed_proj_dim=shape.hidden,  # no project_in/project_out
    )


def _phi3(shape: _Shape) -> dict[str, Any]:
    return dict(
        _llama(shape),
        original_max_position_embeddings=shape.max_positions,
        sliding_window=None,
    )


def _falcon(shape: _Shape) -> dict[str, Any]:
    # Falcon-40B style: new decoder architecture, grouped-query fused QKV, parallel attn/MLP
    # with two input norms, rotary positions.
    return dict(
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        ffn_hidden_size=shape.intermediate,
        max_position_embeddings=shape.max_positions,
        new_decoder_architecture=True,
        multi_query=False,
        parallel_attn=True,
        bias=False,
        alibi=False,
    )


def _gpt_neox(shape: _Shape) -> dict[str, Any]:
    # Pythia style: fused biased query_key_value, parallel attention/MLP residual, rotary on a
    # quarter of each head (the library default), and an untied output layer named `embed_out`.
    return dict(
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        intermediate_size=shape.intermediate,
        max_position_embeddings=shape.max_positions,
        use_parallel_residual=True,
        tie_word_embeddings=False,
    )


def _mixtral(shape: _Shape) -> dict[str, Any]:
    # Mixture of experts: 4 experts of the preset's MLP width, each token routed to 2; the
    # executor serves each expert's matrices as layers of their own (client/experts.py).
    return dict(_llama(shape), num_local_experts=4, num_experts_per_tok=2, sliding_window=None)


# Ordered: ARCHS and error messages list architectures in this order.
_ARCH_FIELDS: dict[str, Callable[[_Shape], dict[str, Any]]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "gemma2": _gemma2,
    "gpt2": _gpt2,
    "gpt_bigcode": _gpt_bigcode,
    "opt": _opt,
    "phi3": _phi3,
    "falcon": _falcon,
    "gpt_neox": _gpt_neox,
    "mixtral": _mixtral,
}

ARCHS: tuple[str, ...] = tuple(_ARCH_FIELDS)
PRESETS: tuple[str, ...] = tuple(_SHAPES)


def _check_choice(kind: str, value: str, supported: tuple[str, ...]) -> None:
    if value not in supported:
        raise ConfigurationError(f"unknown {kind} {value!r}; supported: {', '.join(supported)}")


# ----------------------------------------------------------------------------- tokenizer

_tokenizer_lock = threading.Lock()
_tokenizer_json: str | None = None  # trained once per process, serialized


def _train_tokenizer() -> str:
    """Train the byte-level BPE on the bundled corpus; returns its JSON (deterministic)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[SPECIAL_TOKEN],
        # All 256 byte symbols, so any UTF-8 text round-trips even if the corpus lacks it.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(CORPUS_PATH)], trainer)
    assert tokenizer.token_to_id(SPECIAL_TOKEN) == SPECIAL_TOKEN_ID
    return tokenizer.to_str()


def _cached_tokenizer_json() -> str:
    global _tokenizer_json
    with _tokenizer_lock:
        if _tokenizer_json is None:
            _tokenizer_json = _train_tokenizer()
        return _tokenizer_json


def _wrap_tokenizer(model_max_length: int | None) -> PreTrainedTokenizerFast:
    # A fresh object per call: callers may mutate theirs (padding_side, ...).
    backend = Tokenizer.from_str(_cached_tokenizer_json())
    extra: dict[str, Any] = {} if model_max_length is None else {"model_max_length": model_max_length}
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=SPECIAL_TOKEN,
        eos_token=SPECIAL_TOKEN,
        pad_token=SPECIAL_TOKEN,
        **extra,
    )


def make_tokenizer(
    output_dir: str | os.PathLike[str], *, model_max_length: int | None = None
) -> PreTrainedTokenizerFast:
    """Return the project's byte-level BPE tokenizer and save it into `output_dir`.

    The BPE is trained on `symbiosis/data/corpus.txt` once per process (well under a second) and
    cached. `<|endoftext|>` (id 0) is bos, eos and pad; no BOS is prepended on encode, so
    `decode(encode(s)) == s` for any string. Padding is on the right (HF's default; pass
    `padding_side="left"` when batching prompts for `generate`).
    """
    tokenizer = _wrap_tokenizer(model_max_length)
    tokenizer.save_pretrained(str(output_dir))
    return tokenizer


# ----------------------------------------------------------------------------- configs


def preset_config(
    arch: str,
    preset: str,
    vocab_size: int = TOKENIZER_VOCAB_SIZE,
    *,
    tie_word_embeddings: bool | None = None,
) -> PretrainedConfig:
    """The `transformers` config of `arch` at size `preset`, with our tokenizer's token ids.

    `tie_word_embeddings=None` keeps the preset's choice (untied for the LLaMA family, Phi-3
    and GPT-NeoX, tied for Gemma2, GPT-2, GPTBigCode, OPT and Falcon); a bool overrides it.
    """
    _check_choice("arch", arch, ARCHS)
    _check_choice("preset", preset, PRESETS)
    fields = _ARCH_FIELDS[arch](_SHAPES[preset])
    if tie_word_embeddings is not None:
        fields["tie_word_embeddings"] = tie_word_embeddings
    config = AutoConfig.for_model(
        arch,
        vocab_size=vocab_size,
        bos_token_id=SPECIAL_TOKEN_ID,
        eos_token_id=SPECIAL_TOKEN_ID,
        pad_token_id=SPECIAL_TOKEN_ID,
        **fields,
    )
    config.dtype = torch.float32
    return config


# ----------------------------------------------------------------------------- models


def _perturb_vectors(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Add noise to every 1-D parameter: biases (init 0) and norm scales (init 1 or 0).

    In every architecture here the 1-D parameters are exactly the biases and the norm scales,
    which is why no module types are named.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() != 1:
                continue
            std = _BIAS_NOISE_STD if name.endswith("bias") else _NORM_NOISE_STD
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
            param.add_(noise.to(param.dtype))


def build_random_model(config: PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    """A random-weight causal LM of ``config`` (any ``transformers`` architecture), its 1-D
    parameters perturbed (``_perturb_vectors``): what ``make_model`` saves, for other configs too."""
    # fork_rng: the caller's global RNG state is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_vectors(model, torch.Generator().manual_seed(seed + 1))
    return model.eval()


def _recipe(arch: str, preset: str, seed: int, dtype: torch.dtype, tie_word_embeddings: bool | None) -> dict[str, Any]:
    return {
        "arch": arch,
        "preset": preset,
        "seed": seed,
        "dtype": str(dtype).removeprefix("torch."),
        "tie_word_embeddings": tie_word_embeddings,
        "recipe_version": _RECIPE_VERSION,
    }


def _read_recipe(folder: pathlib.Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None


def holds(output: str | os.PathLike[str], arch: str, preset: str, *, seed: int = 0) -> bool:
    """Whether ``output`` already holds the checkpoint ``make_model`` would write for these
    (default dtype and tying): it would then return it untouched."""
    return _is_complete(pathlib.Path(output).absolute(), _recipe(arch, preset, seed, torch.float32, None))


def _is_complete(folder: pathlib.Path, recipe: dict[str, Any]) -> bool:
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return _read_recipe(folder) == recipe and all((folder / name).is_file() for name in needed)


def _check_replaceable(output: pathlib.Path) -> None:
    """Only a missing path, an empty folder or one made by `make_model` may be replaced.

    Anything else that exists is the user's: a regular file, a symbolic link (replacing it would
    drop the link, and with a folder behind it the folder would be left stale), a device.
    """
    if output.is_symlink():
        raise OutputExistsError(f"{output} is a symbolic link; give the folder itself (refusing to replace the link)")
    if output.exists() and not output.is_dir():
        raise OutputExistsError(f"{output} exists and is not a folder; refusing to overwrite it")
    if output.is_dir() and _read_recipe(output) is None and any(output.iterdir()):
        raise OutputExistsError(f"{output} is not empty and was not made by make_model; refusing to overwrite")


def _replace_folder(built: pathlib.Path, output: pathlib.Path) -> None:
    """Move `built` to `output`, displacing an empty or symbiosis-made folder only."""
    if output.exists():
        _check_replaceable(output)
        trash = pathlib.Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
        try:
            os.replace(output, trash / output.name)
        except FileNotFoundError:  # another process moved it first
            pass
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(built, output)


def make_model(
    arch: str,
    preset: str,
    output: str | os.PathLike[str],
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tie_word_embeddings: bool | None = None,
) -> pathlib.Path:
    """Write a random-weight `arch` checkpoint of size `preset` into `output`; return its path.

    The folder holds `config.json`, `model.safetensors`, `generation_config.json`, tokenizer
    files and `symbiosis_model.json` (the recipe). Weights are a pure function of
    (arch, preset, seed, tie_word_embeddings); `dtype` only changes how they are stored (init
    runs in float32). `tie_word_embeddings=None` keeps the architecture's choice. If `output`
    already holds this recipe it is returned as is. An existing folder with another recipe is
    replaced; a non-empty folder not made here, a file or a symbolic link raises `OutputExistsError`
    (a `FileExistsError`), and an output that cannot be written `ConfigurationError`.
    """
    _check_choice("arch", arch, ARCHS)
    _check_choice("preset", preset, PRESETS)
    output = pathlib.Path(output).absolute()
    recipe = _recipe(arch, preset, seed, dtype, tie_word_embeddings)
    if _is_complete(output, recipe):
        return output
    _check_replaceable(output)
    try:
        _write_checkpoint(arch, preset, output, recipe, seed, dtype, tie_word_embeddings)
    except OutputExistsError:
        raise
    except OSError as exc:  # an unwritable or missing parent, a full disk: the user's to fix
        raise ConfigurationError(f"cannot write a checkpoint to {output}: {exc.strerror or exc}") from None
    return output


def _write_checkpoint(
    arch: str,
    preset: str,
    output: pathlib.Path,
    recipe: dict[str, Any],
    seed: int,
    dtype: torch.dtype,
    tie_word_embeddings: bool | None,
) -> None:
    """Build the checkpoint in a temporary sibling folder of `output`, then rename it into place."""
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary shared folder
    try:
        shape = _SHAPES[preset]
        tokenizer = make_tokenizer(staging, model_max_length=shape.max_positions)
        config = preset_config(arch, preset, len(tokenizer), tie_word_embeddings=tie_word_embeddings)
        model = build_random_model(config, seed).to(dtype)
        model.config.dtype = dtype
        model.save_pretrained(staging, safe_serialization=True)
        (staging / MARKER_FILE).write_text(json.dumps(recipe, indent=2) + "\n")
        share_files(staging)
        # A concurrent maker of the same recipe may have finished first: keep its folder, since
        # readers may already be using it.
        if not _is_complete(output, recipe):
            try:
                _replace_folder(staging, output)
            except OSError:
                if not _is_complete(output, recipe):
                    raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
