"""A full disk (or a read-only folder) outside and inside a checkpoint save: one line, exit 2.

Every file a run writes goes through ``maxscore.training.write_errors`` (on top of
``maxscore.write_errors``, which recognises the failure): the resolved
``config.json`` at start-up, ``metrics.jsonl``, TensorBoard's event files (written by a
background thread), the checkpoint files (the optimizer state through ``torch.save``, whose zip
writer says ``inline_container.cc ... unexpected pos`` and not "no space"), ``summary.json``.
Each fault here is injected into a few-step run of ``maxscore train`` (``SMALL_FLAGS``) and must
end in one error line, exit status 2, and the earlier checkpoints intact.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from maxscore import write_errors  # the shared part: it asks shutil.disk_usage
from maxscore.checkpoints.integrity import verify_checkpoint
from maxscore.cli import main
from maxscore.training.write_errors import FULL_DISK, describe_write_failure
from test_faults import SMALL_FLAGS, checkpoint_names, leftovers

#: The text torch's zip writer gives when ``fwrite`` fails half-way (no errno, no "space").
TORCH_WRITE_FAILURE = (
    "[enforce fail at inline_container.cc:672] . unexpected pos 1536 vs 1430\n"
    "frame #0: c10::ThrowEnforceNotMet(...)"
)


def no_space(path: object) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", str(path))


def error_lines(capsys: pytest.CaptureFixture[str]) -> tuple[list[str], str]:
    """The ``maxscore: error:`` lines of stderr (the last line), and all of stderr; no traceback
    (of the training thread or TensorBoard's writer thread), no second advice line."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err
    assert "the run failed; continue with" not in err, err
    assert err.strip().splitlines()[-1].startswith("maxscore: error:"), err
    return [line for line in err.splitlines() if line.startswith("maxscore: error:")], err


def train_argv(run: Path, *extra: str) -> list[str]:
    return ["train", *SMALL_FLAGS, "--output-dir", str(run), "--max-steps", "4", *extra]


# ------------------------------------------------------------------------------------------------
# the classifier
# ------------------------------------------------------------------------------------------------
def test_describe_write_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def oserror(code: int) -> OSError:
        return OSError(code, "injected", str(tmp_path))

    assert describe_write_failure(oserror(errno.ENOSPC), tmp_path) == FULL_DISK
    assert "quota" in (describe_write_failure(oserror(errno.EDQUOT), tmp_path) or "")
    assert "read-only" in (describe_write_failure(oserror(errno.EROFS), tmp_path) or "")
    assert "permission" in (describe_write_failure(oserror(errno.EACCES), tmp_path) or "")
    assert describe_write_failure(oserror(errno.ENOENT), tmp_path) is None
    assert describe_write_failure(ValueError("a bug"), tmp_path) is None
    # an errno anywhere in the chain (a library that wraps the OSError)
    try:
        try:
            raise oserror(errno.ENOSPC)
        except OSError as inner:
            raise RuntimeError("could not write the shard") from inner
    except RuntimeError as outer:
        assert describe_write_failure(outer, tmp_path) == FULL_DISK
    # torch's zip writer: the file system's free space decides
    torch_error = RuntimeError(TORCH_WRITE_FAILURE)
    assert describe_write_failure(torch_error, tmp_path / "not" / "yet") is None  # room left
    full = shutil._ntuple_diskusage(10**9, 10**9, 0)  # type: ignore[attr-defined]
    monkeypatch.setattr(write_errors.shutil, "disk_usage", lambda path: full)
    assert describe_write_failure(torch_error, tmp_path / "not" / "yet") == FULL_DISK
    writer_error = RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
    assert describe_write_failure(writer_error, tmp_path) == FULL_DISK


# ------------------------------------------------------------------------------------------------
# each writer of a run
# ------------------------------------------------------------------------------------------------
def test_a_full_disk_at_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``write_resolved_config`` fails: one line, no checkpoint to resume, no folder left."""
    run = tmp_path / "run"
    real_write_text = Path.write_text

    def write_text(self: Path, *args: Any, **kw: Any) -> int:
        if self == run / "config.json":
            raise no_space(self)
        return real_write_text(self, *args, **kw)

    monkeypatch.setattr(Path, "write_text", write_text)
    assert main(train_argv(run)) == 2
    errors, _ = error_lines(capsys)
    assert len(errors) == 1
    assert f"could not write the run's config {run / 'config.json'} (the disk is full)" in errors[0]
    assert "--output-dir" in errors[0] and "no checkpoint yet" in errors[0]
    assert not run.exists()


def test_a_full_disk_writing_the_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The metrics line of step 3 (after checkpoint-2) fails; --resume continues afterwards."""
    run = tmp_path / "run"
    real_open = Path.open

    def open_(self: Path, mode: str = "r", *args: Any, **kw: Any) -> Any:
        if self.name == "metrics.jsonl" and "a" in mode and (run / "checkpoint-2").is_dir():
            raise no_space(self)
        return real_open(self, mode, *args, **kw)

    monkeypatch.setattr(Path, "open", open_)
    argv = train_argv(run, "--save-steps", "2", "--eval-steps", "0", "--logging-steps", "1")
    assert main(argv) == 2
    errors, _ = error_lines(capsys)
    assert len(errors) == 1
    line = errors[0]
    assert (
        f"could not write the training metrics {run / 'metrics.jsonl'} (the disk is full)" in line
    )
    assert "checkpoint-2" in line and "--resume" in line and "--output-dir" in line
    assert checkpoint_names(run) == ["checkpoint-2"] and not leftovers(run)
    assert not verify_checkpoint(run / "checkpoint-2")

    monkeypatch.setattr(Path, "open", real_open)  # space freed: continue
    assert main([*argv, "--resume"]) == 0
    steps = [json.loads(row)["step"] for row in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[:4] == [1, 2, 3, 4]


def test_a_full_disk_under_tensorboard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """TensorBoard's writer thread fails after checkpoint-2: the same one line, exit 2."""
    pytest.importorskip("tensorboard")
    from tensorboard.summary.writer import record_writer

    run = tmp_path / "run"
    real_write = record_writer.RecordWriter.write

    def write(self: Any, data: bytes) -> None:
        if (run / "checkpoint-2").is_dir():
            raise no_space(run / "tensorboard")
        real_write(self, data)

    monkeypatch.setattr(record_writer.RecordWriter, "write", write)
    flags = [f for f in train_argv(run) if f != "none"]  # --report-to none -> tensorboard
    flags[flags.index("--report-to") + 1 : flags.index("--report-to") + 1] = ["tensorboard"]
    argv = [*flags, "--save-steps", "2", "--eval-steps", "0", "--logging-steps", "1"]
    assert main(argv) == 2
    errors, _ = error_lines(capsys)
    assert len(errors) == 1
    line = errors[0]
    assert f"could not write the TensorBoard logs in {run / 'tensorboard'}" in line
    assert "(the disk is full)" in line and "--resume" in line
    assert "checkpoint-2" in checkpoint_names(run) and not leftovers(run)
    for name in checkpoint_names(run):
        assert not verify_checkpoint(run / name)


def test_a_full_disk_saving_the_optimizer_state_as_torch_reports_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """torch's zip writer fails on optimizer.pt of checkpoint-4 without an errno; the file
    system has no space left: "the disk is full", checkpoint-2 intact."""
    real_save = torch.save
    run = tmp_path / "run"
    full = shutil._ntuple_diskusage(10**9, 10**9, 0)  # type: ignore[attr-defined]

    def save(obj: object, f: object, *args: object, **kw: object) -> None:
        if isinstance(f, str) and f.endswith("optimizer.pt") and "checkpoint-4" in f:
            Path(f).write_bytes(b"\0" * 1000)  # part of the file made it to disk
            monkeypatch.setattr(write_errors.shutil, "disk_usage", lambda path: full)
            raise RuntimeError(TORCH_WRITE_FAILURE)
        real_save(obj, f, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "save", save)
    assert main(train_argv(run, "--save-steps", "2", "--eval-steps", "0")) == 2
    errors, _ = error_lines(capsys)
    assert len(errors) == 1
    line = errors[0]
    assert line.startswith(f"maxscore: error: could not save checkpoint-4 in {run}")
    assert "(the disk is full)" in line and "inline_container" not in line
    assert "checkpoint-2" in line and "--resume" in line and "--output-dir" in line
    assert checkpoint_names(run) == ["checkpoint-2"] and not leftovers(run)
    assert not verify_checkpoint(run / "checkpoint-2")


def test_a_full_disk_that_the_failed_checkpoint_filled_is_reported_as_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The half-written checkpoint is what filled the disk: removing its staging folder frees
    the space again, so the reason is read before that (a 757M-parameter run's 9 GB checkpoint
    on a shared disk failed this way with torch's text and no word of the disk)."""
    real_save = torch.save
    run = tmp_path / "run"
    full = shutil._ntuple_diskusage(10**9, 10**9, 0)  # type: ignore[attr-defined]
    roomy = shutil._ntuple_diskusage(10**12, 10**9, 10**12 - 10**9)  # type: ignore[attr-defined]

    def disk_usage(path: object) -> Any:
        staging = any(p.name.startswith(".staging-") for p in run.iterdir())
        return full if staging else roomy

    def save(obj: object, f: object, *args: object, **kw: object) -> None:
        if isinstance(f, str) and f.endswith("optimizer.pt") and "checkpoint-4" in f:
            Path(f).write_bytes(b"\0" * 1000)
            monkeypatch.setattr(write_errors.shutil, "disk_usage", disk_usage)
            raise RuntimeError(TORCH_WRITE_FAILURE)
        real_save(obj, f, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "save", save)
    assert main(train_argv(run, "--save-steps", "2", "--eval-steps", "0")) == 2
    errors, _ = error_lines(capsys)
    assert len(errors) == 1 and "(the disk is full)" in errors[0], errors
    assert checkpoint_names(run) == ["checkpoint-2"] and not leftovers(run)


def test_a_read_only_folder_for_the_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``summary.json`` at the end meets a read-only file system: one line, the run kept."""
    run = tmp_path / "run"
    real_write_text = Path.write_text

    def write_text(self: Path, *args: Any, **kw: Any) -> int:
        if self == run / "summary.json":
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_write_text(self, *args, **kw)

    monkeypatch.setattr(Path, "write_text", write_text)
    assert main(train_argv(run, "--max-steps", "2", "--eval-steps", "0")) == 2
    errors, _ = error_lines(capsys)
    assert len(errors) == 1
    assert "could not write the run's summary" in errors[0]
    assert "(the file system is read-only)" in errors[0] and "writable" in errors[0]
    assert checkpoint_names(run) == ["checkpoint-2"]
    assert not verify_checkpoint(run / "checkpoint-2")


def test_a_full_disk_writing_the_comparison(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``maxscore compare``'s own files after the runs: one line, the runs kept."""
    out = tmp_path / "cmp"
    real_write_text = Path.write_text

    def write_text(self: Path, *args: Any, **kw: Any) -> int:
        if self == out / "comparison.md":
            raise no_space(self)
        return real_write_text(self, *args, **kw)

    monkeypatch.setattr(Path, "write_text", write_text)
    argv = ["compare", *SMALL_FLAGS, "--routers", "gshard", "--output-dir", str(out)]
    assert main([*argv, "--max-steps", "2", "--eval-steps", "0"]) == 2
    errors, _ = error_lines(capsys)
    assert len(errors) == 1
    assert f"could not write the comparison files in {out} (the disk is full)" in errors[0]
    assert "--overwrite" in errors[0]
    assert list(out.glob("*/summary.json"))
