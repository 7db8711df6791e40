"""The paper's analysis figures, one function per figure, several routers side by side.

Every ``*_figure`` function returns a matplotlib ``Figure`` (Agg backend, nothing shown) whose
artists carry exactly the numbers given to it: bar containers and lines are labelled with the
run name, so tests (and curious users) can read the plotted values back. :func:`save_figure`
writes a PNG (whole or not at all) and closes the figure.

Figures:
    * dropped and rerouted share by choice rank per layer (paper Fig. 2a shows the complement of
      the dropped share);
    * mean affinity of the r-th choice per layer (Fig. 2b);
    * sorted per-expert load / capacity of one layer, with mean and spread (Fig. 8);
    * training and validation loss curves (whole run and a zoom on its second half), and loss
      differences to a reference router with a band over seeds;
    * training throughput (tokens/s) and peak memory per run (paper Table 9).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: What to do when matplotlib is missing (the figures are the ``plots`` extra).
PLOTS_MISSING = (
    "the figures need matplotlib, which is not installed: pip install 'maxscore[plots]' "
    "(or pip install matplotlib)"
)

try:
    import matplotlib
except ImportError as err:  # an optional dependency: the `plots` extra
    raise ImportError(PLOTS_MISSING, name="matplotlib") from err

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402 (after the matplotlib check)
from matplotlib.figure import Figure  # noqa: E402

from maxscore.analysis.runs import RoutingSnapshot  # noqa: E402 (after the matplotlib check)
from maxscore.write_errors import replaced_file, reported_write  # noqa: E402

RANK_NAMES = ("1st", "2nd", "3rd")


def rank_name(rank: int) -> str:
    """``0 -> "1st"``, ``1 -> "2nd"``, ... (0-based rank in, ordinal out)."""
    return RANK_NAMES[rank] if rank < len(RANK_NAMES) else f"{rank + 1}th"


def save_figure(fig: Figure, path: Path, dpi: int = 110) -> Path:
    """Write ``fig`` as a PNG and close it. A full disk or a read-only folder is a
    :class:`~maxscore.write_errors.FileWriteError` naming the file, and an earlier PNG at
    ``path`` stays as it was (the new one is renamed over it only when complete)."""
    try:
        with reported_write("the figure", path, replaced=True):
            path.parent.mkdir(parents=True, exist_ok=True)
            with replaced_file(path) as tmp:
                fig.savefig(tmp, dpi=dpi, format="png")
    finally:
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


def mean_curve(curves: Sequence[Sequence[tuple[int, float]]]) -> list[tuple[int, float]]:
    """The mean over runs (seeds) at the steps every run logged."""
    if not curves:
        return []
    maps = [dict(c) for c in curves]
    steps = sorted(set.intersection(*(set(m) for m in maps)))
    return [(s, sum(m[s] for m in maps) / len(maps)) for s in steps]


def _zoom_limits(
    series: Sequence[Sequence[tuple[int, float]]], from_fraction: float
) -> tuple[float, float] | None:
    """y-limits covering the points after ``from_fraction`` of the last step (with a margin).

    The first steps of a run sit at losses of 7-10 and differences of several tenths; scaling
    the axis to them flattens the 0.01-0.1 differences of the end of training into one line.
    """
    last = max((step for curve in series for step, _ in curve), default=None)
    if last is None:
        return None
    values = [v for curve in series for step, v in curve if step >= from_fraction * last]
    if not values:
        return None
    low, high = min(values), max(values)
    pad = max(high - low, 1e-3) * 0.1
    return low - pad, high + pad


def loss_curves_figure(
    train: Mapping[str, Sequence[tuple[int, float]]],
    validation: Mapping[str, Sequence[tuple[int, float]]],
) -> Figure:
    """Training loss (solid) and validation loss (dashed, markers) against optimizer step.

    Two panels: the whole run, and its second half with the y-axis fitted to it (where the
    routers' differences of hundredths of a nat are visible).
    """
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    names = list(dict.fromkeys([*train, *validation]))
    for ax in axes:
        for i, name in enumerate(names):
            if train.get(name):
                steps, losses = zip(*train[name], strict=True)
                line = ax.plot(steps, losses, "-", color=f"C{i}", label=f"{name} train")[0]
                line.set_gid(f"{name}/train")
            if validation.get(name):
                steps, losses = zip(*validation[name], strict=True)
                line = ax.plot(
                    steps, losses, "o--", color=f"C{i}", markersize=4, label=f"{name} val"
                )[0]
                line.set_gid(f"{name}/validation")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
    axes[0].set_title("Training and validation loss")
    axes[1].set_title("Second half (zoomed)")
    limits = _zoom_limits([*train.values(), *validation.values()], 0.5)
    if limits is not None:
        last = max(step for curve in [*train.values(), *validation.values()] for step, _ in curve)
        axes[1].set_xlim(0.5 * last, last * 1.02)
        axes[1].set_ylim(*limits)
    if names:
        axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def _differences(
    curves: Mapping[int, Sequence[tuple[int, float]]],
    reference: Mapping[int, Sequence[tuple[int, float]]],
) -> list[tuple[int, float, float]]:
    """``(step, mean, std)`` over seeds of ``curve - reference`` at steps both logged."""
    per_step: dict[int, list[float]] = {}
    for seed, curve in curves.items():
        ref = dict(reference.get(seed, ()))
        for step, value in curve:
            if step in ref:
                per_step.setdefault(step, []).append(value - ref[step])
    out = []
    for step in sorted(per_step):
        values = per_step[step]
        mean = sum(values) / len(values)
        var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
        out.append((step, mean, var**0.5))
    return out


def loss_difference_figure(
    curves: Mapping[str, Mapping[int, Mapping[str, Sequence[tuple[int, float]]]]],
    reference: str,
) -> Figure:
    """Loss minus ``reference``'s at each step, per router: mean over seeds, band ± one std.

    ``curves[router][seed]`` holds ``"validation"`` and ``"train"`` ``(step, loss)`` lists; a
    router is compared with the reference run of the same seed. Left: validation loss; right:
    training loss. The y-axis is fitted to the second half of the run (0.01-0.1 differences).
    """
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, kind, title in (
        (axes[0], "validation", "Validation loss"),
        (axes[1], "train", "Training loss"),
    ):
        series = []
        ref = {seed: c[kind] for seed, c in curves[reference].items()}
        for i, (name, by_seed) in enumerate(curves.items()):
            if name == reference:
                continue
            diff = _differences({seed: c[kind] for seed, c in by_seed.items()}, ref)
            if not diff:
                continue
            steps, mean, std = zip(*diff, strict=True)
            style = "o-" if kind == "validation" else "-"
            line = ax.plot(steps, mean, style, color=f"C{i}", markersize=4, label=name)[0]
            line.set_gid(f"{name}/{kind}")
            if len(by_seed) > 1:
                low = [m - s for m, s in zip(mean, std, strict=True)]
                high = [m + s for m, s in zip(mean, std, strict=True)]
                ax.fill_between(steps, low, high, color=f"C{i}", alpha=0.2, linewidth=0)
                series += [list(zip(steps, low, strict=True)), list(zip(steps, high, strict=True))]
            series.append(list(zip(steps, mean, strict=True)))
        ax.axhline(0.0, color="gray", linewidth=1)
        limits = _zoom_limits(series, 0.5)
        if limits is not None:
            ax.set_ylim(min(limits[0], -0.005), max(limits[1], 0.005))
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"loss − {reference} (nats)")
        ax.set_title(f"{title} minus {reference} (band: ± 1 std over seeds)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
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
