"""Kernel variants on every routing group of a real router's scores.

Trains each ``--presets`` model with maxscore (``real_scores.py``'s recording: compiled, bf16,
micro-batch 64 x 512, so 64 routing groups of 512 tokens per MoE layer), keeps the scores of the
last solver call (all groups; ``--save-scores`` writes them as float16 to
``OUT/scores_<preset>.npz``), then times each variant of the kernel on exactly those scores, in
one process: the starting prices' budget (iterations, temperatures) and blocks per group,
compile-time constants set by the host (``THREADS``, the bid mode's ``WARP_BID_TOKENS``), or the
auction's stall rule (``STALL``, ``STALL_FILL``, constants of the kernel file). The shipped
kernel runs first and again last, so the spread between its two runs bounds the noise.

    PYTHONPATH=src:tests python benchmarks/flow_solver/real_scores_variants.py \\
        --presets base-2x64,deepseek-base,base-8x128 --out OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

from maxscore.routing.flow import global_cuda
from maxscore.routing.flow.global_reference import GlobalBudget

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/common.py
from common import load_script  # noqa: E402


class Variant(NamedTuple):
    """A kernel variant: ``replacements`` in the solver kernel file (the stall rule is the file's
    own "#define STALL 8" / "#define STALL_FILL 2"), host constants (key, value, min_e) prepended
    to it, the budget, and the starting prices' kernel's blocks per group at most."""

    name: str
    replacements: tuple[tuple[str, str], ...] = ()
    defines: tuple[tuple[str, str, int], ...] = ()
    budget: GlobalBudget = GlobalBudget()
    max_cluster: int = global_cuda.MAX_CLUSTER


VARIANTS = [
    Variant("shipped"),
    # the start before the dual prices: the mean affinities and three auctions (400x, 30x, eps)
    Variant("mean-affinity prices, three auctions", budget=GlobalBudget(price_iterations=0)),
    Variant("20 dual iterations", budget=GlobalBudget(price_iterations=20)),
    Variant(
        "40 dual iterations, last temperature 1e-5",
        budget=GlobalBudget(price_iterations=40, price_temperatures=(0.3, 1e-5)),
    ),
    Variant("dual prices: one block per group", max_cluster=1),
    Variant("STALL_FILL=4", replacements=(("#define STALL_FILL 2", "#define STALL_FILL 4"),)),
    Variant("STALL=4", replacements=(("#define STALL 8 ", "#define STALL 4 "),)),
    Variant("THREADS=512", defines=(("THREADS", "512", 0),)),
    Variant("thread bids in every round", defines=(("WARP_BID_TOKENS", "0", 0),)),
    Variant("shipped again"),
]


def variant_source(source: str, replacements: tuple[tuple[str, str], ...]) -> str:
    """The kernel file with ``replacements`` made; each must occur exactly once."""
    for old, new in replacements:
        if source.count(old) != 1:
            raise ValueError(f"{old!r} occurs {source.count(old)} times in the kernel file")
        source = source.replace(old, new)
    return source


def time_variants(
    preset: str,
    steps: int,
    reps: int,
    out: Path,
    save: bool,
    baseline: str | None = None,
    only: set[str] | None = None,
) -> list[dict]:
    """Train ``preset``, then time every variant (those named in ``only``, if given) on its last
    solver call's scores; ``baseline``: the text of an earlier solver kernel file, timed after
    the shipped kernel as the variant "baseline kernel file"."""
    real_scores = load_script(HERE / "real_scores.py", "real_scores")
    compare = load_script(HERE / "compare_kernels.py", "compare_kernels")
    timing = load_script(HERE / "bench.py", "flow_bench")
    a, k, cap, holders, row = real_scores.train_and_record(preset, steps, warmup=steps - 40)
    if save:
        timing.save_scores(out / f"scores_{preset}.npz", a, k, cap)
    shipped = global_cuda.kernel_source()
    rows = []
    try:
        variants = [
            (variant, variant_source(shipped, variant.replacements))
            for variant in VARIANTS
            if only is None or variant.name in only
        ]
        if baseline is not None:  # its prices (if it computes them itself) in its own block
            variants.insert(1, (Variant("baseline kernel file", max_cluster=1), baseline))
        for (name, _, defines, budget, max_cluster), source in variants:
            compare.use_kernel(source, list(defines))
            global_cuda.MAX_CLUSTER = max_cluster
            global_cuda._price_launch.cache_clear()
            ms = timing.graph_time_ms(
                lambda budget=budget: global_cuda.solve_cuda(a, k, cap, holders, budget), reps
            )
            found = {
                "preset": preset,
                "variant": name,
                "ms": ms,
                "shipped_step_ms": row["step_ms"],
                **timing.kernel_stats(a, k, cap, holders, budget),
            }
            print(json.dumps(found), flush=True)
            rows.append(found)
    finally:
        compare.use_kernel(shipped, [])
        global_cuda.MAX_CLUSTER = VARIANTS[0].max_cluster
        global_cuda._price_launch.cache_clear()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="base-2x64,deepseek-base,base-8x128")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--save-scores", action="store_true", help="every group, float16")
    parser.add_argument("--baseline", type=Path, help="an earlier solver kernel file to time too")
    parser.add_argument("--variants", default="", help="only these variants (comma-separated)")
    args = parser.parse_args()
    baseline = args.baseline.read_text() if args.baseline else None
    only = set(args.variants.split(",")) if args.variants else None
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "steps": args.steps,
        "rows": [],
    }
    for preset in args.presets.split(","):
        result["rows"] += time_variants(
            preset, args.steps, args.reps, args.out, args.save_scores, baseline, only
        )
        (args.out / "real_scores_variants.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
