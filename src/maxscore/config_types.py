"""Checking a typed config's values: one generic checker for every config dataclass.

Configs here are dataclasses (``TrainConfig``, ``RouterConfig``, ``TemperatureScheduleConfig``)
or annotated classes (``LlamaMoEConfig``); values reach them from JSON/YAML files and
``KEY=VALUE`` flags, where ``capacity_factor=abc`` arrives as a string. :func:`check_fields`
checks each field against its type annotation (``Literal`` choices included, so a field's
choices are written once, in its type) and then against the :class:`Rule` objects in its
``field(metadata={"rules": ...})``, and says in one sentence what is wrong before the value can
fail later as an unrelated ``TypeError`` (or not at all). :func:`option` builds the metadata of a
field that is also a command-line option (:mod:`maxscore.cli_options` reads it).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union

__all__ = [
    "ConfigError",
    "Rule",
    "annotations_of",
    "at_least",
    "check_fields",
    "check_value",
    "choices_of",
    "greater_than",
    "option",
    "type_name",
    "within",
]


class ConfigError(ValueError):
    """A configuration that cannot work; raised before anything runs (a command line prints it
    as one line)."""


@dataclass(frozen=True)
class Rule:
    """A condition on one field's value beyond its type.

    ``test(value)`` is true for an acceptable value; ``message`` says what the value must be,
    formatted with ``name`` and ``value`` (``"{name} must be > 0, got {value}"``). ``None``
    values are not tested (an optional field that is not set).
    """

    test: Callable[[Any], bool]
    message: str

    def problem(self, name: str, value: Any) -> str | None:
        if value is None or self.test(value):
            return None
        return self.message.format(name=name, value=value)


def at_least(low: float, note: str = "") -> Rule:
    """``value >= low`` (``note``: a parenthesis after the bound, e.g. what 0 means)."""
    return Rule(lambda value: value >= low, f"{{name}} must be >= {low}{note}, got {{value}}")


def greater_than(low: float) -> Rule:
    """``value > low``."""
    return Rule(lambda value: value > low, f"{{name}} must be > {low}, got {{value}}")


def within(low: float, high: float, *, label: str | None = None, open_high: bool = False) -> Rule:
    """``low <= value <= high`` (``< high`` with ``open_high``); ``label`` names the interval."""
    interval = label or f"[{low}, {high}{')' if open_high else ']'}"
    if open_high:
        return Rule(
            lambda value: low <= value < high, f"{{name}} must be in {interval}, got {{value}}"
        )
    return Rule(
        lambda value: low <= value <= high, f"{{name}} must be in {interval}, got {{value}}"
    )


def option(
    *,
    help: str,
    group: str | None,
    rules: tuple[Rule, ...] = (),
    runtime: bool = False,
    **flag: Any,
) -> dict[str, Any]:
    """The ``metadata`` of a config field that is also a command-line option.

    Args:
        help: the command-line help; ``{default}`` is replaced by the default value.
        group: the ``--help`` section of its flag (``None``: the parser's own options).
        rules: conditions the value must meet (:func:`check_fields`).
        runtime: the field says where or how to run, not what is trained (a ``--resume`` may
            change it: ``maxscore.training.config.RUNTIME_FIELDS``).
        flag: how the flag differs from the generated one (``flag="--model-option"``,
            ``metavar="N"``, ``choices=...``, ``switch=True`` for an on-only flag; see
            :func:`maxscore.cli_options.add_dataclass_options`).
    """
    return {"help": help, "group": group, "rules": rules, "runtime": runtime, **flag}


def annotations_of(cls: type, own_only: bool = False) -> dict[str, Any]:
    """The resolved annotations of ``cls`` (``own_only``: without those of its bases)."""
    # Own annotations are evaluated alone: a base class (transformers' PreTrainedConfig) may
    # annotate with names its module only imports for type checkers.
    hints = inspect.get_annotations(cls, eval_str=True) if own_only else typing.get_type_hints(cls)
    return {
        name: hint for name, hint in hints.items() if typing.get_origin(hint) is not typing.ClassVar
    }


def choices_of(annotation: Any) -> tuple[Any, ...] | None:
    """The values of a ``Literal`` annotation (``Literal[...] | None``: without ``None``)."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        found = [choices_of(arg) for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(found) == 1:
            return found[0]
    return None


def type_name(annotation: Any) -> str:
    """``int | None`` -> ``"an integer or null"`` (how a value of this type is described)."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(arg) for arg in typing.get_args(annotation))
    if origin is Literal:
        return "one of " + ", ".join(repr(choice) for choice in typing.get_args(annotation))
    if origin in (dict, Mapping) or annotation is dict:
        return "an object ({...})"
    if origin is list or annotation is list:
        return "a list"
    if dataclasses.is_dataclass(annotation):
        keys = ", ".join(f.name for f in dataclasses.fields(annotation))
        return f"an object with keys {keys}"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if annotation is type(None):
        return "null"
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _matches(value: Any, annotation: Any) -> bool:
    if annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(annotation))
    if origin is Literal:
        return any(
            value == choice and type(value) is type(choice)
            for choice in typing.get_args(annotation)
        )
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return number and math.isfinite(value)
    if annotation is str:
        return isinstance(value, str)
    if origin in (dict, Mapping) or annotation is dict:
        return isinstance(value, dict)
    if origin is list or annotation is list:
        return isinstance(value, list)
    if dataclasses.is_dataclass(annotation):
        return isinstance(value, annotation | dict)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True  # an annotation this checker does not model: left to the config itself


def check_value(name: str, value: Any, annotation: Any) -> str | None:
    """``None`` if ``value`` fits ``annotation``, else the sentence saying what is expected."""
    if _matches(value, annotation):
        return None
    return f"{name} must be {type_name(annotation)}, got {value!r} ({type(value).__name__})"


def check_fields(obj: Any, what: str, error: type[Exception] = ValueError) -> None:
    """Raise ``error`` for the first field of dataclass ``obj`` that breaks its type annotation
    or one of its metadata ``rules``; the message starts with ``what`` (the config's name)."""
    hints = annotations_of(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        problem = check_value(f.name, value, hints.get(f.name, Any))
        for rule in f.metadata.get("rules", ()) if problem is None else ():
            problem = rule.problem(f.name, value)
            if problem is not None:
                break
        if problem is not None:
            raise error(f"{what}: {problem}")
