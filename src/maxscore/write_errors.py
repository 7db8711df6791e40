"""Recognising a failed file write: a full disk or a read-only folder becomes one line (what,
where, why, what to do), not a traceback, and never a half-written file in place of a good one.

Every command that writes files (``train`` and ``compare`` through
:mod:`maxscore.training.write_errors`, ``analyze``, ``report`` and ``eval`` directly) asks
:func:`describe_write_failure` what went wrong. A failure it recognises becomes a
:class:`FileWriteError` (the command prints its message and exits with status 2); anything
else is a bug and keeps its traceback.

Recognised: ``ENOSPC`` / ``EDQUOT`` (full disk, quota), ``EROFS`` / ``EACCES`` / ``EPERM``
(read-only or not writable), anywhere in the exception's cause / context chain, and torch's
``PytorchStreamWriter`` errors (``[enforce fail at inline_container.cc:...] unexpected pos``,
``PytorchStreamWriter failed writing file``) that wrap a failed ``fwrite`` without its errno:
those count as a full disk only when ``shutil.disk_usage`` of the target's file system confirms
that it is (nearly) full.

:func:`replaced_file` and :func:`write_text_atomically` write into a temporary file beside the
target and rename it over the target only when it is complete, so a write that fails half-way
leaves the earlier file as it was.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from maxscore.file_modes import default_file_mode

__all__ = [
    "FULL_DISK",
    "NOT_WRITABLE",
    "QUOTA_EXCEEDED",
    "READ_ONLY",
    "SPACE_REASONS",
    "ErrorFactory",
    "FileWriteError",
    "append_text",
    "describe_write_failure",
    "free_bytes",
    "one_line",
    "output_advice",
    "replaced_file",
    "reported_write",
    "write_text",
    "write_text_atomically",
]

FULL_DISK = "the disk is full"
QUOTA_EXCEEDED = "the disk quota is exceeded"
READ_ONLY = "the file system is read-only"
NOT_WRITABLE = "permission denied"

_REASONS = {
    errno.ENOSPC: FULL_DISK,
    errno.EDQUOT: QUOTA_EXCEEDED,
    errno.EROFS: READ_ONLY,
    errno.EACCES: NOT_WRITABLE,
    errno.EPERM: NOT_WRITABLE,
}
#: Reasons that mean "no space" (the remedy: free some space).
SPACE_REASONS = frozenset({FULL_DISK, QUOTA_EXCEEDED})
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


def free_bytes(path: Path) -> int | None:
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
            return QUOTA_EXCEEDED
        if "Read-only file system" in text:
            return READ_ONLY
        if any(marker in text for marker in _TORCH_WRITER_TEXTS):
            free = free_bytes(Path(path))
            if free is not None and free < _NEARLY_FULL_BYTES:
                return FULL_DISK
    return None


def output_advice(reason: str, option: str = "--output", replaced: bool = False) -> str:
    """What to do about ``reason`` (from :func:`describe_write_failure`) in words, naming the
    command's output ``option``; ``replaced``: the file is written through
    :func:`replaced_file`, so an earlier one is still whole (said first)."""
    kept = "an earlier file of that name is unchanged; " if replaced else ""
    if reason in SPACE_REASONS:
        return f"{kept}free some space or choose another {option}"
    if reason in (READ_ONLY, NOT_WRITABLE):
        return f"{kept}make the folder writable or choose another {option}"
    return f"{kept}fix the cause"


def one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines too) as one space."""
    return " ".join(text.split())


class FileWriteError(RuntimeError):
    """A file could not be written (a full disk, a read-only folder); the message is one line:
    what, where, why and what to do."""

    def __init__(self, what: str, path: Path | str, reason: str, advice: str) -> None:
        self.path = Path(path)
        self.reason = reason
        super().__init__(one_line(f"could not write {what} {path} ({reason}); {advice}"))


#: Builds the error of a recognised failure from its reason (a command's own advice).
ErrorFactory = Callable[[str], FileWriteError]


@contextmanager
def reported_write(
    what: str,
    path: Path | str,
    advice: str | None = None,
    *,
    option: str = "--output",
    replaced: bool = False,
    error: ErrorFactory | None = None,
) -> Iterator[None]:
    """Run the block that writes ``path``; a full disk or an unwritable folder in it becomes a
    :class:`FileWriteError` (``what``: the file in words; ``advice``: what to do, else
    :func:`output_advice` for ``option`` and ``replaced``; ``error``: builds the error from the
    reason instead, for a command with its own advice). Other failures keep their traceback."""
    try:
        yield
    except FileWriteError:
        raise
    except Exception as err:
        reason = describe_write_failure(err, path)
        if reason is None:
            raise
        if error is not None:
            raise error(reason) from err
        advice = advice or output_advice(reason, option, replaced)
        raise FileWriteError(what, path, reason, advice) from err


@contextmanager
def replaced_file(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` for the block to write; renamed over ``path`` when the
    block succeeds, removed when it fails (the earlier ``path``, if any, stays as it was).

    Beside, not in ``/tmp``: the rename is then atomic (one file system). The new file gets the
    mode ``open(path, "w")`` would give it, not ``mkstemp``'s 0600.
    """
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, default_file_mode())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_text_atomically(
    path: Path, text: str, what: str, *, option: str = "--output", error: ErrorFactory | None = None
) -> None:
    """Write ``text`` to ``path`` through :func:`replaced_file` and :func:`reported_write`: a
    failure leaves the earlier ``path`` as it was and says so in one line."""
    with (
        reported_write(what, path, option=option, replaced=True, error=error),
        replaced_file(path) as tmp,
    ):
        tmp.write_text(text, encoding="utf-8")


def write_text(path: Path, text: str, what: str, *, error: ErrorFactory | None = None) -> None:
    """``path.write_text(text)`` through :func:`reported_write` (in place: for a file whose
    half-written state is no worse than none)."""
    with reported_write(what, path, error=error):
        path.write_text(text)


def append_text(path: Path, text: str, what: str, *, error: ErrorFactory | None = None) -> None:
    """Append ``text`` to ``path`` through :func:`reported_write`."""
    with reported_write(what, path, error=error), path.open("a") as handle:
        handle.write(text)
