"""Start-up and exit of the two serving commands: ``symbiosis serve`` and ``symbiosis api --embedded``.

For each, the seconds from the command to ready (``serve``: its ``--ready-file`` written; ``api``:
``/health`` answers 200, polled every 0.2 s) and from SIGTERM, idle, to the process's exit. Variants,
alternated round by round (rotating which goes first) so that they see the same background load:

- ``current``: this checkout as it is;
- ``no-freeze``: the same with ``SYMBIOSIS_FREEZE_HEAP=0`` (no startup heap frozen, the
  interpreter's last collection at exit walks everything: ``symbiosis/heap.py``);
- ``baseline`` with ``--baseline DIR``: a folder holding another copy of the ``symbiosis`` package
  (e.g. ``git worktree add DIR COMMIT``), imported instead of this one.

Run: ``python -m benchmarks.startup [--repeats 3] [--preset small] [--baseline DIR] [--output DIR]``
(``--quick``: the tiny preset, one round). Medians per variant and command, and each variant's
ratio to ``current``, on stdout and in ``startup.json`` in ``--output``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.options import add_common_arguments, checkpoint_path, resolve_common
from benchmarks.results import command_line, machine_info, print_summary, repo_root, write_json
from benchmarks.serving import free_port, wait_healthy
from benchmarks.workers import stop_process

MODULE = "benchmarks.startup"
COMMANDS = ("serve", "api")
IDLE_BEFORE_STOP_S = 0.5  # ready is not quiet yet (the first /health, the ready file's writer)


def _env(variant: str, baseline: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    root = baseline if variant == "baseline" else repo_root()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    if variant == "no-freeze":
        env["SYMBIOSIS_FREEZE_HEAP"] = "0"
    return env


def _start(command: str, model: Path, folder: Path, env: dict[str, str]) -> tuple[subprocess.Popen, float]:
    """Start ``command``; return the process and its seconds to ready."""
    began = time.monotonic()
    if command == "serve":
        ready = folder / "ready.json"
        argv = ["serve", str(model), "--bind", f"ipc://{folder}/executor.sock", "--ready-file", str(ready)]
    else:
        port = free_port()
        argv = ["api", "--model", str(model), "--embedded", "--port", str(port)]
    process = subprocess.Popen(
        [sys.executable, "-m", "symbiosis", *argv],
        env=env,
        cwd=folder,  # not this checkout: the variant's PYTHONPATH decides which package is imported
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    if command == "serve":
        while not ready.exists():
            if process.poll() is not None:
                raise RuntimeError(f"symbiosis serve exited with {process.returncode}")
            time.sleep(0.01)
    else:
        wait_healthy(f"http://127.0.0.1:{port}", process)
    return process, time.monotonic() - began


def measure_once(command: str, model: Path, env: dict[str, str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="symbiosis-startup-") as folder:
        process, ready_s = _start(command, model, Path(folder), env)
        try:
            time.sleep(IDLE_BEFORE_STOP_S)
            began = time.monotonic()
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
            exit_s = time.monotonic() - began
        finally:
            stop_process(process)
    return {"ready_s": ready_s, "exit_s": exit_s}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, default_repeats=3, quick_repeats=1)
    parser.add_argument("--baseline", type=Path, default=None, help="Folder holding another symbiosis package.")
    args = resolve_common(parser.parse_args(argv))
    variants = ["current", "no-freeze"]
    if args.baseline is not None:
        if not (args.baseline / "symbiosis" / "__init__.py").exists():
            raise SystemExit(f"{args.baseline} holds no symbiosis package")
        variants.append("baseline")
    model = checkpoint_path(args)
    runs: dict[str, dict[str, list[dict[str, float]]]] = {v: {c: [] for c in COMMANDS} for v in variants}
    for round_index in range(args.repeats):
        order = variants[round_index % len(variants) :] + variants[: round_index % len(variants)]
        for command in COMMANDS:
            for variant in order:
                runs[variant][command].append(measure_once(command, model, _env(variant, args.baseline)))
    summary: dict[str, Any] = {}
    for command in COMMANDS:
        for figure in ("ready_s", "exit_s"):
            medians = {v: statistics.median(r[figure] for r in runs[v][command]) for v in variants}
            summary[f"{command}/{figure}"] = {
                **{v: round(m, 3) for v, m in medians.items()},
                **{f"{v}/current": round(m / medians["current"], 2) for v, m in medians.items() if v != "current"},
            }
    result = {
        "benchmark": "startup",
        "command": command_line(argv, MODULE),
        "machine": machine_info(),
        "model": str(model),
        "summary": summary,
        "runs": runs,
    }
    write_json(Path(args.output) / "startup.json", result)
    print_summary(summary)
    return result


if __name__ == "__main__":
    main()
