"""The paper's analysis figures, one function per figure, several routers side by side.

Every ``*_figure`` function returns a matplotlib ``Figure`` (Agg backend, nothing shown) whose
artists carry exactly the numbers given to it: bar containers and lines are labelled with the
run name, so tests (and curious users) can read the plotted values back. :func:`save_figure`
writes a PNG and closes the figure.

Figures:
    * dropped and rerouted share by choice rank per layer (paper Fig. 2a shows the complement of
      the dropped share);
    * mean affinity of the r-th choice per layer (Fig. 2b);
    * sorted per-expert load / capacity of one layer, with mean and spread (Fig. 8);
    * training and validation loss curves;
    * training throughput (tokens/s) and peak memory per run (paper Table 9).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from maxscore.analysis.runs import RoutingSnapshot

RANK_NAMES = ("1st", "2nd", "3rd")


def rank_name(rank: int) -> str:
    """``0 -> "1st"``, ``1 -> "2nd"``, ... (0-based rank in, ordinal out)."""
    return RANK_NAMES[rank] if rank < len(RANK_NAMES) else f"{rank + 1}th"


def save_figure(fig: Figure, path: Path, dpi: int = 110) -> Path:
    """Write ``fig`` as a PNG and close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, format="png")
    plt.close(fig)
    return path


def _grouped_bars(ax: Any, groups: Sequence[int], series: Mapping[str, Sequence[float]]) -> None:
    """One bar group per x position (layer), one bar per series (run) inside each group."""
    n = max(len(series), 1)
    width = 0.8 / n
    for i, (name, values) in enumerate(series.items()):
        positions = [g - 0.4 + width * (i + 0.5) for g in groups[: len(values)]]
        ax.bar(positions, list(values), width=width, label=name, color=f"C{i}")
    ax.set_xticks(list(groups))


def _max_rank(snapshots: Mapping[str, RoutingSnapshot], key: str) -> int:
    return max((len(s.stats[key][0]) for s in snapshots.values() if s.stats.get(key)), default=0)


def by_rank_figure(
    snapshots: Mapping[str, RoutingSnapshot], key: str, ylabel: str, title: str
) -> Figure:
    """One panel per choice rank; per layer, one bar per run (``key`` is ``[L][k]``)."""
    ranks = _max_rank(snapshots, key)
    if ranks == 0:
        raise ValueError(f"no run has {key!r} statistics")
    fig, axes = plt.subplots(1, ranks, figsize=(4.2 * ranks + 1, 3.6), squeeze=False, sharey=True)
    for rank in range(ranks):
        ax = axes[0][rank]
        layer_ticks: list[int] = []
        series: dict[str, list[float]] = {}
        for name, snap in snapshots.items():
            per_layer = snap.stats.get(key)
            if not per_layer or rank >= len(per_layer[0]):
                continue
            series[name] = [float(layer[rank]) for layer in per_layer]
            if len(snap.layers) > len(layer_ticks):
                layer_ticks = list(snap.layers)
        # Bars sit at positions 0..L-1; tick labels give the decoder-layer index.
        _grouped_bars(ax, list(range(len(layer_ticks))), series)
        ax.set_xticklabels([str(layer) for layer in layer_ticks])
        ax.set_title(f"{rank_name(rank)} choice")
        ax.set_xlabel("layer")
        ax.grid(axis="y", alpha=0.3)
        if rank == 0:
            ax.set_ylabel(ylabel)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def dropped_figure(snapshots: Mapping[str, RoutingSnapshot]) -> Figure:
    """Per-layer share of tokens whose r-th choice was dropped: slot left empty (Fig. 2a)."""
    return by_rank_figure(
        snapshots,
        "dropped_by_rank",
        "share of tokens dropped",
        "Dropped: r-th choice not given, slot left empty",
    )


def rerouted_figure(snapshots: Mapping[str, RoutingSnapshot]) -> Figure:
    """Per-layer share of tokens whose r-th choice was given to another expert instead."""
    return by_rank_figure(
        snapshots,
        "rerouted_by_rank",
        "share of tokens rerouted",
        "Rerouted: r-th choice not given, slot filled by another expert",
    )


def mean_affinity_figure(snapshots: Mapping[str, RoutingSnapshot]) -> Figure:
    """Per-layer mean affinity of each token's r-th highest-affinity expert (Fig. 2b)."""
    return by_rank_figure(
        snapshots, "mean_affinity_by_rank", "mean affinity", "Mean affinity by choice rank"
    )


def expert_load_summary(values: Sequence[float]) -> dict[str, Any]:
    """Sorted (descending) loads with their mean, min, max and standard deviation."""
    ordered = sorted((float(v) for v in values), reverse=True)
    mean = sum(ordered) / len(ordered)
    var = sum((v - mean) ** 2 for v in ordered) / len(ordered)
    return {
        "sorted": ordered,
        "mean": mean,
        "min": ordered[-1],
        "max": ordered[0],
        "std": var**0.5,
    }


def expert_load_figure(snapshots: Mapping[str, RoutingSnapshot], layer: int) -> Figure:
    """Sorted per-expert load / capacity in decoder layer ``layer``, one line per run (Fig. 8).

    The legend gives each run's mean and min-max spread; the dashed line is capacity (1.0).
    For dropless routers the reference capacity ``k·n/e`` is used (as the statistics define).
    """
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, snap) in enumerate(snapshots.items()):
        values = snap.stats.get("load_over_capacity")
        if not values:
            continue
        summary = expert_load_summary(values[snap.layer_position(layer)])
        ranks = list(range(1, len(summary["sorted"]) + 1))
        label = f"{name} (mean {summary['mean']:.4f}, {summary['min']:.2f}–{summary['max']:.2f})"
        line = ax.plot(ranks, summary["sorted"], "o-", color=f"C{i}", markersize=3, label=label)[0]
        line.set_gid(name)  # the plain run name, for reading the data back
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel("expert (sorted by load)")
    ax.set_ylabel("load / capacity")
    ax.set_title(f"Expert load over capacity, layer {layer}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def loss_curves_figure(
    train: Mapping[str, Sequence[tuple[int, float]]],
    validation: Mapping[str, Sequence[tuple[int, float]]],
) -> Figure:
    """Training loss (solid) and validation loss (dashed, markers) against optimizer step."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    names = list(dict.fromkeys([*train, *validation]))
    for i, name in enumerate(names):
        if train.get(name):
            steps, losses = zip(*train[name], strict=True)
            line = ax.plot(steps, losses, "-", color=f"C{i}", label=f"{name} train")[0]
            line.set_gid(f"{name}/train")
        if validation.get(name):
            steps, losses = zip(*validation[name], strict=True)
            line = ax.plot(steps, losses, "o--", color=f"C{i}", markersize=4, label=f"{name} val")[
                0
            ]
            line.set_gid(f"{name}/validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title("Training and validation loss")
    ax.grid(alpha=0.3)
    if names:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def throughput_figure(rows: Mapping[str, Mapping[str, float | None]]) -> Figure:
    """Two panels: mean training tokens/s and peak memory (GiB), one bar per run."""
    fig, (ax_speed, ax_mem) = plt.subplots(1, 2, figsize=(9, 3.8))
    names = list(rows)
    colors = [f"C{i}" for i in range(len(names))]
    speeds = [rows[n].get("tokens_per_s") or 0.0 for n in names]
    memory = [rows[n].get("peak_memory_gb") or 0.0 for n in names]
    ax_speed.bar(names, speeds, color=colors, label="tokens_per_s")
    ax_speed.set_ylabel("tokens / s")
    ax_speed.set_title("Training throughput")
    ax_mem.bar(names, memory, color=colors, label="peak_memory_gb")
    ax_mem.set_ylabel("GiB")
    ax_mem.set_title("Peak memory")
    for ax in (ax_speed, ax_mem):
        ax.grid(axis="y", alpha=0.3)
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    return fig
