"""``maxscore compare``: several routers (and seeds), same data and budget; tables and plots.

Each router trains into ``<output>/<router>/`` (with several ``--seeds``:
``<output>/<router>/seed-<s>/``), a normal run directory, so ``maxscore eval`` and
``maxscore analyze`` work on it. The comparison itself, in ``<output>``:

* ``comparison.md``: per router the validation loss (± its standard error over validation
  documents for one seed; mean ± std over seeds for several), its paired difference to the
  first router and, with two seeds or more, that difference's Student-t interval over seeds, a
  verdict (better / worse / equivalent within ``--margin`` / inconclusive) and the paired seeds
  the observed effect and spread would need (:mod:`maxscore.training.evidence`); dropped /
  rerouted shares, load imbalance, tokens/s; the same-seed noise of ``--reruns``; one row per run;
* ``comparison.csv`` (one row per run) and ``comparison.json`` (runs, reruns, per-router summary
  with the evidence);
* ``loss_curves.png``: training and validation loss (mean over seeds), the full run and a zoom
  on its second half, where routers differ by hundredths of a nat;
* ``loss_differences.png``: loss minus the first router's at each step, mean over seeds with a
  band of ± one standard deviation over seeds (:mod:`maxscore.training.seed_stats`).

``--reruns N`` trains the first seed of every router N more times with identical settings
(``<router>/seed-<s>-rerun-<i>/``): how far two runs of the same seed land apart is the noise
that no number of paired seeds removes from one run (zero with ``--deterministic``).
"""

from __future__ import annotations

import csv
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from maxscore.analysis.runs import load_run
from maxscore.training import evidence
from maxscore.training.config import ConfigError, TrainConfig
from maxscore.training.continue_command import overwrite_command
from maxscore.training.distributed import is_main_process
from maxscore.training.model_build import run_router
from maxscore.training.run import prepare, train
from maxscore.training.run_dir import RunDirectory, RunDirPlan
from maxscore.training.run_lock import lock_run_dir
from maxscore.training.seed_stats import add_paired_differences, summarize_by_router
from maxscore.training.write_errors import reported_write

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


class ComparisonStopped(Exception):
    """A signal stopped one of the comparison's runs (it saved a checkpoint); nothing after it
    trained and no comparison file was written. ``exit_status``: 128 + the signal number."""

    def __init__(self, router: str, seed: int, run_dir: Path, exit_status: int) -> None:
        super().__init__(
            f"compare stopped by a signal while training {router} seed {seed} (its checkpoint "
            f"is in {run_dir}); no comparison was written: start it again with: "
            f"{overwrite_command()}"
        )
        self.exit_status = exit_status


def compare(
    routers: list[str],
    config: TrainConfig,
    output_dir: str | Path,
    overwrite: bool = False,
    seeds: list[int] | None = None,
    confidence: float = evidence.DEFAULT_CONFIDENCE,
    margin: float = evidence.DEFAULT_MARGIN,
    reruns: int = 0,
) -> list[dict[str, Any]]:
    """Train ``config`` once per router and seed and write the comparison files; return the rows.

    ``seeds`` defaults to ``[config.seed]``. ``confidence`` and ``margin`` (nats) set the
    intervals and the equivalence margin of the verdicts; ``reruns`` trains each router's first
    seed that many more times (same-seed noise). All runs are validated (and the output folder
    checked) before the first one trains. Returns one row per run (reruns excluded), in
    router-then-seed order.
    """
    seeds = list(seeds) if seeds else [config.seed]
    if not routers:
        raise ConfigError("--routers is empty; give comma-separated router presets")
    for router in routers:  # every router with the options, before any folder is touched
        run_router(replace(config, router=router))
    if len(set(routers)) != len(routers):
        raise ConfigError(f"--routers lists a router twice: {routers}")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(
            f"--seeds lists a seed twice: {seeds}; to measure same-seed noise use --reruns N"
        )
    if not 0.0 < confidence < 1.0:
        raise ConfigError(f"--confidence must be in (0, 1), e.g. 0.95; got {confidence}")
    if margin < 0:
        raise ConfigError(f"--margin must be >= 0 nats, e.g. 0.01; got {margin}")
    if reruns < 0:
        raise ConfigError(f"--reruns must be >= 0, got {reruns}")
    out = Path(output_dir)
    # Under torchrun process 0 alone owns the output folder (the others may look at it after
    # process 0 has started filling it); a refusal there ends the launch.
    main = is_main_process()
    _lock = lock_run_dir(out) if main else None  # held (over the runs inside) until return
    replaces = main and out.exists() and any(out.iterdir())
    if replaces and not overwrite:
        raise ConfigError(
            f"output dir {str(out)!r} is not empty; pass --overwrite or choose another --output-dir"
        )

    def run_dir(router: str, seed: int, rerun: int) -> Path:
        name = f"seed-{seed}" + (f"-rerun-{rerun}" if rerun else "")
        return out / router if len(seeds) == 1 and not reruns else out / router / name

    # (router, seed, rerun): rerun 0 is the comparison's own run of that seed.
    plan = [(r, s, 0) for r in routers for s in seeds]
    plan += [(r, seeds[0], i) for r in routers for i in range(1, reruns + 1)]
    configs = [
        replace(
            config,
            router=r,
            seed=s,
            output_dir=str(run_dir(r, s, i)),
            resume=False,
            overwrite=replaces,
        )
        for r, s, i in plan
    ]
    prepared = [prepare(c) for c in configs]  # every bad input fails before any training
    # --overwrite: the previous comparison stays (aside) until the first router has trained.
    directory = RunDirectory(RunDirPlan(out, replaces=replaces))
    if main:
        directory.open()
    rows, rerun_rows = [], []
    for index, (cfg, run, (_, _, rerun)) in enumerate(zip(configs, prepared, plan)):
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
        if result.interrupted:
            # A signal (Ctrl-C, SIGTERM, SIGUSR1) stopped this run at a checkpoint: the
            # comparison stops with it instead of training the next router. A stop does not
            # replace a previous comparison (--overwrite): it stays aside, and the next
            # --overwrite replaces this stopped one (RunDirectory.open).
            if main:
                directory.close(failed=False, interrupted=True)
            raise ComparisonStopped(cfg.router, cfg.seed, run.run_dir, result.exit_status)
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
        if rerun:
            row["rerun"] = rerun
            rerun_rows.append(row)
        else:
            rows.append(row)
    add_paired_differences(rows)
    if main:
        write_comparison(rows, out, config, seeds, confidence, margin, rerun_rows)
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
    """The per-router table: loss and its difference to ``reference`` with their errors.

    With several seeds the difference is the mean over seeds with its t interval, then the
    verdict and the seeds the observed effect would need (:mod:`maxscore.training.evidence`).
    """
    several = any(len(s["seeds"]) > 1 for s in summary)
    loss_head = "val loss (mean ± std over seeds)" if several else "val loss ± SE"
    if several:
        level = next(
            (round(100 * s["evidence"]["confidence"]) for s in summary if s.get("evidence")), 95
        )
        delta_head = f"Δ vs {reference} (mean [{level}% t interval over seeds])"
        extra_head, extra_sep = " verdict | seeds needed |", "---|---|"
    else:
        delta_head, extra_head, extra_sep = f"Δ vs {reference} (± paired SE)", "", ""
    lines = [
        f"| router | seeds | {loss_head} | mean SE | {delta_head} |{extra_head} "
        "dropped 1st / 2nd | rerouted 1st / 2nd | imbalance | tokens/s |",
        f"|---|---|---|---|---|{extra_sep}---|---|---|---|",
    ]
    for s in summary:
        spread = s["eval_loss_std"] if several else s.get("eval_loss_se")
        found = s.get("evidence")
        if several:
            delta = evidence.format_interval(found) if found else _pm(s["delta"], None, "{:+.4f}")
            extra = f" {_verdict_cell(found)} | {_seeds_needed_cell(found)} |"
        else:
            delta, extra = _pm(s["delta"], s.get("delta_se"), "{:+.4f}"), ""
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
            f"{delta} |{extra} {rates['dropped']} | "
            f"{rates['rerouted']} | {_pm(s.get('load_imbalance'), None, '{:.3f}')} | "
            f"{_pm(s.get('tokens_per_s'), None, '{:,.0f}')} |"
        )
    return "\n".join(lines)


def _verdict_cell(found: dict[str, Any] | None) -> str:
    if not found:
        return "reference"
    verdict = found["verdict"]
    if verdict in ("better", "worse") and found["within_margin"]:
        return f"{verdict} (by less than {found['margin']:g})"
    if verdict == "equivalent":
        return f"equivalent (within ±{found['margin']:g})"
    return verdict


def _seeds_needed_cell(found: dict[str, Any] | None) -> str:
    if not found or found.get("sd") is None:
        return "-"
    needed = found.get("seeds_needed")
    return "> 100,000" if needed is None else str(needed)


def format_rerun_markdown(rows: list[dict[str, Any]], reruns: list[dict[str, Any]]) -> str:
    """Same-seed noise: each rerun's loss against its seed's first run."""
    first = {(r["router"], r["seed"]): r for r in rows}
    pairs = []
    lines = [
        "| router | seed | first run | rerun | difference |",
        "|---|---|---|---|---|",
    ]
    for rerun in reruns:
        base = first.get((rerun["router"], rerun["seed"]))
        if base is None or base.get("eval_loss") is None or rerun.get("eval_loss") is None:
            continue
        pairs.append((base["eval_loss"], rerun["eval_loss"]))
        lines.append(
            f"| {rerun['router']} | {rerun['seed']} | {base['eval_loss']:.6f} | "
            f"{rerun['eval_loss']:.6f} | {rerun['eval_loss'] - base['eval_loss']:+.2e} |"
        )
    noise = evidence.rerun_noise(pairs)
    if noise is None:
        return ""
    lines += [
        "",
        f"Same-seed noise over {noise['pairs']} rerun(s): mean |difference| "
        f"{noise['mean_abs_difference']:.2e}, largest {noise['max_abs_difference']:.2e}; "
        f"one run's standard deviation around its seed's expectation {noise['run_sd']:.2e} nats.",
    ]
    return "\n".join(lines)


def verdict_sentences(summary: list[dict[str, Any]], reference: str) -> list[str]:
    """One line per router: its verdict against ``reference`` in words, with the numbers."""
    out = []
    for s in summary:
        found = s.get("evidence")
        if not found:
            continue
        verdict = _verdict_cell(found)
        line = f"- **{s['router']}** vs {reference}: {verdict}, Δ {evidence.format_interval(found)}"
        if found["verdict"] == "inconclusive" and found.get("seeds_needed"):
            line += (
                f"; the observed mean and spread would need about {found['seeds_needed']} paired "
                "seeds to resolve (80% power)"
            )
        out.append(line + ".")
    return out


def write_comparison(
    rows: list[dict[str, Any]],
    out: Path,
    config: TrainConfig,
    seeds: list[int] | None = None,
    confidence: float = evidence.DEFAULT_CONFIDENCE,
    margin: float = evidence.DEFAULT_MARGIN,
    reruns: list[dict[str, Any]] | None = None,
) -> None:
    """comparison.md / .csv / .json, loss_curves.png and loss_differences.png in ``out``."""
    seeds = seeds or sorted({r.get("seed", config.seed) for r in rows})
    reruns = reruns or []
    for row in rows:
        row.setdefault("seed", config.seed)
    summary = summarize_by_router(rows, confidence, margin)
    reference = rows[0]["router"] if rows else "-"
    settings = (
        f"model `{config.model}`, data `{config.dataset}`, seq_len {config.seq_len}, batch "
        f"{config.batch_size} x {config.grad_accum}, {config.total_steps()} steps, lr {config.lr}, "
        f"seeds {', '.join(str(s) for s in seeds)}"
        + (", deterministic" if getattr(config, "deterministic", False) else "")
    )
    tokens = next((r.get("eval_tokens") for r in rows if r.get("eval_tokens")), None)
    verdicts = verdict_sentences(summary, reference)
    level = round(100 * confidence)
    md = [
        "# Router comparison",
        "",
        f"Same data and budget for every router: {settings}.",
        "Validation loss: the evaluation routing (causal by default), over "
        + (f"{tokens:,} validation tokens" if tokens else "the validation blocks")
        + "; SE is its standard error over validation documents (the split is a random sample "
        "of documents). Δ: loss minus the first router's on the same seed, paired by document. "
        f"With several seeds, ± is the standard deviation over seeds and the interval is the "
        f"{level}% Student-t interval of the per-seed differences (n - 1 degrees of freedom); "
        f"verdict: better / worse when the interval excludes 0, equivalent when it lies within "
        f"±{margin:g} nats, else inconclusive; seeds needed: paired seeds for the observed mean "
        "and spread to exclude 0 with 80% power. Dropped (slot left empty) "
        "and rerouted (slot given to another expert) shares of each choice rank, and load "
        "imbalance: mean over MoE layers of the last logging interval (training routing).",
        "",
        format_summary_markdown(summary, reference),
        "",
        *([*verdicts, ""] if verdicts else []),
        *(["![loss differences](loss_differences.png)", ""] if len(summary) > 1 else []),
        "![loss curves](loss_curves.png)",
        "",
        *(["## Same-seed reruns", "", format_rerun_markdown(rows, reruns), ""] if reruns else []),
        "## Runs",
        "",
        format_markdown(rows),
        "",
    ]
    payload = {
        "settings": settings,
        "reference": reference,
        "confidence": confidence,
        "margin": margin,
        "runs": rows,
        "reruns": reruns,
        "routers": summary,
    }
    keys = [k for k, _, _ in RUN_COLUMNS] + ["eval_tokens", "run_dir"]
    # A full disk or a read-only folder: one line (write_errors.py); the runs are complete.
    advice = (
        "every run is complete in its own folder there (summary.json, checkpoints). Free some "
        "space or make the folder writable, then run the same command with --overwrite, or "
        "choose another --output-dir"
    )
    with reported_write("the comparison files in", out, advice=advice):
        (out / "comparison.md").write_text("\n".join(md))
        with (out / "comparison.csv").open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=keys, extrasaction="ignore")
            writer.writeheader()
            for row in rows:
                writer.writerow({k: row.get(k) for k in keys})
        (out / "comparison.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
        plot_comparison(rows, out)


def plot_comparison(rows: list[dict[str, Any]], out: Path) -> None:
    """``loss_curves.png`` (mean over seeds) and ``loss_differences.png`` from the run dirs
    (skipped with a note when matplotlib, the ``plots`` extra, is not installed: the tables are
    the comparison, the figures draw them)."""
    try:  # matplotlib (optional: the plots extra) loads only when a comparison is plotted
        from maxscore.analysis import plots
    except ImportError as err:
        if err.name != "matplotlib":
            raise
        print(f"maxscore: note: no loss_curves.png: {err}", file=sys.stderr)
        return

    runs: dict[str, dict[int, Any]] = {}
    for row in rows:
        run = load_run(row["run_dir"])
        runs.setdefault(row["router"], {})[row.get("seed", 0)] = run
    training = {
        router: plots.mean_curve([run.train_loss() for run in by_seed.values()])
        for router, by_seed in runs.items()
    }
    validation = {
        router: plots.mean_curve([run.eval_loss() for run in by_seed.values()])
        for router, by_seed in runs.items()
    }
    plots.save_figure(plots.loss_curves_figure(training, validation), out / "loss_curves.png")
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
