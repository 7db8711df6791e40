"""Benchmark of the global min-cost-flow solver (Eq. 7-8, issue 3) against other routers.

Times one routing call of n = 16,384 tokens, as 32 groups of 512 and as one group, for
e in {16, 64} and k in {2, 6}, with capacity k*n/e per group, on softmax affinities of skewed logits
(N(0,1) plus a per-expert bias of std 1; the regime where the two-stage heuristic loses most) and,
for e = 16, k = 2, also balanced logits (no bias). Methods, in the same run:

- ``topk``: plain top-k of the affinities (no capacity; the floor of any router).
- ``megatron-sinkhorn``: Megatron-core style: exp of the logits, alternating row / column
  normalisation for a fixed number of iterations, then top-k (no capacity enforcement).
- ``two-stage-sinkhorn``: the paper's Algorithm 1 (``FLOW_SOLVERS``), if registered.
- ``global``: ``FLOW_SOLVERS["global"]`` (this issue), eager and replayed from a CUDA graph.

Each time is the median over repeated calls (CUDA events), each call on one of several input
sets so that the L2 cache does not hold them. Beside each time: the objective of Eq. 8 relative
to the exact optimum (``gap`` = (OPT - obj) / OPT, negative if the method breaks capacity to do
better) and the largest load over capacity. The exact optima are computed once on the CPU
(``--make-reference``, the exact successive-shortest-path solver) and stored in
``benchmarks/flow_solver_gpu_reference.json``; instances are regenerated from their seeds.

Usage (repo root)::

    PYTHONPATH=src python3 benchmarks/flow_solver_gpu.py --make-reference   # CPU, once
    PYTHONPATH=src python3 benchmarks/flow_solver_gpu.py [--out DIR]         # GPU
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from maxscore.routing.flow import (
    FLOW_SOLVERS,
    flow_objective,
    global_cuda,
    global_large,
    global_triton,
)
from maxscore.routing.flow.global_solver import default_budget, fused_budget, solve_global

HERE = Path(__file__).resolve().parent
REFERENCE = HERE / "flow_solver_gpu_reference.json"
TOKENS = 16_384
SINKHORN_ITERATIONS = 8
GAP_EVAL_VARIANTS: tuple[str, ...] = ()  # Triton kernel variants for --gap-eval (round 2 used some)


def configs() -> list[dict]:
    out = []
    for e in (16, 64):
        for k in (2, 6):
            for groups in (32, 1):
                biases = (1.0, 0.0) if (e, k) == (16, 2) else (1.0,)
                for bias in biases:
                    out.append(
                        {"groups": groups, "n": TOKENS // groups, "e": e, "k": k, "bias": bias}
                    )
    return out


def key(c: dict) -> str:
    return f"G{c['groups']}_n{c['n']}_e{c['e']}_k{c['k']}_b{c['bias']}"


def instance(c: dict, copy: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Logits, affinities [G, n, e] and capacity [e] for a config (CPU, deterministic)."""
    seed = hash_seed(key(c)) + 7919 * copy
    gen = torch.Generator().manual_seed(seed)
    g, n, e = c["groups"], c["n"], c["e"]
    logits = torch.randn(g, n, e, generator=gen) + c["bias"] * torch.randn(g, 1, e, generator=gen)
    capacity = torch.full((e,), math.ceil(c["k"] * n / e), dtype=torch.long)
    return logits, torch.softmax(logits, dim=-1), capacity


def hash_seed(text: str) -> int:
    return sum((i + 1) * ord(ch) for i, ch in enumerate(text)) % (2**31)


def megatron_sinkhorn(logits: Tensor, k: int, iterations: int = SINKHORN_ITERATIONS) -> Tensor:
    """Megatron-core style Sinkhorn routing: exp(logits), alternate row / column normalisation
    for a fixed number of iterations, then each token's top-k of the balanced matrix."""
    cost = torch.exp(logits.float())
    d0 = torch.ones(cost.shape[:-1], device=cost.device, dtype=cost.dtype)  # per token
    d1 = torch.ones((*cost.shape[:-2], cost.shape[-1]), device=cost.device, dtype=cost.dtype)
    eps = 1e-8
    n, e = cost.shape[-2], cost.shape[-1]
    for _ in range(iterations):
        d0 = (1.0 / n) / ((cost * d1.unsqueeze(-2)).sum(-1) + eps)
        d1 = (1.0 / e) / ((cost * d0.unsqueeze(-1)).sum(-2) + eps)
    balanced = cost * d0.unsqueeze(-1) * d1.unsqueeze(-2)
    return balanced.topk(k, dim=-1).indices


def max_overload(index: Tensor, capacity: Tensor, e: int) -> float:
    valid = index >= 0
    counts = torch.zeros((*index.shape[:-2], e + 1), dtype=torch.long, device=index.device)
    target = torch.where(valid, index, e).flatten(-2)
    counts.scatter_add_(-1, target, torch.ones_like(target))
    return float((counts[..., :e] / capacity.clamp_min(1)).max())


def time_gpu(fn: Callable[[int], Tensor], sets: int, reps: int) -> float:
    """Median milliseconds per call over ``reps`` calls cycling through ``sets`` inputs."""
    for i in range(3):
        fn(i % sets)
    if not torch.cuda.is_available():  # CPU smoke test of the script itself
        t0 = time.perf_counter()
        for r in range(reps):
            fn(r % sets)
        return (time.perf_counter() - t0) * 1e3 / reps
    torch.cuda.synchronize()
    times = []
    for r in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(r % sets)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_timer(
    solver: Callable[[Tensor], Tensor], inputs: list[Tensor], reps: int
) -> tuple[float, Tensor]:
    """Capture ``solver`` once per input set in CUDA graphs; time the replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            solver(inputs[0])
    torch.cuda.current_stream().wait_stream(stream)
    graphs, outs = [], []
    for x in inputs:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append(solver(x))
        graphs.append(graph)
    ms = time_gpu(lambda i: graphs[i].replay(), len(graphs), reps)
    return ms, outs[0]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_reference() -> None:
    """Exact optima on the CPU (slow; run once, results go to REFERENCE)."""
    exact = FLOW_SOLVERS["exact"].solve
    ref = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else {}
    for c in configs():
        if key(c) in ref:
            continue
        _, aff, cap = instance(c)
        t0 = time.perf_counter()
        idx = exact(aff, c["k"], cap)
        seconds = time.perf_counter() - t0
        ref[key(c)] = {
            "optimum": flow_objective(aff, idx).tolist(),
            "exact_cpu_seconds": seconds,
            "host": platform.node(),
        }
        REFERENCE.write_text(json.dumps(ref, indent=1))
        print(f"{key(c)}: exact {seconds:.2f} s", flush=True)


def run(out_dir: Path, reps: int, sets: int, only: str | None) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ref = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else {}
    meta = {
        "card": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "dtype": "float32 affinities",
        "timing": f"median of {reps} calls (CUDA events), cycling over {sets} input sets",
        "methods_registered": sorted(FLOW_SOLVERS),
    }
    print(json.dumps(meta))
    rows: list[dict] = []
    for c in configs():
        if only and only not in key(c):
            continue
        rows.extend(bench_config(c, ref, device, reps, sets))

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "flow_solver_gpu.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1)
    )
    table = to_markdown(meta, rows)
    (out_dir / "flow_solver_gpu.md").write_text(table)
    print(table)


def kernel_variants(e: int) -> dict[str, dict]:
    """Named option sets of the fused kernel, timed side by side."""
    base = fused_budget(default_budget(e))
    old = {"onepass": False, "bf_alt": False}
    return {
        # The previous kernel (e x e edges by e column arg-maxes, plain BF).
        "fused-v1": {**base, **old},
        "fused-multiprobe": {**base, "multiprobe": True},
        "fused-w4": {**base, "num_warps": 4},
        "fused-c8": {**base, "cycle_rounds": 8},
        "fused-c12-bf6": {**base, "cycle_rounds": 12, "bf_iterations": 6},
        "fused-c0 (no cycles)": {**base, "cycle_rounds": 0},
    }


def fused_call(
    x: Tensor, k: int, cap: Tensor, options: dict, stats: Tensor | None = None
) -> Tensor:
    """The fused kernel with ``options`` on ``[G, n, e]`` inputs and one group's capacity."""
    groups, n, e = x.shape
    return global_triton.solve_triton(
        x, k, cap.expand(groups, e).clamp(max=n), stats=stats, **options
    )


ACCEPTANCE_CAPACITY = torch.full((16,), 64, dtype=torch.long)


def acceptance_set(bias: float) -> Tensor:
    """Issue 3's gap instances: 100 groups, n=512, e=16 (k=2, capacity 64), softmax of N(0, 1)
    logits plus a per-expert bias of std ``bias`` (0 = balanced, 1 = skewed), CPU, fixed seed."""
    gen = torch.Generator().manual_seed(2024)
    logits = torch.randn(100, 512, 16, generator=gen) + bias * torch.randn(
        100, 1, 16, generator=gen
    )
    return torch.softmax(logits, dim=-1)


def gap_eval(out_dir: Path) -> None:
    """Issue 3's acceptance measurement on the GPU paths: n=512, e=16, k=2, capacity 64, 100
    instances each of balanced and skewed (bias std 1) logits, exact optimum on the CPU."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    exact = FLOW_SOLVERS["exact"].solve
    cap = ACCEPTANCE_CAPACITY
    results = []
    for bias in (0.0, 1.0):
        aff = acceptance_set(bias)
        t0 = time.perf_counter()
        opt = flow_objective(aff, exact(aff, 2, cap))
        exact_s = time.perf_counter() - t0
        variants: dict[str, Callable[[Tensor], Tensor]] = {
            "global (auto)": lambda x: solve_global(x, 2, cap.to(device)),
            "global-torch": lambda x: solve_global(x, 2, cap.to(device), backend="torch"),
        }
        if global_cuda.supported(aff.to(device), 2) and global_triton.supported(aff.to(device), 2):
            variants["global-triton"] = lambda x: solve_global(
                x, 2, cap.to(device), backend="triton"
            )
        if global_triton.supported(aff.to(device), 2):
            for label, opts in kernel_variants(16).items():
                if label in GAP_EVAL_VARIANTS:
                    variants[label] = lambda x, o=opts: fused_call(x, 2, cap.to(device), o)
        for label, fn in variants.items():
            index = fn(aff.to(device)).cpu()
            valid = bool((index >= 0).all())
            counts = torch.zeros(100, 512, 17, dtype=torch.long).scatter_add_(
                -1, torch.where(index >= 0, index, 16), torch.ones_like(index)
            )
            feasible = valid and int(counts[..., :16].max()) <= 1
            feasible = feasible and bool((counts[..., :16].sum(1) <= cap).all())
            gaps = ((opt - flow_objective(aff, index)) / opt).numpy()
            row = {
                "bias_std": bias,
                "method": label,
                "feasible": feasible,
                "gap_median": float(np.median(gaps)),
                "gap_p90": float(np.quantile(gaps, 0.9)),
                "gap_max": float(gaps.max()),
                "exact_cpu_s_100_groups": exact_s,
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    (out_dir / "flow_solver_gap.json").write_text(json.dumps(results, indent=1))


def solvers_for(k: int, cap: Tensor) -> dict[str, Callable[[Tensor], Tensor]]:
    """name -> solver of one input tensor (logits for Megatron's Sinkhorn, else affinities)."""
    out: dict[str, Callable[[Tensor], Tensor]] = {
        "topk": lambda x: x.topk(k, dim=-1).indices,
        "megatron-sinkhorn": lambda x: megatron_sinkhorn(x, k),
        "global": lambda x: solve_global(x, k, cap),
        "global-torch": lambda x: solve_global(x, k, cap, backend="torch"),
    }
    if "two-stage-sinkhorn" in FLOW_SOLVERS:
        two = FLOW_SOLVERS["two-stage-sinkhorn"].solve
        out["two-stage-sinkhorn"] = lambda x: two(x, k, cap)
    return out


def bench_config(c: dict, ref: dict, device: torch.device, reps: int, sets: int) -> list[dict]:
    g, e, k = c["groups"], c["e"], c["k"]
    data = [instance(c, s) for s in range(sets)]
    logits = [d[0].to(device) for d in data]
    affs = [d[1].to(device) for d in data]
    cap = data[0][2].to(device)
    opt = torch.tensor(ref[key(c)]["optimum"], dtype=torch.float64) if key(c) in ref else None
    rows = []
    cuda = global_cuda.supported(affs[0], k)
    fused = not cuda and global_triton.supported(affs[0], k)
    large = not cuda and not fused and global_large.preferred(affs[0], k)
    hybrid = not (cuda or fused or large) and global_triton.cycle_supported(affs[0], k)
    solvers = solvers_for(k, cap)
    if not (cuda or fused or hybrid):
        del solvers["global-torch"]  # "global" is the PyTorch path already
    if cuda and global_triton.supported(affs[0], k):  # the previous fast path, same inputs
        solvers["global-triton"] = lambda x: solve_global(x, k, cap, backend="triton")
    for name, solver in solvers.items():
        inputs = logits if name == "megatron-sinkhorn" else affs
        row: dict = {**c, "method": name}
        if name == "global":
            row["backend"] = (
                "cuda"
                if cuda
                else "triton"
                if fused
                else "multi-CTA triton"
                if large
                else "torch + triton cycles"
                if hybrid
                else "torch"
            )
        try:
            index = solver(inputs[0])
            sync(device)
            row["overload"] = max_overload(index, cap, e)
            if opt is not None:
                gaps = (opt - flow_objective(affs[0], index).cpu()) / opt
                row.update(gap_median=float(gaps.median()), gap_max=float(gaps.max()))
            row["eager_ms"] = time_gpu(lambda i, f=solver, xs=inputs: f(xs[i]), sets, reps)
            try:
                if device.type != "cuda":
                    raise RuntimeError("CUDA graphs need a GPU")
                row["graph_ms"], graph_index = graph_timer(solver, inputs, reps)
                sync(device)
                row["graph_matches_eager"] = bool(torch.equal(graph_index, index))
            except Exception as err:  # not capturable: keep the eager time
                row["graph_error"] = f"{type(err).__name__}: {err}"[:200]
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {err}"[:200]
        rows.append(row)
        print(json.dumps(row), flush=True)
    if g == 32 and (e, k) == (16, 2):
        # CPU time of the global solver and of the exact reference on the same input.
        a_cpu, cap_cpu = affs[0].cpu(), cap.cpu()
        solve_global(a_cpu[:2], k, cap_cpu)
        t0 = time.perf_counter()
        solve_global(a_cpu, k, cap_cpu)
        global_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        FLOW_SOLVERS["exact"].solve(a_cpu, k, cap_cpu)
        exact_s = time.perf_counter() - t0
        rows.append(
            {
                **c,
                "method": "cpu",
                "global_cpu_ms": global_s * 1e3,
                "exact_cpu_ms": exact_s * 1e3,
                "cpu_threads": torch.get_num_threads(),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def to_markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        "# Flow solver benchmark (generated by benchmarks/flow_solver_gpu.py)",
        "",
        f"card: {meta['card']}; torch {meta['torch']} (CUDA {meta['cuda']}); {meta['date_utc']}; "
        f"{meta['dtype']}; {meta['timing']}.",
        "",
        *([meta["note"], ""] if "note" in meta else []),
        "| G x n | e | k | logits | method | eager ms | graph ms | gap median | gap max | max load/cap |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x: object, spec: str) -> str:
        return format(x, spec) if isinstance(x, float) else "-"

    for r in rows:
        if r["method"] == "cpu":
            continue
        logits = "skewed (bias std 1)" if r["bias"] else "balanced"
        method = r["method"] + (f" ({r['backend']})" if "backend" in r else "")
        lines.append(
            f"| {r['groups']} x {r['n']} | {r['e']} | {r['k']} | {logits} | {method} | "
            f"{f(r.get('eager_ms'), '.3f')} | {f(r.get('graph_ms'), '.3f')} | "
            f"{f(r.get('gap_median'), '.2e')} | {f(r.get('gap_max'), '.2e')} | "
            f"{f(r.get('overload'), '.2f')} |"
        )
    for r in rows:
        if r["method"] == "cpu":
            lines.append(
                f"\nCPU ({r['cpu_threads']} threads), {r['groups']} x {r['n']}, e={r['e']}, k={r['k']}, "
                f"{'skewed' if r['bias'] else 'balanced'} logits: "
                f"global solver {r['global_cpu_ms']:.1f} ms, exact SSP reference {r['exact_cpu_ms']:.1f} ms."
            )
    errors = [r for r in rows if "error" in r or "graph_error" in r]
    for r in errors:
        lines.append(f"\n{key(r)} {r['method']}: {r.get('error', '')} {r.get('graph_error', '')}")
    return "\n".join(lines) + "\n"


def regenerate_markdown(json_path: Path) -> None:
    """Rewrite the markdown table next to a results JSON (no GPU needed)."""
    data = json.loads(json_path.read_text())
    json_path.with_suffix(".md").write_text(to_markdown(data["meta"], data["rows"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--make-reference", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", HERE)))
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--sets", type=int, default=4)
    parser.add_argument("--only", default=None, help="substring of a config key to run alone")
    parser.add_argument("--gap-eval", action="store_true", help="100-instance gaps, then exit")
    args = parser.parse_args()
    if args.make_reference:
        make_reference()
    elif args.gap_eval:
        args.out.mkdir(parents=True, exist_ok=True)
        gap_eval(args.out)
    else:
        run(args.out, args.reps, args.sets, args.only)


if __name__ == "__main__":
    main()
