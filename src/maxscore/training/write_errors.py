"""The one error path of every file a run writes: a full disk or a read-only folder ends the run
with one line (what, where, what to do), exit status 2, nothing earlier lost.

Every writer of a run (``config.json``, ``metrics.jsonl``, the TensorBoard event files, the
checkpoint files the Trainer writes, ``summary.json`` / ``validation.json``) goes through
:func:`reported_write` (or :func:`write_text` / :func:`append_text`, or, for a checkpoint,
:class:`~maxscore.training.checkpoint.CheckpointSaveError`). Which failures count (a full disk,
a quota, a read-only or unwritable folder, torch's zip writer on a full disk) is decided by
:func:`maxscore.write_errors.describe_write_failure`, shared with the commands that are no
runs (``analyze``, ``report``, ``eval``); what this module adds is the run's advice: which
checkpoints are intact and how to continue. A recognised failure becomes a
:class:`RunWriteError`, one of the CLI's user errors (``maxscore.cli._USER_ERRORS``); anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from maxscore import write_errors as _generic
from maxscore.checkpoints.layout import last_checkpoint
from maxscore.training.continue_command import how_to_continue
from maxscore.write_errors import (
    FULL_DISK,
    NOT_WRITABLE,
    READ_ONLY,
    SPACE_REASONS,
    FileWriteError,
    describe_write_failure,
)

__all__ = [
    "FULL_DISK",
    "NOT_WRITABLE",
    "READ_ONLY",
    "RunWriteError",
    "append_text",
    "describe_write_failure",
    "reported_write",
    "silence_tensorboard_writer_thread",
    "write_failure_advice",
    "write_text",
]


def write_failure_advice(reason: str, run_dir: Path | None) -> str:
    """What to do, and what is safe, in words (the second half of the one line)."""
    previous = last_checkpoint(run_dir) if run_dir is not None else None
    if reason in SPACE_REASONS:
        fix = "Free some space or choose another --output-dir"
    elif reason in (READ_ONLY, NOT_WRITABLE):
        fix = "Make the folder writable or choose another --output-dir"
    else:  # a checkpoint save that failed otherwise (CheckpointSaveError)
        fix = "Fix the cause"
    if previous is None:
        return f"there is no checkpoint yet. {fix}; {how_to_continue(False)}"
    return (
        f"earlier checkpoints are untouched (the newest intact one is {previous.name}). "
        f"{fix}, then {how_to_continue(True)}"
    )


class RunWriteError(FileWriteError):
    """A file of the run could not be written (a full disk, a read-only folder); the message is
    one line: what, where, why and what to do. Earlier checkpoints are untouched."""

    def __init__(
        self,
        what: str,
        path: Path | str,
        reason: str,
        run_dir: Path | None,
        advice: str | None = None,
    ) -> None:
        super().__init__(what, path, reason, advice or write_failure_advice(reason, run_dir))


def _run_error(
    what: str, path: Path | str, run_dir: Path | None, advice: str | None = None
) -> _generic.ErrorFactory:
    def error(reason: str) -> FileWriteError:
        return RunWriteError(what, path, reason, run_dir, advice)

    return error


@contextmanager
def reported_write(
    what: str, path: Path | str, run_dir: Path | None = None, advice: str | None = None
) -> Iterator[None]:
    """Run the block that writes ``path``; a full disk or an unwritable folder in it becomes a
    :class:`RunWriteError` (``what``: the file in words, ``run_dir``: where the checkpoints
    are, ``advice``: what to do, where the checkpoints' advice does not fit).

    A :class:`~maxscore.write_errors.FileWriteError` of a shared writer inside the block (a
    figure of :mod:`maxscore.analysis.plots`) gets the run's advice instead of its own."""
    try:
        with _generic.reported_write(what, path, error=_run_error(what, path, run_dir, advice)):
            yield
    except RunWriteError:
        raise
    except FileWriteError as err:
        raise RunWriteError(what, err.path, err.reason, run_dir, advice) from err


def write_text(path: Path, text: str, what: str, run_dir: Path | None = None) -> None:
    """``path.write_text(text)`` through :func:`reported_write`."""
    _generic.write_text(path, text, what, error=_run_error(what, path, run_dir))


def append_text(path: Path, text: str, what: str, run_dir: Path | None = None) -> None:
    """Append ``text`` to ``path`` through :func:`reported_write`."""
    _generic.append_text(path, text, what, error=_run_error(what, path, run_dir))


# ------------------------------------------------------------------------------------------------
# TensorBoard's writer thread
# ------------------------------------------------------------------------------------------------
_hook_lock = threading.Lock()
_hook_installed = False


def silence_tensorboard_writer_thread() -> None:
    """Keep the traceback of TensorBoard's background writer thread off the console.

    ``tensorboard``'s ``_AsyncWriterThread`` (behind torch's ``SummaryWriter``) stores the
    exception of a failed write, re-raises it in the thread (``threading.excepthook`` prints a
    traceback) and raises it again in the training thread at the next ``add_scalar`` /
    ``flush``, where :func:`reported_write` turns it into the one line. Only the thread's own
    printout is dropped here; every other thread's exception goes to the previous hook.
    """
    global _hook_installed
    with _hook_lock:
        if _hook_installed:
            return
        previous = threading.excepthook

        def hook(args: threading.ExceptHookArgs) -> None:
            if type(args.thread).__name__ == "_AsyncWriterThread":
                return  # raised again in the training thread (see above)
            previous(args)

        threading.excepthook = hook
        _hook_installed = True
