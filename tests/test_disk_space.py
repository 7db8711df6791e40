"""The start-of-run warning that the checkpoints will not fit on the disk (disk_space.py):
the size of a checkpoint, how many are on disk at once, and the line ``maxscore train`` prints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from maxscore import write_errors
from maxscore.cli import main
from maxscore.training.disk_space import checkpoint_bytes, checkpoints_at_once, disk_space_warning
from test_faults import SMALL_FLAGS


def test_checkpoint_bytes_are_weights_plus_two_adam_moments_of_the_trainable_ones() -> None:
    model = nn.Sequential(nn.Linear(10, 5), nn.Linear(5, 3))  # 55 + 18 fp32 parameters
    assert checkpoint_bytes(model) == (55 + 18) * 4 * 3
    model[1].requires_grad_(False)  # frozen: saved, but no optimizer state
    assert checkpoint_bytes(model) == (55 + 18) * 4 + 2 * 55 * 4
    assert checkpoint_bytes(nn.Linear(10, 5).to(torch.bfloat16)) == 55 * 2 * 3


@pytest.mark.parametrize(
    ("total", "every", "final", "keep", "expected"),
    [
        (250, 125, True, 2, 2),  # two saves, the last one at the end
        (400, 125, True, 2, 3),  # four saves: two kept plus the one being written
        (400, 125, False, 2, 3),
        (400, 125, True, 0, 4),  # every checkpoint kept
        (400, 0, True, 2, 1),  # the final one only
        (400, 0, False, 2, 0),  # none at all
        (400, 100_000, False, 2, 0),
    ],
)
def test_checkpoints_at_once(total: int, every: int, final: bool, keep: int, expected: int) -> None:
    assert checkpoints_at_once(total, every, final, keep) == expected


def test_warning_when_the_disk_is_too_small(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = nn.Linear(1000, 1000)  # 1,001,000 parameters: 12.0 MB a checkpoint
    kw = {"total_steps": 400, "save_steps": 125, "save_final": True, "keep": 2}
    monkeypatch.setattr(write_errors, "free_bytes", lambda path: 40_000_000)
    assert disk_space_warning(tmp_path / "run", model, **kw) is None  # 3 x 12 MB fit
    monkeypatch.setattr(write_errors, "free_bytes", lambda path: 30_000_000)
    line = disk_space_warning(tmp_path / "run", model, **kw)
    assert line is not None and "\n" not in line
    assert "about 0.1 GB" in line and "0.1 GB, but" in line  # 12 MB and 36 MB, rounded up
    assert "up to 3 at once (--save-total-limit 2 plus the one being written)" in line
    assert "--save-total-limit" in line and "--no-save-final" in line
    assert (
        disk_space_warning(tmp_path / "run", model, **{**kw, "save_steps": 0, "save_final": False})
        is None
    )
    monkeypatch.setattr(write_errors, "free_bytes", lambda path: None)  # unknown: no warning
    assert disk_space_warning(tmp_path / "run", model, **kw) is None


def test_maxscore_train_warns_at_the_start_and_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(write_errors, "free_bytes", lambda path: 1000)
    argv = ["train", *SMALL_FLAGS, "--output-dir", str(tmp_path / "run"), "--max-steps", "2"]
    assert main([*argv, "--eval-steps", "0", "--save-steps", "1"]) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "maxscore: warning: a checkpoint" in line]
    assert len(warnings) == 1 and "up to 2 at once" in warnings[0]
