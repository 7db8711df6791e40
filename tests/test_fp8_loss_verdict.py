"""The fp8-against-bf16 loss verdict (benchmarks/train_throughput/fp8_loss.py) on constructed
losses: equal precisions land within the seed spread, a shift of several spreads does not, and
inputs that cannot give a paired spread are refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "train_throughput"))

import fp8_loss


def test_same_losses_are_within_the_spread() -> None:
    bf16 = {0: 3.50, 1: 3.52, 2: 3.48}
    result = fp8_loss.fp8_verdict(bf16, {0: 3.51, 1: 3.49, 2: 3.50})
    assert result["within"] and result["verdict"] == "within the bf16 seed spread"
    assert result["bf16_seed_sd"] == pytest.approx(0.02)
    assert result["mean_difference"] == pytest.approx(0.0)
    assert result["paired_difference"] == pytest.approx({"0": 0.01, "1": -0.03, "2": 0.02})


def test_a_shift_of_several_spreads_is_outside() -> None:
    bf16 = {0: 3.50, 1: 3.52, 2: 3.48}
    result = fp8_loss.fp8_verdict(bf16, {s: v + 0.1 for s, v in bf16.items()})
    assert not result["within"] and result["verdict"] == "outside the bf16 seed spread"
    assert result["mean_difference"] == pytest.approx(0.1)
    # a gain of that size is outside too: the check is two-sided
    assert not fp8_loss.fp8_verdict(bf16, {s: v - 0.1 for s, v in bf16.items()})["within"]


def test_the_boundary_is_one_standard_deviation() -> None:
    bf16 = {0: 1.0, 1: 3.0}  # sd = sqrt(2)
    assert fp8_loss.fp8_verdict(bf16, {0: 2.0 + 1.41, 1: 2.0 + 1.41})["within"]
    assert not fp8_loss.fp8_verdict(bf16, {0: 2.0 + 1.42, 1: 2.0 + 1.42})["within"]


@pytest.mark.parametrize(
    ("bf16", "fp8", "message"),
    [
        ({0: 3.5}, {0: 3.5}, ">= 2 seeds"),
        ({0: 3.5, 1: 3.6}, {0: 3.5, 2: 3.6}, "share their seeds"),
        ({0: 3.5, 1: float("nan")}, {0: 3.5, 1: 3.6}, "not finite"),
    ],
)
def test_refuses_what_gives_no_paired_spread(
    bf16: dict[int, float], fp8: dict[int, float], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        fp8_loss.fp8_verdict(bf16, fp8)


def test_report_reads_the_run_folders(tmp_path: Path) -> None:
    losses = {("bf16", 0): 3.5, ("bf16", 1): 3.6, ("fp8", 0): 3.55, ("fp8", 1): 3.58}
    for (precision, seed), loss in losses.items():
        run = tmp_path / "runs" / fp8_loss.run_name(precision, seed)
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({"eval_loss": loss, "steps": 400}))
    out = tmp_path / "fp8.json"
    assert fp8_loss.main(["report", str(tmp_path / "runs"), "--output", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["result"]["mean_fp8"] == pytest.approx(3.565)
    assert written["runs"]["fp8-seed1"]["eval_loss"] == 3.58
