"""``maxscore analyze``: the paper's routing analyses for one or more runs, as PNGs + markdown.

:func:`analyze` reads each run directory (and optionally runs its checkpoint on validation
data), draws the figures of :mod:`maxscore.analysis.plots` with all runs side by side, and
writes into the output directory:

* ``dropped_by_rank.png``, ``rerouted_by_rank.png``, ``mean_affinity_by_rank.png``, ``expert_load_layer<N>.png``,
  ``loss_curves.png``, ``throughput_memory.png``;
* ``analysis.json``: every plotted number (per run: routing snapshot, sorted expert loads with
  mean / spread, loss curves, throughput and memory);
* ``analysis.md``: the report embedding the figures, with the numbers as tables.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from maxscore.analysis import plots
from maxscore.analysis.markdown import ANALYSIS_JSON, ANALYSIS_MD, analysis_markdown
from maxscore.analysis.runs import (
    RoutingSnapshot,
    RunData,
    RunError,
    load_run,
    unique_names,
)
from maxscore.checkpoints.layout import CONFIG_FILE, METRICS_FILE
from maxscore.evaluation.runner import EvaluationError, resolve_model_path
from maxscore.write_errors import reported_write, write_text_atomically

logger = logging.getLogger(__name__)


@dataclass
class AnalysisResult:
    """What :func:`analyze` produced."""

    output_dir: Path
    figures: dict[str, Path] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def markdown_path(self) -> Path:
        return self.output_dir / ANALYSIS_MD

    @property
    def json_path(self) -> Path:
        return self.output_dir / ANALYSIS_JSON


def default_layer(snapshots: dict[str, RoutingSnapshot]) -> int | None:
    """The middle MoE layer common to all runs (the paper shows one layer)."""
    common: list[int] | None = None
    for snap in snapshots.values():
        common = snap.layers if common is None else [x for x in common if x in snap.layers]
    if not common:
        return None
    return common[len(common) // 2]


def _snapshot(
    run: RunData,
    checkpoint: str | None,
    window: int,
    routing: str,
    max_blocks: int,
    device: str | None,
) -> RoutingSnapshot | None:
    if checkpoint is None:
        return run.routing_snapshot(window)
    # torch loads only when a checkpoint is analysed (a run's own metrics need none of it).
    from maxscore.analysis.checkpoint_stats import checkpoint_snapshot

    target = run.path if checkpoint == "latest" else Path(checkpoint)
    try:
        resolved = resolve_model_path(target)
    except EvaluationError as err:
        raise RunError(str(err)) from err
    return checkpoint_snapshot(
        run, resolved.checkpoint, max_blocks=max_blocks, routing=routing, device=device
    )


def expand_run_dirs(paths: list[str | Path]) -> list[str | Path]:
    """Replace a ``maxscore compare`` output directory by the run directories inside it."""
    out: list[str | Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        is_run = (path / METRICS_FILE).is_file() or (path / CONFIG_FILE).is_file()
        children = sorted(p for p in path.glob(f"*/{METRICS_FILE}")) if path.is_dir() else []
        if not is_run and children:
            out.extend(child.parent for child in children)
        else:
            out.append(raw)
    return out


def analyze(
    run_dirs: list[str | Path],
    output_dir: str | Path,
    *,
    layer: int | None = None,
    names: list[str] | None = None,
    checkpoint: str | None = None,
    window: int = 1,
    routing: str = "train",
    max_blocks: int = 8,
    device: str | None = None,
) -> AnalysisResult:
    """Analyse runs side by side and write figures, ``analysis.json`` and ``analysis.md``.

    Args:
        run_dirs: run directories (outputs of ``maxscore train``); a ``maxscore compare``
            output directory stands for the runs inside it.
        output_dir: where to write.
        layer: decoder layer of the expert-load figure (default: the middle MoE layer).
        names: labels, one per run (default: the router preset, else the directory name).
        checkpoint: ``None`` (routing statistics from ``metrics.jsonl``), ``"latest"`` (run each
            run's final / latest checkpoint on its validation data) or a checkpoint path
            (one run only).
        window: average the routing statistics of the last ``window`` training logs.
        routing: routing used when running checkpoints (``train`` or ``causal``).
        max_blocks: validation blocks per checkpoint.
        device: torch device for checkpoints.

    Raises:
        RunError: a bad run directory, a layer that is not an MoE layer, or nothing to analyse.
        FileWriteError: an output file could not be written (a full disk, a read-only
            folder); the files written before stay whole.
    """
    run_dirs = expand_run_dirs(run_dirs)
    if not run_dirs:
        raise RunError("no run directories given")
    if names is not None and len(names) != len(run_dirs):
        raise RunError(f"{len(names)} names for {len(run_dirs)} runs")
    if checkpoint not in (None, "latest") and len(run_dirs) != 1:
        raise RunError(
            "--checkpoint PATH works with one run; use --checkpoint alone for the latest of each"
        )
    runs = [load_run(p, names[i] if names else None) for i, p in enumerate(run_dirs)]
    unique_names(runs)
    out = Path(output_dir)
    with reported_write("the output folder", out):
        out.mkdir(parents=True, exist_ok=True)
    result = AnalysisResult(out)

    snapshots: dict[str, RoutingSnapshot] = {}
    for run in runs:
        snap = _snapshot(run, checkpoint, window, routing, max_blocks, device)
        if snap is None:
            result.notes.append(
                f"{run.name}: no routing statistics in metrics.jsonl (dense model?)"
            )
        else:
            snapshots[run.name] = snap

    data: dict[str, Any] = {"runs": {}}
    for run in runs:
        entry: dict[str, Any] = {
            "path": str(run.path),
            "router": run.router,
            "train_loss": run.train_loss(),
            "eval_loss": run.eval_loss(),
            "validation": run.final_validation(),
            "throughput": run.throughput(),
        }
        if run.name in snapshots:
            entry["routing"] = snapshots[run.name].to_dict()
        data["runs"][run.name] = entry

    figures, notes = draw_figures(data, out, layer)
    result.figures.update(figures)
    result.notes.extend(notes)

    data["figures"] = {k: v.name for k, v in result.figures.items()}
    data["notes"] = result.notes
    data["settings"] = {
        "checkpoint": checkpoint,
        "window": window,
        "routing": routing if checkpoint else "training (as logged)",
    }
    result.data = data
    # Each file whole or not at all: a full disk leaves an earlier analysis as it was.
    write_text_atomically(result.json_path, json.dumps(data, indent=2) + "\n", "the analysis")
    write_text_atomically(result.markdown_path, analysis_markdown(data), "the analysis page")
    return result


def draw_figures(
    data: dict[str, Any], output_dir: Path, layer: int | None = None
) -> tuple[dict[str, Path], list[str]]:
    """Draw the figures of an analysis from its numbers alone (``data["runs"]`` as in
    ``analysis.json``), so saved numbers redraw the same figures without the run directories.

    Sets ``data["expert_load"]`` when there are expert loads. Returns the figures by key and
    notes on what could not be drawn.
    """
    out = Path(output_dir)
    figures: dict[str, Path] = {}
    notes: list[str] = []
    runs = data["runs"]
    snapshots = {
        name: RoutingSnapshot(**entry["routing"])
        for name, entry in runs.items()
        if entry.get("routing") is not None
    }
    if snapshots:
        by_rank_figures = (("dropped", plots.dropped_figure), ("rerouted", plots.rerouted_figure))
        for name, figure in by_rank_figures:
            if any(s.stats.get(f"{name}_by_rank") for s in snapshots.values()):
                path = out / f"{name}_by_rank.png"
                figures[name] = plots.save_figure(figure(snapshots), path)
        if any(s.stats.get("mean_affinity_by_rank") for s in snapshots.values()):
            fig = plots.mean_affinity_figure(snapshots)
            figures["mean_affinity"] = plots.save_figure(fig, out / "mean_affinity_by_rank.png")
        chosen = layer if layer is not None else default_layer(snapshots)
        if chosen is None:
            raise RunError("the runs share no MoE layer; pass --layer")
        for snap in snapshots.values():
            snap.layer_position(chosen)  # raises a clear error for a non-MoE layer
        loads = {
            name: plots.expert_load_summary(s.stats["load_over_capacity"][s.layer_position(chosen)])
            for name, s in snapshots.items()
            if s.stats.get("load_over_capacity")
        }
        if loads:
            fig = plots.expert_load_figure(snapshots, chosen)
            figures["expert_load"] = plots.save_figure(fig, out / f"expert_load_layer{chosen}.png")
            data["expert_load"] = {"layer": chosen, "runs": loads}

    train = {name: entry["train_loss"] for name, entry in runs.items()}
    validation = {name: entry["eval_loss"] for name, entry in runs.items()}
    if any(train.values()) or any(validation.values()):
        fig = plots.loss_curves_figure(train, validation)
        figures["loss_curves"] = plots.save_figure(fig, out / "loss_curves.png")
    else:
        notes.append("no training or validation losses in any metrics.jsonl")
    throughput = {name: entry["throughput"] for name, entry in runs.items()}
    if any(
        t["tokens_per_s"] is not None or t["peak_memory_gb"] is not None
        for t in throughput.values()
    ):
        fig = plots.throughput_figure(throughput)
        figures["throughput"] = plots.save_figure(fig, out / "throughput_memory.png")
    return figures, notes
