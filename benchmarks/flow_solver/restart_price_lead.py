"""A lead for the global solver's eps-scaling, on the NumPy reference: lower restart prices.

Each auction of eps-scaling restarts from the previous one's prices. Those differ by multiples of
the previous auction's coarse eps even where the optimal prices are equal (all affinities tied),
and a forward auction cannot lower a price, so experts priced one coarse step too high stay empty
and phase 2 fills their slots one path at a time. This script lowers every restart price by
``m`` steps (floored at 0: the shipped auction with its stages wrapped) and prints, per input
family and shape, the open slots phase 2 receives and its rounds, with the shipped schedule
(``GlobalBudget().epsilon_scales``, from the mean affinities: ``price_iterations=0``): ``m`` =
none, 1, 4 and 16 steps of the previous auction's (coarse) eps, and 1 and 4 steps of the
restarting auction's own (finer) eps. The shipped solver does not change.

``PYTHONPATH=src:tests python benchmarks/flow_solver/restart_price_lead.py --out DIR``
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from maxscore.routing.flow import global_reference as ref
from maxscore.routing.flow.global_reference import GlobalBudget

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/common.py
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "tests"))  # flow_helpers: the stored router scores
from reference_leads import lead_arguments, record, solve_patched, write_rows  # noqa: E402

from common import load_script  # noqa: E402

SCHEDULE = GlobalBudget().epsilon_scales
BUDGET = GlobalBudget(price_iterations=0)  # the start these leads were measured from


def stages_lowering(steps: int | None, original: Callable[..., Any], fine: bool = False):
    """``original``, the reference's auction (one stage of eps-scaling), with each restart's
    starting prices lowered by ``steps`` times the previous stage's eps (``fine``: the restarting
    stage's own), floored at 0 (``None``: as shipped). A fresh one per group: it remembers the
    previous stage's eps."""
    previous_eps: list[float] = []

    def stage(
        a: np.ndarray, k: int, cap: np.ndarray, budget: GlobalBudget, start: np.ndarray, eps: float
    ) -> tuple[np.ndarray, np.ndarray, int]:
        if steps is not None and previous_eps:  # a restart (closed experts start at 0 already)
            start = np.maximum(start - steps * (eps if fine else previous_eps[-1]), 0.0)
        previous_eps.append(eps)
        return original(a, k, cap, budget, start, eps)

    return stage


def run(a_all: np.ndarray, k: int, steps: int | None, fine: bool = False) -> dict[str, Any]:
    """Every group of ``a_all`` through the reference with the lowered restarts."""
    n, e = a_all.shape[1:]
    cap = np.full(e, -(-k * n // e))
    original = ref._auction_stage
    found = []
    for a in a_all:
        stage = stages_lowering(steps, original, fine)  # a fresh one per group
        found.append(solve_patched(a, k, cap, {"_auction_stage": stage}, BUDGET, False))
    return {
        "open_after_auction": [s["open_after_auction"] for s in found],
        "augment_rounds": [s["augment_rounds"] for s in found],
        "feasible": all(s["feasible"] for s in found),
    }


def main() -> None:
    args = lead_arguments(__doc__)
    bench = load_script(HERE / "bench.py", "flow_bench")
    import flow_helpers

    cases = []
    for n, e, k in [(256, 16, 2), (512, 16, 2), (256, 64, 2), (256, 64, 6)]:
        cases.append((k, "ties", np.full((args.groups, n, e), 1.0 / e)))
        for family in ["random", "near-tied-0.03"]:
            a = bench.synthetic(family, args.groups, n, e, seed=7).double().numpy()
            cases.append((k, family, a))
    cases.append((2, "router-e64_k2", flow_helpers.real_router_scores("e64_k2").double().numpy()))
    rows: list[dict] = []
    for k, family, a_all in cases:
        _, n, e = a_all.shape
        row = {"n": n, "e": e, "k": k, "family": family, "schedule": list(SCHEDULE)}
        for steps, fine in [
            (None, False),
            (1, False),
            (4, False),
            (16, False),
            (1, True),
            (4, True),
        ]:
            unit = "this auction's eps" if fine else "the previous auction's eps"
            found = run(a_all, k, steps, fine)
            record(rows, {**row, "lowered_by_steps": steps, "step_unit": unit, **found})
    write_rows(args.out, "restart_price_lead.json", rows)


if __name__ == "__main__":
    main()
