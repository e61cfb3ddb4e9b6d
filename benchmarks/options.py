"""The command line every benchmark shares, and the checkpoints it measures.

* ``--quick`` means: the ``tiny`` preset and few iterations, so the script finishes in seconds; it
  exists for smoke tests (``tests/test_benchmarks_quick.py``), its numbers mean little.
* Checkpoints are random-weight ``symbiosis.modelzoo`` models, made once and cached under
  ``--cache`` (default ``$SYMBIOSIS_BENCH_CACHE`` or ``~/.cache/symbiosis/bench``); ``--model DIR``
  uses an existing checkpoint folder instead.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

DEFAULT_PRESET = "small"
QUICK_PRESET = "tiny"


def default_cache_dir() -> Path:
    env = os.environ.get("SYMBIOSIS_BENCH_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "symbiosis" / "bench"


def add_common_arguments(parser: argparse.ArgumentParser, *, default_repeats: int, quick_repeats: int) -> None:
    """The flags every benchmark takes (``--quick --output --cache --preset --repeats --model --threads``)."""
    parser.add_argument(
        "--quick", action="store_true", help=f"Smoke-test mode: the {QUICK_PRESET!r} preset and few iterations."
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=Path("bench-results"),
        help="Folder for the JSON result and PNG plot (<benchmark>.json, <benchmark>.png).",
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="Folder where benchmark checkpoints are made once and kept "
        "(default: $SYMBIOSIS_BENCH_CACHE or ~/.cache/symbiosis/bench).",
    )
    parser.add_argument(
        "--preset",
        choices=("tiny", "small", "base"),
        default=None,
        help=f"Model size (default {DEFAULT_PRESET!r}, or {QUICK_PRESET!r} with --quick).",
    )
    parser.add_argument(
        "--arch", default="llama", help="Architecture of the random-weight checkpoint (default: %(default)s)."
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"Measured repetitions, medians taken over them "
        f"(default {default_repeats}, {quick_repeats} with --quick).",
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="Use this existing checkpoint folder instead of making one."
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads(N) before measuring (default: torch's choice)."
    )
    parser.set_defaults(_default_repeats=default_repeats, _quick_repeats=quick_repeats)


def resolve_common(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on ``--quick`` and apply ``--threads``."""
    if args.preset is None:
        args.preset = QUICK_PRESET if args.quick else DEFAULT_PRESET
    if args.repeats is None:
        args.repeats = args._quick_repeats if args.quick else args._default_repeats
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    if args.cache is None:
        args.cache = default_cache_dir()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    quiet_libraries()
    return args


def checkpoint_path(args: argparse.Namespace, seed: int = 0) -> Path:
    """``--model`` if given, else a cached random-weight checkpoint of ``--arch``/``--preset``."""
    if args.model is not None:
        return Path(args.model)
    from symbiosis.modelzoo import make_model

    return make_model(args.arch, args.preset, Path(args.cache) / f"{args.arch}-{args.preset}-seed{seed}", seed=seed)


def quiet_libraries() -> None:
    """No progress bars or deprecation chatter from transformers/peft in benchmark output."""
    import warnings

    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
