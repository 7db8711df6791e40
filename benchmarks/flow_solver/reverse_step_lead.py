"""A lead for the global solver's phase 1, measured on the NumPy reference: an expert-side
(reverse) step after the auction stalls.

The Jacobi auction's tail fills about one slot per 30 rounds (bidders raise prices by little at
a time), so the solver hands the open slots to phase 2, whose rounds cost about four auction
rounds each on the GPU and fill one to three slots. A reverse step (Bertsekas' forward-reverse
auction for transportation problems) fills a free slot from the expert's side: expert ``j`` with
a free slot lowers its price ``p_j`` to ``max(L_j, min(p_j, U_i))`` and gives the slot to the open
token ``i`` with the largest ``U_i = A_ij - (i's best other unheld reduced value) + eps`` (at that
price ``j`` is within eps of ``i``'s best choice), provided ``U_i >= L_j = max_t (A_tj - pi_t)
- eps`` over the other tokens ``t`` that hold slots but not ``j`` (``pi_t``: ``t``'s worst held
reduced value), so that no token then prefers ``j`` to a slot it holds by more than eps:
eps-complementary slackness, which phase 2 relies on, is kept. Experts are taken one at a time,
passes repeated until none fills.

This script runs the reference solver with and without the step (patched in after the auction)
and prints, per instance family and shape, the open slots phase 2 receives, phase 2's rounds
and the gap to the exact optimum. It changes no shipped solver.

``PYTHONPATH=src python benchmarks/flow_solver/reverse_step_lead.py --out DIR``
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from maxscore.routing.flow import global_reference as ref
from maxscore.routing.flow.global_reference import GlobalBudget

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from reference_leads import lead_arguments, record, solve_with_auction, summary, write_rows  # noqa: E402

from common import load_script  # noqa: E402


def reverse_steps(a: np.ndarray, k: int, cap: np.ndarray, held: np.ndarray, price: np.ndarray,
                  eps: float) -> int:  # fmt: skip
    """Fill free slots from the experts' side (module docstring); returns the slots filled."""
    filled_total = 0
    while True:
        filled = 0
        for j in np.flatnonzero(held.sum(axis=0) < cap):
            reduced = a - price
            count = held.sum(axis=1)
            open_tokens = np.flatnonzero((count < k) & ~held[:, j])
            if open_tokens.size == 0:
                break
            others = np.where(held[open_tokens], -np.inf, reduced[open_tokens])
            others[:, j] = -np.inf
            best_other = others.max(axis=1)
            upper = a[open_tokens, j] - best_other + eps
            i = int(open_tokens[np.argmax(upper)])
            u = float(upper.max())
            worst_held = np.where(held, reduced, np.inf).min(axis=1)
            bound = (count > 0) & ~held[:, j]
            bound[i] = False
            lower = float((a[bound, j] - worst_held[bound]).max() - eps) if bound.any() else -np.inf
            if u < lower:
                continue
            price[j] = max(lower, min(float(price[j]), u))
            held[i, j] = True
            filled += 1
        filled_total += filled
        if filled == 0:
            return filled_total


def run(a: np.ndarray, k: int, cap: np.ndarray, reverse: bool) -> dict[str, Any]:
    original = ref._auction

    def auction(
        a_: np.ndarray, k_: int, cap_: np.ndarray, budget: GlobalBudget
    ) -> tuple[np.ndarray, np.ndarray, int]:
        held, price, rounds = original(a_, k_, cap_, budget)
        if reverse:
            reverse_steps(a_, k_, cap_, held, price, ref.auction_epsilon(a_, budget))
        return held, price, rounds

    return solve_with_auction(a, k, cap, auction, gap=True)


def main() -> None:
    args = lead_arguments(__doc__)
    bench = load_script(HERE / "bench.py", "flow_bench")
    rows = []
    for n, e, k in [(512, 16, 2), (512, 64, 2), (512, 64, 6)]:
        for family in ["random", "near-tied-0.03"]:
            a_all = bench.synthetic(family, args.groups, n, e, seed=5).double().numpy()
            cap = np.full(e, -(-k * n // e))
            for reverse in (False, True):
                found = [run(a_all[g], k, cap, reverse) for g in range(args.groups)]
                row = {
                    "n": n, "e": e, "k": k, "family": family, "reverse_step": reverse,
                    **summary(found),
                }  # fmt: skip
                record(rows, row)
    write_rows(args.out, "reverse_step_lead.json", rows)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
