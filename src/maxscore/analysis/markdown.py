"""The ``analysis.md`` page of ``maxscore analyze`` and the names of its output files.

:mod:`~maxscore.analysis.analyze` writes the page; :mod:`~maxscore.analysis.report` finds
analyze outputs by these file names and embeds the page in its combined report.
"""

from __future__ import annotations

from typing import Any

from maxscore.analysis.plots import rank_name

ANALYSIS_JSON = "analysis.json"
ANALYSIS_MD = "analysis.md"


def _fmt(value: Any, spec: str = ".4f") -> str:
    if value is None:
        return "–"
    if isinstance(value, float | int):
        return format(value, spec)
    return str(value)


def _by_rank_table(runs: dict[str, Any], key: str, percent: bool) -> list[str]:
    """``| Run | Choice | L0 | L1 | ... | Mean |`` from each run's routing snapshot."""
    layer_sets = [
        r["routing"]["layers"]
        for r in runs.values()
        if key in r.get("routing", {}).get("stats", {})
    ]
    if not layer_sets:
        return []
    layers = max(layer_sets, key=len)
    lines = [
        "| Run | Choice | " + " | ".join(f"L{i}" for i in layers) + " | Mean |",
        "|---|---|" + "---:|" * (len(layers) + 1),
    ]
    for name, run in runs.items():
        values = run.get("routing", {}).get("stats", {}).get(key)
        if not values:
            continue
        for rank in range(len(values[0])):
            row = [float(layer[rank]) for layer in values]
            scale = 100.0 if percent else 1.0
            cells = [f"{v * scale:.2f}" if percent else f"{v:.4f}" for v in row]
            mean = sum(row) / len(row) * scale
            mean_text = f"{mean:.2f}" if percent else f"{mean:.4f}"
            lines.append(
                f"| {name} | {rank_name(rank)} | " + " | ".join(cells) + f" | {mean_text} |"
            )
    return lines


#: The by-rank routing sections of ``analysis.md``: (figure key, heading, what the share means).
_BY_RANK_SECTIONS: tuple[tuple[str, str, str], ...] = (
    (
        "dropped",
        "Dropped choices by rank",
        "Share of tokens whose r-th choice was not given and whose slot stayed empty (the token "
        "is processed by fewer than k experts; the paper's Fig. 2a shows one minus this)",
    ),
    (
        "rerouted",
        "Rerouted choices by rank",
        "Share of tokens whose r-th choice was not given but whose slot another expert filled",
    ),
)


def analysis_markdown(data: dict[str, Any]) -> str:
    """The ``analysis.md`` page for the ``analysis.json`` payload ``data``.

    Figures side by side for all runs, the numbers as tables, then the notes.
    """
    runs: dict[str, Any] = data["runs"]
    figures = data.get("figures", {})
    lines = ["# Routing analysis", ""]
    lines += [
        "| Run | Router | Routing statistics from | Final train loss | Final val loss ± SE |",
        "|---|---|---|---:|---:|",
    ]
    for name, run in runs.items():
        train, val = run["train_loss"], run["eval_loss"]
        loss = _fmt(val[-1][1] if val else None)
        se = (run.get("validation") or {}).get("se")
        if val and se is not None:
            loss += f" ± {se:.4f}"
        lines.append(
            f"| {name} | {run.get('router') or '–'} | {run.get('routing', {}).get('source', '–')} | "
            f"{_fmt(train[-1][1] if train else None)} | {loss} |"
        )
    lines += [
        "",
        "SE: standard error of the validation loss over validation documents (the split is a "
        "random sample of documents).",
        "",
    ]
    routing_mode = data.get("settings", {}).get("routing", "train")
    for name, title, meaning in _BY_RANK_SECTIONS:
        if name in figures:
            lines += [
                f"## {title}",
                "",
                f"{meaning}, per layer (percent; {routing_mode} routing).",
                "",
                f"![{name} by choice rank]({figures[name]})",
                "",
                *_by_rank_table(runs, f"{name}_by_rank", percent=True),
                "",
            ]
    if "mean_affinity" in figures:
        lines += [
            "## Mean affinity of the 1st and 2nd choice",
            "",
            f"![mean affinity by choice rank]({figures['mean_affinity']})",
            "",
            *_by_rank_table(runs, "mean_affinity_by_rank", percent=False),
            "",
        ]
    if "expert_load" in figures:
        load = data["expert_load"]
        lines += [
            f"## Expert load over capacity (layer {load['layer']})",
            "",
            "Tokens per expert divided by its capacity, experts sorted by load; dropless routers "
            "use the reference capacity k·n/e.",
            "",
            f"![expert load]({figures['expert_load']})",
            "",
            "| Run | Mean | Min | Max | Spread (max-min) | Std |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, s in load["runs"].items():
            lines.append(
                f"| {name} | {s['mean']:.4f} | {s['min']:.4f} | {s['max']:.4f} | "
                f"{s['max'] - s['min']:.4f} | {s['std']:.4f} |"
            )
        lines.append("")
    if "loss_curves" in figures:
        lines += ["## Loss curves", "", f"![loss curves]({figures['loss_curves']})", ""]
    if "throughput" in figures:
        lines += [
            "## Throughput and memory",
            "",
            f"![throughput and memory]({figures['throughput']})",
            "",
            "| Run | Tokens/s (mean) | Tokens/hour | Peak memory (GiB) |",
            "|---|---:|---:|---:|",
        ]
        for name, run in runs.items():
            t = run["throughput"]
            per_hour = t.get("tokens_per_hour")
            lines.append(
                f"| {name} | {_fmt(t.get('tokens_per_s'), ',.0f')} | "
                f"{_fmt(per_hour / 1e9 if per_hour is not None else None, '.4f')}B | "
                f"{_fmt(t.get('peak_memory_gb'), '.2f')} |"
            )
        lines.append("")
    notes = data.get("notes", [])
    if notes:
        lines += ["## Notes", "", *(f"- {note}" for note in notes), ""]
    return "\n".join(lines)
