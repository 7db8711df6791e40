"""Atomic checkpoint directories and the run directory's bookkeeping.

A checkpoint is first written into a staging folder (``.staging-checkpoint-N/checkpoint-N``),
every file is fsynced, then the folder is renamed to ``checkpoint-N`` in one ``rename`` and the
parent directory is fsynced. A crash at any point leaves either the old set of checkpoints or the
old set plus the new complete one; older checkpoints are only deleted after the new one is in
place. ``transformers.trainer_utils.get_last_checkpoint`` only matches ``checkpoint-<N>``, so a
leftover staging folder is never mistaken for a checkpoint (and is removed on the next start).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from maxscore.checkpoints.layout import list_checkpoints
from maxscore.file_modes import give_default_file_modes
from maxscore.training.write_errors import (
    RunWriteError,
    describe_write_failure,
    write_failure_advice,
)


class CheckpointSaveError(RunWriteError):
    """A checkpoint could not be written (disk full, permissions, ...); the earlier ones are
    intact and the half-written staging folder is gone. One of the run's write errors
    (:mod:`maxscore.training.write_errors`): the same reasons and remedies, in one line."""

    def __init__(self, name: str, run_dir: Path, cause: BaseException) -> None:
        reason = describe_write_failure(cause, run_dir)
        if reason is None:  # not a full disk: say what it was (still one line)
            reason = f"{type(cause).__name__}: {cause}"
        self.path = run_dir / name
        self.reason = reason
        advice = write_failure_advice(reason, run_dir)
        message = f"could not save {name} in {run_dir} ({reason}); {advice}"
        RuntimeError.__init__(self, " ".join(message.split()))  # one line


STAGING_PREFIX = ".staging-"
TRASH_PREFIX = ".trash-"


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` and every directory (so renames are durable)."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(root))


def fsync_dir(path: Path) -> None:
    """fsync a directory entry (no-op where the OS refuses directory fsync)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def publish_checkpoint(staged: Path, final: Path) -> None:
    """Make the complete checkpoint folder ``staged`` visible as ``final`` atomically.

    If ``final`` exists (a checkpoint of the same step written again, e.g. at Ctrl-C), it is
    moved aside first and deleted only after the new one is in place.
    """
    give_default_file_modes(staged)
    fsync_tree(staged)
    trash: Path | None = None
    if final.exists():
        trash = final.with_name(TRASH_PREFIX + final.name)
        if trash.exists():
            shutil.rmtree(trash)
        os.rename(final, trash)
    os.rename(staged, final)
    fsync_dir(final.parent)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def rotate_checkpoints(run_dir: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints (``keep <= 0`` keeps all)."""
    if keep <= 0:
        return
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def remove_stale_staging(run_dir: Path) -> None:
    """Remove half-written staging / trash folders left by a crash."""
    if not run_dir.is_dir():
        return
    for child in run_dir.iterdir():
        if child.name.startswith((STAGING_PREFIX, TRASH_PREFIX)) and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
