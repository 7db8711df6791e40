"""The one error path of every file a run writes: a full disk or a read-only folder ends the run
with one line (what, where, what to do), exit status 2, nothing earlier lost.

Every writer of a run (``config.json``, ``metrics.jsonl``, the TensorBoard event files, the
checkpoint files the Trainer writes, ``summary.json`` / ``validation.json``) goes through
:func:`reported_write` (or :func:`write_text` / :func:`append_text`, or, for a checkpoint,
:class:`~maxscore.training.checkpoint.CheckpointSaveError`), which asks
:func:`describe_write_failure` what went wrong. A failure it recognises becomes a
:class:`RunWriteError`, one of the CLI's user errors (``maxscore.cli._USER_ERRORS``); anything
else is a bug and keeps its traceback.

Recognised: ``ENOSPC`` / ``EDQUOT`` (full disk, quota), ``EROFS`` / ``EACCES`` / ``EPERM``
(read-only or not writable), anywhere in the exception's cause / context chain, and torch's
``PytorchStreamWriter`` errors (``[enforce fail at inline_container.cc:...] unexpected pos``,
``PytorchStreamWriter failed writing file``) that wrap a failed ``fwrite`` without its errno:
those count as a full disk only when ``shutil.disk_usage`` of the target's file system confirms
that it is (nearly) full.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from maxscore.checkpoints.layout import last_checkpoint
from maxscore.training.continue_command import how_to_continue

__all__ = [
    "FULL_DISK",
    "RunWriteError",
    "append_text",
    "describe_write_failure",
    "reported_write",
    "silence_tensorboard_writer_thread",
    "write_failure_advice",
    "write_text",
]

FULL_DISK = "the disk is full"
READ_ONLY = "the file system is read-only"
NOT_WRITABLE = "permission denied"

_REASONS = {
    errno.ENOSPC: FULL_DISK,
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: READ_ONLY,
    errno.EACCES: NOT_WRITABLE,
    errno.EPERM: NOT_WRITABLE,
}
#: Reasons that mean "no space" (the remedy: free some space).
_SPACE_REASONS = {FULL_DISK, _REASONS[errno.EDQUOT]}
#: Texts of torch's zip writer (``caffe2/serialize/inline_container.cc``) when ``fwrite`` fails:
#: they carry no errno, so the file system's free space decides.
_TORCH_WRITER_TEXTS = ("inline_container.cc", "PytorchStreamWriter failed writing file")
#: Below this much free space a torch writer failure counts as a full disk.
_NEARLY_FULL_BYTES = 64 * 1024 * 1024


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _free_bytes(path: Path) -> int | None:
    """Free bytes of the file system holding ``path`` (its nearest existing ancestor)."""
    probe = Path(os.path.abspath(path))
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def describe_write_failure(err: BaseException, path: Path | str) -> str | None:
    """Why writing ``path`` failed in words (``"the disk is full"``), or ``None`` when ``err``
    is not a full disk or a read-only / unwritable folder (a bug: it keeps its traceback)."""
    for cause in _chain(err):
        if isinstance(cause, OSError) and cause.errno in _REASONS:
            return _REASONS[cause.errno]
    for cause in _chain(err):
        text = str(cause)
        if "No space left on device" in text:
            return FULL_DISK
        if "Disk quota exceeded" in text:
            return _REASONS[errno.EDQUOT]
        if "Read-only file system" in text:
            return READ_ONLY
        if any(marker in text for marker in _TORCH_WRITER_TEXTS):
            free = _free_bytes(Path(path))
            if free is not None and free < _NEARLY_FULL_BYTES:
                return FULL_DISK
    return None


def write_failure_advice(reason: str, run_dir: Path | None) -> str:
    """What to do, and what is safe, in words (the second half of the one line)."""
    previous = last_checkpoint(run_dir) if run_dir is not None else None
    if reason in _SPACE_REASONS:
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


def _one_line(text: str) -> str:
    return " ".join(text.split())


class RunWriteError(RuntimeError):
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
        self.path = Path(path)
        self.reason = reason
        advice = advice or write_failure_advice(reason, run_dir)
        super().__init__(_one_line(f"could not write {what} {path} ({reason}); {advice}"))


@contextmanager
def reported_write(
    what: str, path: Path | str, run_dir: Path | None = None, advice: str | None = None
) -> Iterator[None]:
    """Run the block that writes ``path``; a full disk or an unwritable folder in it becomes a
    :class:`RunWriteError` (``what``: the file in words, ``run_dir``: where the checkpoints
    are, ``advice``: what to do, where the checkpoints' advice does not fit)."""
    try:
        yield
    except RunWriteError:
        raise
    except Exception as err:
        reason = describe_write_failure(err, path)
        if reason is None:
            raise
        raise RunWriteError(what, path, reason, run_dir, advice) from err


def write_text(path: Path, text: str, what: str, run_dir: Path | None = None) -> None:
    """``path.write_text(text)`` through :func:`reported_write`."""
    with reported_write(what, path, run_dir):
        path.write_text(text)


def append_text(path: Path, text: str, what: str, run_dir: Path | None = None) -> None:
    """Append ``text`` to ``path`` through :func:`reported_write`."""
    with reported_write(what, path, run_dir), path.open("a") as handle:
        handle.write(text)


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
