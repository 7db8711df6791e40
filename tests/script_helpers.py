"""Benchmark scripts loaded as modules for their tests."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from common import load_script  # noqa: E402


def load_benchmark_script(folder: str, script: str) -> ModuleType:
    """``benchmarks/<folder>/<script>.py`` as the module ``<folder>_<script>``: several folders
    have a script of one name (``report.py``), which a plain import would mix up."""
    return load_script(BENCHMARKS / folder / f"{script}.py", f"{folder}_{script}")
