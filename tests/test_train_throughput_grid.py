"""``benchmarks/train_throughput/grid.py``: the presets spread over GPUs, every run's command,
and the table computed from constructed result files (hand-computed ratios)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from script_helpers import load_benchmark_script

grid = load_benchmark_script("train_throughput", "grid")


def test_presets_are_balanced_over_the_gpus() -> None:
    lanes = grid.assign(list(grid.BASELINES), 2)
    assert sorted(p for lane in lanes for p in lane) == sorted(grid.BASELINES)
    loads = [sum(grid.EXPECTED_S[p] for p in lane) for lane in lanes]
    # Longest first onto the least loaded GPU: within the longest preset of each other.
    assert abs(loads[0] - loads[1]) <= max(grid.EXPECTED_S.values())
    assert grid.assign(["base"], 4) == [["base"], [], [], []]
    with pytest.raises(ValueError, match="at least one GPU"):
        grid.assign(["base"], 0)


def test_each_preset_runs_its_baseline_and_maxscore_per_precision(tmp_path: Path) -> None:
    args = argparse.Namespace(steps=240, warmup=200, batch_size=64)
    cmd = grid.bench_command(args, "deepseek-base", "fp8", tmp_path)
    assert cmd[1] == str(grid.BENCH) and cmd[2] == "run" and "--compile" in cmd
    value = {cmd[i]: cmd[i + 1] for i in range(3, len(cmd) - 1) if cmd[i].startswith("--")}
    assert value["--runs"] == "deepseek-base:deepseek,deepseek-base:maxscore"
    assert value["--precision"] == "fp8" and value["--tag"] == "deepseek-base_fp8"
    assert (value["--steps"], value["--warmup"], value["--batch-size"]) == ("240", "200", "64")
    assert grid.routers_of("dense-base") == ["dense"]


def _result(router: str, tokens_per_s: float, dropped: float | None = 0.0) -> dict:
    return {
        "router": router,
        "step_ms": 64 * 512 / tokens_per_s * 1000,
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s / 1e6,
        "peak_memory_gib_rank0": 20.0,
        "dropped": dropped,
    }


def _write_run(folder: Path, gpus: int, results: dict[tuple[str, str], list[dict]]) -> None:
    """A folder as ``grid.py run`` leaves it: per GPU the bench files, and grid.json."""
    lanes: dict[int, list[dict]] = {}
    for index, ((preset, precision), rows) in enumerate(results.items()):
        gpu = index % gpus
        (folder / f"gpu{gpu}").mkdir(parents=True, exist_ok=True)
        document = {"meta": {"precision": precision}, "results": rows}
        (folder / f"gpu{gpu}" / f"{preset}_{precision}.json").write_text(json.dumps(document))
        lanes.setdefault(gpu, []).append({"preset": preset, "precision": precision, "exit": 0})
    runs = [{"gpu": g, "runs": r} for g, r in lanes.items()]
    (folder / "grid.json").write_text(json.dumps({"gpus": gpus, "lanes": runs}))


def test_table_ratios_are_within_one_preset_and_gpu(tmp_path: Path) -> None:
    _write_run(
        tmp_path,
        1,
        {
            ("base", "bf16"): [_result("gshard", 400_000, 0.25), _result("maxscore", 380_000)],
            ("base", "fp8"): [_result("gshard", 420_000, 0.25), _result("maxscore", 399_000)],
            ("dense-base", "bf16"): [_result("dense", 500_000, None)],
        },
    )
    rows = grid.table(grid.collect(tmp_path))
    assert len(rows) == 2 + 3
    gshard, maxscore, dense = (row.split(" | ") for row in rows[2:])
    assert gshard[10] == "1.050" and gshard[11] == "25.0%"  # fp8 / bf16; dropped
    assert maxscore[10] == "1.050" and maxscore[12] == "**0.950**"  # 380k / 400k
    assert maxscore[13].rstrip(" |") == "0.950"  # 399k / 420k
    assert maxscore[5] == "38.0%" and maxscore[11] == "0"
    # A precision that was not run shows as "-", never as a number.
    assert dense[7] == "-" and dense[10] == "-" and dense[11] == "-"


def test_a_failed_run_is_stated_never_a_number_or_a_crash(tmp_path: Path) -> None:
    """A run that failed leaves ``{"router", "error"}`` in its file (bench.py keeps going): its
    cells say "failed", no ratio uses it, and its error follows the table."""
    error = "ConfigError: precision fp8 needs torchao, which is not installed"
    _write_run(
        tmp_path,
        1,
        {
            ("base", "bf16"): [_result("gshard", 400_000, 0.25), _result("maxscore", 380_000)],
            ("base", "fp8"): [{"router": "gshard", "error": error}, _result("maxscore", 399_000)],
        },
    )
    rows = grid.table(grid.collect(tmp_path))
    gshard, maxscore = (row.split(" | ") for row in rows[2:4])
    assert gshard[7:11] == ["failed", "failed", "failed", "-"]  # fp8 ms, MFU, GiB; fp8 / bf16
    assert maxscore[12] == "**0.950**" and maxscore[13].rstrip(" |") == "-"  # vs failed gshard
    assert rows[-1] == f"base / gshard / fp8 failed: {error}"


def test_run_trains_every_preset_in_both_precisions_and_report_writes_the_readme(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run`` end to end on the CPU with a stand-in for bench.py (writes a result file the way
    it does), then ``report --write`` into a README with the markers."""
    fake = tmp_path / "fake_bench.py"
    fake.write_text(
        "import json, os, sys\n"
        "a = sys.argv\n"
        "out, tag, runs = (a[a.index(k) + 1] for k in ('--output', '--tag', '--runs'))\n"
        "rows = [{'router': r.split(':')[1], 'step_ms': 80.0, 'tokens_per_s': 4e5, 'mfu': 0.36,\n"
        "         'peak_memory_gib_rank0': 26.5, 'dropped': 0.0,\n"
        "         'gpu': os.environ['CUDA_VISIBLE_DEVICES']} for r in runs.split(',')]\n"
        "json.dump({'meta': {}, 'results': rows}, open(os.path.join(out, tag + '.json'), 'w'))\n"
    )
    monkeypatch.setattr(
        grid, "bench_command", lambda args, p, prec, out: [sys.executable, str(fake), "run",
        "--output", str(out), "--tag", f"{p}_{prec}",
        "--runs", ",".join(f"{p}:{r}" for r in grid.routers_of(p))],
    )  # fmt: skip
    out = tmp_path / "out"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    grid.main(["run", "--output", str(out), "--gpus", "2", "--presets", "base,dense-base"])
    layout = json.loads((out / "grid.json").read_text())
    assert [len(lane["runs"]) for lane in layout["lanes"]] == [2, 2]
    for lane in layout["lanes"]:
        for entry in lane["runs"]:
            assert entry["exit"] == 0
            result = out / f"gpu{lane['gpu']}" / f"{entry['preset']}_{entry['precision']}.json"
            rows = json.loads(result.read_text())["results"]
            assert {r["gpu"] for r in rows} == {str(lane["gpu"])}  # one GPU per list
    # A second call with another preset adds to the same folder; the caller's visible GPUs
    # are the ones used.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    grid.main(["run", "--output", str(out), "--gpus", "1", "--presets", "base-2x32"])
    assert set(grid.collect(out)["presets"]) == {"base", "dense-base", "base-2x32"}
    rows = json.loads((out / "gpu0" / "base-2x32_bf16.json").read_text())["results"]
    assert {r["gpu"] for r in rows} == {"3"}
    assert grid.collect(out)["presets"]["base-2x32"]["gpu"] == "3"
    # A preset run again replaces its earlier runs, both precisions (its ratios stay in a call).
    grid.main(["run", "--output", str(out), "--gpus", "1", "--presets", "base"])
    base = grid.collect(out)["presets"]["base"]
    assert base["gpu"] == "3" and {r["device"] for r in base["runs"].values()} == {"3"}
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{grid.START}\nold table\n{grid.END}\nrest\n")
    monkeypatch.setattr(grid, "HERE", tmp_path)
    merged = tmp_path / "merged.json"
    grid.main(["report", str(out), "--output", str(merged), "--write", "--note", "a machine"])
    text = readme.read_text()
    assert "old table" not in text and text.startswith("intro\n") and text.endswith("rest\n")
    assert "| base | maxscore | " in text and "**1.000**" in text
    assert json.loads(merged.read_text())["note"] == "a machine"


def test_unknown_preset_and_a_readme_without_markers_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"unknown preset\(s\) \['bse'\]"):
        grid.main(["run", "--output", str(tmp_path), "--gpus", "1", "--presets", "bse"])
    assert not (tmp_path / "grid.json").exists()
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit, match="no <!-- grid -->"):
        grid.write_readme(readme, ["| a |"])
    assert readme.read_text() == "no markers\n"
