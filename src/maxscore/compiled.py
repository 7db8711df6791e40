"""Calling a function through ``torch.compile`` where that pays, with an exact eager fallback.

Used for the elementwise SwiGLU functions on CUDA without the Triton kernels
(``moe/experts.py``) and for the per-step routing statistics (``routing/statistics.py``): a few
fused kernels instead of dozens of small eager launches. The compiled function is built once per
name. If compiling or running it fails (no compiler toolchain, an unsupported build), that name
runs eagerly from then on, with one warning; a genuine error in the function recurs eagerly.
``MAXSCORE_COMPILE=0`` turns compilation off.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["call_compiled"]

_COMPILED: dict[str, Callable[..., Any]] = {}
_FAILED: set[str] = set()


def call_compiled(
    name: str, fn: Callable[..., Any], *args: Any, enabled: bool = True, dynamic: bool = False
) -> Any:
    """``fn(*args)``, through ``torch.compile(fn, dynamic=dynamic, fullgraph=True)`` when
    ``enabled`` (the caller's condition, e.g. a CUDA input). Inside a graph being compiled the
    function is called as it is (dynamo traces it into that graph)."""
    if (
        not enabled
        or name in _FAILED
        or torch.compiler.is_compiling()
        or os.environ.get("MAXSCORE_COMPILE", "1") == "0"
    ):
        return fn(*args)
    compiled = _COMPILED.get(name)
    if compiled is None:
        compiled = _COMPILED[name] = torch.compile(fn, dynamic=dynamic, fullgraph=True)
    try:
        return compiled(*args)
    except Exception as exc:  # a compiler failure: stay correct, eagerly
        _FAILED.add(name)
        warnings.warn(
            f"{name}: torch.compile failed ({type(exc).__name__}: {exc}); running eagerly from now on",
            RuntimeWarning,
            stacklevel=2,
        )
        return fn(*args)
