"""The ``maxscore`` command line: train, compare, presets (and eval / analyze / report).

``maxscore train`` with no arguments trains the tiny preset with the MaxScore router on the
embedded corpus (a few minutes on a laptop CPU) and prints validation loss, perplexity and a
routing summary. ``maxscore <command> --help`` shows each command's options and examples.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from maxscore.cli_options import parse_options
from maxscore.host_memory import reuse_freed_host_memory
from maxscore.training.checkpoint import CheckpointSaveError
from maxscore.training.config import RECIPES, ConfigError, TrainConfig, apply_recipe
from maxscore.training.write_errors import RunWriteError

#: Failures that end a command with one line (what happened, what to do), not a traceback: a
#: bad option, a checkpoint save that failed, any other file of the run that could not be
#: written (a full disk, a read-only folder: ``training/write_errors.py``).
_USER_ERRORS = (ConfigError, CheckpointSaveError, RunWriteError)

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


def _add_train_options(parser: argparse.ArgumentParser, compare: bool = False) -> None:
    """Flags that map onto :class:`TrainConfig` fields (defaults: ``None`` = not given)."""
    d = TrainConfig()
    g = parser.add_argument_group("model")
    g.add_argument(
        "--model",
        help=f"model preset (default {d.model}; see `maxscore presets`), or a checkpoint directory "
        "/ hub name (maxscore, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE; a hub name is read from the "
        "HF cache when the Hub is offline or unreachable)",
    )
    g.add_argument(
        "--model-option",
        action="append",
        metavar="KEY=VALUE",
        help="override a model config field, e.g. num_hidden_layers=2 (repeatable)",
    )
    if not compare:
        g.add_argument(
            "--router",
            help=f"router preset (default {d.router}); 'native' keeps a converted model's own",
        )
    g.add_argument(
        "--router-option",
        action="append",
        metavar="KEY=VALUE",
        help="override a router config field, e.g. capacity_factor=1.25 (repeatable)",
    )
    g = parser.add_argument_group("data")
    g.add_argument(
        "--dataset",
        help="'default' (embedded corpus), a HF dataset name ('c4' = allenai/c4 en, streamed) "
        "or a local .txt/.jsonl file or folder. Documents: one JSON object per .jsonl line; in a "
        ".txt file, text separated by blank lines (see --txt-documents); 1%% of them (at least "
        "one; validation_fraction in a --config file) is held out for validation",
    )
    g.add_argument("--dataset-config", help="HF dataset config name (e.g. en)")
    g.add_argument("--text-field", help=f"text column / JSON field (default {d.text_field})")
    g.add_argument(
        "--txt-documents",
        choices=["paragraphs", "lines"],
        help="how a .txt file is cut into documents: paragraphs = separated by blank lines "
        f"(lines empty or only white space), lines = every non-blank line (default {d.txt_documents})",
    )
    g.add_argument(
        "--data-format",
        choices=["auto", "text", "chat", "prompt-completion"],
        help="text (a document per record), chat (a 'messages' list, rendered with the "
        "tokenizer's chat template) or prompt-completion ('prompt' + 'completion'); auto "
        "(default): from a .jsonl's first record",
    )
    g.add_argument(
        "--completion-only-loss",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="chat / prompt-completion data: loss on the completion (assistant turns) only "
        "(default on)",
    )
    g.add_argument(
        "--streaming",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="stream the HF dataset (default: only for c4)",
    )
    g.add_argument("--max-train-documents", type=int, help="use only the first N documents")
    g.add_argument(
        "--max-eval-blocks",
        type=int,
        help="validation blocks, evenly spaced over the split (default: the whole split)",
    )
    g.add_argument(
        "--tokenizer", help="'default' (embedded 32k LLaMA-style) or a HF name / local path"
    )
    g.add_argument("--seq-len", type=int, help=f"tokens per sequence (default {d.seq_len})")
    g = parser.add_argument_group("optimisation")
    g.add_argument("--batch-size", type=int, help=f"sequences per device (default {d.batch_size})")
    g.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step (default 1)")
    g.add_argument("--max-steps", type=int, help=f"optimizer steps (default {d.max_steps})")
    g.add_argument("--max-tokens", type=int, help="token budget instead of --max-steps")
    g.add_argument("--lr", type=float, help=f"peak learning rate (default {d.lr})")
    g.add_argument(
        "--weight-decay", type=float, help=f"AdamW weight decay (default {d.weight_decay})"
    )
    g.add_argument("--adam-beta1", type=float, help=f"(default {d.adam_beta1})")
    g.add_argument("--adam-beta2", type=float, help=f"(default {d.adam_beta2})")
    g.add_argument("--adam-eps", type=float, help=f"(default {d.adam_eps})")
    g.add_argument("--max-grad-norm", type=float, help=f"clipping (default {d.max_grad_norm})")
    g.add_argument(
        "--lr-schedule",
        choices=["wsd", "cosine", "linear", "constant"],
        help="learning-rate schedule (default wsd: warmup-stable-decay)",
    )
    g.add_argument("--warmup-steps", type=int, help="warmup steps (default: --warmup-ratio)")
    g.add_argument("--warmup-ratio", type=float, help=f"(default {d.warmup_ratio})")
    g.add_argument("--decay-steps", type=int, help="WSD decay steps at the end (default: ratio)")
    g.add_argument("--decay-ratio", type=float, help=f"(default {d.decay_ratio})")
    g.add_argument("--decay-shape", choices=["linear", "cosine", "1-sqrt"])
    g.add_argument("--min-lr-ratio", type=float)
    g.add_argument(
        "--temperature-steps",
        type=int,
        help="optimizer steps over which the SoftTopk t anneals (default: "
        "--temperature-fraction of the run; the paper recipe: 30000)",
    )
    g.add_argument(
        "--temperature-fraction",
        type=float,
        help="share of the run's optimizer steps over which t anneals when --temperature-steps "
        "is not given (default 1/6: the paper's 30k of 180k)",
    )
    g.add_argument("--seed", type=int, help=f"(default {d.seed})")
    g.add_argument(
        "--precision",
        choices=["auto", "bf16", "fp16", "fp32"],
        help="auto = bf16 on a GPU, fp32 on CPU",
    )
    g.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="recompute activations in backward (activation checkpointing)",
    )
    g.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile each decoder layer and the loss (GPU speed; ~1 min warm-up)",
    )
    g.add_argument(
        "--compile-mode",
        choices=["default", "max-autotune-no-cudagraphs"],
        help="torch.compile mode for --compile",
    )
    g.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="same-seed reruns agree bit for bit on one GPU type: torch's deterministic "
        "algorithms (an op without one fails), cuDNN deterministic, CUBLAS_WORKSPACE_CONFIG="
        ":4096:8, inductor's deterministic mode with --compile (slower; default off)",
    )
    g.add_argument("--deepspeed", help="zero2, zero3 (shipped configs) or a DeepSpeed JSON path")
    g.add_argument(
        "--lora",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="train LoRA adapters (peft; pip install 'maxscore[lora]') instead of every weight",
    )
    g.add_argument("--lora-r", type=int, help=f"LoRA rank (default {d.lora_r})")
    g.add_argument("--lora-alpha", type=float, help=f"LoRA scale alpha (default {d.lora_alpha})")
    g.add_argument(
        "--lora-targets",
        help=f"comma-separated: attention, experts, mlp (LoRA), router (trained in full) "
        f"(default {d.lora_targets})",
    )
    g.add_argument(
        "--expert-parallel",
        type=int,
        metavar="N",
        help="spread each MoE layer's experts over N processes (torchrun; N divides the "
        "processes and the experts; default 1)",
    )
    g = parser.add_argument_group("run directory")
    g.add_argument("--output-dir", help="run directory (default runs/<model>-<router>)")
    g.add_argument(
        "--eval-steps", type=int, help=f"evaluate every N steps (default {d.eval_steps})"
    )
    g.add_argument(
        "--save-steps", type=int, help=f"checkpoint every N steps (default {d.save_steps})"
    )
    g.add_argument(
        "--logging-steps", type=int, help=f"log every N steps (default {d.logging_steps})"
    )
    g.add_argument("--save-total-limit", type=int, help="checkpoints kept (default 2)")
    g.add_argument(
        "--save-final",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="checkpoint at the last step (default on)",
    )
    g.add_argument("--num-workers", type=int, help="DataLoader workers (default 0)")
    g.add_argument(
        "--gc-interval",
        type=int,
        metavar="N",
        help="collect Python's garbage every N steps instead of automatically (no stalls from "
        f"full collections; 0: automatic; default {d.gc_interval})",
    )
    g.add_argument(
        "--report-to",
        help="auto (TensorBoard if installed), none, all (every installed tracker), or "
        "comma-separated trackers the HF Trainer knows: tensorboard, wandb, mlflow, trackio, "
        "comet_ml, clearml, dvclive, swanlab, ... (pip install 'maxscore[trackers]')",
    )
    g.add_argument("--quiet", action="store_true", default=None, help="no progress bar")
    if not compare:
        g.add_argument("--resume", action="store_true", default=None, help="continue the run")
    g.add_argument(
        "--overwrite", action="store_true", default=None, help="replace an existing run directory"
    )
    parser.add_argument("--config", help="a JSON/YAML TrainConfig file (flags override it)")
    parser.add_argument(
        "--recipe",
        choices=list(RECIPES),
        help="paper: the paper's setup (Base, C4, 180k steps, t over 30k); paper-shape: its "
        "optimizer and WSD / t schedule proportions scaled to this run (flags override both)",
    )


def config_from_args(args: argparse.Namespace, **forced: Any) -> TrainConfig:
    """Build the :class:`TrainConfig`: file < recipe < explicit flags < ``forced``."""
    base = TrainConfig.from_file(args.config) if getattr(args, "config", None) else TrainConfig()
    data = base.to_dict()
    explicit: set[str] = set()
    names = {f.name for f in fields(TrainConfig)}
    for name in names:
        value = getattr(args, name, None)
        if value is not None and name not in ("model_overrides", "router_overrides"):
            data[name] = value
            explicit.add(name)
    model_opts = parse_options(getattr(args, "model_option", None), "--model-option")
    router_opts = parse_options(getattr(args, "router_option", None), "--router-option")
    if model_opts:
        data["model_overrides"] = {**data["model_overrides"], **model_opts}
        explicit.add("model_overrides")
    if router_opts:
        data["router_overrides"] = {**data["router_overrides"], **router_opts}
        explicit.add("router_overrides")
    if args.config:
        # Values from a config file count as explicit too (they win over a recipe).
        explicit |= {k for k, v in base.to_dict().items() if v != getattr(TrainConfig(), k)}
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
    from maxscore.training.pretrained import check_model_name

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
    from maxscore.training.compare import ComparisonStopped, compare
    from maxscore.training.continue_command import set_command_line

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
    from maxscore.training.compare import format_summary_markdown, verdict_sentences
    from maxscore.training.distributed import is_main_process
    from maxscore.training.seed_stats import summarize_by_router

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
    from maxscore.preset_tables import MODEL_PRESETS, ROUTER_PRESET_TABLE

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
    import importlib

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
