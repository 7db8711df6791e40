"""The lead for the global solver's phase 1 that led to its eps-scaling, on the NumPy reference.

The Jacobi auction's tail is slow where many tokens want the same experts (near-tied inputs, a
real router's scores): bidders raise the contested prices by ``eps`` at a time, the auction
stalls with many slots open, and phase 2 fills them one to three per round. eps-scaling
(Bertsekas) runs auctions with ``s`` times the ``eps`` first, which settle the contested prices
in large steps, then one with the final ``eps``, each starting, every slot open, from the
previous one's prices (the lowest open expert's at 0) instead of the experts' mean affinities.
Each schedule (``(100, 10)``: three auctions, 100x, 10x, then 1x; ``()``: one auction) is patched
in over a one-auction phase 1, so schedules that ``GlobalBudget`` does not allow compare too.

This script prints, per shape and input family, the auction rounds (all stages), the open
slots phase 2 receives, phase 2's and phase 3's rounds and the gap to the exact optimum (up to
64 experts). A GPU call costs about as many cycles as its slowest group's rounds, so each row
also gives that group's cost in the kernel's cycles per auction round and per phase-2 round
(thousands of cycles, the H200 clock table of the kernel before eps-scaling): a model, not a
measurement.

``PYTHONPATH=src:tests python benchmarks/flow_solver/eps_scaling_lead.py --out DIR``
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from maxscore.routing.flow import global_reference as ref
from maxscore.routing.flow.global_reference import GlobalBudget

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "tests"))  # flow_helpers: the stored router scores
from reference_leads import lead_arguments, record, solve_with_auction, summary, write_rows  # noqa: E402

from common import load_script  # noqa: E402

#: Thousands of SM cycles per auction round and per phase-2 round of the shipped kernel (H200,
#: 512 tokens, random inputs: the clock table's auction and phase-2 totals over their rounds).
ROUND_KCYCLES = {(16, 2): (10, 26), (64, 2): (11, 49), (64, 6): (18, 80), (128, 8): (26, 172)}


def counted(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` and how many auction rounds it ran (calls of the reference's bid step)."""
    original, calls = ref._bids, [0]

    def bids(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    ref._bids = bids
    try:
        return fn(), calls[0]
    finally:
        ref._bids = original


def run(a: np.ndarray, k: int, cap: np.ndarray, scales: Sequence[int], gap: bool) -> dict:
    """One group through the reference with the auctions of ``scales`` before the shipped one."""
    original_auction, original_warm = ref._auction, ref.warm_prices
    rounds = [0]

    def auction(
        a_: np.ndarray, k_: int, cap_: np.ndarray, budget: GlobalBudget
    ) -> tuple[np.ndarray, np.ndarray, int]:
        price = None
        for scale in [*scales, 1]:
            if price is not None:
                start = price - price[np.isfinite(price)].min()
                ref.warm_prices = lambda _a, start=start: start
            stage = GlobalBudget(
                epsilon=budget.epsilon * scale, epsilon_scales=(), price_iterations=0
            )
            try:
                (held, price, _), used = counted(lambda s=stage: original_auction(a_, k_, cap_, s))
            finally:
                ref.warm_prices = original_warm
            rounds[0] += used
        return held, price, rounds[0]

    found = solve_with_auction(a, k, cap, auction, gap)
    return {**found, "auction_rounds": rounds[0]}


def main() -> None:
    args = lead_arguments(__doc__)
    bench = load_script(HERE / "bench.py", "flow_bench")
    import flow_helpers

    cases = []
    for n, e, k in [(512, 16, 2), (512, 64, 2), (512, 64, 6), (512, 128, 8)]:
        for family in ["random", "near-tied-0.03"]:
            a = bench.synthetic(family, args.groups, n, e, seed=7).double().numpy()
            cases.append((k, family, a))
    for key in ["e16_k2", "e64_k2"]:  # two groups each of a trained router's selection scores
        cases.append((2, f"router-{key}", flow_helpers.real_router_scores(key).double().numpy()))
    rows = []
    for k, family, a_all in cases:
        _, n, e = a_all.shape
        cap = np.full(e, -(-k * n // e))
        per_auction, per_phase2 = ROUND_KCYCLES[(e, k)]
        for scales in [(), (10,), (30,), (100,), (400,), (100, 10), (400, 30)]:
            found = [run(a, k, cap, scales, gap=e <= 64) for a in a_all]
            model = [
                per_auction * s["auction_rounds"] + per_phase2 * s["augment_rounds"] for s in found
            ]
            row = {
                "n": n, "e": e, "k": k, "family": family, "scales": list(scales),
                "auction_rounds": [s["auction_rounds"] for s in found], **summary(found),
                "model_kcycles_slowest_group": max(model),
            }  # fmt: skip
            record(rows, row)
    write_rows(args.out, "eps_scaling_lead.json", rows)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
