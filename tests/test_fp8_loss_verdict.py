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
    # The written report judged again: the same result, the first date kept.
    again = tmp_path / "again.json"
    assert fp8_loss.main(["report", str(out), "--output", str(again)]) == 0
    rejudged = json.loads(again.read_text())
    assert rejudged["result"] == written["result"]
    assert rejudged["meta"]["date"] == written["meta"]["date"] and "judged" in rejudged["meta"]


def test_the_paired_interval_and_its_verdict() -> None:
    """Differences -0.018, -0.0087, -0.0111: mean -0.0126, sd 0.0048280, se 0.0027875,
    t(0.975, 2) = 4.3027, so [-0.024594, -0.000606]: below 0, fp8 lower."""
    bf16 = {0: 4.3687, 1: 4.3696, 2: 4.3676}
    fp8 = {0: 4.3687 - 0.018, 1: 4.3696 - 0.0087, 2: 4.3676 - 0.0111}
    paired = fp8_loss.fp8_verdict(bf16, fp8)
    assert paired["paired"]["low"] == pytest.approx(-0.024594, abs=2e-6)
    assert paired["paired"]["high"] == pytest.approx(-0.000606, abs=2e-6)
    assert paired["paired"]["verdict"] == "better"
    assert paired["paired_verdict"].startswith("fp8 reaches a lower loss than bf16: fp8 - bf16 =")
    # Differences 0.001, -0.001, 0.0005: [-0.0024, +0.0028], inside the 0.01 margin.
    same = fp8_loss.fp8_verdict(bf16, {0: 4.3697, 1: 4.3686, 2: 4.3681})
    assert same["paired"]["verdict"] == "equivalent"
    assert same["paired_verdict"].startswith("fp8 and bf16 equivalent (within 0.01 nats)")


def test_report_refuses_a_folder_without_runs(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"no <precision>-seed<n>/summary\.json runs"):
        fp8_loss.main(["report", str(tmp_path), "--output", str(tmp_path / "out.json")])
