"""``benchmarks/expert_parallel/report.py``: the README block of one ``run_gpus.sh`` call, from
its files (here the 2-GPU test report kept in the repository and constructed pytest output)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from script_helpers import load_benchmark_script

report = load_benchmark_script("expert_parallel", "report")

HERE = Path(__file__).resolve().parent.parent / "benchmarks" / "expert_parallel"

PYTEST_OUTPUT = """\
PASSED tests/test_expert_parallel_gpu.py::test_expert_parallel_matches_one_gpu[gshard]
FAILED tests/test_expert_parallel_gpu.py::test_deepspeed_is_close_to_ddp[zero3] - AssertionError
SKIPPED [1] tests/test_expert_parallel_gpu.py:425: deepspeed is not installed
=================== 1 passed, 1 failed, 1 skipped in 122.74s ===================
"""


@pytest.fixture
def call_folder(tmp_path: Path) -> Path:
    """A call's $OUT: versions, the kept 2-GPU test report, pytest's output."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "versions.txt").write_text("NVIDIA H200, 143771 MiB\ncommit abc1234 a change\n")
    shutil.copyfile(HERE / "gpu_tests_2gpu_h200.json", out / "gpu_tests.json")
    (out / "gpu_tests.txt").write_text(PYTEST_OUTPUT)
    return out


def test_render_states_the_outcomes_and_the_measured_gaps(call_folder: Path) -> None:
    gpus, markdown = report.render(call_folder)
    assert gpus == 2
    assert "Measured: NVIDIA H200, 143771 MiB; commit abc1234 a change." in markdown
    assert "`test_expert_parallel_gpu.py`: 1 passed, 1 failed, 1 skipped in 122.74s." in markdown
    assert "`test_expert_parallel_layouts.py`: not run." in markdown
    assert "* test_expert_parallel_matches_one_gpu[gshard]: passed" in markdown
    assert "* test_deepspeed_is_close_to_ddp[zero3]: failed (AssertionError)" in markdown
    assert "* skipped: deepspeed is not installed" in markdown
    # The kept report's numbers: GShard's step-1 gap 9.13e-8, largest gap 0.94% at step 43.
    gshard = next(line for line in markdown.splitlines() if line.startswith("| gshard |"))
    assert "9.1e-08, 0 of 8192" in gshard and "0.94% (43)" in gshard
    assert "| DeepSpeed zero2 vs DDP, 30 steps | 0.0e+00 | 0.88% (28) | 0.093% |" in markdown


def test_write_replaces_only_its_own_block_and_keeps_the_raw_files(
    call_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(
        "intro\n### 2 GPUs\n\n<!-- report:2gpu -->\nold\n<!-- /report:2gpu -->\n\nkept\n"
        "## Not run\n\nrest\n"
    )
    monkeypatch.setattr(report, "README", readme)
    monkeypatch.setattr(report, "HERE", tmp_path)
    gpus, markdown = report.render(call_folder)
    report.write(call_folder, gpus, markdown)
    text = readme.read_text()
    assert "old" not in text and text.count("<!-- report:2gpu -->") == 1
    assert text.startswith("intro\n### 2 GPUs\n\n<!-- report:2gpu -->\nMeasured:")
    assert text.endswith("<!-- /report:2gpu -->\n\nkept\n## Not run\n\nrest\n")
    assert (tmp_path / "results" / "2gpu" / "gpu_tests.json").is_file()
    # A count without a block gets its own section before "## Not run".
    report.write(call_folder, 8, markdown)
    text = readme.read_text()
    assert "### 8 GPUs (raw files: `results/8gpu/`)\n\n<!-- report:8gpu -->" in text
    assert text.index("<!-- /report:8gpu -->") < text.index("## Not run")


def test_a_folder_that_is_not_a_call_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"no versions\.txt"):
        report.render(tmp_path)
