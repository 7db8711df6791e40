"""Every Python example in the README runs as written (in a scratch directory); the README's
benchmark table and the benchmark READMEs stay short (the current numbers, not their history)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
BENCHMARK_READMES = sorted(ROOT.glob("benchmarks/*/README.md"))


def test_readme_has_python_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_example_runs(
    index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    exec(compile(BLOCKS[index], f"README.md python block {index}", "exec"), {})


def test_readme_benchmark_table_rows_are_short() -> None:
    """One short sentence per study (the headline number with its card); the details live in
    the study's own README."""
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Benchmarks\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert len(rows) > 10  # the header, its rule and a row per study
    long = {row[:60]: len(row) for row in rows if len(row) >= 400}
    assert not long, f"benchmark table rows of 400 characters or more: {long}"


@pytest.mark.parametrize("path", BENCHMARK_READMES, ids=lambda p: p.parent.name)
def test_benchmark_readmes_are_at_most_250_lines(path: Path) -> None:
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= 250, f"{path.relative_to(ROOT)}: {lines} lines"
