"""The run directory: checked before training, opened when it starts, never lost on failure.

* :func:`check_run_dir` decides, without writing, whether a run may use its directory: a new
  one, a ``--resume`` (from the newest checkpoint that passes its integrity check), or an
  ``--overwrite`` of an existing run. It refuses conflicts with a message saying what to do.
* :class:`RunDirectory` opens the directory when training starts. ``--overwrite`` moves the
  previous run aside (``.<name>.previous-run`` beside it) instead of deleting it, and marks the
  new run (``.replacing-previous-run`` inside it) until the replacement is done: the previous
  run is deleted at the new run's first *scheduled* checkpoint (a ``save_steps`` multiple or
  the last step) or at its normal end; a checkpoint saved because of a stop signal (Ctrl-C,
  SIGTERM, SIGUSR1) does not replace it (the stopped run is resumable and, resumed, replaces
  it at its first scheduled checkpoint). The previous run is put back if the new run fails
  before any checkpoint. A run that fails before its first checkpoint leaves nothing behind (it
  has nothing to resume from, and its ``config.json`` would block the corrected rerun).
  Meanwhile :func:`~maxscore.checkpoints.layout.pending_previous_run` names the previous run (``maxscore eval NAME``
  evaluates it).
* :func:`continue_command` is the exact command line that continues (or restarts) a run, for
  every message that says how to go on.
* A checkpoint that fails verification on ``--resume`` is renamed ``damaged-checkpoint-N``:
  kept for inspection, out of the way of resuming and rotation.
* One process owns a run directory at a time (:mod:`maxscore.training.run_lock`):
  :func:`check_run_dir` takes the lock before it looks at (or repairs) anything.

Only process 0 calls these (the others wait at the Trainer's barriers).
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from maxscore.checkpoints.integrity import describe_damage, newest_intact
from maxscore.checkpoints.layout import (
    CONFIG_FILE,
    REPLACING_MARKER,
    list_checkpoints,
    previous_run_path,
)
from maxscore.training import checkpoint as ckpt
from maxscore.training.config import ConfigError, TrainConfig
from maxscore.training.continue_command import continue_command, overwrite_command
from maxscore.training.run_lock import RunDirLock, lock_run_dir

DAMAGED_PREFIX = "damaged-"


def _say(message: str) -> None:
    print(f"maxscore: {message}", file=sys.stderr, flush=True)


def _checkpoint_names(run_dir: Path) -> str:
    names = [p.name for p in list_checkpoints(run_dir)]
    return ", ".join(names) if names else "no checkpoints"


@dataclass
class RunDirPlan:
    """What :func:`check_run_dir` decided.

    Attributes:
        path: the run directory.
        resume_from: the checkpoint to resume from (``None``: start from scratch).
        replaces: an existing run will be replaced (``--overwrite``).
        damaged: checkpoints newer than ``resume_from`` that failed verification, with the
            problems found.
    """

    path: Path
    resume_from: Path | None = None
    replaces: bool = False
    damaged: dict[Path, list[str]] = field(default_factory=dict)
    #: this process's hold on the run directory's lock (taken by :func:`check_run_dir`, given
    #: up by :meth:`release_lock` when the run ends); ``None`` on processes other than 0.
    lock: RunDirLock | None = field(default=None, repr=False, compare=False)

    def release_lock(self) -> None:
        """Give up the plan's hold on the run directory's lock (no-op when it has none)."""
        if self.lock is not None:
            self.lock.release()


def recover_interrupted_overwrite(run_dir: Path) -> None:
    """Finish or undo an ``--overwrite`` that ended with the previous run still aside.

    A replacing run without a checkpoint (its process died) is removed and the previous run put
    back. One with checkpoints that do not replace (saved at a stop signal: the marker) is kept,
    resumable, with the previous run still aside. One with checkpoints and no marker (it died
    between its first scheduled checkpoint and deleting the previous run) finishes the
    replacement: the previous run is deleted.
    """
    previous = previous_run_path(run_dir)
    if not previous.is_dir():
        return
    if list_checkpoints(run_dir) and (run_dir / REPLACING_MARKER).exists():
        _say(
            f"the previous run of {run_dir} is kept as {previous.name} until the --overwrite "
            f"run there ({_checkpoint_names(run_dir)}, saved at a stop) reaches a scheduled "
            "checkpoint or its end"
        )
        return
    if list_checkpoints(run_dir):
        shutil.rmtree(previous)
        _say(f"finished replacing the previous run in {run_dir} (--overwrite was interrupted)")
        return
    if run_dir.exists():
        shutil.rmtree(run_dir)
    os.rename(previous, run_dir)
    _say(
        f"restored the previous run in {run_dir} ({_checkpoint_names(run_dir)}): an --overwrite "
        "of it stopped before its first checkpoint"
    )


def _check_writable(run_dir: Path) -> None:
    """The run directory (or its nearest existing parent) must be a writable folder."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(
            f"output dir {str(run_dir)!r} cannot be created: {str(existing)!r} is not a directory"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"output dir {str(run_dir)!r} is not writable ({existing} is not)")


def _resume_point(run_dir: Path) -> tuple[Path | None, dict[Path, list[str]]]:
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        _say(f"no checkpoint in {run_dir} yet; starting from scratch")
        return None, {}
    intact, damaged = newest_intact(checkpoints)
    if intact is None:
        raise ConfigError(
            f"no intact checkpoint in {run_dir}: {describe_damage(damaged)}. Copy a good "
            "checkpoint back, or start again with --overwrite"
        )
    # Damaged checkpoints are reported once, when RunDirectory.open sets them aside.
    return intact, damaged


def check_run_dir(config: TrainConfig) -> RunDirPlan:
    """Decide how the run uses ``config.run_dir``; raise ConfigError on a conflict.

    Takes the run directory's lock first (:func:`lock_run_dir`: another process's run there is
    refused with :class:`~maxscore.training.run_lock.RunDirInUseError`); the returned plan holds it until
    :meth:`RunDirPlan.release_lock` (``train`` calls it when the run ends), a refusal here
    releases it. Refuses an existing run with a different config unless ``resume`` or
    ``overwrite``, an existing run with the same config unless one of them, a folder that is not
    a run directory unless ``overwrite``, and a location that is not writable. Writes nothing
    but the lock file, apart from finishing or undoing an interrupted ``--overwrite``
    (:func:`recover_interrupted_overwrite`).
    """
    run_dir = config.run_dir
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"output dir {str(run_dir)!r} exists and is not a directory")
    _check_writable(run_dir)
    lock = lock_run_dir(run_dir)
    try:
        plan = _plan_run_dir(config)
    except BaseException:
        lock.release()
        raise
    plan.lock = lock
    return plan


def _plan_run_dir(config: TrainConfig) -> RunDirPlan:
    """:func:`check_run_dir` once the lock is held."""
    run_dir = config.run_dir
    recover_interrupted_overwrite(run_dir)
    plan = RunDirPlan(run_dir)
    if not (run_dir.is_dir() and any(run_dir.iterdir())):
        return plan
    stored_path = run_dir / CONFIG_FILE
    if config.overwrite:
        plan.replaces = True
    elif not stored_path.is_file():
        raise ConfigError(
            f"output dir {str(run_dir)!r} exists and is not a maxscore run directory; pass "
            "--overwrite to replace it or choose another --output-dir"
        )
    else:
        diff = config.differences(TrainConfig.from_file(stored_path))
        if config.resume:
            if diff:
                _say(
                    "resuming with changed settings: "
                    + ", ".join(f"{k}: {b!r} -> {a!r}" for k, (a, b) in diff.items())
                )
            plan.resume_from, plan.damaged = _resume_point(run_dir)
        elif diff:
            lines = "\n".join(f"  {k}: stored {b!r}, now {a!r}" for k, (a, b) in diff.items())
            raise ConfigError(
                f"output dir {str(run_dir)!r} holds a run with a different config:\n{lines}\n"
                f"continue it anyway with: {continue_command(True)}\nreplace it with: "
                f"{overwrite_command()}\nor choose another --output-dir"
            )
        else:
            raise ConfigError(
                f"output dir {str(run_dir)!r} already holds this run; continue it with: "
                f"{continue_command(True)}; or start again with: {overwrite_command()}"
            )
    return plan


class RunDirectory:
    """Opens a run directory for training and settles it when the run ends (see module doc)."""

    def __init__(self, plan: RunDirPlan) -> None:
        self.plan = plan
        self.path = plan.path
        self.previous: Path | None = None
        self._created_root: Path | None = None
        self._was_empty = False
        self._has_checkpoint = plan.resume_from is not None
        self._noted_stop = False

    def open(self) -> None:
        """Move a replaced run aside, create the folder, clear crash leftovers."""
        path = self.path
        aside = previous_run_path(path)
        if self.plan.replaces and path.exists():
            if aside.is_dir():
                # An earlier --overwrite stopped before it replaced the run (recover kept both):
                # that stopped run is what this one replaces; the previous run stays aside.
                _say(
                    f"--overwrite: removing the stopped --overwrite run in {path} "
                    f"({_checkpoint_names(path)}); the previous run stays as {aside.name} until "
                    "this run reaches its first scheduled checkpoint"
                )
                shutil.rmtree(path)
            else:
                _say(
                    f"--overwrite: the previous run in {path} ({_checkpoint_names(path)}) is kept "
                    "until this run reaches its first scheduled checkpoint"
                )
                os.rename(path, aside)
            self.previous = aside
        elif (path / REPLACING_MARKER).exists() and aside.is_dir():
            self.previous = aside  # a resumed --overwrite run that has not replaced it yet
        elif (path / REPLACING_MARKER).exists():
            (path / REPLACING_MARKER).unlink()  # the previous run went: nothing to replace
        self._was_empty = path.is_dir() and not any(path.iterdir())
        # The outermost folder this run creates (removed again if the run fails early).
        self._created_root = None
        for folder in (path, *path.parents):
            if folder.exists():
                break
            self._created_root = folder
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            self._restore_previous()
            raise ConfigError(f"output dir {str(path)!r} cannot be created: {err}") from err
        if self.previous is not None:
            (path / REPLACING_MARKER).touch()
        ckpt.remove_stale_staging(path)
        for damaged, problems in self.plan.damaged.items():
            if damaged.is_dir():
                target = damaged.with_name(DAMAGED_PREFIX + damaged.name)
                if target.exists():
                    shutil.rmtree(target)
                os.rename(damaged, target)
                _say(f"{damaged.name} is damaged ({', '.join(problems)}): kept it as {target.name}")

    @property
    def resumable(self) -> bool:
        """Whether the run has a checkpoint to continue from (``--resume``)."""
        return self._has_checkpoint and bool(list_checkpoints(self.path))

    def checkpoint_written(self, scheduled: bool = True) -> None:
        """The run has a checkpoint. A ``scheduled`` one (``save_steps``, the last step)
        replaces the previous run (deleted now); one saved at a stop signal does not."""
        self._has_checkpoint = True
        if self.previous is None:
            return
        if not scheduled:
            if not self._noted_stop:
                self._noted_stop = True
                _say(
                    f"--overwrite: a checkpoint saved at a stop does not replace the previous run "
                    f"(kept as {self.previous.name})"
                )
            return
        # The marker first: killed in between, the next start finishes the replacement.
        (self.path / REPLACING_MARKER).unlink(missing_ok=True)
        shutil.rmtree(self.previous, ignore_errors=True)
        _say(f"replaced the previous run in {self.path} (--overwrite)")
        self.previous = None

    def close(self, failed: bool, interrupted: bool = False, keep: bool = False) -> None:
        """Settle the directory at the end of the run (``failed``: it raised; ``interrupted``:
        a stop signal ended it early, at a checkpoint; ``keep``: a failure that leaves the
        directory as it is, like one with a checkpoint, e.g. a tracker that did not start)."""
        if not failed and not interrupted:
            self.checkpoint_written()
            return
        if not failed or self._has_checkpoint or keep:
            if self.previous is not None:  # resumable: keep everything
                _say(
                    f"the previous run of {self.path} stays as {self.previous.name} (`maxscore "
                    f"eval {self.path}` evaluates it) until this run, continued, reaches a "
                    "scheduled checkpoint or its end"
                )
            return
        if self._was_empty:  # a folder the user made for this run: empty it again
            for child in self.path.iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()
            _say(f"the run failed before its first checkpoint; emptied {self.path} again")
            return
        if self._created_root is None and self.previous is None:
            return  # not this run's folder (cannot happen after check_run_dir): keep it
        shutil.rmtree(self._created_root or self.path, ignore_errors=True)
        if self._restore_previous():
            _say(
                f"the run failed before its first checkpoint; the previous run in {self.path} "
                "is back in place"
            )
        else:
            _say(f"the run failed before its first checkpoint; removed {self.path}")

    def _restore_previous(self) -> bool:
        if self.previous is None:
            return False
        if self.path.exists():
            shutil.rmtree(self.path)
        os.rename(self.previous, self.path)
        self.previous = None
        return True
