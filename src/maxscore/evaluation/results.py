"""Evaluation result files and the paper-layout markdown table.

``eval_results.json`` holds one entry per evaluated model (see
:meth:`maxscore.evaluation.runner.ModelEvalResult.to_dict`); ``eval_results.md`` renders it the
way the paper's tables do: one row per model, one column per task (accuracy in percent; ReCoRD
F1), and the average over the tasks shown.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from maxscore.evaluation.registry import PAPER_TASK_BY_NAME, PAPER_TASKS
from maxscore.write_errors import replaced_file, reported_write, write_text_atomically

RESULTS_JSON = "eval_results.json"
RESULTS_MD = "eval_results.md"
SCHEMA_VERSION = 1


def paper_metric(task: str) -> str:
    """The metric a task's column reports (``acc`` unless the paper uses another)."""
    spec = PAPER_TASK_BY_NAME.get(task)
    return spec.metric if spec else "acc"


def _column(task: str) -> str:
    spec = PAPER_TASK_BY_NAME.get(task)
    return spec.column if spec else task


def ordered_tasks(tasks: Sequence[str]) -> list[str]:
    """Paper tasks in the paper's column order, then any other tasks in the given order."""
    present = list(dict.fromkeys(tasks))
    paper = [t.name for t in PAPER_TASKS if t.name in present]
    return paper + [t for t in present if t not in paper]


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}f}"


def paper_scores(model: dict[str, Any]) -> dict[str, float]:
    """``{task: score in percent}`` for one model entry (missing metrics are skipped)."""
    scores: dict[str, float] = {}
    for task, metrics in model.get("metrics", {}).items():
        value = metrics.get(paper_metric(task))
        if value is not None:
            scores[task] = 100.0 * float(value)
    return scores


def checkpoint_validation(run_dir: Path | None, checkpoint: Path) -> dict[str, Any] | None:
    """The run's validation loss at ``checkpoint``'s step, with its standard error, if logged.

    Read from the run's ``metrics.jsonl`` (the evaluation at the checkpoint's step:
    ``eval_loss``, ``eval_loss_se`` over validation documents, ``eval_tokens``); ``None`` for
    a checkpoint outside a run directory or a step without an evaluation.
    """
    if run_dir is None or not (run_dir / "metrics.jsonl").is_file():
        return None
    match = re.search(r"(\d+)$", checkpoint.name)
    step = int(match.group(1)) if match else None
    found: dict[str, Any] | None = None
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        is_eval = record.get("type") == "eval" and "eval_loss" in record
        if is_eval and (step is None or record.get("step") == step):
            found = record  # the last one at that step (or of the run)
    if found is None:
        return None
    return {
        "step": found.get("step"),
        "loss": found["eval_loss"],
        "se": found.get("eval_loss_se"),
        "tokens": found.get("eval_tokens"),
    }


def _validation_cell(model: dict[str, Any]) -> str:
    v = model.get("validation") or {}
    if v.get("loss") is None:
        return "–"
    return f"{v['loss']:.4f}" + (f" ± {v['se']:.4f}" if v.get("se") is not None else "")


def markdown_table(models: Sequence[dict[str, Any]], tasks: Sequence[str] | None = None) -> str:
    """The paper-layout table: ``| Model | ARC-c | ... | Avg. |`` with scores in percent.

    The average is over the columns shown; a model missing a column gets ``–`` there and its
    average is taken over the tasks it has (marked with ``*``). When any model comes from a
    training run, a last column gives that run's validation loss at the checkpoint ± its
    standard error over validation documents.
    """
    if tasks is None:
        tasks = ordered_tasks([t for m in models for t in m.get("metrics", {})])
    with_loss = any((m.get("validation") or {}).get("loss") is not None for m in models)
    header = "| Model | " + " | ".join(_column(t) for t in tasks) + " | Avg. |"
    rule = "|---|" + "---:|" * (len(tasks) + 1)
    if with_loss:
        header += " Val loss ± SE |"
        rule += "---:|"
    rows = [header, rule]
    for model in models:
        scores = paper_scores(model)
        present = [scores[t] for t in tasks if t in scores]
        avg = sum(present) / len(present) if present else None
        partial = "*" if present and len(present) < len(tasks) else ""
        cells = [_fmt(scores.get(t)) for t in tasks]
        row = f"| {model['name']} | " + " | ".join(cells) + f" | {_fmt(avg)}{partial} |"
        if with_loss:
            row += f" {_validation_cell(model)} |"
        rows.append(row)
    return "\n".join(rows)


def detail_table(models: Sequence[dict[str, Any]]) -> str:
    """Every metric of every task, one row per (model, task), values as lm-eval reports them."""
    rows = [
        "| Model | Task | Split | n | Metric | Value | Stderr |",
        "|---|---|---|---:|---|---:|---:|",
    ]
    for model in models:
        for task in ordered_tasks(list(model.get("metrics", {}))):
            metrics = model["metrics"][task]
            info = model.get("tasks", {}).get(task, {})
            for metric in sorted(k for k in metrics if not k.endswith("_stderr")):
                stderr = metrics.get(f"{metric}_stderr")
                rows.append(
                    f"| {model['name']} | {task}{' (bundled)' if info.get('bundled') else ''} | "
                    f"{info.get('split', '')} | {model.get('n_samples', {}).get(task, '')} | "
                    f"{metric} | {_fmt(metrics[metric], 4)} | {_fmt(stderr, 4)} |"
                )
    return "\n".join(rows)


def routing_table(models: Sequence[dict[str, Any]]) -> str:
    """Evaluation routing of each model: mode, trained vs. evaluated strategy, routing group."""
    rows = [
        "| Model | Router | Eval routing | Strategy (train → eval) | Group | Checkpoint |",
        "|---|---|---|---|---|---|",
    ]
    for m in models:
        r = m.get("routing", {})
        group = r.get("group", "")
        if r.get("group_size"):
            group = f"{group} ({r['group_size']})"
        strategy = r.get("strategy", "")
        if r.get("eval_strategy") and r.get("eval_strategy") != strategy:
            strategy = f"{strategy} → {r['eval_strategy']}"
        rows.append(
            f"| {m['name']} | {r.get('router', '')} | {r.get('eval_routing', '')} | {strategy} | "
            f"{group} | `{m.get('checkpoint', '')}` |"
        )
    return "\n".join(rows)


def render_markdown(payload: dict[str, Any]) -> str:
    """The full ``eval_results.md`` page."""
    models = payload["models"]
    parts = [
        "# Evaluation results",
        "",
        "Zero-shot lm-evaluation-harness scores in percent (accuracy; ReCoRD: F1), as in the "
        "paper's tables."
        + (f" Limited to {payload['limit']} documents per task." if payload.get("limit") else ""),
        "",
        markdown_table(models),
        "",
        "## Evaluation routing",
        "",
        routing_table(models),
        "",
        "## All metrics",
        "",
        detail_table(models),
        "",
    ]
    return "\n".join(parts)


def write_results(
    output_dir: Path, models: Sequence[Any], settings: dict[str, Any]
) -> tuple[Path, Path]:
    """Write ``eval_results.json`` and ``eval_results.md`` into ``output_dir``.

    ``models`` are :class:`~maxscore.evaluation.runner.ModelEvalResult` objects or their dicts;
    per-document samples, if present, go to ``samples_<name>.jsonl`` beside them. Each file is
    written whole or not at all: a full disk or a read-only folder is a
    :class:`~maxscore.write_errors.FileWriteError` naming the file, and earlier results there
    stay as they were.
    """
    with reported_write("the output folder", output_dir):
        output_dir.mkdir(parents=True, exist_ok=True)
    entries = [m if isinstance(m, dict) else m.to_dict() for m in models]
    payload = {"schema_version": SCHEMA_VERSION, **settings, "models": entries}
    json_path = output_dir / RESULTS_JSON
    json_text = json.dumps(payload, indent=2, sort_keys=False) + "\n"
    write_text_atomically(json_path, json_text, "the evaluation results")
    md_path = output_dir / RESULTS_MD
    write_text_atomically(md_path, render_markdown(payload), "the evaluation table")
    for model in models:
        samples = getattr(model, "samples", None)
        if samples:
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model.name)
            path = output_dir / f"samples_{safe}.jsonl"
            with (
                reported_write("the evaluation samples", path, replaced=True),
                replaced_file(path) as tmp,
                tmp.open("w") as handle,
            ):
                for task, records in samples.items():
                    for record in records:
                        handle.write(json.dumps({"task": task, **record}) + "\n")
    return json_path, md_path


def load_results(path: Path) -> dict[str, Any]:
    """Read an ``eval_results.json`` (or the directory holding one)."""
    file = path / RESULTS_JSON if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no {RESULTS_JSON} at {path}")
    return json.loads(file.read_text())
