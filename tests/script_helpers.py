"""Benchmark scripts loaded as modules for their tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark_script(folder: str, script: str) -> ModuleType:
    """``benchmarks/<folder>/<script>.py`` as the module ``<folder>_<script>``: several folders
    have a script of one name (``report.py``), which a plain import would mix up."""
    name = f"{folder}_{script}"
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / folder / f"{script}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while a class is built
    spec.loader.exec_module(module)
    return module
