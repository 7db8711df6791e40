"""``maxscore compare``: several routers, same data, seed and budget; a table and a loss plot.

Each router trains into ``<output>/<router>/`` (a normal run directory, so ``maxscore eval`` and
``maxscore analyze`` work on it). The comparison itself is ``comparison.md``, ``comparison.csv``
and ``loss_curves.png`` (training loss per step, validation loss as markers) in ``<output>``.
"""

from __future__ import annotations

import csv
import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from maxscore.training.config import ConfigError, TrainConfig

COLUMNS: list[tuple[str, str, str]] = [
    # (key, markdown header, format)
    ("router", "router", "{}"),
    ("eval_loss", "val loss", "{:.4f}"),
    ("perplexity", "val ppl", "{:.2f}"),
    ("train_loss", "train loss", "{:.4f}"),
    ("dropped_rank1", "dropped 1st", "{:.2%}"),
    ("dropped_rank2", "dropped 2nd", "{:.2%}"),
    ("rerouted_rank1", "rerouted 1st", "{:.2%}"),
    ("rerouted_rank2", "rerouted 2nd", "{:.2%}"),
    ("load_imbalance", "imbalance", "{:.3f}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("peak_memory_gb", "peak mem GiB", "{:.2f}"),
    ("runtime_s", "time s", "{:.0f}"),
    ("steps", "steps", "{}"),
]


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl``."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def compare(
    routers: list[str],
    config: TrainConfig,
    output_dir: str | Path,
    overwrite: bool = False,
) -> list[dict[str, Any]]:
    """Train ``config`` once per router and write the comparison files; return the rows.

    All routers are validated (and the output folder checked) before the first one trains.
    """
    from maxscore.routing.presets import ROUTER_PRESETS
    from maxscore.training.trainer import prepare, train

    if not routers:
        raise ConfigError("--routers is empty; give comma-separated router presets")
    unknown = [r for r in routers if r not in ROUTER_PRESETS]
    if unknown:
        raise ConfigError(
            f"unknown router preset(s) {unknown}; available: {sorted(ROUTER_PRESETS)}"
        )
    if len(set(routers)) != len(routers):
        raise ConfigError(f"--routers lists a router twice: {routers}")
    out = Path(output_dir)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ConfigError(
                f"output dir {str(out)!r} is not empty; pass --overwrite or choose another "
                "--output-dir"
            )
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)

    configs = [
        replace(config, router=r, output_dir=str(out / r), resume=False, overwrite=False)
        for r in routers
    ]
    prepared = [prepare(c) for c in configs]  # every bad input fails before any training
    rows = []
    for cfg, run in zip(configs, prepared):
        print(f"maxscore compare: training {cfg.router} -> {run.run_dir}", flush=True)
        result = train(cfg, prepared=run)
        row: dict[str, Any] = {
            "router": cfg.router,
            "eval_loss": result.eval_loss,
            "perplexity": result.perplexity,
            "train_loss": result.train_loss,
            "tokens_per_s": result.tokens_per_s,
            "peak_memory_gb": result.peak_memory_gb,
            "runtime_s": result.runtime_s,
            "steps": result.steps,
            "load_imbalance": result.routing.get("load_imbalance"),
            "run_dir": str(run.run_dir),
        }
        for name in ("dropped", "rerouted"):
            for i, rate in enumerate(result.routing.get(f"{name}_by_rank", [])):
                row[f"{name}_rank{i + 1}"] = rate
        rows.append(row)
    write_comparison(rows, out, config)
    return rows


def format_markdown(rows: list[dict[str, Any]]) -> str:
    """The comparison as a markdown table (missing values shown as '-')."""
    header = "| " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    sep = "|" + "|".join("---" for _ in COLUMNS) + "|"
    lines = [header, sep]
    for row in rows:
        cells = []
        for key, _, fmt in COLUMNS:
            value = row.get(key)
            cells.append("-" if value is None else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_comparison(rows: list[dict[str, Any]], out: Path, config: TrainConfig) -> None:
    """comparison.md, comparison.csv and loss_curves.png in ``out``."""
    settings = (
        f"model `{config.model}`, data `{config.dataset}`, seq_len {config.seq_len}, batch "
        f"{config.batch_size} x {config.grad_accum}, {config.total_steps()} steps, lr {config.lr}, "
        f"seed {config.seed}"
    )
    md = [
        "# Router comparison",
        "",
        f"Same data, seed and budget for every router: {settings}.",
        "Dropped (slot left empty) and rerouted (slot given to another expert) shares of each "
        "choice rank, and load imbalance: mean over MoE layers of the last logging interval "
        "(training routing); validation loss uses the evaluation routing (causal by default).",
        "",
        format_markdown(rows),
        "",
        "![loss curves](loss_curves.png)",
        "",
    ]
    (out / "comparison.md").write_text("\n".join(md))
    keys = [k for k, _, _ in COLUMNS] + ["run_dir"]
    with (out / "comparison.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k) for k in keys})
    plot_loss_curves({r["router"]: Path(r["run_dir"]) for r in rows}, out / "loss_curves.png")


def plot_loss_curves(runs: dict[str, Path], path: Path) -> None:
    """Training loss (lines) and validation loss (markers) per step for each run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, run_dir) in enumerate(runs.items()):
        color = f"C{i}"
        records = read_metrics(run_dir)
        train = [
            (r["step"], r["loss"]) for r in records if r.get("type") == "train" and "loss" in r
        ]
        evals = [
            (r["step"], r["eval_loss"])
            for r in records
            if r.get("type") == "eval" and "eval_loss" in r
        ]
        if train:
            ax.plot(*zip(*train), color=color, label=f"{name} train")
        if evals:
            ax.plot(*zip(*evals), "o--", color=color, label=f"{name} val", markersize=4)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title("Training and validation loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
