"""The global min-cost-flow solver (Eq. 7-8): gaps to the exact optimum and time per call.

Input families (``softmax`` of the logits, ``n`` tokens per routing group, capacity
``c = ceil(k n / e)``):

- ``random``: logits ~ N(0, 1);
- ``skewed``: plus a per-expert bias ~ N(0, 1) shared by the group (popular experts);
- ``ties``: every affinity equal;
- ``one-hot``: logits ~ N(0, 1) with expert 0 raised by 8 (every token prefers it);
- ``near-tied-0.1`` / ``-0.03`` / ``-0.01``: one shared logit vector per group plus noise of that
  std, what a router produces early in training;
- ``router-early`` / ``router-late``: the selection scores a MaxScore router of that shape
  produces in training, captured from a small Llama-MoE (the ``tiny`` preset's widths with ``e``
  experts and top-``k``) trained on the embedded corpus: at initialisation and after
  ``--router-steps`` optimizer steps.

``--gaps``: ``(OPT - objective) / OPT`` per group against the exact solver (successive shortest
paths, CPU; checked against OR-Tools in the tests), for the CUDA kernel when a GPU is present and
for the reference (NumPy) backend with ``--reference``. ``--timing``: milliseconds per call of the
CUDA kernels (32 groups of 512 tokens unless the shape says otherwise), replayed in a CUDA graph,
median over ``--reps`` replays, on random and near-tied inputs and on the routers' scores saved
by ``real_scores.py --save-calls`` (``--scores``), with the rounds each phase used and its clocks
(one more call of the kernel's debug build, ``MAXSCORE_FLOW_DEBUG``).

    PYTHONPATH=src python benchmarks/flow_solver/bench.py --gaps --timing --out OUT
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import multiprocessing
import platform
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from maxscore.routing.flow import compiled_call, flow_objective, global_cuda
from maxscore.routing.flow.exact import solve_exact
from maxscore.routing.flow.global_reference import GlobalBudget
from maxscore.routing.flow.global_solver import solve_global

#: (n, e, k): the shapes the solver must handle (the speed targets' grid and the paper's presets).
SHAPES = [(512, 16, 2), (512, 32, 2), (512, 64, 2), (512, 64, 6), (512, 128, 8), (512, 256, 8)]
LARGE_SHAPES = [(4096, 16, 2), (4096, 64, 6)]
SYNTHETIC = [
    "random",
    "skewed",
    "ties",
    "one-hot",
    "near-tied-0.1",
    "near-tied-0.03",
    "near-tied-0.01",
]


def synthetic(family: str, groups: int, n: int, e: int, seed: int) -> torch.Tensor:
    """``[groups, n, e]`` affinities of one synthetic family (CPU, float32)."""
    gen = torch.Generator().manual_seed(seed)
    if family == "ties":
        return torch.full((groups, n, e), 1.0 / e)
    if family.startswith("near-tied-"):
        noise = float(family.rsplit("-", 1)[1])
        shared = torch.randn(groups, 1, e, generator=gen)
        return torch.softmax(shared + noise * torch.randn(groups, n, e, generator=gen), -1)
    logits = torch.randn(groups, n, e, generator=gen)
    if family == "skewed":
        logits = logits + torch.randn(groups, 1, e, generator=gen)
    if family == "one-hot":
        logits[..., 0] += 8.0
    return torch.softmax(logits, -1)


def router_scores(
    n: int, e: int, k: int, steps: int, groups: int, device: str
) -> dict[str, torch.Tensor]:
    """Selection scores of a MaxScore router in training: at initialisation and after ``steps``
    optimizer steps (captured in the first MoE layer's solver call)."""
    from maxscore.data import load_default_corpus, load_default_tokenizer
    from maxscore.models import LlamaMoEForCausalLM
    from maxscore.models.presets import get_model_config

    torch.manual_seed(0)
    tokenizer = load_default_tokenizer()
    config = get_model_config(
        "tiny",
        router="maxscore",
        num_experts=e,
        num_experts_per_tok=k,
        vocab_size=len(tokenizer),
        max_position_embeddings=max(1024, n),
    )
    model = LlamaMoEForCausalLM(config).to(device)
    docs, ids_list, start = load_default_corpus()["train"], [], 0
    while len(ids_list) < (2 * groups + 64) * n:  # the captures' groups and the steps' batches
        ids_list += tokenizer("\n".join(docs[start : start + 20]))["input_ids"]
        start += 20
    ids = torch.tensor(ids_list)
    blocks = ids[: (ids.numel() // n) * n].view(-1, n)
    captured: list[torch.Tensor] = []
    original = compiled_call.solve_flow

    def recording(method, affinities, *args, **kwargs):
        if not captured:
            captured.append(affinities.detach().float().cpu().clone())
        return original(method, affinities, *args, **kwargs)

    def capture(batch: torch.Tensor) -> torch.Tensor:
        captured.clear()
        compiled_call.solve_flow = recording
        try:
            model.train()
            with torch.no_grad():
                model(input_ids=batch.to(device))
        finally:
            compiled_call.solve_flow = original
        return captured[0]

    out = {"router-early": capture(blocks[:groups])}
    optim = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for step in range(steps):
        batch = blocks[(step * 8) % (len(blocks) - 8) :][:8].to(device)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        model.advance_router_schedule()
    out["router-late"] = capture(blocks[-groups:])
    return out


def _exact_objective(args: tuple[torch.Tensor, int, int]) -> float:
    a, k, c = args
    cap = torch.full((a.shape[-1],), c)
    return float(flow_objective(a, solve_exact(a.unsqueeze(0), k, cap)[0]))


def gaps(
    a: torch.Tensor, index: torch.Tensor, k: int, c: int, pool: ProcessPoolExecutor
) -> list[float]:
    """Relative gap per group against the exact optimum (exact solves in parallel)."""
    opts = list(pool.map(_exact_objective, [(a[g], k, c) for g in range(a.shape[0])]))
    got = flow_objective(a, index.cpu()).tolist()
    return [(o - x) / abs(o) if o else 0.0 for o, x in zip(opts, got, strict=True)]


def check_constraints(index: torch.Tensor, k: int, c: int, e: int) -> None:
    """Eq. 7 exactly: k distinct experts per token (capacity suffices here), loads <= c."""
    index = index.cpu()
    assert bool((index >= 0).all()), "an empty slot although capacity allows a full assignment"
    sorted_idx = index.sort(-1).values
    assert bool((sorted_idx[..., 1:] != sorted_idx[..., :-1]).all()), "an expert twice in a token"
    loads = torch.zeros(index.shape[0], e, dtype=torch.long)
    loads.scatter_add_(1, index.flatten(1), torch.ones_like(index.flatten(1)))
    assert int(loads.max()) <= c, f"load {int(loads.max())} above capacity {c}"


def graph_time_ms(fn, reps: int) -> float:
    """Median milliseconds per replay of ``fn`` captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_stats(
    a: torch.Tensor, k: int, capacity: torch.Tensor, holders: int, budget: GlobalBudget
) -> dict[str, Any]:
    """One solve's statistics (the kernel's debug build, ``solve_cuda(stats=...)``), the slowest
    group's: rounds of each phase, and thousands of SM cycles of each phase and of their parts."""
    stats = torch.zeros(a.shape[0], global_cuda.DEBUG_STATS, dtype=torch.int32, device=a.device)
    global_cuda.solve_cuda(a, k, capacity, holders, budget, stats=stats)
    s = stats.cpu()

    def worst(first: int, last: int) -> list[int]:
        return [int(x) for x in s[:, first:last].max(0).values]

    return {
        "auction_rounds_max": int(s[:, 0].max()),
        "open_after_auction_max": int(s[:, 1].max()),
        "augment_rounds_max": int(s[:, 2].max()),
        "cancel_rounds_max": int(s[:, 3].max()),
        "kcycles_setup_auction_augment_cancel_max": worst(4, 8),
        "kcycles_auction_list_bid_merge": worst(8, 11),
        "kcycles_augment_graph_bf_moves": worst(11, 14),
        "kcycles_cancel_graph_bf_moves": worst(14, 17),
        "kcycles_augment_select": int(s[:, 17].max()),
        "kcycles_graph_rows_augment_cancel": worst(18, 20),
    }


def time_and_stats(a: torch.Tensor, k: int, capacity: torch.Tensor, reps: int) -> dict[str, Any]:
    """The shipped budget's solve of ``a`` (``[G, n, e]``, CUDA) with ``capacity`` (``[G, e]``
    int32): ms a call replayed in a CUDA graph, and :func:`kernel_stats`."""
    holders = min(int(capacity.max()), a.shape[1])
    budget = GlobalBudget()
    ms = graph_time_ms(lambda: global_cuda.solve_cuda(a, k, capacity, holders, budget), reps)
    return {"ms": ms, **kernel_stats(a, k, capacity, holders, budget)}


def save_scores(path: Path, a: torch.Tensor, k: int, capacity: torch.Tensor) -> None:
    """One solver call's scores (every group) as float16, with its ``k`` and capacities: the
    file ``--timing --scores`` times (:func:`load_scores`)."""
    np.savez_compressed(path, scores=a.half().cpu().numpy(), k=k, capacity=capacity.cpu().numpy())


def load_scores(path: Path) -> tuple[torch.Tensor, int, torch.Tensor]:
    """:func:`save_scores`' file on the GPU: scores (float32), ``k``, capacities (int32)."""
    saved = np.load(path)
    a = torch.from_numpy(saved["scores"].astype(np.float32)).cuda()
    return a, int(saved["k"]), torch.from_numpy(saved["capacity"]).to(torch.int32).cuda()


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """``"512x64x2,4096x16x2"`` -> ``[(512, 64, 2), (4096, 16, 2)]`` (``""``: none)."""
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",") if item]  # type: ignore[misc]


def run_gaps(args: argparse.Namespace, results: dict) -> None:
    device = "cuda" if torch.cuda.is_available() and not args.reference else "cpu"
    backend = "cuda" if device == "cuda" else "reference"
    rows = results.setdefault("gaps", [])
    # spawn, not fork: the parent has initialised CUDA, and a forked child would hang on it
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.workers, mp_context=context) as pool:
        shapes = parse_shapes(args.shapes) or SHAPES + (LARGE_SHAPES if args.large else [])
        names = args.families.split(",") if args.families else SYNTHETIC
        for n, e, k in shapes:
            c = math.ceil(args.capacity_factor * k * n / e)
            families = {f: synthetic(f, args.groups, n, e, seed=1000 + e + k) for f in names}
            if args.router_steps > 0:
                families.update(router_scores(n, e, k, args.router_steps, args.groups, device))
            for family, a in families.items():
                start = time.time()
                index = solve_global(
                    a.to(device), k, torch.full((e,), c), capacity_bound=c, backend=backend
                )
                check_constraints(index, k, c, e)
                g = gaps(a, index, k, c, pool)
                row = {
                    "n": n,
                    "e": e,
                    "k": k,
                    "capacity": c,
                    "family": family,
                    "backend": backend,
                    "groups": len(g),
                    "median_gap": statistics.median(g),
                    "worst_gap": max(g),
                }
                rows.append(row)
                print(
                    f"gap {backend:9s} n={n:5d} e={e:3d} k={k} {family:15s} median "
                    f"{row['median_gap']:.1e} worst {row['worst_gap']:.1e} "
                    f"({time.time() - start:.1f} s)",
                    flush=True,
                )


def run_timing(args: argparse.Namespace, results: dict) -> None:
    rows = results.setdefault("timing", [])
    for n, e, k in parse_shapes(args.shapes) or SHAPES + LARGE_SHAPES:
        groups = 32 if n <= 512 else 8
        c = math.ceil(args.capacity_factor * k * n / e)
        cap = torch.full((e,), c, device="cuda")
        for family in ["random", "near-tied-0.03"]:
            a = synthetic(family, groups, n, e, seed=7).cuda()
            call = partial(
                solve_global, a, k, cap, capacity_bound=c, budget=args.budget, backend="cuda"
            )
            ms = graph_time_ms(call, args.reps)
            # the starting prices' kernel alone (None: this solver kernel computes its own)
            capacities = cap.to(torch.int32).expand(groups, e).contiguous()
            prices = partial(global_cuda.start_prices, a, k, capacities, args.budget, None, 0)
            prices_ms = graph_time_ms(prices, args.reps) if prices() is not None else None
            row = {
                "n": n,
                "e": e,
                "k": k,
                "capacity": c,
                "groups": groups,
                "family": family,
                "ms": ms,
                "prices_ms": prices_ms,
                **kernel_stats(a, k, cap.expand(groups, e), c, args.budget),
            }
            rows.append(row)
            print(
                f"time {groups}x{n} e={e:3d} k={k} {family:15s} {ms:.3f} ms "
                f"(prices {prices_ms if prices_ms is None else round(prices_ms, 3)})  rounds "
                f"{row['auction_rounds_max']} / open {row['open_after_auction_max']} / "
                f"{row['augment_rounds_max']} / {row['cancel_rounds_max']}",
                flush=True,
            )
        # torch.topk on the same input: the floor a router pays anyway
        ms = graph_time_ms(partial(torch.topk, a, k, -1), args.reps)
        rows.append({"n": n, "e": e, "k": k, "groups": groups, "family": "topk-baseline", "ms": ms})
    for path in args.scores:
        a, k, capacity = load_scores(path)
        row = {"scores": path.name, "groups": a.shape[0], "n": a.shape[1], "e": a.shape[2], "k": k}
        rows.append(row | time_and_stats(a, k, capacity, args.reps))
        print(f"time {path.name}: {rows[-1]['ms']:.3f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gaps", action="store_true")
    parser.add_argument("--timing", action="store_true")
    parser.add_argument("--reference", action="store_true", help="gaps of the NumPy backend")
    parser.add_argument("--large", action="store_true", help="also the 4096-token shapes' gaps")
    parser.add_argument("--groups", type=int, default=8, help="groups per (shape, family) for gaps")
    parser.add_argument("--router-steps", type=int, default=200)
    parser.add_argument(
        "--capacity-factor",
        type=float,
        default=1.0,
        help="gaps and times at capacity ceil(factor k n / e) (above 1: spare capacity)",
    )
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument(
        "--shapes", default="", help="shapes to time or measure, e.g. 512x64x2,4096x16x2"
    )
    parser.add_argument(
        "--families", default="", help="synthetic families for --gaps, e.g. one-hot,random"
    )
    parser.add_argument(
        "--scores",
        type=Path,
        action="append",
        default=[],
        help="--timing also on a router's scores saved by real_scores.py --save-calls",
    )
    parser.add_argument(
        "--budget",
        default="",
        help="GlobalBudget fields for --timing, e.g. stop_open=0.02,auction_rounds=48",
    )
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    fields = dict(item.split("=", 1) for item in args.budget.split(",") if item)
    args.budget = GlobalBudget(
        **{key: type(getattr(GlobalBudget(), key))(value) for key, value in fields.items()}
    )
    results: dict = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else platform.processor(),
        "budget": args.budget.__dict__,
    }
    if args.timing:
        run_timing(args, results)
    if args.gaps:
        run_gaps(args, results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
