"""The global solver on a real router's scores, taken from training.

Trains each ``--presets`` model with the ``maxscore`` router for ``--steps`` compiled steps
(``benchmarks/expert_parallel/bench.py``'s path: HF Trainer, bf16, the embedded corpus, micro-batch
64 x 512, so 64 routing groups of 512 tokens per MoE layer), keeps the selection scores of the
last solver call, and then times the CUDA kernel on exactly those scores (CUDA graph, median of
``--reps`` replays) with its phase statistics: the rounds of the auction and of phase 2 per group
(median and maximum: a call lasts as long as its slowest group) and the kernel's clocks.
``--save-scores`` also writes two groups of each preset's scores to ``OUT/router_scores.npz``
(keys ``e{e}_k{k}``; the tests' ``tests/data/router_scores.npz`` came from such a run), and
``--save-calls`` every group of the call, as float16, to ``OUT/scores_<preset>.npz`` (the files
``bench.py --timing --scores`` times).

    PYTHONPATH=src python benchmarks/flow_solver/real_scores.py --steps 200 --out OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from maxscore.routing.flow import global_cuda
from maxscore.routing.flow.global_reference import GlobalBudget

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/common.py
from common import load_script  # noqa: E402


def train_and_record(
    preset: str, steps: int, warmup: int | None = None
) -> tuple[torch.Tensor, int, torch.Tensor, int, dict[str, Any]]:
    """Train ``preset`` with maxscore for ``steps`` compiled steps (``warmup`` of them untimed,
    default all but 5); the last solver call's arguments (scores ``[G, n, e]``, ``k``,
    capacities, holders) and the training row."""
    train_bench = load_script(HERE.parent / "expert_parallel" / "bench.py", "ep_bench")
    kept: list[tuple[torch.Tensor, int, torch.Tensor, int]] = []
    solve = global_cuda.solve_cuda

    def recording(a: torch.Tensor, k: int, cap: torch.Tensor, holders: int, budget, **kw):
        kept[:] = [(a.detach().clone(), k, cap.detach().clone(), holders)]
        return solve(a, k, cap, holders, budget, **kw)

    global_cuda.solve_cuda = recording  # the backend looks it up on the module at each call
    try:
        args = argparse.Namespace(
            batch_size=64,
            seq_len=512,
            steps=steps,
            warmup=steps - 5 if warmup is None else warmup,
            compile=True,
            expert_parallel=1,
            runs_dir="/tmp/maxscore-real-scores",
        )
        row = train_bench.run_one(preset, "maxscore", args)
    finally:
        global_cuda.solve_cuda = solve
    return (*kept[-1], row)


def solver_on_real_scores(
    preset: str,
    steps: int,
    reps: int,
    saved: dict[str, Any] | None = None,
    call_file: Path | None = None,
) -> dict[str, Any]:
    """Train ``preset`` with maxscore, then time the kernel on its last call's scores (two
    groups of which go into ``saved`` when given, every group into ``call_file``)."""
    timing = load_script(HERE / "bench.py", "flow_bench")
    solve = global_cuda.solve_cuda
    a, k, cap, holders, row = train_and_record(preset, steps)
    groups, n, e = a.shape
    if saved is not None:
        saved[f"e{e}_k{k}"] = a[:2].float().cpu().numpy()
    if call_file is not None:
        timing.save_scores(call_file, a, k, cap)
    stats = torch.zeros(groups, global_cuda.DEBUG_STATS, dtype=torch.int32, device=a.device)
    solve(a, k, cap, holders, GlobalBudget(), stats=stats)
    s = stats.cpu()
    ms = timing.graph_time_ms(lambda: solve(a, k, cap, holders, GlobalBudget()), reps)
    top = a.topk(k + 1, dim=-1).values

    def median_max(column: int) -> list[int]:
        return [int(s[:, column].median()), int(s[:, column].max())]

    return {
        "preset": preset,
        "step_ms": row["step_ms"],
        "G": groups,
        "n": n,
        "e": e,
        "k": k,
        "ms_per_call": ms,
        "auction_rounds_median_max": median_max(0),
        "open_after_auction_median_max": median_max(1),
        "augment_rounds_median_max": median_max(2),
        "cancel_rounds_max": int(s[:, 3].max()),
        "kcycles_setup_auction_augment_cancel_max": [int(x) for x in s[:, 4:8].max(0).values],
        "kcycles_augment_graph_search_moves_max": [int(x) for x in s[:, 11:14].max(0).values],
        "row_max_mean": float(a.amax(-1).mean()),
        "row_min_mean": float(a.amin(-1).mean()),
        "gap_k_to_k1_median": float((top[..., k - 1] - top[..., k]).median()),
        "top1_expert_share_max": float(
            torch.bincount(a.argmax(-1).flatten(), minlength=e).max() / (groups * n)
        ),
        "dtype": str(a.dtype),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="base,base-2x64")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--save-scores", action="store_true", help="two groups per preset")
    parser.add_argument("--save-calls", action="store_true", help="every group, float16")
    args = parser.parse_args()
    saved: dict[str, Any] = {}
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "steps": args.steps, "rows": []}
    args.out.mkdir(parents=True, exist_ok=True)
    for preset in args.presets.split(","):
        call_file = args.out / f"scores_{preset}.npz" if args.save_calls else None
        info = solver_on_real_scores(
            preset, args.steps, args.reps, saved if args.save_scores else None, call_file
        )
        print(json.dumps(info), flush=True)
        out["rows"].append(info)
        (args.out / "real_scores.json").write_text(json.dumps(out, indent=1) + "\n")
    if saved:
        np.savez_compressed(args.out / "router_scores.npz", **saved)


if __name__ == "__main__":
    main()
