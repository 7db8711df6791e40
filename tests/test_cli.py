"""The ``maxscore`` CLI: help texts, presets, clear errors, and ``compare``."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from maxscore.cli import build_parser, config_from_args, main


@pytest.mark.parametrize("command", ["train", "compare", "presets"])
def test_help_has_examples(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert "example" in capsys.readouterr().out


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    for command in ("train", "compare", "presets"):
        assert command in out


def test_presets_lists_routers_and_models(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for name in ("gshard", "maxscore", "dropless", "expert-choice", "tiny", "base"):
        assert name in out


def test_flags_map_onto_the_config_and_recipe() -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["train", "--router", "gshard", "--seq-len", "64", "--router-option",
         "capacity_factor=1.25", "--model-option", "num_hidden_layers=2"]
    )  # fmt: skip
    cfg = config_from_args(args)
    assert (cfg.router, cfg.seq_len) == ("gshard", 64)
    assert cfg.router_overrides == {"capacity_factor": 1.25}
    assert cfg.model_overrides == {"num_hidden_layers": 2}
    cfg = config_from_args(parser.parse_args(["train", "--recipe", "paper", "--max-steps", "7"]))
    assert (cfg.seq_len, cfg.max_steps, cfg.lr) == (512, 7, 3e-5)
    assert cfg.compile  # the recipe compiles; an explicit --no-compile wins
    cfg = config_from_args(parser.parse_args(["train", "--recipe", "paper", "--no-compile"]))
    assert not cfg.compile
    args = parser.parse_args(["train", "--compile", "--compile-mode", "max-autotune-no-cudagraphs"])
    cfg = config_from_args(args)
    assert (cfg.compile, cfg.compile_mode) == (True, "max-autotune-no-cudagraphs")
    assert not config_from_args(parser.parse_args(["train"])).compile


def test_config_file_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text("router: gshard\nseq_len: 32\nlr: 0.01\n")
    args = build_parser().parse_args(["train", "--config", str(path), "--lr", "0.02"])
    cfg = config_from_args(args)
    assert (cfg.router, cfg.seq_len, cfg.lr) == ("gshard", 32, 0.02)


def test_bad_input_is_a_clear_error_with_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["train", "--router", "no-such-router", "--output-dir", str(tmp_path / "r")])
    assert code == 2
    err = capsys.readouterr().err
    assert "unknown router preset 'no-such-router'" in err and "maxscore" in err
    assert not (tmp_path / "r").exists()
    assert main(["train", "--router-option", "capacity_factor"]) == 2
    assert main(["compare", "--routers", "gshard,bogus"]) == 2


def test_console_script_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "maxscore.cli", "presets", "model"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "base" in out.stdout


def test_compare_writes_table_csv_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    argv = [
        "compare", "--routers", "gshard,maxscore", "--output-dir", str(out), "--seeds", "1,2",
        "--model-option", "hidden_size=32", "--model-option", "num_hidden_layers=1",
        "--model-option", "num_attention_heads=2", "--model-option", "num_experts=4",
        "--seq-len", "16", "--batch-size", "2", "--max-steps", "4", "--logging-steps", "1",
        "--eval-steps", "2", "--save-steps", "0", "--no-save-final", "--max-eval-blocks", "4",
        "--quiet", "--report-to", "none", "--reruns", "1", "--margin", "0.02",
    ]  # fmt: skip
    assert main(argv) == 0
    md = (out / "comparison.md").read_text()
    assert "val loss (mean ± std over seeds)" in md
    assert "Δ vs gshard (mean [95% t interval over seeds])" in md and "seeds needed" in md
    assert "**maxscore** vs gshard: " in md and "±0.02" in md
    assert "| gshard | 1 |" in md and "| maxscore | 2 |" in md  # the per-run rows
    # --reruns 1: each router's first seed once more, reported as same-seed noise
    assert "## Same-seed reruns" in md and "Same-seed noise over 2 rerun(s)" in md
    assert (out / "maxscore" / "seed-1-rerun-1" / "metrics.jsonl").is_file()
    with (out / "comparison.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["router"], r["seed"]) for r in rows] == [
        ("gshard", "1"), ("gshard", "2"), ("maxscore", "1"), ("maxscore", "2")
    ]  # fmt: skip
    assert all(float(r["eval_loss"]) > 0 and float(r["eval_loss_se"]) > 0 for r in rows)
    # The delta is paired by validation document and seed: the reference's own is 0.
    assert [float(r["delta"]) for r in rows[:2]] == [0.0, 0.0]
    assert all(float(r["delta_se"]) >= 0 for r in rows[2:])
    payload = json.loads((out / "comparison.json").read_text())
    summary = payload["routers"]
    mean = sum(float(r["eval_loss"]) for r in rows[2:]) / 2
    assert summary[1]["router"] == "maxscore" and summary[1]["eval_loss"] == pytest.approx(mean)
    found = summary[1]["evidence"]
    assert found["n"] == 2 and found["df"] == 1 and found["margin"] == 0.02
    assert found["low"] < found["mean"] < found["high"]
    assert "evidence" not in summary[0]  # the reference
    assert [(r["router"], r["rerun"]) for r in payload["reruns"]] == [
        ("gshard", 1), ("maxscore", 1)
    ]  # fmt: skip
    for name in ("loss_curves.png", "loss_differences.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "gshard" / "seed-1" / "metrics.jsonl").is_file()
    bad = ["compare", "--seeds", "1,x", "--output-dir", str(tmp_path / "bad")]
    assert main(bad) == 2 and not (tmp_path / "bad").exists()  # a clear error, nothing run
