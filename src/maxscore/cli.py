"""The ``maxscore`` command line: train, compare, presets (and eval / analyze / report).

``maxscore train`` with no arguments trains the tiny preset with the MaxScore router on the
embedded corpus (a few minutes on a laptop CPU) and prints validation loss, perplexity and a
routing summary. ``maxscore <command> --help`` shows each command's options and examples.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from maxscore.cli_options import add_dataclass_options, given_options
from maxscore.host_memory import reuse_freed_host_memory
from maxscore.preset_tables import MODEL_PRESETS, ROUTER_PRESET_TABLE
from maxscore.training.checkpoint import CheckpointSaveError
from maxscore.training.config import ConfigError, TrainConfig, apply_recipe
from maxscore.training.pretrained import check_model_name
from maxscore.write_errors import FileWriteError

#: Failures that end a command with one line (what happened, what to do), not a traceback: a
#: bad option, a checkpoint save that failed, any other file of the run that could not be
#: written (a full disk, a read-only folder: ``write_errors.py``, with the run's advice from
#: ``training/write_errors.py``).
_USER_ERRORS = (ConfigError, CheckpointSaveError, FileWriteError)

_TRAIN_EXAMPLES = """\
examples:
  maxscore train                                   # tiny + maxscore on the embedded corpus (CPU)
  maxscore train --router gshard --max-steps 500 --output-dir runs/gshard
  maxscore train --dataset my_texts.jsonl --text-field content --seq-len 512
  maxscore train --router-option capacity_factor=1.25 --model-option num_hidden_layers=2
  maxscore train --output-dir runs/gshard --resume   # continue after a crash or Ctrl-C
  maxscore train --recipe paper --router maxscore   # the paper's setup (Base, C4, 180k steps)
  maxscore train --recipe paper-shape --max-steps 400  # its schedule proportions, a short run
  torchrun --nproc-per-node 8 -m maxscore.cli train --recipe paper --deepspeed zero2
  torchrun --nproc-per-node 4 -m maxscore.cli train --model base-2x64 --expert-parallel 4
"""

_COMPARE_EXAMPLES = """\
examples:
  maxscore compare                                  # gshard, maxscore, dropless on tiny (CPU)
  maxscore compare --routers gshard,gshard-i,maxscore-i,maxscore --max-steps 200
  maxscore compare --routers dense,gshard,maxscore --model base --output-dir runs/cmp-base
  maxscore compare --routers gshard,maxscore --seeds 42,43,44   # intervals and verdicts
  maxscore compare --routers gshard,maxscore --seeds 1,2,3,4,5,6 --margin 0.005 --deterministic

Every router trains with the same data, seed(s) and budget; the output folder gets
comparison.md (validation loss with its standard error, differences to the first router),
comparison.csv / .json, loss_curves.png, loss_differences.png and one run directory per
router (per router and seed with --seeds).
"""


#: The sections of ``maxscore train --help``, in order (each TrainConfig field names its own).
_TRAIN_SECTIONS = ("model", "data", "optimisation", "run directory")


def _add_train_options(parser: argparse.ArgumentParser, compare: bool = False) -> None:
    """One flag per :class:`TrainConfig` field (generated from the fields: name, type, choices,
    help), then ``--config``. ``compare`` sets the router of each run itself and never resumes."""
    exclude = frozenset({"router", "resume"}) if compare else frozenset()
    add_dataclass_options(parser, TrainConfig, exclude, _TRAIN_SECTIONS)
    parser.add_argument("--config", help="a JSON/YAML TrainConfig file (flags override it)")


def config_from_args(args: argparse.Namespace, **forced: Any) -> TrainConfig:
    """Build the :class:`TrainConfig`: file < recipe < explicit flags < ``forced``."""
    base = TrainConfig.from_file(args.config) if getattr(args, "config", None) else TrainConfig()
    data = base.to_dict()
    explicit: set[str] = set()
    for name, value in given_options(args, TrainConfig).items():
        if isinstance(value, dict):  # KEY=VALUE options add to the file's
            if not value:
                continue
            value = {**data[name], **value}
        data[name] = value
        explicit.add(name)
    if getattr(args, "config", None):
        # Values from a config file count as explicit too (they win over a recipe).
        explicit |= set(TrainConfig().differences(base, ignore=frozenset()))
    data.update(forced)
    explicit |= set(forced)
    config = TrainConfig.from_dict(data)
    return apply_recipe(config, explicit)


# ------------------------------------------------------------------------------------------------
# commands
# ------------------------------------------------------------------------------------------------
def _error(message: str) -> int:
    print(f"maxscore: error: {message}", file=sys.stderr)
    return 2


def _check_model_early(args: argparse.Namespace) -> str | None:
    """A ``--model`` typo's message, found before torch and transformers are imported (~10 s)."""
    if getattr(args, "model", None):
        try:
            check_model_name(args.model)
        except _USER_ERRORS as err:
            return str(err)
    return None


def run_train(args: argparse.Namespace) -> int:
    if (problem := _check_model_early(args)) is not None:
        return _error(problem)
    reuse_freed_host_memory()  # a CPU step would otherwise fault in its large tensors anew
    # Here, not at the top: training imports torch and transformers (seconds), which `--help`
    # and a refused `--model` do not wait for.
    from maxscore.training.continue_command import set_command_line
    from maxscore.training.distributed import is_main_process
    from maxscore.training.run import format_summary, prepare, train

    # The exact command that continues the run, in every message that says how to go on.
    set_command_line(getattr(args, "command_line", None) or sys.argv[1:])
    try:
        config = config_from_args(args)
        prepared = prepare(config)
        if not config.quiet and is_main_process():
            print(
                f"maxscore: training {config.model} + {config.router} on {prepared.data.description}"
                f" for {prepared.total_steps} steps; run directory {prepared.run_dir}",
                file=sys.stderr,
            )
            if prepared.precision != "fp32" and not config.compile:
                print(
                    "maxscore: tip: --compile trains ~1.7x faster on a GPU "
                    "(benchmarks/train_throughput/README.md)",
                    file=sys.stderr,
                )
        result = train(config, prepared=prepared)
    except _USER_ERRORS as err:
        return _error(str(err))
    if is_main_process():
        print(format_summary(result))
    return result.exit_status  # 0, or 128 + the signal that stopped the run (130: Ctrl-C)


def run_compare(args: argparse.Namespace) -> int:
    if (problem := _check_model_early(args)) is not None:
        return _error(problem)
    reuse_freed_host_memory()
    # Here, not at the top: as in run_train.
    from maxscore.training.compare import (
        ComparisonStopped,
        compare,
        format_summary_markdown,
        verdict_sentences,
    )
    from maxscore.training.continue_command import set_command_line
    from maxscore.training.distributed import is_main_process
    from maxscore.training.seed_stats import summarize_by_router

    set_command_line(getattr(args, "command_line", None) or sys.argv[1:])
    try:
        routers = [r.strip() for r in args.routers.split(",") if r.strip()]
        seeds = _parse_seeds(args.seeds)
        config = config_from_args(args, router=routers[0] if routers else "maxscore")
        rows = compare(
            routers,
            config,
            args.output_dir or "runs/compare",
            overwrite=bool(args.overwrite),
            seeds=seeds,
            confidence=args.confidence,
            margin=args.margin,
            reruns=args.reruns,
        )
    except _USER_ERRORS as err:
        return _error(str(err))
    except ComparisonStopped as stopped:
        print(f"maxscore: {stopped}", file=sys.stderr)
        return stopped.exit_status
    if is_main_process():
        summary = summarize_by_router(rows, args.confidence, args.margin)
        print(format_summary_markdown(summary, rows[0]["router"]))
        for line in verdict_sentences(summary, rows[0]["router"]):
            print(line)
    return 0


def _parse_seeds(text: str | None) -> list[int] | None:
    """``"42,43,44"`` -> ``[42, 43, 44]`` (``None``: the single ``--seed``)."""
    if text is None:
        return None
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--seeds expects comma-separated integers, got {text!r}") from None
    if not seeds:
        raise ConfigError("--seeds is empty; give comma-separated integers, e.g. 42,43,44")
    return seeds


def run_presets(args: argparse.Namespace) -> int:
    # The plain tables: neither torch nor transformers is imported (0.3 s instead of 8 s).
    if args.kind in ("all", "router"):
        print("router presets (--router):")
        for name, preset in ROUTER_PRESET_TABLE.items():
            paper = preset.paper_name
            label = f" [{paper}]" if paper and paper.lower() != name else ""
            print(f"  {name:<22}{preset.description}{label}")
    if args.kind in ("all", "model"):
        if args.kind == "all":
            print()
        print("model presets (--model):")
        for name, preset in MODEL_PRESETS.items():
            print(f"  {name:<22}{preset.description}")
    return 0


# ------------------------------------------------------------------------------------------------
# parser
# ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The full ``maxscore`` parser (eval / analyze / report join when their modules exist)."""
    parser = argparse.ArgumentParser(
        prog="maxscore",
        description="Maximum Score Routing for Mixture-of-Experts: train, compare, evaluate and "
        "analyse MoE routers.",
        epilog="run `maxscore <command> --help` for each command's options and examples",
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>")

    train_p = sub.add_parser(
        "train",
        help="train a Llama-MoE model (no arguments: tiny + maxscore on the embedded corpus)",
        description="Train a Llama-MoE language model with one of the paper's routers on the "
        "HF Trainer. Writes config.json, checkpoints (safetensors + tokenizer), metrics.jsonl, "
        "TensorBoard logs and summary.json into the run directory.",
        epilog=_TRAIN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_train_options(train_p)
    train_p.set_defaults(func=run_train)

    compare_p = sub.add_parser(
        "compare",
        help="train several routers with the same data, seed and budget; table + loss plot",
        description="Train several router presets one after another with identical settings "
        "and write a comparison table (markdown + CSV) and a loss-curve PNG.",
        epilog=_COMPARE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    compare_p.add_argument(
        "--routers",
        default="gshard,maxscore,dropless",
        help="comma-separated router presets (default gshard,maxscore,dropless)",
    )
    compare_p.add_argument(
        "--seeds",
        default=None,
        help="comma-separated seeds, e.g. 42,43,44: every router trains once per seed; the "
        "table gives mean ± std over seeds, each router's paired difference to the first router "
        "with its t interval over seeds, a verdict and the seeds needed, and a plot of the "
        "differences (default: the single --seed)",
    )
    compare_p.add_argument(
        "--confidence",
        type=float,
        default=0.95,
        help="two-sided confidence of the intervals over seeds (default 0.95)",
    )
    compare_p.add_argument(
        "--margin",
        type=float,
        default=0.01,
        help="equivalence margin in nats: a router whose whole interval lies within ±margin of "
        "the first router's loss is called equivalent (default 0.01, a 1%% perplexity change)",
    )
    compare_p.add_argument(
        "--reruns",
        type=int,
        default=0,
        help="train each router's first seed N more times with identical settings and report "
        "the same-seed noise (default 0)",
    )
    _add_train_options(compare_p, compare=True)
    compare_p.set_defaults(func=run_compare)

    presets_p = sub.add_parser(
        "presets",
        help="list router and model presets",
        description="List the named router presets (the paper's variants) and model sizes.",
        epilog="examples:\n  maxscore presets\n  maxscore presets router",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    presets_p.add_argument("kind", nargs="?", choices=["all", "router", "model"], default="all")
    presets_p.set_defaults(func=run_presets)

    _add_optional_commands(sub)
    return parser


def _add_optional_commands(sub: Any) -> None:
    """eval / analyze / report come from their packages; the CLI works while they are absent.

    A command whose module is missing is left out; one whose module fails to import (a missing
    optional dependency such as lm-eval) is listed but reports the import error when run.
    """
    hooks = (
        ("eval", "maxscore.evaluation.commands", "add_eval_parser"),
        ("analyze", "maxscore.analysis.commands", "add_analyze_parser"),
        ("report", "maxscore.analysis.commands", "add_report_parser"),
        ("upcycle", "maxscore.model_commands", "add_upcycle_parser"),
        ("export", "maxscore.model_commands", "add_export_parser"),
    )
    for command, module_name, function in hooks:
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            if err.name is not None and module_name.startswith(err.name):
                continue  # the module itself does not exist (yet)
            _add_unavailable(sub, command, f"{type(err).__name__}: {err}")
            continue
        hook = getattr(module, function, None)
        if hook is not None:
            hook(sub)


def _add_unavailable(sub: Any, command: str, reason: str) -> None:
    parser = sub.add_parser(command, help=f"(unavailable: {reason})", add_help=True)
    parser.add_argument("rest", nargs=argparse.REMAINDER)

    def fail(args: argparse.Namespace) -> int:
        return _error(f"`maxscore {command}` is unavailable here: {reason}")

    parser.set_defaults(func=fail)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``maxscore`` console script."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.command_line = argv
    if args.command is None:
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
