"""Router comparisons over seeds: mean ± std per router, differences to a reference router.

Router differences that matter here are 0.01-0.1 nats, the size of the seed-to-seed spread of
one router, so a comparison reports, per router:

* the validation loss of each run with its standard error over validation documents
  (:mod:`maxscore.training.validation_set`): the noise of the validation sample;
* with several seeds, the mean and standard deviation over seeds: the noise of training;
* the difference to the first router, paired: per seed, the two runs' losses on the same
  validation documents (its error, ``paired_se``, is much smaller than either loss's), then
  mean ± std of those differences over seeds.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from maxscore.training import evidence
from maxscore.training.validation_set import VALIDATION_FILE, paired_difference

__all__ = ["add_paired_differences", "mean_std", "summarize_by_router"]


def mean_std(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation of the finite values (std ``None`` below two)."""
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return None, None
    return statistics.fmean(finite), statistics.stdev(finite) if len(finite) > 1 else None


def _validation(run_dir: str | Path) -> dict[str, Any] | None:
    path = Path(run_dir) / VALIDATION_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def add_paired_differences(rows: list[dict[str, Any]]) -> None:
    """Add ``delta`` and ``delta_se`` (loss minus the first router's, same seed) to each row.

    Rows are the per-run rows of ``maxscore compare`` (``router``, ``seed``, ``eval_loss``,
    ``run_dir``); the first router is the reference (its own delta is 0). The pairing uses the
    runs' ``validation.json``; without it (or on different validation tokens) ``delta`` is the
    plain difference and ``delta_se`` is missing.
    """
    if not rows:
        return
    reference = rows[0]["router"]
    by_seed = {r["seed"]: r for r in rows if r["router"] == reference}
    for row in rows:
        base = by_seed.get(row["seed"])
        if base is None or row.get("eval_loss") is None or base.get("eval_loss") is None:
            continue
        mine, theirs = _validation(row["run_dir"]), _validation(base["run_dir"])
        paired = paired_difference(mine, theirs) if mine and theirs else None
        if paired is not None:
            row["delta"], row["delta_se"] = paired
        else:
            row["delta"] = row["eval_loss"] - base["eval_loss"]


#: Per-run columns averaged over seeds in the per-router summary.
MEAN_KEYS: tuple[str, ...] = (
    "eval_loss_se",
    "train_loss",
    "dropped_rank1",
    "dropped_rank2",
    "rerouted_rank1",
    "rerouted_rank2",
    "load_imbalance",
    "tokens_per_s",
    "peak_memory_gb",
    "runtime_s",
    "steps",
)


def summarize_by_router(
    rows: list[dict[str, Any]],
    confidence: float = evidence.DEFAULT_CONFIDENCE,
    margin: float = evidence.DEFAULT_MARGIN,
) -> list[dict[str, Any]]:
    """One row per router, in first-seen order: mean ± std over seeds of loss and delta.

    Keys: ``router``, ``seeds``, ``eval_loss`` / ``eval_loss_std`` (over seeds), ``delta`` /
    ``delta_std`` (over seeds) or, for one seed, ``delta_se`` (paired), the seed means of
    :data:`MEAN_KEYS`, and for every router but the reference ``evidence``: the t interval of
    its per-seed differences, the verdict at ``margin`` and the seeds needed
    (:func:`maxscore.training.evidence.describe`).
    """
    reference = rows[0]["router"] if rows else None
    out = []
    for router in dict.fromkeys(r["router"] for r in rows):
        runs = [r for r in rows if r["router"] == router]
        summary: dict[str, Any] = {"router": router, "seeds": [r["seed"] for r in runs]}
        summary["eval_loss"], summary["eval_loss_std"] = mean_std(
            [r.get("eval_loss") for r in runs]
        )
        summary["delta"], summary["delta_std"] = mean_std([r.get("delta") for r in runs])
        if len(runs) == 1:
            summary["delta_se"] = runs[0].get("delta_se")
        deltas = [r.get("delta") for r in runs]
        if router != reference and any(d is not None for d in deltas):
            summary["evidence"] = evidence.describe(deltas, confidence, margin)
        for key in MEAN_KEYS:
            summary[key] = mean_std([r.get(key) for r in runs])[0]
        out.append(summary)
    return out
