"""What the lead scripts of this folder share (``reverse_step_lead.py``, ``eps_scaling_lead.py``):
each patches a change into the NumPy reference solver and reports, per group, how its result
compares with the exact optimum."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from maxscore.routing.flow import global_reference as ref
from maxscore.routing.flow.exact import solve_exact_numpy
from maxscore.routing.flow.global_reference import GlobalBudget


def lead_arguments(doc: str | None) -> argparse.Namespace:
    """``--groups`` (per synthetic row) and ``--out`` (the folder of the JSON)."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("."))
    return parser.parse_args()


def outcome(a: np.ndarray, held: np.ndarray, k: int, cap: np.ndarray, gap: bool) -> dict:
    """``feasible`` (every token k experts, no capacity exceeded) and, if ``gap``, the relative
    gap of ``held``'s objective to the exact optimum (the exact solver is slow beyond 64 experts)."""
    found: dict = {
        "feasible": bool((held.sum(axis=1) == k).all() and (held.sum(axis=0) <= cap).all())
    }
    if gap:
        optimum = float((a * solve_exact_numpy(a, k, cap)).sum())
        found["gap"] = (optimum - float((a * held).sum())) / abs(optimum)
    return found


def summary(found: list[dict]) -> dict:
    """The groups of one row: their reference statistics, worst gap and feasibility."""
    gaps = [s["gap"] for s in found if "gap" in s]
    return {
        "open_after_auction": [s["open_after_auction"] for s in found],
        "augment_rounds": [s["augment_rounds"] for s in found],
        "cancel_rounds": [s["cancel_rounds"] for s in found],
        "worst_gap": max(gaps) if gaps else None,
        "feasible": all(s["feasible"] for s in found),
    }


def write_rows(out: Path, name: str, rows: list[dict]) -> None:
    """``rows`` as ``out/name`` (``{"rows": [...]}``)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps({"rows": rows}, indent=1) + "\n")


def record(rows: list[dict], row: dict) -> None:
    """Keep ``row`` and print it as it comes (a long run shows its progress)."""
    rows.append(row)
    print(json.dumps(row), flush=True)


def solve_patched(
    a: np.ndarray,
    k: int,
    cap: np.ndarray,
    patches: dict[str, Callable[..., Any]],
    budget: GlobalBudget,
    gap: bool,
) -> dict:
    """One group through the reference solver with ``patches`` (functions of
    ``global_reference`` by name) in place of its own: its statistics (``solve_group``'s) and
    :func:`outcome`."""
    originals = {name: getattr(ref, name) for name in patches}
    stats: dict[str, Any] = {}
    try:
        for name, function in patches.items():
            setattr(ref, name, function)
        held = ref.solve_group(a, k, cap, budget, stats)
    finally:
        for name, function in originals.items():
            setattr(ref, name, function)
    return {**stats, **outcome(a, held, k, cap, gap)}


def solve_with_auction(
    a: np.ndarray, k: int, cap: np.ndarray, auction: Callable[..., Any], gap: bool
) -> dict:
    """:func:`solve_patched` with ``auction`` in place of its phase 1. The budget is the
    one-auction phase 1 from the mean affinities (``epsilon_scales=()``, no dual prices) that
    these leads were measured against."""
    budget = GlobalBudget(epsilon_scales=(), price_iterations=0)
    return solve_patched(a, k, cap, {"_auction": auction}, budget, gap)
