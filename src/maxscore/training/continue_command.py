"""The exact command that goes on with a run, for the messages that say how.

The command line (``maxscore train ...``) is remembered by the CLI (:func:`set_command_line`);
:func:`continue_command` drops ``--overwrite`` and adds ``--resume`` where the run has a checkpoint
to continue from, :func:`overwrite_command` starts it again over what it left. Library use (no
command line) gets the advice in words.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence

#: ``maxscore ARGS`` as the CLI parsed it (:func:`set_command_line`); ``None``: called as a
#: library, where :func:`continue_command` describes the change instead.
_COMMAND_LINE: list[str] | None = None


def set_command_line(argv: Sequence[str], program: str = "maxscore") -> None:
    """Remember the command line (``argv`` without the program) for :func:`continue_command`."""
    global _COMMAND_LINE
    _COMMAND_LINE = [program, *argv]


def _is_flag(token: str, flag: str) -> bool:
    """``token`` is ``flag`` or an abbreviation argparse accepts for it (``--overw``)."""
    return token == flag or (len(token) >= 5 and flag.startswith(token))


def continue_command(resume: bool, argv: Sequence[str] | None = None) -> str:
    """The command that goes on with a run: ``resume`` (it has a checkpoint to continue from)
    drops ``--overwrite`` and adds ``--resume``; else the same command again (a run that failed
    before its first checkpoint left nothing to resume: an ``--overwrite`` put the previous run
    back, so ``--resume`` would continue *that* one). ``argv``: the command line, program
    first (default: the one :func:`set_command_line` stored)."""
    line = list(argv) if argv is not None else _COMMAND_LINE
    if line is None:
        if resume:
            return "the same settings with resume=True and overwrite=False"
        return "the same settings again"
    program, args = line[0], list(line[1:])
    if resume:
        if "--" in args:  # nothing after "--" is an option
            args = args[: args.index("--")]
        args = [a for a in args if not _is_flag(a, "--overwrite")]
        if not any(_is_flag(a, "--resume") for a in args):
            args.append("--resume")
    return shlex.join([program, *args])


def overwrite_command(argv: Sequence[str] | None = None) -> str:
    """The command that starts a run (or ``maxscore compare``) again over what it left: the
    same command with ``--overwrite`` (and without ``--resume``)."""
    line = list(argv) if argv is not None else _COMMAND_LINE
    if line is None:
        return "the same settings with overwrite=True"
    program, args = line[0], [a for a in line[1:] if not _is_flag(a, "--resume")]
    if not any(_is_flag(a, "--overwrite") for a in args):
        args.append("--overwrite")
    return shlex.join([program, *args])


def _launcher_note() -> str:
    """Under torchrun (or another launcher) the command goes after the launcher's own part."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        return " (under your launcher, e.g. torchrun, as before)"
    return ""


def how_to_continue(resume: bool) -> str:
    """``continue with: CMD`` (``resume``) or ``run it again with: CMD``, for messages."""
    verb = "continue with" if resume else "start it again with"
    return f"{verb}: {continue_command(resume)}{_launcher_note()}"
