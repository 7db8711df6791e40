"""Benchmark of the multi-CTA global solver (Eq. 7-8) for one large routing group (issue 3).

Run on a CUDA machine: ``PYTHONPATH=src python benchmarks/flow_solver_large.py --out DIR``.

1. Gaps: instances (softmax of N(0,1) logits plus a per-expert bias of std 0 or 1, as in
   ``tests/test_flow_global.py``) are solved exactly on the CPU (a process pool, before CUDA starts)
   and by :func:`maxscore.routing.flow.global_large.solve_large` on the GPU; every output is checked
   against Eq. 7 (k distinct experts, loads <= capacity).
2. Times: CUDA-graph replay, median of ``--reps`` replays (events), for budget / option variants,
   plain top-k and the previous hybrid path (PyTorch phases 1-3 + one-program cycle kernel).

Prints a compact table last and writes ``DIR/flow_solver_large.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from maxscore.routing.flow import flow_objective
from maxscore.routing.flow.exact import solve_exact


def instances(seed: int, count: int, n: int, e: int, bias: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(count, n, e, generator=gen) + bias * torch.randn(
        count, 1, e, generator=gen
    )
    return torch.softmax(logits, dim=-1)


def _exact_one(args: tuple[torch.Tensor, int, int]) -> float:
    a, k, c = args
    e = a.shape[-1]
    cap = torch.full((e,), c)
    return float(flow_objective(a[None], solve_exact(a[None], k, cap))[0])


def check(index: torch.Tensor, k: int, cap: torch.Tensor, e: int) -> None:
    g, n, slots = index.shape
    assert slots == k and bool(((index >= 0) & (index < e)).all()), "empty or invalid slot"
    counts = torch.zeros(g, n, e, dtype=torch.long).scatter_add_(-1, index, torch.ones_like(index))
    assert int(counts.max()) <= 1, "expert twice in a token"
    assert bool((counts.sum(1) <= cap).all()), "load above capacity"


def time_graph(fn, reps: int) -> float:
    """Median ms of ``reps`` CUDA-graph replays of ``fn()`` (captured after a warm-up)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        graph.replay()
        en.record()
        en.synchronize()
        times.append(st.elapsed_time(en))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--gap-counts", default="16:2:100,64:6:20,16:6:10,64:2:10")
    args = ap.parse_args()
    n = args.n
    shapes = [tuple(int(x) for x in s.split(":")) for s in args.gap_counts.split(",")]

    # 1. Exact optima on the CPU first (fork-free pool, before CUDA is initialised).
    jobs, sets = [], []
    for e, k, count in shapes:
        c = -(-k * n // e)
        for bias in (0.0, 1.0):
            a = instances(1000 + e + k + int(bias), count, n, e, bias)
            sets.append((e, k, c, bias, a))
            jobs.extend((a[i], k, c) for i in range(count))
    t0 = time.time()
    with mp.get_context("spawn").Pool(max(1, mp.cpu_count() - 1)) as pool:
        opts = pool.map(_exact_one, jobs, chunksize=1)
    print(f"exact: {len(jobs)} instances in {time.time() - t0:.1f} s", flush=True)

    from maxscore.routing.flow import global_large
    from maxscore.routing.flow.global_large import LargeOptions
    from maxscore.routing.flow.global_solver import default_budget, solve_global

    dev = "cuda"
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "n": n}
    gaps_out = []
    pos = 0
    for e, k, c, bias, a in sets:
        cap = torch.full((a.shape[0], e), c, dtype=torch.long, device=dev)
        out = global_large.solve_large(a.to(dev), k, cap, **default_budget(e)._asdict()).cpu()
        check(out, k, cap.cpu(), e)
        got = flow_objective(a, out).numpy()
        opt = np.array(opts[pos : pos + a.shape[0]])
        pos += a.shape[0]
        gap = (opt - got) / np.abs(opt)
        row = {
            "e": e,
            "k": k,
            "bias": bias,
            "count": int(a.shape[0]),
            "median": float(np.median(gap)),
            "worst": float(gap.max()),
            "min": float(gap.min()),
        }
        gaps_out.append(row)
        print("gap", row, flush=True)
    result["gaps"] = gaps_out

    # 2. Times (CUDA graph replay).
    rows = []

    def add(name: str, e: int, k: int, bias: float, fn) -> None:
        ms = time_graph(fn, args.reps)
        rows.append({"name": name, "e": e, "k": k, "bias": bias, "ms": ms})
        print(f"time {name:28s} e={e:2d} k={k} bias={bias} {ms:.3f} ms", flush=True)

    def add_large(name: str, a, k: int, bias: float, cap, options=None, **change: int) -> None:
        """Time ``solve_large`` on ``a`` with the default budget updated by ``change``."""
        steps = {**default_budget(a.shape[-1])._asdict(), **change}

        def fn() -> torch.Tensor:
            return global_large.solve_large(a, k, cap, options=options, **steps)

        add(name, a.shape[-1], k, bias, fn)

    for e, k in [(16, 2), (16, 6), (64, 2), (64, 6)]:
        c = -(-k * n // e)
        for bias in (1.0, 0.0):
            a = instances(7 + e + k, 1, n, e, bias).to(dev)
            cap1 = torch.full((e,), c, device=dev)
            run = (a, k, bias, cap1.expand(1, e))
            add_large("large default", *run)
            if (e, k) == (64, 6):
                add_large("prices only", *run, repair_rounds=0, cycle_rounds=0)
                add_large("prices+repair", *run, cycle_rounds=0)
            if (e, k) != (16, 2):
                continue
            add("topk", e, k, bias, lambda a=a, k=k: a.topk(k, dim=-1))
            add_large("prices only", *run, repair_rounds=0, cycle_rounds=0)
            add_large("prices+repair", *run, cycle_rounds=0)
            add_large("cycles 8", *run, cycle_rounds=8)
            no_hist = LargeOptions(hist_bins=0, first_passes=3)
            add_large("probe passes 3/2 (no hist)", *run, options=no_hist)
            add_large("hist 256", *run, options=LargeOptions(hist_bins=256))
            add_large("warps 8", *run, options=LargeOptions(num_warps=8))
            # The previous hybrid path (PyTorch phases 1-3 + the one-program cycle kernel).
            orig = global_large.supported
            global_large.supported = lambda *_: False
            try:
                add(
                    "hybrid (previous)",
                    e,
                    k,
                    bias,
                    lambda a=a, k=k, cap1=cap1: solve_global(a[0], k, cap1),
                )
            finally:
                global_large.supported = orig
    result["times"] = rows
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "flow_solver_large.json").write_text(json.dumps(result, indent=1))
    print("\n| variant | e | k | bias | ms |")
    for r in rows:
        print(f"| {r['name']} | {r['e']} | {r['k']} | {r['bias']} | {r['ms']:.3f} |")
    for g in gaps_out:
        print(
            f"gap e={g['e']} k={g['k']} bias={g['bias']} n_inst={g['count']} median={g['median']:.2e} worst={g['worst']:.2e} min={g['min']:.1e}"
        )


if __name__ == "__main__":
    main()
