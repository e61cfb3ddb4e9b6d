"""What a job leaves on disk: folders written atomically, adapters, loss plots."""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from symbiosis.jobs.base import JobError


def write_atomically(final: Path, write: Callable[[Path], Any]) -> Path:
    """Call ``write(tmp)`` on a fresh sibling folder of ``final``, then rename it to ``final``.

    On any failure the temporary folder is removed and ``final`` is left as it was, so a folder
    at ``final`` is always complete. An existing ``final`` is replaced only after the new one is
    fully written.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        write(tmp)
        tmp.chmod(0o755)
        if final.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.replace(final, trash / final.name)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, final)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise JobError(f"could not write {str(final)!r}: {exc.strerror or exc}; nothing was left there") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def save_adapter(peft_model, output: Path, extra_files: tuple[Path, ...] = ()) -> Path:
    """Write ``peft_model``'s adapter as a standard PEFT folder at ``output``, atomically."""
    output = Path(output)
    if output.is_dir() and any(output.iterdir()) and not (output / "adapter_config.json").is_file():
        raise JobError(f"--output {str(output)!r} is a non-empty folder that is not an adapter; refusing to overwrite it")

    def write(tmp: Path) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft_model.save_pretrained(tmp)
        for path in extra_files:
            if path.is_file():
                shutil.copy2(path, tmp / path.name)

    return write_atomically(output, write)


def save_loss_plot(curves: dict[str, list[tuple[int, float]]], path: Path, title: str = "training loss") -> Path:
    """One line per curve (step, loss) into a PNG; matplotlib's Agg backend, no display needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for label, points in curves.items():
        if points:
            ax.plot([s for s, _ in points], [v for _, v in points], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(curves) > 1 or any(label for label in curves):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# ---- connecting ---------------------------------------------------------------------------------
