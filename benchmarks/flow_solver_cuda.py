"""CUDA kernel of the global solver (Eq. 7-8, issue 3; ``global_cuda.py``) against the Triton one.

Round 4 of ``flow_solver_notes.md``. On one GPU, in one call:

1. correctness: Eq. 7 exactly and the gaps to the exact optimum (CPU successive shortest paths)
   for several shapes, CUDA kernel and Triton fused kernel on the same inputs;
2. issue 3's acceptance measurement (n=512, e=16, k=2, c=64, 100 balanced + 100 skewed groups);
3. times of one call replayed from a CUDA graph (median of ``--reps`` replays cycling over 4
   input sets), with the rounds the slowest group used and the phase split of the slowest group
   (SM clocks written by the kernel).

Usage (repo root, on the GPU machine)::

    PYTHONPATH=src:benchmarks python3 benchmarks/flow_solver_cuda.py --out DIR
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from flow_solver_fused import affinities, feasible, gap_row, gaps
from flow_solver_gpu import ACCEPTANCE_CAPACITY, acceptance_set, graph_timer
from maxscore.routing.flow import FLOW_SOLVERS, flow_objective, global_cuda, global_triton
from maxscore.routing.flow.global_solver import (
    cuda_budget,
    default_budget,
    fused_budget,
    solve_global,
)

# (groups, n, e, k, bias std of the per-expert logit bias)
SHAPES = [
    (32, 512, 16, 2, 1.0),
    (32, 512, 16, 2, 0.0),
    (64, 512, 16, 2, 1.0),
    (32, 512, 16, 6, 1.0),
    (32, 512, 8, 3, 1.0),
    (32, 1024, 8, 2, 1.0),
    (32, 500, 12, 2, 1.0),
]
PHASES = ["load", "scale+prices", "rounding+repair", "cycles", "finalize+output"]


def cuda_variants(e: int) -> dict[str, dict]:
    base = cuda_budget(default_budget(e))  # the default of solve_global's CUDA path
    return {
        "cuda": base,
        "cuda p12": {**base, "price_iterations": 12},
        "cuda p20": {**base, "price_iterations": 20},
        "cuda c16": {**base, "cycle_rounds": 16},
        "cuda c24": {**base, "cycle_rounds": 24},
        "cuda bf6": {**base, "bf_iterations": 6},
        "cuda m4": {**base, "moves": 4},
        "cuda m4 c16": {**base, "moves": 4, "cycle_rounds": 16},
    }


def phase_split(clocks: Tensor, stats: Tensor) -> dict:
    """Microseconds per phase of the slowest group and the mean over groups (SM clock)."""
    rate = torch.cuda.get_device_properties(0).clock_rate * 1e3  # kHz -> Hz (max SM clock)
    c = clocks.cpu().double()
    d = (c[:, 1:6] - c[:, 0:5]) / rate * 1e6
    total = (c[:, 5] - c[:, 0]) / rate * 1e6
    slow = int(total.argmax())
    # clocks[:, 6:8]: the cycle phase's edge scans (with their barrier) and warp 0's graph part,
    # summed over the rounds
    sub = c[:, 6:8] / rate * 1e6
    return {
        "slowest_us": {p: round(float(d[slow, i]), 2) for i, p in enumerate(PHASES)},
        "slowest_total_us": round(float(total[slow]), 2),
        "slowest_rounds": stats[slow, :2].tolist(),
        "slowest_cycle_split_us": {
            "edges": round(float(sub[slow, 0]), 2),
            "graph": round(float(sub[slow, 1]), 2),
        },
        "mean_us": {p: round(float(d[:, i].mean()), 2) for i, p in enumerate(PHASES)},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="first two shapes, no 100-gap run")
    args = parser.parse_args()
    dev = torch.device("cuda")
    exact = FLOW_SOLVERS["exact"].solve
    meta = {
        "card": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "sm_clock_mhz": torch.cuda.get_device_properties(0).clock_rate / 1e3,
    }
    print(json.dumps(meta), flush=True)
    rows: list[dict] = []
    shapes = SHAPES[:2] if args.quick else SHAPES
    for groups, n, e, k, bias in shapes:
        cap = torch.full((e,), math.ceil(k * n / e), dtype=torch.long)
        sets = [affinities(groups, n, e, bias, 100 * e + 7 * k + s) for s in range(4)]
        t0 = time.perf_counter()
        opt = flow_objective(sets[0], exact(sets[0], k, cap))
        exact_ms = (time.perf_counter() - t0) * 1e3
        xs = [s.to(dev) for s in sets]
        capd = cap.to(dev).expand(groups, e).contiguous()
        calls: dict[str, Callable[..., Tensor]] = {}
        for name, opts in cuda_variants(e).items():
            calls[name] = lambda x, o=opts, k=k, c=capd, **kw: global_cuda.solve_cuda(
                x, k, c, **o, **kw
            )
        compare = (n, e, k) == (512, 16, 2)  # the Triton kernel on the shape only
        if compare and global_triton.supported(xs[0], k):
            base = fused_budget(default_budget(e))
            calls["triton fused"] = lambda x, o=base, k=k, c=capd, **kw: global_triton.solve_triton(
                x, k, c, **o, **kw
            )
        if compare:
            calls["solve_global auto"] = lambda x, k=k, c=capd: solve_global(x, k, c)
        for name, fn in calls.items():
            stats = torch.zeros(groups, 4, dtype=torch.int32, device=dev)
            extra: dict = {}
            try:
                if name.startswith("cuda"):
                    clocks = torch.zeros(groups, 8, dtype=torch.int64, device=dev)
                    out = fn(xs[0], stats=stats, clocks=clocks)
                elif name.startswith("triton"):
                    out = fn(xs[0], stats=stats)
                else:
                    out = fn(xs[0])
                torch.cuda.synchronize()
                if name.startswith("cuda"):
                    extra = phase_split(clocks, stats.cpu())
                ok = feasible(out, k, cap, e)
                gp = gaps(sets[0], out, opt)
                ms, _ = graph_timer(fn, xs, args.reps)
            except Exception as exc:  # report and go on: one broken variant must not stop the run
                row = {"shape": [groups, n, e, k, bias], "variant": name, "error": repr(exc)[:500]}
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            row = {
                "shape": [groups, n, e, k, bias],
                "variant": name,
                "graph_ms": round(ms, 4),
                "feasible": ok,
                "gap_median": float(np.median(gp)),
                "gap_max": float(gp.max()),
                "repair_rounds_max": int(stats[:, 0].max()),
                "cycle_rounds_max": int(stats[:, 1].max()),
                "cycle_rounds_mean": float(stats[:, 1].float().mean()),
                "exact_cpu_ms": round(exact_ms, 1),
                **extra,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)

    gap_rows = []
    if not args.quick:
        cap = ACCEPTANCE_CAPACITY
        for bias in (0.0, 1.0):
            x = acceptance_set(bias)
            opt = flow_objective(x, exact(x, 2, cap))
            for name, opts in cuda_variants(16).items():
                stats = torch.zeros(100, 4, dtype=torch.int32, device=dev)
                out = global_cuda.solve_cuda(x.to(dev), 2, cap.to(dev), **opts, stats=stats)
                r = {
                    **gap_row(bias, name, x, out, opt, cap),
                    "cycle_rounds_max": int(stats[:, 1].max()),
                }
                gap_rows.append(r)
                print(json.dumps(r), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "flow_solver_cuda.json").write_text(
        json.dumps({"meta": meta, "times": rows, "gaps_100": gap_rows}, indent=1)
    )


if __name__ == "__main__":
    main()
