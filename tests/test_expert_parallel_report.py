"""``benchmarks/expert_parallel/report.py``: the README block of ``run_gpus.sh`` calls, from
their files (here the 2-GPU test report kept in the repository, constructed pytest output and
constructed benchmark summaries)."""

from __future__ import annotations

import dataclasses
import json
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
    rendered = report.render(call_folder)
    gpus, markdown = rendered.gpus, rendered.full
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
    # The README's summary: the outcomes and where the rest is, not the tests' tables.
    assert "`test_expert_parallel_gpu.py`: 1 passed, 1 failed" in rendered.summary
    assert "| gshard |" not in rendered.summary
    assert rendered.summary.rstrip().endswith("[`results/2gpu/REPORT.md`](results/2gpu/REPORT.md).")


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
    rendered = report.render(call_folder)
    report.write([call_folder], rendered)
    text = readme.read_text()
    assert "old" not in text and text.count("<!-- report:2gpu -->") == 1
    assert text.startswith("intro\n### 2 GPUs\n\n<!-- report:2gpu -->\nMeasured:")
    assert text.endswith("<!-- /report:2gpu -->\n\nkept\n## Not run\n\nrest\n")
    assert (tmp_path / "results" / "2gpu" / "gpu_tests.json").is_file()
    full = (tmp_path / "results" / "2gpu" / "REPORT.md").read_text()
    assert full.startswith("# Expert parallelism on 2 GPUs") and rendered.full in full
    assert rendered.full not in text and rendered.summary in text
    # A count without a block gets its own section before "## Not run".
    report.write([call_folder], dataclasses.replace(rendered, gpus=8))
    text = readme.read_text()
    assert "### 8 GPUs (raw files: `results/8gpu/`)\n\n<!-- report:8gpu -->" in text
    assert text.index("<!-- /report:8gpu -->") < text.index("## Not run")


def test_a_folder_that_is_not_a_call_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"no versions\.txt"):
        report.render(tmp_path)


def _bench_call(folder: Path, preset: str, one: dict[str, float], two: dict[str, float]) -> Path:
    """A ``PHASES=bench PRESETS=<preset>`` call's folder: tokens/s per router on 1 and 2 GPUs,
    summarised by ``bench.py summarize`` (so its scaling is computed within this call)."""
    bench = load_benchmark_script("expert_parallel", "bench")
    folder.mkdir()
    (folder / "versions.txt").write_text(f"NVIDIA H200; bench {preset}\n")
    sweep = folder / "sweep"
    sweep.mkdir()
    meta = {"seq_len": 512, "steps": 240, "warmup_steps_excluded": 200}
    for gpus, speeds in ((1, one), (2, two)):
        rows = [
            {"preset": preset, "router": router, "gpus": gpus, "tokens_per_s": tps, "mfu": 0.3}
            for router, tps in speeds.items()
        ]
        (sweep / f"gpus{gpus}.json").write_text(json.dumps({"meta": meta, "results": rows}))
    bench.main(
        ["summarize", str(sweep), "--output", str(folder / f"expert_parallel_2gpu_{preset}.json")]
    )
    return folder


def test_several_calls_make_one_block_with_each_calls_own_ratios(
    call_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    one, two = {"gshard": 100.0, "maxscore": 95.0}, {"gshard": 190.0, "maxscore": 171.0}
    first = _bench_call(tmp_path / "b1", "base-2x64", one, two)
    one, two = {"gshard": 80.0, "maxscore": 76.0}, {"gshard": 160.0, "maxscore": 150.4}
    second = _bench_call(tmp_path / "b2", "base-8x128", one, two)
    rendered = report.render(call_folder, first, second)
    markdown = rendered.full
    assert rendered.gpus == 2
    assert "Measured in 3 calls:" in markdown and "3. NVIDIA H200; bench base-8x128." in markdown
    assert "* test_expert_parallel_matches_one_gpu[gshard]: passed" in markdown
    # 171 / (2 x 95) = 90.0% scaling, 171 / 190 = 0.900 of gshard; 150.4 / 152 = 98.9%, 0.940.
    assert "| base-2x64 | maxscore | 2 | 171 | 95 | 1.80 | 90.0% | 0.900 | 30.0% |" in markdown
    assert "| base-8x128 | maxscore | 2 | 150 | 76 | 1.98 | 98.9% | 0.940 | 30.0% |" in markdown
    assert "| base-8x128 | maxscore | 1 | 76 | - | - | - | 0.950 | 30.0% |" in markdown
    # The README's table: a row per preset and router, a column per GPU count.
    summary = rendered.summary.splitlines()
    assert "| preset | router | 1 GPU | 2 GPUs |" in summary
    assert "| base-2x64 | gshard | 100 | 190 (95.0%) |" in summary
    assert "| base-2x64 | maxscore | 95 (0.950) | 171 (90.0%, 0.900) |" in summary
    assert "| base-8x128 | maxscore | 76 (0.950) | 150 (98.9%, 0.940) |" in summary
    monkeypatch.setattr(report, "README", tmp_path / "README.md")
    monkeypatch.setattr(report, "HERE", tmp_path)
    (tmp_path / "README.md").write_text("## Not run\n")
    report.write([call_folder, first, second], rendered)
    raw = tmp_path / "results" / "2gpu"
    merged = json.loads((raw / "expert_parallel.json").read_text())
    assert len(merged["runs"]) == 8 and len(merged["scaling"]) == 4
    assert (raw / "gpu_tests.json").is_file()
    assert (raw / "versions.txt").read_text().count("# call ") == 3


def test_two_calls_with_tests_or_two_machine_sizes_are_refused(
    call_folder: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    shutil.copytree(call_folder, other)
    with pytest.raises(SystemExit, match=r"gpu_tests output is in 2 of the folders"):
        report.render(call_folder, other)
    four = tmp_path / "four"
    four.mkdir()
    (four / "versions.txt").write_text("4 GPUs\n")
    (four / "expert_parallel_4gpu.json").write_text(json.dumps({"runs": [], "scaling": []}))
    with pytest.raises(SystemExit, match=r"different sizes \(\[2, 4\] GPUs\)"):
        report.render(call_folder, four)


def test_a_run_in_two_calls_is_refused(tmp_path: Path) -> None:
    speeds = {"gshard": 100.0, "maxscore": 95.0}
    first = _bench_call(tmp_path / "b1", "base-2x64", speeds, speeds)
    again = _bench_call(tmp_path / "b2", "base-2x64", speeds, speeds)
    with pytest.raises(SystemExit, match=r"base-2x64 / gshard on 1 GPUs is in two of the calls"):
        report.render(first, again)


def test_layout_table_states_each_window_and_the_chaos_past_it() -> None:
    layouts = {
        "processes": 4,
        "steps": 30,
        "expert_parallel_a": 2,
        "dp_ep_fsdp_vs_one": {"steps": [1, 30], "step1_rel": 9.1e-8, "window_max_rel": 2.9e-6,
                              "max_rel": 3.4e-3, "max_rel_step": 28, "mean_rel": 4.1e-4},
        "two_agents_vs_one_launch": {"steps": [1, 30], "step1_rel": 0.0, "window_max_rel": 0.0,
                                     "max_rel": 0.0, "checkpoint_max_abs_diff":
                                     {"checkpoint-10": 0.0, "checkpoint-30": 1.5e-6}},
        "reshard_chain": {
            "w_to_half": {"steps": [11, 30], "window_max_rel": 9.6e-7, "max_rel": 1.2e-4,
                          "max_rel_step": 29, "mean_rel": 2.0e-5},
            "c_vs_one_process": {"max_rel": 3.4e-3, "mean_rel": 4.0e-4},
            "final_weights_max_rel_norm": 0.14,
            "uninterrupted_max_rel_norm": 0.13,
        },
    }  # fmt: skip
    lines = report.layout_table(layouts)
    assert (
        "| dp 2 x ep 2 + FSDP2 vs 1 GPU | 1-30 | 9.1e-08 | 2.9e-06 | 3.4e-03 (28) | 4.1e-04 | - |"
        in lines
    )
    assert lines[-1].startswith("The chain's last run against the one-GPU run")
    agents = next(line for line in lines if line.startswith("| two torchrun agents"))
    assert agents.endswith("| checkpoint-10: 0.0e+00, checkpoint-30: 1.5e-06 |")
    reshard = next(line for line in lines if "resharded 4 -> 2 vs the 4-GPU run" in line)
    assert "| 11-30 | - | 9.6e-07 | 1.2e-04 (29) | 2.0e-05 | - |" in reshard
    assert not any("then 2 -> 1" in line for line in lines)  # no row without its numbers


def test_failed_and_skipped_runs_are_stated_in_the_summary(tmp_path: Path) -> None:
    call = tmp_path / "call"
    call.mkdir()
    (call / "versions.txt").write_text("NVIDIA H200\n")
    bench = {
        "runs": [{"preset": "base-8x128", "router": "maxscore", "gpus": 2, "error": "OOM"}],
        "scaling": [],
        "skipped": ["base-2x64:gshard on 2 GPUs"],
    }
    (call / "expert_parallel_2gpu.json").write_text(json.dumps(bench))
    summary = report.render(call).summary
    assert "base-8x128 / maxscore on 2 GPUs failed: OOM" in summary
    assert "Not run (no time left in the call): base-2x64:gshard on 2 GPUs." in summary
