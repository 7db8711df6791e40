"""Calling a function through ``torch.compile`` where that pays, with an exact eager fallback.

Used for the elementwise SwiGLU functions on CUDA without the Triton kernels
(``moe/experts.py``) and for the per-step routing statistics (``routing/statistics.py``): a few
fused kernels instead of dozens of small eager launches. The compiled function is built once per
name. If compiling or running it fails (no compiler toolchain, an unsupported build), that name
runs eagerly from then on, with one warning; a genuine error in the function recurs eagerly.
Arguments that need a new compiled variant once torch.compile's recompile limit is reached
(eight per function: a process that routes with many router configurations, such as the test
suite or a comparison of routers in one process) run eagerly, that call only: the variants
compiled so far keep serving their arguments. ``MAXSCORE_COMPILE=0`` turns compilation off.
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
_AT_LIMIT: set[str] = set()


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
    except Exception as exc:
        # What a fullgraph compile raises past the recompile limit (matched by name: importing
        # torch._dynamo here would slow every import of the package).
        if type(exc).__name__ == "FailOnRecompileLimitHit":
            if name not in _AT_LIMIT:
                _AT_LIMIT.add(name)
                warnings.warn(
                    f"{name}: torch.compile's recompile limit reached; calls that would need a "
                    "new compiled variant run eagerly (the compiled ones are still used)",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return fn(*args)
        # a compiler failure: stay correct, eagerly
        _FAILED.add(name)
        warnings.warn(
            f"{name}: torch.compile failed ({type(exc).__name__}: {exc}); running eagerly from now on",
            RuntimeWarning,
            stacklevel=2,
        )
        return fn(*args)
