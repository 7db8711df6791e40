"""Package attributes that import their module on first use (PEP 562).

``maxscore --help`` must start without importing torch, transformers or matplotlib (each costs
seconds); the packages' public names therefore resolve lazily::

    __getattr__, __dir__ = lazy_exports(__name__, {"maxscore.training.run": ("train",)})
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, tuple[str, ...]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``; ``exports`` maps a module to its names."""
    home = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = home.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    def __dir__() -> list[str]:
        return sorted(home)

    return __getattr__, __dir__
