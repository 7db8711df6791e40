"""``maxscore analyze`` and ``maxscore report``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from maxscore.analysis.runs import RunError
from maxscore.evaluation.runner import EvaluationError
from maxscore.write_errors import FileWriteError


def add_analyze_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``maxscore analyze`` on an ``argparse`` sub-parser collection."""
    parser = subparsers.add_parser(
        "analyze",
        help="routing analysis plots and report for one or more runs",
        description="Reproduce the paper's analyses from run directories: per-layer token-drop "
        "proportion by choice rank, mean affinity of the 1st/2nd choice, sorted per-expert "
        "load/capacity of one layer (mean and spread), training/validation loss curves, "
        "tokens/s and peak memory. Writes PNGs, analysis.json and analysis.md (runs side by side).",
    )
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run directories")
    parser.add_argument(
        "--layer",
        type=int,
        default=None,
        help="layer of the expert-load plot (default: middle MoE layer)",
    )
    parser.add_argument(
        "--checkpoint",
        nargs="?",
        const="latest",
        default=None,
        metavar="PATH",
        help="measure routing by running a checkpoint on the run's validation data instead of "
        "reading metrics.jsonl; alone: each run's final/latest checkpoint",
    )
    parser.add_argument(
        "--routing",
        choices=("train", "causal"),
        default="train",
        help="routing when running a checkpoint (default: train)",
    )
    parser.add_argument(
        "--max-blocks", type=int, default=8, help="validation blocks per checkpoint (default: 8)"
    )
    parser.add_argument(
        "--window",
        type=int,
        default=1,
        help="average the routing stats of the last N training logs (default: 1)",
    )
    parser.add_argument("--names", default=None, help="comma-separated labels, one per run")
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="output directory (default: RUN/analysis for one run, else ./maxscore-analysis)",
    )
    parser.set_defaults(func=run_analyze_command)
    return parser


def run_analyze_command(args: argparse.Namespace) -> int:
    """Entry point of ``maxscore analyze``; returns the exit code."""
    # On use: the command line reads this module at start-up, analyze loads matplotlib (an
    # optional dependency: maxscore[plots]).
    try:
        from maxscore.analysis.analyze import analyze
    except ImportError as err:
        if err.name != "matplotlib":
            raise
        print(f"maxscore analyze: error: {err}", file=sys.stderr)
        return 2

    output = args.output or (
        Path(args.runs[0]) / "analysis" if len(args.runs) == 1 else Path("maxscore-analysis")
    )
    try:
        if args.window < 1 or args.max_blocks < 1:
            raise RunError("--window and --max-blocks must be >= 1")
        result = analyze(
            args.runs,
            output,
            layer=args.layer,
            names=args.names.split(",") if args.names else None,
            checkpoint=args.checkpoint,
            window=args.window,
            routing=args.routing,
            max_blocks=args.max_blocks,
            device=args.device,
        )
    except (RunError, EvaluationError, FileWriteError) as err:
        print(f"maxscore analyze: error: {err}", file=sys.stderr)
        return 2
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    for path in result.figures.values():
        print(f"wrote {path}")
    print(f"wrote {result.json_path} and {result.markdown_path}")
    return 0


def add_report_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``maxscore report`` on an ``argparse`` sub-parser collection."""
    parser = subparsers.add_parser(
        "report",
        help="combine compare, eval and analyze outputs into one markdown page",
        description="Combine the outputs of `maxscore compare` (comparison.md), `maxscore eval` "
        "(eval_results.json) and `maxscore analyze` (analysis.json) into one markdown page. "
        "Give output directories or run directories (their eval/ and analysis/ are used).",
    )
    parser.add_argument(
        "paths", nargs="+", metavar="DIR", help="compare / eval / analyze output or run directories"
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=Path("report.md"),
        help="markdown file or directory (default: report.md)",
    )
    parser.add_argument("--title", default="maxscore report")
    parser.set_defaults(func=run_report_command)
    return parser


def run_report_command(args: argparse.Namespace) -> int:
    """Entry point of ``maxscore report``; returns the exit code."""
    from maxscore.analysis.report import ReportError, combined_report  # on use, as analyze

    try:
        path = combined_report(args.paths, args.output, title=args.title)
    except (ReportError, RunError, FileNotFoundError, FileWriteError) as err:
        print(f"maxscore report: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
