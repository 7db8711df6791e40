"""Reading run directories: resolved config, ``metrics.jsonl`` and the numbers the paper plots.

A run directory (written by ``maxscore train``, see :mod:`maxscore.training.run`) holds
``config.json`` (``{"train": ..., "resolved": ..., "model": ...}``), ``metrics.jsonl`` (one JSON
object per log event with a ``type``: ``train``, ``eval``, ``end`` or ``final``) and
``checkpoint-N/`` / ``final/`` model directories. Training records carry a ``routing`` object
with per-MoE-layer lists (``dropped_by_rank[L][k]``, ``rerouted_by_rank[L][k]``,
``mean_affinity_by_rank[L][k]``,
``load_over_capacity[L][e]``, ``tokens_per_expert[L][e]``, ``load_imbalance[L]``,
``unused_experts[L]``, ``moe_layers[L]``).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from maxscore.checkpoints.layout import CONFIG_FILE, METRICS_FILE

logger = logging.getLogger(__name__)


#: Per-layer routing statistics the analysis uses (lists over MoE layers in ``routing``).
LAYER_STAT_KEYS: tuple[str, ...] = (
    "dropped_by_rank",
    "rerouted_by_rank",
    "mean_affinity_by_rank",
    "load_over_capacity",
    "tokens_per_expert",
    "load_imbalance",
    "unused_experts",
)


class RunError(ValueError):
    """A path that is not a usable run directory, or a run without the needed data."""


@dataclass
class RoutingSnapshot:
    """Per-layer routing statistics at one point of a run (or of a checkpoint evaluation).

    Attributes:
        layers: decoder-layer index of each entry (dense layers are not listed).
        stats: ``{key: [per-layer value]}``, value a float or a list (by rank / by expert).
        source: where the numbers come from (``"metrics.jsonl step 600"``, ``"checkpoint ..."``).
        step: optimizer step of the snapshot, if known.
    """

    layers: list[int]
    stats: dict[str, list[Any]]
    source: str
    step: int | None = None

    def layer_position(self, layer: int) -> int:
        """Index into the per-layer lists of decoder layer ``layer``."""
        if layer not in self.layers:
            raise RunError(f"layer {layer} is not an MoE layer here; MoE layers: {self.layers}")
        return self.layers.index(layer)

    def to_dict(self) -> dict[str, Any]:
        return {
            "layers": self.layers,
            "stats": self.stats,
            "source": self.source,
            "step": self.step,
        }


@dataclass
class RunData:
    """Everything the analysis reads from one run directory.

    Attributes:
        path: the run directory.
        name: label in plots and tables (router preset by default).
        config: the resolved ``config.json`` (empty if missing).
        records: the ``metrics.jsonl`` records in file order.
    """

    path: Path
    name: str
    config: dict[str, Any]
    records: list[dict[str, Any]]
    checkpoint_snapshot: RoutingSnapshot | None = field(default=None)

    # -- config ------------------------------------------------------------------------------
    @property
    def router(self) -> str | None:
        """Router preset name of the run."""
        return self.config.get("train", {}).get("router") or self.config.get("model", {}).get(
            "router"
        )

    @property
    def router_config(self) -> dict[str, Any]:
        return dict(self.config.get("model", {}).get("router_config") or {})

    # -- curves ------------------------------------------------------------------------------
    def train_loss(self) -> list[tuple[int, float]]:
        """``(step, loss)`` of every training log."""
        return [
            (int(r["step"]), float(r["loss"]))
            for r in self.records
            if r.get("type", "train") == "train" and _finite(r.get("loss"))
        ]

    def eval_loss(self) -> list[tuple[int, float]]:
        """``(step, eval_loss)`` of every validation log (repeats at the same step kept once)."""
        seen: dict[int, float] = {}
        for r in self.records:
            if r.get("type", "eval") == "eval" and _finite(r.get("eval_loss")):
                seen.setdefault(int(r["step"]), float(r["eval_loss"]))
        return sorted(seen.items())

    def final_validation(self) -> dict[str, float] | None:
        """The last validation: ``{"step", "loss", "se", "tokens"}`` (``se``: standard error
        over validation documents; missing in runs that predate it)."""
        evals = [
            r
            for r in self.records
            if r.get("type", "eval") == "eval" and _finite(r.get("eval_loss"))
        ]
        if not evals:
            return None
        last = evals[-1]
        return {
            "step": int(last["step"]),
            "loss": float(last["eval_loss"]),
            "se": last.get("eval_loss_se"),
            "tokens": last.get("eval_tokens"),
        }

    def throughput(self) -> dict[str, float | None]:
        """Mean training tokens/s, its last logged value, and peak memory (GiB, max over logs)."""
        speeds = [
            float(r["tokens_per_s"])
            for r in self.records
            if r.get("type", "train") == "train" and _finite(r.get("tokens_per_s"))
        ]
        memory = [
            float(r["peak_memory_gb"])
            for r in self.records
            if r.get("type") in ("train", "final", None) and _finite(r.get("peak_memory_gb"))
        ]
        # The end-of-run summary (type "final") holds the trainer's own mean; use it so the
        # analysis and `maxscore compare` agree, else average the training logs.
        finals = [
            r for r in self.records if r.get("type") == "final" and _finite(r.get("tokens_per_s"))
        ]
        if finals:
            mean: float | None = float(finals[-1]["tokens_per_s"])
        else:
            mean = sum(speeds) / len(speeds) if speeds else None
        return {
            "tokens_per_s": mean,
            "tokens_per_s_last": speeds[-1] if speeds else None,
            "tokens_per_hour": mean * 3600 if mean is not None else None,
            "peak_memory_gb": max(memory) if memory else None,
        }

    # -- routing ----------------------------------------------------------------------------
    def routing_records(self) -> list[dict[str, Any]]:
        return [
            r
            for r in self.records
            if r.get("type", "train") == "train"
            and isinstance(r.get("routing"), dict)
            and r["routing"]
        ]

    def routing_snapshot(self, window: int = 1) -> RoutingSnapshot | None:
        """Routing statistics of the last ``window`` training logs, averaged elementwise.

        Each training log already averages the optimizer steps since the previous log; the
        default (``window=1``) is the end of training, which is what the paper's figures show.
        """
        records = self.routing_records()
        if not records:
            return None
        chosen = records[-max(window, 1) :]
        first = chosen[-1]["routing"]
        layers = [
            int(i) for i in first.get("moe_layers", range(len(first.get("load_imbalance", []))))
        ]
        stats: dict[str, list[Any]] = {}
        for key in LAYER_STAT_KEYS:
            values = [r["routing"][key] for r in chosen if key in r["routing"]]
            if values:
                stats[key] = _mean_nested(values)
        steps = [int(r["step"]) for r in chosen]
        span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
        return RoutingSnapshot(layers, stats, f"metrics.jsonl {span}", steps[-1])

    def routing_over_steps(self, key: str) -> list[tuple[int, list[Any]]]:
        """``(step, per-layer values)`` of one routing statistic over training."""
        return [
            (int(r["step"]), r["routing"][key])
            for r in self.routing_records()
            if key in r["routing"]
        ]


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _mean_nested(values: list[Any]) -> Any:
    """Elementwise mean of equally shaped nested lists of numbers."""
    if isinstance(values[0], list):
        return [_mean_nested([v[i] for v in values]) for i in range(len(values[0]))]
    return sum(float(v) for v in values) / len(values)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``; a line cut short by a crash is skipped with a warning."""
    records: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                logger.warning("%s:%d: not JSON, skipped", path, number)
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def load_run(path: str | Path, name: str | None = None) -> RunData:
    """Read a run directory.

    Raises:
        RunError: the path does not exist or has neither ``metrics.jsonl`` nor ``config.json``.
    """
    run_dir = Path(path).expanduser()
    if not run_dir.is_dir():
        raise RunError(f"run directory not found: {run_dir}")
    metrics = run_dir / METRICS_FILE
    config_path = run_dir / CONFIG_FILE
    if not metrics.is_file() and not config_path.is_file():
        raise RunError(
            f"{run_dir} is not a run directory (no {METRICS_FILE} or {CONFIG_FILE}); "
            "give the output directory of `maxscore train`"
        )
    config: dict[str, Any] = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except json.JSONDecodeError as err:
            raise RunError(f"{config_path} is not valid JSON: {err}") from err
    records = read_metrics(metrics) if metrics.is_file() else []
    run = RunData(run_dir, name or "", config, records)
    run.name = name or run.router or run_dir.resolve().name
    return run


def unique_names(runs: list[RunData]) -> None:
    """Make run labels unique (two runs of one router get their directory name appended)."""
    counts: dict[str, int] = {}
    for run in runs:
        counts[run.name] = counts.get(run.name, 0) + 1
    for run in runs:
        if counts[run.name] > 1:
            run.name = f"{run.name} ({run.path.resolve().name})"
