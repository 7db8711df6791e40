"""The shipped solver kernel against an earlier version of it, in one process on one GPU.

Times ``--variants`` in turn with ``bench.py``'s timing (CUDA graph, 32 groups x 512 tokens,
median of ``--reps`` replays, random and near-tied inputs, the kernel's clocks): ``shipped`` is
the kernel in the working tree, ``baseline`` the kernel file ``--baseline`` (a path, or a git
revision whose kernel file is taken; a device machine's copy of the tree may have no git
history, so save it to a file first) with the compile-time constants ``--baseline-define
KEY=VALUE[@MIN_E]`` added (``@MIN_E``: only from that many experts): switches an earlier
kernel has, or the shipped kernel's own constants changed; ``--baseline-prices`` (a path or a
git revision) gives the baseline its own starting prices' kernel file. After timing, each
variant's objective is checked against the reference backend's on small shapes. ``--scores
FILE`` (repeatable) times each variant on a router's saved scores too
(``real_scores_variants.py --save-scores``: every group of one solver call). The first variant
runs again at the end, so the spread between its two runs bounds the noise.

    git show 9719619:src/maxscore/routing/flow/kernels/global_auction.cu > /tmp/baseline.cu
    PYTHONPATH=src python benchmarks/flow_solver/compare_kernels.py --baseline /tmp/baseline.cu \\
        --out OUT
    # both kernel files of an earlier commit as the baseline, on a router's saved scores too
    PYTHONPATH=src python benchmarks/flow_solver/compare_kernels.py --baseline 52f940d \\
        --baseline-prices 52f940d --scores scores_base-8x128.npz --out OUT
    # the shipped file with Dijkstra at every size as the baseline
    PYTHONPATH=src python benchmarks/flow_solver/compare_kernels.py \\
        --baseline src/maxscore/routing/flow/kernels/global_auction.cu \\
        --baseline-define SEARCH_FRONTIER=0 --out OUT
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from maxscore.routing.flow import flow_objective, global_cuda
from maxscore.routing.flow.global_reference import GlobalBudget
from maxscore.routing.flow.global_solver import solve_global

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/common.py
from common import load_script  # noqa: E402

KERNEL = "src/maxscore/routing/flow/kernels/global_auction.cu"
PRICES_KERNEL = "src/maxscore/routing/flow/kernels/dual_prices.cu"
# The host's own planner, taken once: each variant wraps this one, not the previous variant's
# wrapper (nested wrappers gave a variant timed again the constants of the one before it).
SHIPPED_DEFINES = global_cuda.kernel_defines


SHIPPED_SOURCE = global_cuda.kernel_source
SHIPPED_START_PRICES = global_cuda.start_prices


def use_kernel(
    source: str, extra: list[tuple[str, str, int]], prices_source: str | None = None
) -> None:
    """Make ``global_cuda`` compile ``source`` as the solver kernel with the ``extra`` (key,
    value, min_e) defines. An earlier solver kernel that computes its starting prices itself
    (before they had a kernel of their own) gets their temperatures as constants (the prices'
    kernel's, from the default budget), and the host launches no prices' kernel for it; one that
    reads the tokens' duals (before the prices' kernel listed the first bids) gets them where
    the first bids go (an earlier prices' kernel ignores the first bids' buffers, which the
    launch passes beyond its parameters). ``prices_source``: the prices' kernel file to use
    with it (``None``: the working tree's)."""
    own_prices = "start_prices" not in source
    reads_duals = "token_duals" in source
    if own_prices and "PRICE_T0" in source:
        prices = global_cuda.price_defines(1, 1, 1, GlobalBudget(), 1)
        extra = [*extra, *((key, prices[key], 0) for key in ("PRICE_T0", "PRICE_T1"))]

    def defines(n: int, e: int, *args: Any, **kwargs: Any) -> dict[str, str]:
        # Given to the planner, so a constant that changes the memory (THREADS) is counted; they
        # win over the host's own choices (its larger blocks, say).
        overrides = dict(kwargs.pop("overrides", None) or {})
        overrides.update({key: value for key, value, min_e in extra if e >= min_e})
        return SHIPPED_DEFINES(n, e, *args, overrides=overrides, **kwargs)

    def kernel_source(name: str = "global_auction.cu") -> str:
        if name == "global_auction.cu":
            return source
        if name == "dual_prices.cu" and prices_source is not None:
            return prices_source
        return SHIPPED_SOURCE(name)

    def start_prices_with_duals(*args: Any) -> Any:
        start = SHIPPED_START_PRICES(*args)
        return None if start is None else start._replace(first_experts=start.duals)

    global_cuda.kernel_source = kernel_source
    global_cuda.kernel_defines = defines
    if own_prices:
        global_cuda.start_prices = lambda *_: None
    elif reads_duals:
        global_cuda.start_prices = start_prices_with_duals
    else:
        global_cuda.start_prices = SHIPPED_START_PRICES
    global_cuda.launch_defines.cache_clear()
    global_cuda._compiled.cache_clear()
    global_cuda._price_launch.cache_clear()


def objective_matches_reference(bench: Any) -> bool:
    """The CUDA objective equals the reference backend's (relative 1e-5) on small shapes
    (``bench``: this folder's ``bench.py``, for its input families)."""
    ok = True
    for n, e, k in [(512, 16, 2), (512, 64, 2), (512, 64, 6)]:
        for family in ["random", "near-tied-0.03"]:
            a = bench.synthetic(family, 3, n, e, seed=3)
            cap = torch.full((e,), -(-k * n // e), dtype=torch.int32)
            gpu = solve_global(a.cuda(), k, cap.cuda(), backend="cuda").cpu()
            ref = solve_global(a, k, cap, backend="reference")
            value, target = float(flow_objective(a, gpu).sum()), float(flow_objective(a, ref).sum())
            ok &= bool((gpu >= 0).all()) and abs(value - target) <= 1e-5 * abs(target)
    return ok


def time_saved_scores(bench: Any, path: Path, reps: int) -> dict[str, Any]:
    """The kernel on a router's saved scores (every group of one solver call, as
    ``real_scores_variants.py --save-scores`` writes them): ms a call and its statistics."""
    a, k, capacity = bench.load_scores(path)
    row = {"scores": path.name, "groups": a.shape[0], "n": a.shape[1], "e": a.shape[2], "k": k}
    row |= bench.time_and_stats(a, k, capacity, reps)
    print(f"time {path.name}: {row['ms']:.3f} ms {json.dumps(row)}", flush=True)
    return row


def read_kernel(where: str, path: str) -> str:
    """A kernel file's text: ``where`` is a file, or a git revision whose ``path`` is read."""
    if Path(where).is_file():
        return Path(where).read_text()
    return subprocess.run(
        ["git", "show", f"{where}:{path}"],
        cwd=HERE.parents[1],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="kernel file, or a git revision")
    parser.add_argument("--baseline-define", action="append", default=[])
    parser.add_argument(
        "--baseline-prices",
        help="the baseline's prices' kernel file, or a git revision (default: the working tree's)",
    )
    parser.add_argument("--variants", default="shipped,baseline")
    parser.add_argument(
        "--shapes", default="512x16x2,512x32x2,512x64x2,512x64x6,512x128x8,512x256x8"
    )
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument(
        "--scores",
        type=Path,
        action="append",
        default=[],
        help="a router's scores saved by real_scores_variants.py --save-scores, timed too",
    )
    parser.add_argument(
        "--capacity-factor",
        type=float,
        default=1.0,
        help="time at capacity ceil(factor k n / e) (above 1: spare capacity)",
    )
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    baseline = read_kernel(args.baseline, KERNEL)
    baseline_prices = (
        read_kernel(args.baseline_prices, PRICES_KERNEL) if args.baseline_prices else None
    )
    extra = []
    for item in args.baseline_define:
        pair, _, min_e = item.partition("@")
        key, _, value = pair.partition("=")
        extra.append((key, value, int(min_e or 0)))
    if "GRAPH_IN_WORK" not in baseline:  # an older kernel: its graph has no place in phase 1's
        extra.append(("GRAPH_IN_WORK", "0", 0))  # buffers, so the host must not count on one
    if "WARP_BID_TOKENS" not in baseline:  # an older kernel: its bid mode was one switch for
        extra.append(("WARP_BIDS", "1", 33))  # every round, warp bids above 32 experts
    kernels = {
        "shipped": (global_cuda.kernel_source(), []),
        "baseline": (baseline, extra, baseline_prices),
    }
    bench = load_script(HERE / "bench.py", "flow_bench")
    names = args.variants.split(",")
    names.append(names[0])
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "baseline": args.baseline,
        "baseline_defines": args.baseline_define,
        "baseline_prices": args.baseline_prices,
        "capacity_factor": args.capacity_factor,
        "runs": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        use_kernel(*kernels[name])
        timing_args = argparse.Namespace(
            shapes=args.shapes,
            reps=args.reps,
            budget=GlobalBudget(),
            capacity_factor=args.capacity_factor,
        )
        rows: dict[str, Any] = {}
        bench.run_timing(timing_args, rows)
        rows["saved_scores"] = [time_saved_scores(bench, path, args.reps) for path in args.scores]
        run = {"variant": name, "objective_ok": objective_matches_reference(bench), **rows}
        out["runs"].append(run)
        print(f"== {name}: objective ok {run['objective_ok']}", flush=True)
        (args.out / "compare_kernels.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
