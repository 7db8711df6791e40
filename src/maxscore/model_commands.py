"""``maxscore upcycle`` and ``maxscore export``: dense checkpoints in, family checkpoints out.

This module lives beside :mod:`maxscore.cli`, not in :mod:`maxscore.models`: importing that
package imports torch and transformers (it registers the model with the Auto classes), and the
CLI imports this module to build its parser, which ``maxscore --help`` must do without them.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

from maxscore.cli_options import parse_options
from maxscore.file_modes import give_default_file_modes

__all__ = ["add_export_parser", "add_upcycle_parser"]

_UPCYCLE_EXAMPLES = """\
examples:
  maxscore upcycle ./my-llama ./my-llama-moe --num-experts 8 --top-k 2 --router maxscore
  maxscore train --model ./my-llama-moe --router maxscore --dataset my_texts.jsonl
"""

_EXPORT_EXAMPLES = """\
examples:
  maxscore export runs/my-mixtral-gshard/checkpoint-250 ./mixtral-finetuned
  maxscore export runs/my-olmoe-maxscore/checkpoint-250 ./olmoe-out --allow-routing-change
"""


def _copy_tokenizer(source: str, output: Path) -> None:
    src = Path(source)
    if not src.is_dir():
        return
    from maxscore.models.convert.export import TOKENIZER_FILES  # on use (module docstring)

    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, output / name)


def add_upcycle_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "upcycle",
        help="turn a dense Llama-style checkpoint into an MoE (experts copied from each MLP)",
        description="Sparse upcycling: every MLP of a dense Llama / Mistral / Qwen2 / Qwen3 "
        "checkpoint becomes an MoE layer whose experts start as copies of it, with a new "
        "router. Writes a maxscore checkpoint that `maxscore train --model` fine-tunes.",
        epilog=_UPCYCLE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("source", help="dense checkpoint directory or hub name")
    parser.add_argument("output", help="directory for the MoE checkpoint")
    parser.add_argument("--num-experts", type=int, required=True, help="experts per layer e")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token k (default 2)")
    parser.add_argument("--router", default="maxscore", help="router preset (default maxscore)")
    parser.add_argument("--router-option", action="append", metavar="KEY=VALUE")
    parser.add_argument("--seed", type=int, default=0, help="seed of the new router weights")
    parser.set_defaults(func=run_upcycle)
    return parser


def run_upcycle(args: argparse.Namespace) -> int:
    # On use (module docstring).
    from maxscore.models.convert import ConversionError
    from maxscore.models.upcycle import upcycle

    try:
        model = upcycle(
            args.source,
            args.num_experts,
            args.top_k,
            router=args.router,
            router_config=parse_options(args.router_option, "--router-option"),
            seed=args.seed,
        )
    except (ConversionError, ValueError) as err:
        print(f"maxscore: error: {err}", file=sys.stderr)
        return 2
    output = Path(args.output)
    model.save_pretrained(output)
    give_default_file_modes(output)
    _copy_tokenizer(args.source, output)
    counts = model.parameter_counts()
    print(
        f"upcycled {args.source} -> {output}: {args.num_experts} experts, top-{args.top_k}, "
        f"router {args.router}; {counts['total']:,} parameters ({counts['activated']:,} active)"
    )
    return 0


def add_export_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "export",
        help="write a converted checkpoint back in its original family's format",
        description="Save a maxscore checkpoint that was converted from Mixtral / Qwen2-MoE / "
        "Qwen3-MoE / OLMoE in that family's own format (loads with AutoModelForCausalLM, no "
        "remote code). Refused when the family cannot express the model's routing, unless "
        "--allow-routing-change.",
        epilog=_EXPORT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint", help="maxscore checkpoint directory (e.g. a run's)")
    parser.add_argument("output", help="directory for the exported model")
    parser.add_argument(
        "--allow-routing-change",
        action="store_true",
        help="export the weights even if the family will route differently",
    )
    parser.set_defaults(func=run_export)
    return parser


def run_export(args: argparse.Namespace) -> int:
    from maxscore.models.convert import ConversionError, export_pretrained  # on use, as above

    try:
        out = export_pretrained(args.checkpoint, args.output, args.allow_routing_change)
    except (ConversionError, OSError) as err:
        print(f"maxscore: error: {err}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {out}")
    return 0
