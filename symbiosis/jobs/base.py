"""What every job module shares: its error type and the help-text convention of its options."""

from __future__ import annotations

from symbiosis.errors import SymbiosisError


class JobError(SymbiosisError):
    """A fine-tuning or inference job cannot run as asked (options, resume state, saving)."""

    code = "job"


def _help(text: str) -> dict[str, str]:
    """Dataclass field metadata whose ``help`` the CLI shows for the matching flag."""
    return {"help": text}


def flag(field_name: str) -> str:
    """The command-line flag of an options field (typer's rule): ``batch_size`` -> ``--batch-size``.
    Errors name the flag, which a Python caller still maps to its field at a glance."""
    return "--" + field_name.replace("_", "-")
