"""Every ``SchedulerConfig`` field as a command-line option, generated from the dataclass.

``with_scheduler_options`` gives a typer command one option per field (``--max-wait-ms``,
``--decode-slo-ms``, ``--adapt-waits/--no-adapt-waits``, ...), with the field's own help text and
default, and hands the command one validated ``scheduler_config: SchedulerConfig``. A field added
to the config is an option of ``symbiosis serve`` at once; none can be forgotten.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Annotated

import typer

from symbiosis.executor.scheduler_config import SchedulerConfig

PANEL = "Scheduler (batching and sharing between clients)"


def scheduler_parameters() -> list[inspect.Parameter]:
    """One keyword-only typer parameter per ``SchedulerConfig`` field."""
    helps = SchedulerConfig.help_texts()
    hints = typing.get_type_hints(SchedulerConfig)
    parameters = []
    for field in dataclasses.fields(SchedulerConfig):
        option = typer.Option(help=helps[field.name], rich_help_panel=PANEL)  # a Literal shows its choices
        kind = hints[field.name]
        parameters.append(
            inspect.Parameter(
                field.name, inspect.Parameter.KEYWORD_ONLY, default=field.default, annotation=Annotated[kind, option]
            )
        )
    return parameters


def with_scheduler_options(command: Callable) -> Callable:
    """Decorate a typer command that takes ``scheduler_config: SchedulerConfig`` (see module doc)."""
    signature = inspect.signature(command)
    if "scheduler_config" not in signature.parameters:
        raise TypeError(f"{command.__name__} must take a scheduler_config parameter")
    # Resolved here, in the command's module: typer resolves the wrapper's hints in this one.
    hints = typing.get_type_hints(command, include_extras=True)
    kept = [
        p.replace(annotation=hints.get(name, p.annotation))
        for name, p in signature.parameters.items()
        if name != "scheduler_config"
    ]
    generated = scheduler_parameters()
    names = [p.name for p in generated]
    clash = set(names) & {p.name for p in kept}
    if clash:
        raise TypeError(f"{command.__name__} already has parameters named like SchedulerConfig fields: {sorted(clash)}")

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        fields = {name: kwargs.pop(name) for name in names if name in kwargs}
        try:
            config = SchedulerConfig(**fields)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        return command(*args, scheduler_config=config, **kwargs)

    parameters = kept + generated
    wrapper.__signature__ = signature.replace(parameters=parameters)  # what typer reads
    wrapper.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": hints.get("return")}
    del wrapper.__wrapped__  # typer must see the new signature, not the wrapped one
    return wrapper
