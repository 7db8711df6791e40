"""GPU micro-benchmark of the routing and dispatch pieces a Base training step runs per layer.

At the Base preset's training shapes (micro-batch 128 x 512 tokens, e = 16, k = 2, D = 768):

* slot positions (``dispatch._positions``): the Triton kernel (rows of one routing group, as
  MaxScore's 128 groups x 1,024 slots) against the sort path it replaces, and the sort path on
  one group of the whole batch (GShard's ``[1, 131072]``, which keeps the sort);
* expert ranking (``ranking.top_experts``, k = 2, the per-step routing statistics): repeated
  argmax over integer keys against the stable sort;
* the gather-sum kernel (``dispatch._sum_slot_rows``): every autotuner configuration's time, with
  every slot filled (MaxScore) and with a third of the slots empty (a dropping router).

CUDA-event timing (``common.timed``), median of ``--reps`` calls after warm-up. Writes
``dispatch_kernels.json``.

``PYTHONPATH=src python3 benchmarks/dispatch_kernels/dispatch_kernels.py --out DIR``
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton

from maxscore.moe import dispatch
from maxscore.routing import ranking

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import timed


def median_ms(fn: Callable[[], object], reps: int) -> float:
    return timed(fn, warmup=5, iters=reps)[0]


def positions_rows(reps: int) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for label, groups, m in [("maxscore groups", 128, 1024), ("one group (gshard)", 1, 131072)]:
        key = torch.randint(0, 17, (groups, m), device="cuda", generator=gen)
        limit = dispatch._SCAN_ROW_LIMIT
        kernel = median_ms(lambda k=key: dispatch._positions(k, 16, with_counts=False), reps)
        dispatch._SCAN_ROW_LIMIT = 0
        try:
            sort = median_ms(lambda k=key: dispatch._positions(k, 16, with_counts=False), reps)
        finally:
            dispatch._SCAN_ROW_LIMIT = limit
        rows.append(
            {"what": f"positions, {label} [{groups}, {m}]", "default_ms": kernel, "sort_ms": sort}
        )
    return rows


def ranking_rows(reps: int) -> list[dict]:
    scores = torch.rand(128, 512, 16, device="cuda")
    fast = median_ms(lambda: ranking.top_experts(scores, 2), reps)
    sort = median_ms(lambda: ranking.ranked_experts(scores)[..., :2], reps)
    return [{"what": "top_experts k=2 [128, 512, 16]", "default_ms": fast, "sort_ms": sort}]


def gather_sum_rows(reps: int) -> list[dict]:
    rows = []
    t, s, d = 65536, 2, 768
    src = torch.randn(t * s, d, device="cuda", dtype=torch.bfloat16)
    full = torch.randperm(t * s, device="cuda").view(t, s)
    partial = torch.where(torch.rand(t, s, device="cuda") < 1 / 3, -1, full)
    for label, slot_row in [("all slots filled", full), ("a third empty", partial)]:
        for i, cfg in enumerate(dispatch._SUM_SLOT_ROWS_CONFIGS):
            out = src.new_empty(t, d)
            grid = (triton.cdiv(t, cfg.kwargs["tokens"]), triton.cdiv(d, cfg.kwargs["block"]))

            def call(cfg=cfg, grid=grid, out=out, slot_row=slot_row) -> None:
                dispatch._sum_slot_rows_kernel[grid](
                    src, slot_row, out, t, d, slots=s, num_warps=cfg.num_warps, **cfg.kwargs
                )

            ms = median_ms(call, reps)
            moved = (t * d * 2) + int((slot_row >= 0).sum()) * d * 2
            rows.append(
                {
                    "what": f"gather-sum [{t}, {s}] x {d}, {label}, config {i} {cfg}",
                    "default_ms": ms,
                    "tb_per_s": moved / ms / 1e9,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    rows = positions_rows(args.reps) + ranking_rows(args.reps) + gather_sum_rows(args.reps)
    device = torch.cuda.get_device_name()
    for row in rows:
        extra = "".join(f" {k} {v:.4f}" for k, v in row.items() if k != "what")
        print(f"{row['what']}:{extra}")
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"device": device, "torch": torch.__version__, "rows": rows}
    (args.out / "dispatch_kernels.json").write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
