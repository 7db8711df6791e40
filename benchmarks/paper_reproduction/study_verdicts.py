"""The paper-reproduction study's verdicts and table helpers.

:func:`verdict` reads the 95% Student-t interval of a claim's per-seed paired differences
(:mod:`maxscore.training.evidence`) against the equivalence margin :data:`MARGIN`;
:func:`negligible_verdict` does the same for the paper's "negligible improvement" claims.
:mod:`study_report` computes the study's summary with these, and :mod:`study_readme` renders it.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from maxscore.training import evidence
from maxscore.training.validation_set import paired_difference

#: Accuracy of guessing (%), per bundled task: uniform over the choices (BoolQ: the majority
#: class of its validation split, 62.2%; LAMBADA: an open answer, 0).
CHANCE: dict[str, float] = {
    "arc_challenge": 25.0,
    "arc_easy": 25.0,
    "boolq": 62.2,
    "hellaswag": 25.0,
    "lambada_openai": 0.0,
    "piqa": 50.0,
    "sciq": 25.0,
    "openbookqa": 25.0,
}


def _mean_std(values: list[float]) -> dict[str, Any] | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return None
    std = statistics.stdev(values) if len(values) > 1 else None
    return {
        "mean": statistics.fmean(values),
        "std": std,
        "sem": std / math.sqrt(len(values)) if std is not None else None,
        "n": len(values),
    }


def _device(run: dict[str, Any]) -> str:
    return run.get("device") or "unknown"


def _card(device: str) -> str:
    """A short card name for tables: ``NVIDIA H100 80GB HBM3`` -> ``H100``."""
    words = device.removeprefix("NVIDIA ").split()
    return words[0] if words else device


def _per_card(speeds: dict[str, Any]) -> str:
    """``mean (card)`` per card, ``; ``-separated; ``pending`` without runs."""
    parts = [
        f"{v['mean']:,.0f} ({_card(device)}{', n=' + str(v['n']) if len(speeds) > 1 else ''})"
        for device, v in speeds.items()
        if v is not None
    ]
    return "; ".join(parts) or "pending"


#: Equivalence margin (nats) of the verdicts: a 1% change in perplexity.
MARGIN = 0.01


def _paired(runs: dict[str, list[dict[str, Any]]], a: str, b: str) -> dict[str, Any] | None:
    """``loss(a) - loss(b)`` per common seed (paired by validation document), over seeds, with
    the per-seed values (``per_seed``) and their t interval (``evidence``)."""
    by_seed = {r["seed"]: r for r in runs.get(b, [])}
    diffs, ses, seeds = [], [], []
    for run in runs.get(a, []):
        other = by_seed.get(run["seed"])
        if other is None or run["eval_loss"] is None or other["eval_loss"] is None:
            continue
        paired = (
            paired_difference(run["validation"], other["validation"])
            if run.get("validation") and other.get("validation")
            else None
        )
        diffs.append(paired[0] if paired else run["eval_loss"] - other["eval_loss"])
        ses.append(paired[1] if paired else None)
        seeds.append(run["seed"])
    stats = _mean_std(diffs)
    if stats is not None:
        stats["per_seed"] = dict(zip(seeds, diffs, strict=True))
        stats["evidence"] = evidence.describe(diffs, margin=MARGIN)
        known = [s for s in ses if s is not None]
        stats["validation_se"] = (
            math.sqrt(sum(s * s for s in known)) / len(known) if known else None
        )
    return stats


def verdict(diff: dict[str, Any] | None, expected_sign: int) -> str:
    """``reproduces`` / ``opposite`` / ``no difference beyond ±m`` / ``inconclusive`` /
    ``pending`` from the 95% t interval of ``diff``'s per-seed values (module docstring)."""
    if diff is None:
        return "pending"
    found = diff.get("evidence") or evidence.describe(
        list(diff.get("per_seed", {}).values()) or [diff["mean"]], margin=MARGIN
    )
    if found["low"] is None:
        return "inconclusive (one seed)"
    low, high = sorted((expected_sign * found["low"], expected_sign * found["high"]))
    if low > 0:
        return "reproduces"
    if high < 0:
        return "opposite"
    if found["within_margin"]:
        return f"no difference beyond ±{MARGIN}"
    return "inconclusive"


def negligible_verdict(diff: dict[str, Any] | None) -> str:
    """The paper's "negligible improvement" claims (GShard-M, GShard-I): ``reproduces`` when
    the interval lies within ±:data:`MARGIN` or wholly on the losing side; a clear gain does
    not reproduce; an interval that reaches past the margin is inconclusive."""
    found = verdict(diff, 1)
    return {
        "reproduces": "does not reproduce (a clear gain)",
        "opposite": "reproduces (no gain; worse than GShard)",
        f"no difference beyond ±{MARGIN}": f"reproduces (within ±{MARGIN})",
    }.get(found, found)
