"""Command-line options from a config dataclass's fields, and ``KEY=VALUE`` options.

:func:`add_dataclass_options` gives every field of a config dataclass (:class:`TrainConfig`) a
flag whose name, type, choices and help come from the field itself: its name (``seq_len`` ->
``--seq-len``), its annotation (``int``, ``float``, a ``Literal`` of choices, ``bool`` ->
``--x / --no-x``, ``dict`` -> a repeatable ``KEY=VALUE`` option) and its ``metadata``:

* ``help`` (with ``{default}`` replaced by the field's default) and ``group`` (the ``--help``
  section; ``None``: the parser's own options);
* optional ``flag`` (another flag name, e.g. ``--model-option`` for ``model_overrides``),
  ``metavar``, ``choices`` (for a ``str`` field whose values live elsewhere) and ``switch``
  (an on-only flag, ``--resume``, without ``--no-resume``).

A field without ``help`` gets no flag. :func:`given_options` reads the flags back as the fields
the user set. Its own light module (no torch) so that every command's parser uses it.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from collections.abc import Sequence
from dataclasses import MISSING, Field, fields
from typing import Any, Union

from maxscore.config_types import ConfigError, annotations_of, choices_of

__all__ = ["add_dataclass_options", "given_options", "parse_options"]


def _parse_value(text: str) -> Any:
    """A value: JSON when it parses (numbers, true/false, lists), else a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_options(items: list[str] | None, flag: str) -> dict[str, Any]:
    """``["k=v", ...]`` given with ``flag`` as ``{k: value}``; a :class:`ConfigError` (a
    ``ValueError``) names the flag when an item has no ``=``."""
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"{flag} expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        out[key.strip()] = _parse_value(value)
    return out


def _flag(f: Field[Any]) -> str:
    return str(f.metadata.get("flag", "--" + f.name.replace("_", "-")))


def _value_type(annotation: Any) -> Any:
    """``int | None`` -> ``int``: the type a flag's value has."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        kinds = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return kinds[0] if len(kinds) == 1 else str
    return typing.get_origin(annotation) or annotation


def _default(f: Field[Any]) -> Any:
    return f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]


def add_dataclass_options(
    parser: argparse.ArgumentParser,
    cls: type,
    exclude: frozenset[str] = frozenset(),
    sections: Sequence[str] = (),
) -> None:
    """Add a flag for every field of dataclass ``cls`` that has ``help`` (module docstring),
    except the fields named in ``exclude``. Every flag defaults to ``None``: not given.
    ``sections``: the ``--help`` sections to show first, in this order."""
    hints = annotations_of(cls)
    groups: dict[str, Any] = {name: parser.add_argument_group(name) for name in sections}

    def place(f: Field[Any]) -> int:  # listed sections first, the parser's own options last
        group = f.metadata.get("group")
        if group is None:
            return len(sections) + 1
        return sections.index(group) if group in sections else len(sections)

    for f in sorted(fields(cls), key=place):
        meta = f.metadata
        if f.name in exclude or "help" not in meta:
            continue
        group = meta["group"]
        target = parser if group is None else groups.get(group)
        if target is None:
            target = groups[group] = parser.add_argument_group(group)
        options: dict[str, Any] = {"dest": f.name, "default": None}
        options["help"] = meta["help"].format(default=_default(f))
        kind = _value_type(hints[f.name])
        choices = meta.get("choices") or choices_of(hints[f.name])
        if kind is dict:
            options["action"] = "append"
        elif kind is bool:
            options["action"] = (
                "store_true" if meta.get("switch") else argparse.BooleanOptionalAction
            )
        elif choices:
            options["choices"] = list(choices)
        elif kind in (int, float):
            options["type"] = kind
        if "metavar" in meta:
            options["metavar"] = meta["metavar"]
        target.add_argument(_flag(f), **options)


def given_options(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of ``cls`` set on the command line (flags from :func:`add_dataclass_options`):
    ``{name: value}``, a repeatable ``KEY=VALUE`` option as a dict."""
    out: dict[str, Any] = {}
    for f in fields(cls):
        value = getattr(args, f.name, None)
        if value is None:
            continue
        out[f.name] = parse_options(value, _flag(f)) if isinstance(value, list) else value
    return out
