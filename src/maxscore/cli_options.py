"""``KEY=VALUE`` command-line options (``--model-option``, ``--router-option``) into a dict.

Its own light module (no torch) so that every command's parser uses it without importing the
others.
"""

from __future__ import annotations

import json
from typing import Any

from maxscore.training.errors import ConfigError

__all__ = ["parse_options"]


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
