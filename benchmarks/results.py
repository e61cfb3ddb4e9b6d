"""What a benchmark run leaves behind: ``<benchmark>.json`` (+ ``.png``, ``.md``) in its ``--output`` folder.

One layout for every result under ``docs/benchmarks``: a folder per result (the ``--output`` given
to the benchmark), holding files named after the benchmark that wrote them: ``<name>.json`` (the
command line, the machine, the configuration, the figures, the wall time), ``<name>.png`` (the
plot) and, for the suite's scenarios, ``<name>.md`` (the table the report quotes). ``result_file``
names them.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def result_file(folder: Path, name: str, suffix: str = ".json") -> Path:
    """``<folder>/<name><suffix>``: a result (``.json``), plot (``.png``) or table (``.md``) of benchmark ``name``."""
    return Path(folder) / f"{name}{suffix}"


def usable_cpus() -> int:
    """The CPUs this process may run on (all of them where affinity is not known)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: CPU count and affinity, torch threads, library versions, load."""
    import peft
    import transformers

    try:
        load_average = list(os.getloadavg())
    except OSError:
        load_average = None
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "load_average_1_5_15min": load_average,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda_available": torch.cuda.is_available(),
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }


def jsonable(value: Any) -> Any:
    """NaN/inf become null (strict JSON); tuples become lists; paths and dtypes become strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (Path, torch.dtype, torch.device)):
        return str(value)
    return value


def write_json(path: Path, result: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jsonable(result), indent=2, allow_nan=False) + "\n")
    return path


def command_line(argv: Sequence[str] | None, module: str) -> str:
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python", "-m", module, *args])


def print_summary(summary: Mapping[str, Any]) -> None:
    print(json.dumps(jsonable(summary), indent=2, allow_nan=False), flush=True)
