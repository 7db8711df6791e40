"""One process owns a run directory at a time: a lock beside it (``.NAME.lock``).

:func:`lock_run_dir` takes it; :func:`maxscore.training.run_dir.check_run_dir` takes it before it
looks at (or repairs) anything, :func:`~maxscore.training.run.train` releases it when the run
ends, also when it raises; ``maxscore compare`` takes it on its output folder, which covers the
runs inside. A second process is refused with :class:`RunDirInUseError`, one line naming the
owner (host, pid, since when).
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import json
import os
import socket
import sys
import tempfile
import time
from contextlib import suppress
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: the O_CREAT | O_EXCL lock below
    fcntl = None  # type: ignore[assignment]

from maxscore.training.config import ConfigError

LOCK_SUFFIX = ".lock"


def _say(message: str) -> None:
    print(f"maxscore: {message}", file=sys.stderr, flush=True)


__all__ = ["LOCK_SUFFIX", "RunDirInUseError", "RunDirLock", "lock_file_path", "lock_run_dir"]


# ------------------------------------------------------------------------------------------------
# the lock: one process owns a run directory at a time
# ------------------------------------------------------------------------------------------------
# Where: ``.NAME.lock`` beside the run directory, not inside it: --overwrite moves the directory
# aside (``.NAME.previous-run``), a new run creates it, a run that fails early removes it again,
# and the lock has to stay in one place through all of that (and exist before the directory).
#
# How: fcntl.flock on that file, whose JSON (host, pid, since, command) only names the owner in
# the refusal. flock rather than a file created with O_CREAT | O_EXCL and a pid check, because
# the kernel releases a flock when its process dies, however it dies (SIGKILL, the OOM killer,
# a scheduler's kill), so a stale lock is simply one that can be taken: no guess from a pid that
# may have been reused, and no race between two processes that both find a lock stale and
# both remove it. A lock file is removed when its lock is released; one left by a process that
# died is taken over with a note. Where the filesystem has no flock (Lustre mounted without
# ``flock``, NFS with ``nolock``, Windows) the lock is the O_CREAT | O_EXCL creation itself and
# a stale file is recognised by its pid being gone on this host. A lock file naming another
# host is never taken over (this host cannot see that process): the refusal says to delete it
# if that run is over.


class RunDirInUseError(ConfigError):
    """Another process owns the run directory (a user error: one line, exit status 2)."""


@dataclass
class _HeldLock:
    """A lock this process holds: the lock file, open (and flocked where flock works)."""

    run_dir: Path  # resolved
    path: Path
    fd: int
    flocked: bool
    owner: dict[str, Any]
    created: list[Path]  # folders made to hold the lock file (outermost first)
    count: int = 1


#: This process's locks by resolved run directory. ``lock_run_dir`` is re-entrant, and a lock
#: covers the directories inside its own (``maxscore compare``'s runs inside its output folder).
_HELD: dict[Path, _HeldLock] = {}

_NO_FLOCK_ERRNOS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
_HELD_ERRNOS = {errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES}


class RunDirLock:
    """This process's hold on a run directory's lock; :meth:`release` gives it up (once).

    Holds on one directory (or on directories inside a held one) share its lock file, which is
    unlocked and removed with the last of them; a hold garbage-collected or still open when the
    interpreter exits is released then (and the kernel drops a flock when the process dies).
    """

    def __init__(self, held: _HeldLock) -> None:
        self._held: _HeldLock | None = held

    @property
    def held(self) -> bool:
        """Whether this hold is still open."""
        return self._held is not None and self._held.fd >= 0

    @property
    def path(self) -> Path | None:
        """The lock file (``None`` once released)."""
        return self._held.path if self._held is not None else None

    def release(self) -> None:
        held, self._held = self._held, None
        if held is None:
            return
        held.count -= 1
        if held.count <= 0:
            _unlock(held)

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        with suppress(Exception):  # at interpreter shutdown
            self.release()


def lock_file_path(run_dir: Path) -> Path:
    """Where ``run_dir``'s lock lives: ``.NAME.lock`` beside it, or, where the folder holding
    it cannot be written (a run directory made by someone else in a read-only folder: it cannot
    be moved aside or re-created there either), in the temporary folder, named by the path
    (then only processes of this host see it)."""
    resolved = run_dir.resolve()
    if resolved.name and _writable_or_creatable(resolved.parent):
        return resolved.parent / f".{resolved.name}{LOCK_SUFFIX}"
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:24]
    return Path(tempfile.gettempdir()) / "maxscore-locks" / f"{digest}{LOCK_SUFFIX}"


def lock_run_dir(run_dir: Path | str) -> RunDirLock:
    """Take ``run_dir``'s lock for this process (see the section comment above).

    Raises :class:`RunDirInUseError` (a :class:`ConfigError`) when another process holds it, or
    holds the folder it is in (a running ``maxscore compare``); takes over, with a note, a lock
    left by a process of this host that no longer runs. Re-entrant: a directory this process
    holds, or one inside it, gets another hold on the same lock.
    """
    run_dir = Path(run_dir)
    resolved = run_dir.resolve()
    for folder in (resolved, *resolved.parents):
        held = _HELD.get(folder)
        if held is not None and held.fd >= 0:
            held.count += 1
            return RunDirLock(held)
    _refuse_inside_a_locked_folder(run_dir, resolved)
    path = lock_file_path(resolved)
    created = _make_folders(path.parent, run_dir)
    try:
        fd, flocked, owner = _take(path, run_dir)
    except BaseException:
        _remove_empty(created)
        raise
    held = _HeldLock(resolved, path, fd, flocked, owner, created)
    _HELD[resolved] = held
    return RunDirLock(held)


def _take(path: Path, run_dir: Path) -> tuple[int, bool, dict[str, Any]]:
    """Open, lock and fill in the lock file; (fd, flocked, owner)."""
    for _attempt in range(20):
        created = True
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            created = False
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                continue  # released by its owner in between
            except OSError as err:
                raise _cannot_create(path, run_dir, err) from err
        except OSError as err:
            raise _cannot_create(path, run_dir, err) from err
        locked = _try_flock(fd)
        if locked is False:
            os.close(fd)
            raise RunDirInUseError(_in_use(run_dir, path, _read_owner(path, wait=True)))
        if locked is None:  # no flock on this filesystem: O_EXCL alone decides
            if created:
                return fd, False, _write_owner(fd, run_dir)
            os.close(fd)
            previous = _read_owner(path, wait=True)
            alive = _owner_alive(previous)
            if alive is not False:
                raise RunDirInUseError(_in_use(run_dir, path, previous, unsure=alive is None))
            _took_over(run_dir, previous)
            with suppress(FileNotFoundError):
                os.unlink(path)
            continue
        if not _same_file(fd, path):  # its owner released and removed it in between: again
            os.close(fd)
            continue
        previous = _read_owner(path)
        if previous is not None and previous.get("host") != socket.gethostname():
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            raise RunDirInUseError(_in_use(run_dir, path, previous, unsure=True))
        if previous is not None and previous.get("pid") != os.getpid():
            _took_over(run_dir, previous)
        return fd, True, _write_owner(fd, run_dir)
    raise RunDirInUseError(
        f"output dir {str(run_dir)!r}: other processes keep taking and releasing its lock "
        f"({path}); try again, or choose another --output-dir"
    )


def _try_flock(fd: int) -> bool | None:
    """True: locked; False: another process holds it; None: this filesystem has no flock."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in _HELD_ERRNOS:
            return False
        if err.errno in _NO_FLOCK_ERRNOS:
            return None
        raise
    return True


def _unlock(held: _HeldLock) -> None:
    """Release a lock: remove its file (still holding it), unlock, close, tidy up folders."""
    if held.fd < 0:
        return
    fd, held.fd = held.fd, -1
    if _HELD.get(held.run_dir) is held:
        del _HELD[held.run_dir]
    if os.getpid() != held.owner.get("pid"):
        os.close(fd)  # a forked child's copy: the lock (and its file) are its parent's
        return
    try:
        if _same_file(fd, held.path):
            with suppress(OSError):
                os.unlink(held.path)
        if held.flocked:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    _remove_empty(held.created)


@atexit.register
def _release_all() -> None:
    for held in list(_HELD.values()):
        _unlock(held)


def _write_owner(fd: int, run_dir: Path) -> dict[str, Any]:
    owner = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": datetime.now().astimezone().isoformat(timespec="seconds"),
        "run_dir": str(run_dir.resolve()),
        "command": " ".join(sys.argv)[:1000],
    }
    data = (json.dumps(owner) + "\n").encode()
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    while data:
        data = data[os.write(fd, data) :]
    os.fsync(fd)  # seen by other hosts of a network filesystem
    return owner


def _read_owner(path: Path, wait: bool = False) -> dict[str, Any] | None:
    """The owner a lock file names (``None``: empty or unreadable). ``wait``: give a process
    that has just created the file a moment to write its name."""
    for _ in range(10 if wait else 1):
        try:
            owner = json.loads(path.read_text())
        except (OSError, ValueError):
            owner = None
        if isinstance(owner, dict):
            return owner
        if wait:
            time.sleep(0.05)
    return None


def _owner_alive(owner: dict[str, Any] | None) -> bool | None:
    """Whether the process a lock file names still runs: None where this host cannot tell (on
    another host, or no name)."""
    if owner is None or owner.get("host") != socket.gethostname() or os.name == "nt":
        return None  # (Windows' os.kill(pid, 0) would send a Ctrl-C event)
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return None
    if pid == os.getpid():
        return False  # this process, which holds no lock on it: a leftover
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    except OSError:
        return None
    return True


def _describe(owner: dict[str, Any] | None) -> str:
    if owner is None:
        return "a process that has not written its name yet"
    return (
        f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}, "
        f"since {owner.get('since', '?')}"
    )


def _in_use(run_dir: Path, path: Path, owner: dict[str, Any] | None, unsure: bool = False) -> str:
    if unsure:
        return (
            f"output dir {str(run_dir)!r} is locked by {_describe(owner)} (lock file {path}), "
            "which this host cannot check: wait for that run to end or stop it; if it is no "
            f"longer running, delete {path}; or choose another --output-dir"
        )
    return (
        f"output dir {str(run_dir)!r} is in use by another maxscore run: {_describe(owner)} "
        f"(lock file {path}); wait for it to end or stop it (SIGTERM saves a checkpoint "
        "first), or choose another --output-dir"
    )


def _took_over(run_dir: Path, previous: dict[str, Any] | None) -> None:
    _say(
        f"took over the lock of {run_dir} left by {_describe(previous)}, which is no longer running"
    )


def _refuse_inside_a_locked_folder(run_dir: Path, resolved: Path) -> None:
    """A run directory inside a folder another process holds (a running ``maxscore compare``'s
    output) is refused like the folder itself."""
    for folder in resolved.parents:
        if not folder.name:
            break
        path = folder.parent / f".{folder.name}{LOCK_SUFFIX}"
        if not path.is_file():
            continue
        owner = _read_owner(path)
        alive = _owner_alive(owner)
        if owner is None or alive is False or (alive and not _held_by_someone(path)):
            continue  # a dead owner's file (also where its pid has been reused since)
        raise RunDirInUseError(
            f"output dir {str(run_dir)!r} is inside {str(folder)!r}, which is in use by "
            f"another maxscore run: {_describe(owner)} (lock file {path}); wait for it to "
            "end or stop it, or choose another --output-dir"
        )


def _held_by_someone(path: Path) -> bool:
    """Whether a lock file of this host is flocked by a process: a shared lock taken and
    dropped at once succeeds on a dead owner's file. True where this filesystem cannot say."""
    if fcntl is None:
        return True
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True  # held, or no flock here
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (on_disk.st_dev, on_disk.st_ino) == (opened.st_dev, opened.st_ino)


def _writable_or_creatable(folder: Path) -> bool:
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)


def _make_folders(folder: Path, run_dir: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; the ones created, outermost first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    created: list[Path] = []
    for path in reversed(missing):
        try:
            path.mkdir()
        except FileExistsError:
            continue
        except OSError as err:
            _remove_empty(created)
            raise ConfigError(f"output dir {str(run_dir)!r} cannot be created: {err}") from err
        created.append(path)
    return created


def _remove_empty(folders: list[Path]) -> None:
    """Remove folders this process created, innermost first, as long as they are empty."""
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            return


def _cannot_create(path: Path, run_dir: Path, err: OSError) -> ConfigError:
    return ConfigError(
        f"output dir {str(run_dir)!r}: cannot create its lock file {path} ({err.strerror or err})"
    )
