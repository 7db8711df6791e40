"""Fused global solver (Eq. 7-8, issue 3) for many small groups: correctness, gaps and times.

Round 3 of ``flow_solver_notes.md``: phase 4 of the fused kernel with per-expert token lists and a
barrier-free graph phase (``lists=True``) against the round-2 kernel (``lists=False``: token
sweep, graph phase on ``[V, V]`` tiles). On one GPU, in one call:

1. correctness: every variant's output meets Eq. 7 exactly, gaps to the exact optimum (CPU
   successive shortest paths) on 32 x 512 groups for several shapes;
2. issue 3's acceptance measurement (n=512, e=16, k=2, c=64, 100 balanced + 100 skewed groups)
   for the default and the variants whose budget differs;
3. times of one call, 32 groups x 512 tokens, replayed from a CUDA graph (median of ``--reps``
   replays, cycling over 4 input sets), with the rounds the slowest group used (early exit).

Usage (repo root, on the GPU machine)::

    PYTHONPATH=src python3 benchmarks/flow_solver_fused.py --out DIR
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from flow_solver_gpu import ACCEPTANCE_CAPACITY, acceptance_set, fused_call, graph_timer
from maxscore.routing.flow import FLOW_SOLVERS, flow_objective
from maxscore.routing.flow.global_solver import default_budget, fused_budget, solve_global


def affinities(groups: int, n: int, e: int, bias: float, seed: int) -> Tensor:
    """Softmax of N(0, 1) logits plus a per-expert bias of std ``bias`` (CPU)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(groups, n, e, generator=gen) + bias * torch.randn(
        groups, 1, e, generator=gen
    )
    return torch.softmax(logits, dim=-1)


def variants(e: int) -> dict[str, dict]:
    base = fused_budget(default_budget(e))
    return {
        "sweep (round 2)": {**base, "lists": False},
        "lists": {**base, "lists": True},
        "lists w4": {**base, "lists": True, "num_warps": 4},
        "lists c24": {**base, "lists": True, "cycle_rounds": 24},
        "lists bf6": {**base, "lists": True, "bf_iterations": 6},
        "lists p8": {**base, "lists": True, "price_iterations": 8},
        "lists r6": {**base, "lists": True, "repair_rounds": 6},
        "lists c0": {**base, "lists": True, "cycle_rounds": 0},
    }


def feasible(index: Tensor, k: int, cap: Tensor, e: int) -> bool:
    index = index.cpu()
    if not bool((index >= 0).all()) or index.shape[-1] != k:
        return False
    counts = torch.zeros(*index.shape[:-1], e, dtype=torch.long).scatter_add_(
        -1, index, torch.ones_like(index)
    )
    return int(counts.max()) <= 1 and bool((counts.sum(-2) <= cap.cpu()).all())


def gaps(x: Tensor, index: Tensor, opt: Tensor) -> np.ndarray:
    return ((opt - flow_objective(x, index.cpu())) / opt).numpy()


def gap_row(
    bias: float, variant: str, x: Tensor, index: Tensor, opt: Tensor, cap: Tensor
) -> dict[str, object]:
    """One row of the 100-instance acceptance table: feasibility and gap quantiles."""
    gp = gaps(x, index, opt)
    return {
        "bias": bias,
        "variant": variant,
        "feasible": feasible(index, index.shape[-1], cap, x.shape[-1]),
        "gap_median": float(np.median(gp)),
        "gap_p90": float(np.quantile(gp, 0.9)),
        "gap_max": float(gp.max()),
    }


def _warm(job: tuple[int, int, str]) -> str:
    """Compile one (shape, variant) in a worker process (fills Triton's on-disk cache)."""
    e, k, name = job
    n, groups = 512, 32
    x = affinities(groups, n, e, 1.0, 1).cuda()
    cap = torch.full((e,), math.ceil(k * n / e), dtype=torch.long, device="cuda")
    if name == "auto":
        solve_global(x, k, cap)
    else:
        stats = torch.zeros(groups, 4, dtype=torch.int32, device="cuda")
        fused_call(x, k, cap, variants(e)[name], stats)
    torch.cuda.synchronize()
    return f"{e} {k} {name}"


def prewarm() -> None:
    import multiprocessing as mp

    jobs = sorted({(e, k, name) for e, k, _ in SHAPES for name in SHAPE_VARIANTS[(e, k)]})
    jobs.append((16, 2, "auto"))
    with mp.get_context("spawn").Pool(min(len(jobs), 14)) as pool:
        for done in pool.imap_unordered(_warm, jobs):
            print("compiled", done, flush=True)


SHAPES = [(16, 2, 1.0), (16, 2, 0.0), (16, 6, 1.0), (8, 3, 1.0)]
SHAPE_VARIANTS = {
    (16, 2): list(variants(16)),
    (16, 6): ["sweep (round 2)", "lists"],
    (8, 3): ["sweep (round 2)", "lists"],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--skip-gap-eval", action="store_true")
    parser.add_argument("--prewarm-only", action="store_true", help="compile, then stop")
    parser.add_argument("--no-prewarm", action="store_true")
    args = parser.parse_args()
    if args.prewarm_only:
        prewarm()
        return
    dev = torch.device("cuda")
    exact = FLOW_SOLVERS["exact"].solve
    meta = {
        "card": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    print(json.dumps(meta), flush=True)
    if not args.no_prewarm:
        prewarm()
    rows: list[dict] = []
    for e, k, bias in SHAPES:
        n, groups = 512, 32
        cap = torch.full((e,), math.ceil(k * n / e), dtype=torch.long)
        sets = [affinities(groups, n, e, bias, 100 * e + k + s) for s in range(4)]
        opt = flow_objective(sets[0], exact(sets[0], k, cap))
        xs = [s.to(dev) for s in sets]
        capd = cap.to(dev)
        for name in SHAPE_VARIANTS[(e, k)]:
            opts = variants(e)[name]
            stats = torch.zeros(groups, 4, dtype=torch.int32, device=dev)
            out = fused_call(xs[0], k, capd, opts, stats)
            torch.cuda.synchronize()
            ok = feasible(out, k, cap, e)
            gp = gaps(sets[0], out, opt)
            ms, _ = graph_timer(
                lambda x, k=k, c=capd, o=opts, s=stats: fused_call(x, k, c, o, s), xs, args.reps
            )
            row = {
                "e": e,
                "k": k,
                "bias": bias,
                "variant": name,
                "graph_ms": ms,
                "feasible": ok,
                "gap_median": float(np.median(gp)),
                "gap_max": float(gp.max()),
                "repair_rounds_max": int(stats[:, 0].max()),
                "cycle_rounds_max": int(stats[:, 1].max()),
                "cycle_rounds_mean": float(stats[:, 1].float().mean()),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        if (e, k) == (16, 2):  # the auto path as a user calls it (the fused default)
            ms, _ = graph_timer(lambda x, k=k, c=capd: solve_global(x, k, c), xs, args.reps)
            rows.append(
                {"e": e, "k": k, "bias": bias, "variant": "solve_global auto", "graph_ms": ms}
            )
            print(json.dumps(rows[-1]), flush=True)
    # e = 64 (32 x 512 is beyond the fused kernel's n e <= 8192): the path solve_global takes.
    for k in (2, 6):
        e, n, groups = 64, 512, 32
        cap = torch.full((e,), math.ceil(k * n / e), dtype=torch.long, device=dev)
        xs = [affinities(groups, n, e, 1.0, 900 + k + s).to(dev) for s in range(2)]
        ms, _ = graph_timer(lambda x, k=k, c=cap: solve_global(x, k, c), xs, 10)
        rows.append({"e": e, "k": k, "bias": 1.0, "variant": "solve_global auto", "graph_ms": ms})
        print(json.dumps(rows[-1]), flush=True)

    gap_rows = []
    if not args.skip_gap_eval:  # the variants of the (16, 2) timing, same compiled kernels
        cap = ACCEPTANCE_CAPACITY
        for bias in (0.0, 1.0):
            x = acceptance_set(bias)
            opt = flow_objective(x, exact(x, 2, cap))
            for name, opts in variants(16).items():
                if name in ("lists w4", "lists c0"):
                    continue
                stats = torch.zeros(100, 4, dtype=torch.int32, device=dev)
                out = fused_call(x.to(dev), 2, cap.to(dev), opts, stats)
                r = gap_row(bias, name, x, out, opt, cap)
                gap_rows.append(r)
                print(json.dumps(r), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "flow_solver_fused.json").write_text(
        json.dumps({"meta": meta, "times": rows, "gaps_100": gap_rows}, indent=1)
    )
    print(f"\n{meta['card']} torch {meta['torch']} {meta['date']}")
    print(
        "| e | k | bias | variant | graph ms | feasible | gap med | gap max | rep max | cyc max |"
    )
    for r in rows:
        print(
            f"| {r['e']} | {r['k']} | {r['bias']} | {r['variant']} | {r['graph_ms']:.3f} | "
            f"{r.get('feasible', '-')} | {r.get('gap_median', float('nan')):.2e} | "
            f"{r.get('gap_max', float('nan')):.2e} | {r.get('repair_rounds_max', '-')} | "
            f"{r.get('cycle_rounds_max', '-')} |"
        )
    print("| 100-instance gaps | bias | variant | feasible | median | p90 | max |")
    for r in gap_rows:
        print(
            f"| | {r['bias']} | {r['variant']} | {r['feasible']} | {r['gap_median']:.2e} | "
            f"{r['gap_p90']:.2e} | {r['gap_max']:.2e} |"
        )


if __name__ == "__main__":
    main()
