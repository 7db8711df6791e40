"""Names and locations in a run directory: ``config.json``, ``metrics.jsonl``, the
``checkpoint-N`` folders, and
the previous run an ``--overwrite`` keeps aside (``.<name>.previous-run`` beside it, with
``.replacing-previous-run`` inside the new run until the replacement is done;
:mod:`maxscore.training.run_dir` manages them)."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = [
    "CHECKPOINT_RE",
    "CONFIG_FILE",
    "METRICS_FILE",
    "PREVIOUS_RUN_SUFFIX",
    "REPLACING_MARKER",
    "last_checkpoint",
    "list_checkpoints",
    "pending_previous_run",
    "previous_run_path",
]

#: The run's resolved configuration (training config, derived values, model config).
CONFIG_FILE = "config.json"
#: One JSON line per training log (:data:`maxscore.training.metrics.METRICS_SCHEMA`).
METRICS_FILE = "metrics.jsonl"
#: A complete checkpoint folder's name (``transformers``' convention).
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
PREVIOUS_RUN_SUFFIX = ".previous-run"
#: Inside a run that an ``--overwrite`` started: the previous run (aside) is not replaced yet.
REPLACING_MARKER = ".replacing-previous-run"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run directory, oldest (lowest step) first."""
    if not run_dir.is_dir():
        return []
    found = []
    for child in run_dir.iterdir():
        match = CHECKPOINT_RE.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def last_checkpoint(run_dir: Path) -> Path | None:
    """The highest-step complete checkpoint, or None."""
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None


def previous_run_path(run_dir: Path) -> Path:
    """Where ``--overwrite`` keeps the previous run until the new one has a checkpoint."""
    return run_dir.with_name(f".{run_dir.name}{PREVIOUS_RUN_SUFFIX}")


def pending_previous_run(run_dir: Path) -> Path | None:
    """The previous run an unfinished ``--overwrite`` of ``run_dir`` keeps aside, or ``None``.

    Pending while the replacing run has no checkpoint (it is starting, or it was killed) or only
    ones that do not replace (saved at a stop signal: ``run_dir`` holds the marker). Read-only:
    safe while the replacing run trains.
    """
    previous = previous_run_path(run_dir)
    if not previous.is_dir():
        return None
    if (run_dir / REPLACING_MARKER).exists() or not list_checkpoints(run_dir):
        return previous
    return None
