"""Checking option values against the type annotations of a typed config.

Configs here are dataclasses (``TrainConfig``, ``RouterConfig``) or annotated classes
(``LlamaMoEConfig``); values reach them from JSON/YAML files and ``KEY=VALUE`` flags, where
``capacity_factor=abc`` arrives as a string. :func:`check_value` says, in one sentence, what is
wrong with such a value before it can fail later as an unrelated ``TypeError`` (or not at all).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

__all__ = ["annotations_of", "check_dataclass_types", "check_value", "type_name"]


def annotations_of(cls: type, own_only: bool = False) -> dict[str, Any]:
    """The resolved annotations of ``cls`` (``own_only``: without those of its bases)."""
    # Own annotations are evaluated alone: a base class (transformers' PreTrainedConfig) may
    # annotate with names its module only imports for type checkers.
    hints = inspect.get_annotations(cls, eval_str=True) if own_only else typing.get_type_hints(cls)
    return {
        name: hint for name, hint in hints.items() if typing.get_origin(hint) is not typing.ClassVar
    }


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


def check_dataclass_types(obj: Any, what: str, error: type[Exception] = ValueError) -> None:
    """Raise ``error`` naming the first field of dataclass ``obj`` whose value has a wrong type."""
    hints = annotations_of(type(obj))
    for f in dataclasses.fields(obj):
        problem = check_value(f.name, getattr(obj, f.name), hints.get(f.name, Any))
        if problem is not None:
            raise error(f"{what}: {problem}")
