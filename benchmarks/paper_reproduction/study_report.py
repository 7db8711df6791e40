"""The study's report: every number in ``results.json``, and the README and figures from it.

    python benchmarks/paper_reproduction/study_report.py              # results/ -> README.md
    python benchmarks/paper_reproduction/study_report.py --results-dir \
        benchmarks/paper_reproduction/results_full --readme \
        benchmarks/paper_reproduction/results_full/README.md

Nothing here measures. ``<results-dir>/results.json`` is the study's summary: every complete
run's numbers (its per-document validation losses included, for the paired differences), the
claims and verdicts computed from them, and the runs trained twice; ``analysis/analysis.json``
holds every number the figures plot. A run's raw files (``raw/<router>/seed-<s>/``, copied from
its run directory by ``study.py run``) take precedence over its record in the summary, so
``study.py report`` after a device call adds the new runs; once the summary holds them the raw
files are not needed (``raw/`` is not kept in the repository). The report states, claim by
claim, what the runs say, with the number of seeds and tokens each claim rests on. A claim
whose runs are missing is "pending".

Verdicts rest on the per-seed paired differences (paired by seed and validation document) and
their 95% Student-t interval over seeds (``n - 1`` degrees of freedom;
:mod:`maxscore.training.evidence`): "reproduces" when the interval excludes 0 on the paper's
side, "opposite" on the other side, "no difference beyond ±0.01" when the whole interval lies
within the equivalence margin (``study_verdicts.MARGIN``) where the paper claims a gain, "inconclusive"
otherwise and always with a single seed. The paper's "negligible gain" claims (GShard-M,
GShard-I alone) reproduce only when the interval lies within the margin (or wholly on the losing
side: no gain); non-significance alone is not equivalence. Superadditivity is the excess
gain(SM) - gain(S) - gain(M) computed per seed (the GShard run it shares enters once per seed)
and judged like a gain. The verdicts live in :mod:`study_verdicts`, the README's text in
:mod:`study_readme`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from study_plan import ROUTERS, SUPERSEDED, StudyConfig
from study_readme import render_readme
from study_verdicts import (
    CHANCE,
    MARGIN,
    _card,
    _device,
    _mean_std,
    _paired,
    negligible_verdict,
    verdict,
)

from maxscore.evaluation.registry import PAPER_TASK_BY_NAME
from maxscore.training import evidence

HERE = Path(__file__).resolve().parent

#: The paper's Table 2 / Table 3 average accuracy (%) over its ten tasks, Base size.
PAPER_AVG: dict[str, float] = {
    "dense": 38.57,
    "gshard": 42.11,
    "gshard-i": 42.10,
    "sbase": 40.75,
    "expert-choice": 41.80,
    "dropless": 41.76,
    "deepseek": 42.49,
    "maxscore-i": 42.77,
    "maxscore": 43.44,
    "gshard-m": 42.16,
    "gshard-s": 42.55,
}
#: The paper's Fig. 8: mean load / capacity of one layer's experts.
PAPER_LOAD = {"gshard": 0.8237, "maxscore": 0.9996}


#: The study's summary in its results folder (:func:`summarize` writes it).
SUMMARY = "results.json"


def _read(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def _last_routing(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    routing = None
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("type") == "train" and record.get("routing"):
            routing = record["routing"]
    return routing


def _layer_mean(per_layer: list[list[float]] | None) -> list[float] | None:
    if not per_layer:
        return None
    return [sum(layer[r] for layer in per_layer) / len(per_layer) for r in range(len(per_layer[0]))]


def stored_runs(results: Path) -> dict[str, dict[str, Any]]:
    """The complete runs the summary (``<results>/results.json``) records, by ``router/seed``."""
    return (_read(results / SUMMARY) or {}).get("runs", {})


def load_run(
    results: Path, router: str, seed: int, stored: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any] | None:
    """The numbers of one run from its raw files, else from its record in the summary
    (``stored``: :func:`stored_runs`, read when not given); ``None`` until it is trained."""
    folder = results / "raw" / router / f"seed-{seed}"
    summary, config = _read(folder / "summary.json"), _read(folder / "config.json")
    if summary is None or config is None:
        record = (stored_runs(results) if stored is None else stored).get(f"{router}/{seed}")
        return copy.deepcopy(record)
    resolved = config["resolved"]
    routing = _last_routing(folder / "metrics.jsonl") or {}
    loads = routing.get("load_over_capacity") or []
    middle = loads[len(loads) // 2] if loads else None
    train_tokens = (resolved.get("train_blocks") or 0) * config["train"]["seq_len"]
    run: dict[str, Any] = {
        "router": router,
        "seed": seed,
        "complete": summary.get("steps", 0) >= resolved["total_steps"],
        "steps": summary.get("steps"),
        "tokens": summary.get("tokens"),
        "passes": summary["tokens"] / train_tokens if train_tokens else None,
        "eval_loss": summary.get("eval_loss"),
        "eval_loss_se": summary.get("eval_loss_se"),
        "eval_tokens": summary.get("eval_tokens"),
        "train_loss": summary.get("train_loss"),
        "tokens_per_s": summary.get("tokens_per_s"),
        "peak_memory_gb": summary.get("peak_memory_gb"),
        "device": resolved.get("device"),
        "temperature_schedule": resolved.get("temperature_schedule"),
        "dropped_by_rank": _layer_mean(routing.get("dropped_by_rank")),
        "rerouted_by_rank": _layer_mean(routing.get("rerouted_by_rank")),
        "mean_affinity_by_rank": _layer_mean(routing.get("mean_affinity_by_rank")),
        "load_over_capacity_middle_layer": (
            {"mean": sum(middle) / len(middle), "min": min(middle), "max": max(middle)}
            if middle
            else None
        ),
        "lm_eval": {},
    }
    for path in sorted(folder.glob("eval_*.json")):
        payload = _read(path)
        scores = {}
        for task, metrics in payload.get("metrics", {}).items():
            spec = PAPER_TASK_BY_NAME.get(task)
            metric = spec.metric if spec else "acc"
            if metric in metrics:
                scores[task] = {
                    "score": 100 * metrics[metric],
                    "stderr": 100 * (metrics.get(f"{metric}_stderr") or 0.0),
                    "n": payload.get("n_samples", {}).get(task),
                }
        run["lm_eval"][payload.get("eval_routing") or path.stem.removeprefix("eval_")] = scores
    run["validation"] = _read(folder / "validation.json")
    return run


def _spearman(a: list[float], b: list[float]) -> float | None:
    if len(a) < 3:
        return None

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb, strict=True)) / (n * (n * n - 1))


def reruns(config: StudyConfig, results: Path) -> dict[str, Any]:
    """Runs trained twice with the same seed and settings (again for their lm-eval, the first
    run's files kept in ``SUPERSEDED/``): how far apart the two validation losses are,
    the run-to-run variation that no seed explains (GPU nondeterminism, another card). A run
    without raw files keeps the pair the summary records."""
    recorded = ((_read(results / SUMMARY) or {}).get("reruns") or {}).get("pairs", [])
    recorded_pairs = {p["run"]: p for p in recorded}
    pairs = []
    for router, seed in config.runs():
        folder = results / "raw" / router / f"seed-{seed}"
        if not (folder / "summary.json").is_file():
            if f"{router}/{seed}" in recorded_pairs:
                pairs.append(recorded_pairs[f"{router}/{seed}"])
            continue
        new = _read(folder / "summary.json")
        old = _read(folder / SUPERSEDED / "summary.json")
        cards = [
            (_read(f / "config.json") or {}).get("resolved", {}).get("device")
            for f in (folder / SUPERSEDED, folder)
        ]
        if new and old and new.get("eval_loss") is not None and old.get("eval_loss") is not None:
            pairs.append(
                {
                    "run": f"{router}/{seed}",
                    "first": old["eval_loss"],
                    "second": new["eval_loss"],
                    "difference": new["eval_loss"] - old["eval_loss"],
                    "cards": [_card(c or "unknown") for c in cards],
                }
            )
    gaps = [abs(p["difference"]) for p in pairs]
    return {
        "pairs": pairs,
        "mean_abs_difference": statistics.fmean(gaps) if gaps else None,
        "max_abs_difference": max(gaps) if gaps else None,
    }


def summarize(config: StudyConfig, results: Path) -> dict[str, Any]:
    """Everything the README says, as data (written to ``results.json``), with every complete
    run's own numbers (``runs``) to compute it again."""
    stored = stored_runs(results)
    runs: dict[str, list[dict[str, Any]]] = {}
    for router, seed in config.runs():
        run = load_run(results, router, seed, stored)
        if run is not None and run["complete"]:
            runs.setdefault(router, []).append(run)
    routers: dict[str, Any] = {}
    for plan in config.plans():
        done = runs.get(plan.router, [])
        entry: dict[str, Any] = {
            "paper_name": plan.paper_name,
            "seeds_planned": list(plan.seeds),
            "seeds_done": [r["seed"] for r in done],
            "eval_loss": _mean_std([r["eval_loss"] for r in done]),
            "eval_loss_se": _mean_std([r["eval_loss_se"] for r in done]),
            # Speeds compare only on one card: one mean per card the runs trained on.
            "tokens_per_s": {
                card: _mean_std([r["tokens_per_s"] for r in done if _device(r) == card])
                for card in sorted({_device(r) for r in done})
            },
            "delta_vs_gshard": _paired(runs, plan.router, "gshard")
            if plan.router != "gshard"
            else None,
        }
        for key in ("dropped_by_rank", "rerouted_by_rank", "mean_affinity_by_rank"):
            values = [r[key] for r in done if r[key]]
            entry[key] = (
                [statistics.fmean(v[i] for v in values) for i in range(len(values[0]))]
                if values
                else None
            )
        loads = [
            r["load_over_capacity_middle_layer"]
            for r in done
            if r["load_over_capacity_middle_layer"]
        ]
        entry["load_over_capacity_middle_layer"] = (
            {k: statistics.fmean(x[k] for x in loads) for k in ("mean", "min", "max")}
            if loads
            else None
        )
        lm: dict[str, dict[str, Any]] = {}
        for routing in ("causal", "train"):
            per_task: dict[str, Any] = {}
            for task in CHANCE:
                scores = [
                    r["lm_eval"][routing][task]
                    for r in done
                    if task in r["lm_eval"].get(routing, {})
                ]
                if scores:
                    mean = statistics.fmean(s["score"] for s in scores)
                    stderr = statistics.fmean(s["stderr"] for s in scores)
                    per_task[task] = {
                        "score": mean,
                        "stderr": stderr,
                        # below chance counts too: such a score tells routers apart no better
                        "no_better_than_chance": mean < CHANCE[task] + 2 * max(stderr, 1e-9),
                    }
            if per_task:
                lm[routing] = per_task
        entry["lm_eval"] = lm
        routers[plan.router] = entry
    tokens = next((r["tokens"] for rs in runs.values() for r in rs), None)
    passes = next((r["passes"] for rs in runs.values() for r in rs), None)
    claims = _claims(runs, routers)
    return {
        "settings": config.to_dict(),
        "tokens_per_run": tokens,
        "passes_over_corpus": passes,
        "devices": sorted({r["device"] for rs in runs.values() for r in rs if r.get("device")}),
        "routers": routers,
        "claims": claims,
        "reruns": reruns(config, results),
        "runs": {f"{r['router']}/{r['seed']}": r for rs in runs.values() for r in rs},
    }


def _claims(runs: dict[str, list[dict[str, Any]]], routers: dict[str, Any]) -> dict[str, Any]:
    """The paper's claims, each with its numbers and verdict."""
    have = [r for r in PAPER_AVG if r in routers and routers[r]["eval_loss"]]
    ours = [routers[r]["eval_loss"]["mean"] for r in have]
    paper = [-PAPER_AVG[r] for r in have]  # a higher accuracy ranks like a lower loss
    gain = {
        name: _paired(runs, "gshard", name)
        for name in ("gshard-s", "gshard-m", "gshard-i", "maxscore", "maxscore-i")
    }
    over_gshard_i = _paired(runs, "gshard-i", "maxscore")
    additive = None
    if all(gain[n] for n in ("gshard-s", "gshard-m", "maxscore")):
        sm, s, m = (gain[n]["mean"] for n in ("maxscore", "gshard-s", "gshard-m"))
        # The excess gain(SM) - gain(S) - gain(M) per seed: the three gains share the GShard
        # run of each seed, so their errors are not independent.
        per = [gain[n]["per_seed"] for n in ("maxscore", "gshard-s", "gshard-m")]
        common = sorted(set(per[0]) & set(per[1]) & set(per[2]))
        values = [per[0][x] - per[1][x] - per[2][x] for x in common]
        excess = _mean_std(values)
        if excess is not None:
            excess["per_seed"] = dict(zip(common, values, strict=True))
            excess["evidence"] = evidence.describe(values, margin=MARGIN)
        additive = {
            "gain_sm": sm,
            "gain_s_plus_gain_m": s + m,
            "superadditive": sm > s + m,
            "excess": excess,
            "verdict": verdict(excess, 1),
        }
    return {
        "ranking": {
            "routers": have,
            "our_order_by_loss": [r for _, r in sorted(zip(ours, have, strict=True))],
            "paper_order_by_accuracy": [r for _, r in sorted(zip(paper, have, strict=True))],
            "spearman": _spearman(ours, paper),
        },
        "maxscore_beats_gshard": {
            "gain": gain["maxscore"],
            "verdict": verdict(gain["maxscore"], 1),
        },
        "softtopk_alone_helps": {"gain": gain["gshard-s"], "verdict": verdict(gain["gshard-s"], 1)},
        "flow_alone_negligible": {
            "gain": gain["gshard-m"],
            "verdict": negligible_verdict(gain["gshard-m"]),
        },
        "rerouting_alone_negligible": {
            "gain": gain["gshard-i"],
            "verdict": negligible_verdict(gain["gshard-i"]),
        },
        "maxscore_i_beats_gshard": {
            "gain": gain["maxscore-i"],
            "verdict": verdict(gain["maxscore-i"], 1),
        },
        "maxscore_beats_gshard_i": {"gain": over_gshard_i, "verdict": verdict(over_gshard_i, 1)},
        "s_and_m_superadditive": additive,
    }


def _figure_run_key(entry: dict[str, Any]) -> tuple[str, int] | None:
    """``(router, seed)`` of a run of the saved analysis, from its path ``.../<router>/seed-<s>``."""
    path = Path(entry.get("path") or "")
    if not path.name.startswith("seed-"):
        return None
    return path.parent.name, int(path.name.removeprefix("seed-"))


def write_figures(config: StudyConfig, results: Path) -> list[str]:
    """The routing analysis (``maxscore analyze``'s figures, ``analysis.json`` and
    ``analysis.md``, in ``analysis/``) of the first trained seed of each router.

    A run's numbers come from its raw copy where there is one (``config.json`` and
    ``metrics.jsonl``, all the analysis reads: the dropped / rerouted shares and mean affinity by
    choice rank per layer, the sorted expert load over capacity, loss curves, tokens/s), else
    from the saved ``analysis/analysis.json``, which holds every plotted number; the figures are
    drawn from these numbers. Returns the figure file names.
    """
    from maxscore.analysis.analyze import analyze, draw_figures
    from maxscore.analysis.markdown import ANALYSIS_JSON, ANALYSIS_MD, analysis_markdown

    out = results / "analysis"
    saved: dict[tuple[str, int], dict[str, Any]] = {}
    for entry in ((_read(out / ANALYSIS_JSON) or {}).get("runs") or {}).values():
        key = _figure_run_key(entry)
        if key is not None:
            saved[key] = entry
    stored = stored_runs(results)
    chosen: list[tuple[str, int, Path | None, str]] = []  # router, seed, raw folder, device
    for plan in config.plans():
        for seed in plan.seeds:
            folder = results / "raw" / plan.router / f"seed-{seed}"
            if (folder / "metrics.jsonl").is_file():
                resolved = (_read(folder / "config.json") or {}).get("resolved", {})
                chosen.append((plan.router, seed, folder, resolved.get("device") or "unknown"))
                break
            if (plan.router, seed) in saved:
                device = stored.get(f"{plan.router}/{seed}", {}).get("device") or "unknown"
                chosen.append((plan.router, seed, None, device))
                break
    if not chosen:
        return []
    # The throughput figure compares speeds: name each run's card where the runs used several.
    several = len({device for *_, device in chosen}) > 1
    names = [f"{r} ({_card(device)})" if several else r for r, _, _, device in chosen]
    fresh: dict[str, dict[str, Any]] = {}
    raw = [(name, folder) for name, (_, _, folder, _) in zip(names, chosen, strict=True) if folder]
    if raw:
        with tempfile.TemporaryDirectory() as scratch:
            found = analyze([f for _, f in raw], scratch, names=[n for n, _ in raw]).data
        fresh = found["runs"]
    data: dict[str, Any] = {"runs": {}}
    for name, (router, seed, folder, _) in zip(names, chosen, strict=True):
        entry = dict(fresh[name] if folder else saved[(router, seed)])
        entry["path"] = f"raw/{router}/seed-{seed}"  # relative to the results folder
        data["runs"][name] = entry
    notes = [
        f"{name}: no routing statistics in metrics.jsonl (dense model?)"
        for name, entry in data["runs"].items()
        if entry.get("routing") is None
    ]
    out.mkdir(parents=True, exist_ok=True)
    figures, drawing_notes = draw_figures(data, out)
    data["figures"] = {k: v.name for k, v in figures.items()}
    data["notes"] = notes + drawing_notes
    data["settings"] = {"checkpoint": None, "window": 1, "routing": "training (as logged)"}
    (out / ANALYSIS_JSON).write_text(json.dumps(data, indent=2) + "\n")
    (out / ANALYSIS_MD).write_text(analysis_markdown(data))
    return sorted(p.name for p in figures.values())


def write_report(
    config: StudyConfig,
    results: Path,
    readme: Path,
    status: list[dict[str, Any]],
    figures: bool = True,
) -> dict[str, Any]:
    """Write ``results.json``, the analysis figures (``figures=False``: keep the saved ones)
    and the README; return the data."""
    data = summarize(config, results)
    if figures:
        data["figures"] = write_figures(config, results)
    else:
        saved = _read(results / "analysis" / "analysis.json") or {}
        data["figures"] = sorted((saved.get("figures") or {}).values())
    results.mkdir(parents=True, exist_ok=True)
    (results / SUMMARY).write_text(json.dumps(data, indent=1) + "\n")
    where = os.path.relpath(results.resolve(), readme.resolve().parent)
    others = tuple(
        os.path.relpath(path, readme.resolve().parent)
        for path in sorted(results.resolve().parent.glob("*/README.md"))
        if path.parent != results.resolve()
        and path.resolve() != readme.resolve()
        and (path.parent / "results.json").is_file()
    )
    readme.write_text(render_readme(data, status, where, others))
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Write a study's results.json, figures and README from its summary "
        "(results.json) and the raw files beside it."
    )
    parser.add_argument("--results-dir", type=Path, default=HERE / "results")
    parser.add_argument("--readme", type=Path, default=HERE / "README.md")
    parser.add_argument(
        "--no-figures", action="store_true", help="keep the saved figures and analysis/"
    )
    args = parser.parse_args(argv)
    summary = _read(args.results_dir / SUMMARY)
    if summary is None:
        parser.error(f"no {args.results_dir / SUMMARY}: `study.py report` writes it from raw/")
    from study import status

    config = StudyConfig.from_dict(summary["settings"])
    rows = status(config, args.results_dir)
    write_report(config, args.results_dir, args.readme, rows, figures=not args.no_figures)
    print(f"wrote {args.results_dir / SUMMARY}, {args.results_dir / 'analysis'} and {args.readme}")
    return 0


__all__ = ["ROUTERS", "render_readme", "summarize", "verdict", "write_report"]


if __name__ == "__main__":
    sys.exit(main())
