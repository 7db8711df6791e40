"""``maxscore compare``: several routers (and seeds), same data and budget; tables and plots.

Each router trains into ``<output>/<router>/`` (with several ``--seeds``:
``<output>/<router>/seed-<s>/``), a normal run directory, so ``maxscore eval`` and
``maxscore analyze`` work on it. The comparison itself, in ``<output>``:

* ``comparison.md``: per router the validation loss (± its standard error over validation
  documents for one seed; mean ± std over seeds for several), its paired difference to the
  first router, dropped / rerouted shares, load imbalance, tokens/s; then one row per run;
* ``comparison.csv`` (one row per run) and ``comparison.json`` (runs and per-router summary);
* ``loss_curves.png``: training and validation loss (mean over seeds), the full run and a zoom
  on its second half, where routers differ by hundredths of a nat;
* ``loss_differences.png``: loss minus the first router's at each step, mean over seeds with a
  band of ± one standard deviation over seeds (:mod:`maxscore.training.seed_stats`).
"""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from maxscore.training.config import ConfigError, TrainConfig
from maxscore.training.seed_stats import add_paired_differences, summarize_by_router

#: Per-run columns: (key, markdown header, format).
RUN_COLUMNS: list[tuple[str, str, str]] = [
    ("router", "router", "{}"),
    ("seed", "seed", "{}"),
    ("eval_loss", "val loss", "{:.4f}"),
    ("eval_loss_se", "± SE", "{:.4f}"),
    ("delta", "Δ vs first", "{:+.4f}"),
    ("delta_se", "± paired SE", "{:.4f}"),
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


def compare(
    routers: list[str],
    config: TrainConfig,
    output_dir: str | Path,
    overwrite: bool = False,
    seeds: list[int] | None = None,
) -> list[dict[str, Any]]:
    """Train ``config`` once per router and seed and write the comparison files; return the rows.

    ``seeds`` defaults to ``[config.seed]``. All runs are validated (and the output folder
    checked) before the first one trains. Returns one row per run, in router-then-seed order.
    """
    from maxscore.routing.presets import ROUTER_PRESETS
    from maxscore.training.distributed import is_main_process
    from maxscore.training.run import prepare, train
    from maxscore.training.run_dir import RunDirectory, RunDirPlan

    seeds = list(seeds) if seeds else [config.seed]
    if not routers:
        raise ConfigError("--routers is empty; give comma-separated router presets")
    from maxscore.models.convert import NATIVE_ROUTER
    from maxscore.training.pretrained import is_pretrained_model

    # A converted checkpoint may also be compared with its own family's routing.
    native_ok = is_pretrained_model(config.model)
    unknown = [
        r for r in routers if r not in ROUTER_PRESETS and not (native_ok and r == NATIVE_ROUTER)
    ]
    if unknown:
        raise ConfigError(
            f"unknown router preset(s) {unknown}; available: {sorted(ROUTER_PRESETS)}"
        )
    if len(set(routers)) != len(routers):
        raise ConfigError(f"--routers lists a router twice: {routers}")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds lists a seed twice: {seeds}")
    out = Path(output_dir)
    # Under torchrun process 0 alone owns the output folder (the others may look at it after
    # process 0 has started filling it); a refusal there ends the launch.
    main = is_main_process()
    replaces = main and out.exists() and any(out.iterdir())
    if replaces and not overwrite:
        raise ConfigError(
            f"output dir {str(out)!r} is not empty; pass --overwrite or choose another --output-dir"
        )

    def run_dir(router: str, seed: int) -> Path:
        return out / router if len(seeds) == 1 else out / router / f"seed-{seed}"

    configs = [
        replace(
            config,
            router=r,
            seed=s,
            output_dir=str(run_dir(r, s)),
            resume=False,
            overwrite=replaces,
        )
        for r in routers
        for s in seeds
    ]
    prepared = [prepare(c) for c in configs]  # every bad input fails before any training
    # --overwrite: the previous comparison stays (aside) until the first router has trained.
    directory = RunDirectory(RunDirPlan(out, replaces=replaces))
    if main:
        directory.open()
    rows = []
    for index, (cfg, run) in enumerate(zip(configs, prepared)):
        if main:
            print(
                f"maxscore compare: training {cfg.router} seed {cfg.seed} -> {run.run_dir}",
                flush=True,
            )
        try:
            result = train(cfg, prepared=run)
        except BaseException:
            if main:
                directory.close(failed=index == 0)
            raise
        if main:
            directory.checkpoint_written()
        row: dict[str, Any] = {
            "router": cfg.router,
            "seed": cfg.seed,
            "eval_loss": result.eval_loss,
            "eval_loss_se": result.eval_loss_se,
            "eval_tokens": result.eval_tokens,
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
    add_paired_differences(rows)
    if main:
        write_comparison(rows, out, config, seeds)
    return rows


def _cells(row: dict[str, Any], columns: list[tuple[str, str, str]]) -> str:
    cells = []
    for key, _, fmt in columns:
        value = row.get(key)
        cells.append("-" if value is None else fmt.format(value))
    return "| " + " | ".join(cells) + " |"


def format_markdown(rows: list[dict[str, Any]]) -> str:
    """The per-run table (missing values shown as '-')."""
    header = "| " + " | ".join(h for _, h, _ in RUN_COLUMNS) + " |"
    sep = "|" + "|".join("---" for _ in RUN_COLUMNS) + "|"
    return "\n".join([header, sep, *(_cells(row, RUN_COLUMNS) for row in rows)])


def _pm(mean: float | None, spread: float | None, fmt: str = "{:.4f}") -> str:
    if mean is None:
        return "-"
    return fmt.format(mean) + ("" if spread is None else f" ± {spread:.4f}")


def format_summary_markdown(summary: list[dict[str, Any]], reference: str) -> str:
    """The per-router table: loss and its difference to ``reference`` with their errors."""
    several = any(len(s["seeds"]) > 1 for s in summary)
    loss_head = "val loss (mean ± std over seeds)" if several else "val loss ± SE"
    delta_head = f"Δ vs {reference} (" + ("mean ± std over seeds)" if several else "± paired SE)")
    lines = [
        f"| router | seeds | {loss_head} | mean SE | {delta_head} | dropped 1st / 2nd | "
        "rerouted 1st / 2nd | imbalance | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        spread = s["eval_loss_std"] if several else s.get("eval_loss_se")
        delta_spread = s["delta_std"] if several else s.get("delta_se")
        rates = {
            name: " / ".join(
                "-" if s.get(f"{name}_rank{r}") is None else f"{s[f'{name}_rank{r}']:.1%}"
                for r in (1, 2)
            )
            for name in ("dropped", "rerouted")
        }
        lines.append(
            f"| {s['router']} | {', '.join(str(x) for x in s['seeds'])} | "
            f"{_pm(s['eval_loss'], spread)} | {_pm(s.get('eval_loss_se'), None)} | "
            f"{_pm(s['delta'], delta_spread, '{:+.4f}')} | {rates['dropped']} | "
            f"{rates['rerouted']} | {_pm(s.get('load_imbalance'), None, '{:.3f}')} | "
            f"{_pm(s.get('tokens_per_s'), None, '{:,.0f}')} |"
        )
    return "\n".join(lines)


def write_comparison(
    rows: list[dict[str, Any]], out: Path, config: TrainConfig, seeds: list[int] | None = None
) -> None:
    """comparison.md / .csv / .json, loss_curves.png and loss_differences.png in ``out``."""
    seeds = seeds or sorted({r.get("seed", config.seed) for r in rows})
    for row in rows:
        row.setdefault("seed", config.seed)
    summary = summarize_by_router(rows)
    reference = rows[0]["router"] if rows else "-"
    settings = (
        f"model `{config.model}`, data `{config.dataset}`, seq_len {config.seq_len}, batch "
        f"{config.batch_size} x {config.grad_accum}, {config.total_steps()} steps, lr {config.lr}, "
        f"seeds {', '.join(str(s) for s in seeds)}"
    )
    tokens = next((r.get("eval_tokens") for r in rows if r.get("eval_tokens")), None)
    md = [
        "# Router comparison",
        "",
        f"Same data and budget for every router: {settings}.",
        "Validation loss: the evaluation routing (causal by default), over "
        + (f"{tokens:,} validation tokens" if tokens else "the validation blocks")
        + "; SE is its standard error over validation documents (the split is a random sample "
        "of documents). Δ: loss minus the first router's on the same seed, paired by document. "
        "With several seeds, ± is the standard deviation over seeds. Dropped (slot left empty) "
        "and rerouted (slot given to another expert) shares of each choice rank, and load "
        "imbalance: mean over MoE layers of the last logging interval (training routing).",
        "",
        format_summary_markdown(summary, reference),
        "",
        *(["![loss differences](loss_differences.png)", ""] if len(summary) > 1 else []),
        "![loss curves](loss_curves.png)",
        "",
        "## Runs",
        "",
        format_markdown(rows),
        "",
    ]
    (out / "comparison.md").write_text("\n".join(md))
    keys = [k for k, _, _ in RUN_COLUMNS] + ["eval_tokens", "run_dir"]
    with (out / "comparison.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k) for k in keys})
    payload = {"settings": settings, "reference": reference, "runs": rows, "routers": summary}
    (out / "comparison.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    plot_comparison(rows, out)


def plot_comparison(rows: list[dict[str, Any]], out: Path) -> None:
    """``loss_curves.png`` (mean over seeds) and ``loss_differences.png`` from the run dirs."""
    from maxscore.analysis import plots
    from maxscore.analysis.runs import load_run

    runs: dict[str, dict[int, Any]] = {}
    for row in rows:
        run = load_run(row["run_dir"])
        runs.setdefault(row["router"], {})[row.get("seed", 0)] = run
    train = {
        router: plots.mean_curve([run.train_loss() for run in by_seed.values()])
        for router, by_seed in runs.items()
    }
    validation = {
        router: plots.mean_curve([run.eval_loss() for run in by_seed.values()])
        for router, by_seed in runs.items()
    }
    plots.save_figure(plots.loss_curves_figure(train, validation), out / "loss_curves.png")
    if len(runs) > 1:
        curves = {
            router: {
                seed: {"train": run.train_loss(), "validation": run.eval_loss()}
                for seed, run in by_seed.items()
            }
            for router, by_seed in runs.items()
        }
        figure = plots.loss_difference_figure(curves, reference=next(iter(runs)))
        plots.save_figure(figure, out / "loss_differences.png")
