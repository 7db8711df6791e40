"""File permissions of what a run writes.

safetensors writes ``model.safetensors`` with mode 0600 whatever the process's umask, while
every other file of a checkpoint or export gets the usual 0644: a shared checkpoint folder then
has one file its group cannot read. Saved folders are given the umask's default mode instead.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["default_file_mode", "give_default_file_modes"]


def default_file_mode() -> int:
    """``0o666`` less the process's umask (what ``open(path, "w")`` gives a new file)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def give_default_file_modes(folder: Path) -> None:
    """Widen every regular file under ``folder`` that is stricter than the default mode to it
    (files that are already wider, e.g. executables, are left as they are)."""
    mode = default_file_mode()
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            info = os.lstat(path)
            current = stat.S_IMODE(info.st_mode)
            if not stat.S_ISLNK(info.st_mode) and current & mode != mode:
                os.chmod(path, current | mode)
