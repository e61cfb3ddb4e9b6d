"""What a job leaves on disk: folders written atomically, adapters, loss plots.

A job writes only into folders it owns. Each folder it makes (an adapter folder, a ``X.run/``
folder) holds a marker file, ``.symbiosis-output.json``, naming its kind and, for an adapter, the
files written there. A folder without the marker is someone else's: a job refuses to replace it
(unless it is empty) and never deletes anything in it. Outputs are checked before the first
training step, so a bad ``--output`` costs nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from symbiosis.jobs.base import JobError

MARKER = ".symbiosis-output.json"
ADAPTER, RUN = "adapter", "run"
#: What a job writes into its run folder; a fresh run removes these and nothing else.
RUN_FILES = ("log.jsonl", "loss.png", "training_options.json")
CHECKPOINTS = "checkpoints"
_CHECKPOINT_NAME = re.compile(r"(step-\d+|\.step-\d+\.(tmp|old)-.*)")


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The marker of a folder a job wrote, or None (no marker, or not one of ours)."""
    try:
        value = json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) and value.get("kind") in (ADAPTER, RUN) else None


def write_marker(folder: Path, kind: str, files: Iterable[str] = ()) -> None:
    marker = {"kind": kind, "written_by": "symbiosis", "files": sorted(files)}
    (Path(folder) / MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def check_new_folder(path: Path, what: str) -> None:
    """Refuse a path that cannot become a folder of ours: no name, a symlink, a non-folder, a
    folder of another user, or under a parent we cannot write. Checks only; nothing is created."""
    path = Path(path)
    if path.name in ("", ".", ".."):
        raise JobError(f"{what} {str(path)!r} must name a folder (not '.' or '..')")
    if path.is_symlink():
        raise JobError(f"{what} {str(path)!r} is a symbolic link; give the folder itself")
    if path.exists() and not path.is_dir():
        raise JobError(f"{what} {str(path)!r} exists and is not a folder; refusing to replace it")
    # In a shared folder (/tmp) another user could plant a marked folder full of symlinks.
    if path.is_dir() and path.stat().st_uid != os.geteuid():
        raise JobError(f"{what} {str(path)!r} belongs to another user; refusing to write into it")
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise JobError(f"cannot create {what} {str(path)!r}: {str(ancestor)!r} is not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise JobError(f"cannot create {what} {str(path)!r}: {str(ancestor)!r} is not writable")


def check_output_folder(output: Path, what: str = "--output") -> None:
    """Refuse an adapter output we could not replace without deleting what we did not write.

    Fine: a missing path, an empty folder, or our own previous adapter folder holding only the
    files its marker lists. Refused: anything else, so that ``save_adapter`` never loses data.
    """
    output = Path(output)
    check_new_folder(output, what)
    if not output.is_dir():
        return
    entries = sorted(p.name for p in output.iterdir())
    if not entries:
        return
    marker = read_marker(output)
    if marker is None or marker["kind"] != ADAPTER:
        raise JobError(
            f"{what} {str(output)!r} is a non-empty folder that Symbiosis did not write (no {MARKER}); "
            "refusing to replace it: pick another folder or empty it first"
        )
    foreign = [name for name in entries if name not in {MARKER, *marker.get("files", ())}]
    if foreign:
        raise JobError(
            f"{what} {str(output)!r} holds files Symbiosis did not write ({', '.join(foreign[:5])}); "
            "refusing to replace the folder: move them away or pick another folder"
        )


def check_run_folder(run_dir: Path, resume: bool) -> None:
    """Refuse a run folder (``X.run/``) that is not ours: a fresh run would clear it."""
    run_dir = Path(run_dir)
    check_new_folder(run_dir, "run folder")
    if resume and not run_dir.is_dir():
        raise JobError(f"--resume: there is no run folder {str(run_dir)!r} to resume from")
    if not run_dir.is_dir() or read_marker(run_dir) is not None or not any(run_dir.iterdir()):
        return
    if resume and _has_checkpoints(run_dir):
        return  # made before run folders had markers; resuming deletes nothing
    raise JobError(
        f"run folder {str(run_dir)!r} (where this job keeps checkpoints and its log) exists and was not written "
        f"by Symbiosis (no {MARKER}); refusing to use it: move it away or pick another --output"
    )


def prepare_run_folder(run_dir: Path, resume: bool) -> Path:
    """Make (or, for a fresh run, clear) our run folder: only files a run writes are removed."""
    run_dir = Path(run_dir)
    check_run_folder(run_dir, resume)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:  # stale checkpoints must not be resumed later
        _clear_run_folder(run_dir)
    write_marker(run_dir, RUN)
    return run_dir


def _has_checkpoints(run_dir: Path) -> bool:
    return any((p / "trainer_state.pt").is_file() for p in (run_dir / CHECKPOINTS).glob("step-*"))


def _clear_run_folder(run_dir: Path) -> None:
    for name in RUN_FILES:
        path = run_dir / name
        if path.is_symlink() or path.is_file():  # a link is dropped, never written through
            path.unlink()
    checkpoints = run_dir / CHECKPOINTS
    if not checkpoints.is_dir() or checkpoints.is_symlink():
        return
    for path in checkpoints.iterdir():
        if _CHECKPOINT_NAME.fullmatch(path.name) and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
    if not any(checkpoints.iterdir()):
        checkpoints.rmdir()


def write_atomically(final: Path, write: Callable[[Path], Any]) -> Path:
    """Call ``write(tmp)`` on a fresh sibling folder of ``final``, then rename it to ``final``.

    On any failure the temporary folder is removed and ``final`` is left as it was, so a folder
    at ``final`` is always complete. An existing ``final`` is replaced only after the new one is
    fully written; callers check first that it is theirs to replace (``check_output_folder``).
    """
    final = Path(final)
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        raise JobError(f"{str(final)!r} exists and is not a folder; refusing to replace it")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        write(tmp)
        share_files(tmp)
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


def share_files(folder: Path) -> None:
    """Give the files in ``folder`` the mode a plain ``open`` gives (0666 less the umask).

    safetensors writes its files 0600 whatever the umask, so an adapter's (or ``make-model``'s
    checkpoint's) weights were private while the config beside them was not; the folder is
    ordinary shared output (0755).
    """
    probe = folder / ".mode-probe"
    probe.touch()
    mode = probe.stat().st_mode & 0o777
    probe.unlink()
    for path in folder.iterdir():
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


def _absolute_folder(path: str | None) -> str | None:
    """``path`` made absolute when it is a relative path to a folder here (else as it is: a hub id)."""
    return str(Path(path).absolute()) if path and not Path(path).is_absolute() and Path(path).is_dir() else path


def save_adapter(peft_model, output: Path, extra_files: tuple[Path, ...] = ()) -> Path:
    """Write ``peft_model``'s adapter as a standard PEFT folder at ``output``, atomically.

    An existing ``output`` is replaced only if it is empty or our own previous adapter folder
    (``check_output_folder``); the new folder's marker lists the files written into it.
    """
    output = Path(output)
    check_output_folder(output)
    # peft records the path the base model was loaded from (adapter_config.json's
    # base_model_name_or_path, the model card's base_model from the model's config): a relative one
    # finds the base (AutoPeftModel, a mismatch message) only from the folder the job ran in.
    for config in peft_model.peft_config.values():
        config.base_model_name_or_path = _absolute_folder(config.base_model_name_or_path)
    model_config = peft_model.get_base_model().config
    model_config._name_or_path = _absolute_folder(model_config._name_or_path)

    def write(tmp: Path) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft_model.save_pretrained(tmp)
        for path in extra_files:
            if path.is_file():
                shutil.copy2(path, tmp / path.name)
        write_marker(tmp, ADAPTER, (p.name for p in tmp.iterdir()))

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
