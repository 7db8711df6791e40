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
within the equivalence margin (:data:`MARGIN`) where the paper claims a gain, "inconclusive"
otherwise and always with a single seed. The paper's "negligible gain" claims (GShard-M,
GShard-I alone) reproduce only when the interval lies within the margin (or wholly on the losing
side: no gain); non-significance alone is not equivalence. Superadditivity is the excess
gain(SM) - gain(S) - gain(M) computed per seed (the GShard run it shares enters once per seed)
and judged like a gain.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from study_plan import ROUTERS, SUPERSEDED, StudyConfig

from maxscore.evaluation.registry import PAPER_TASK_BY_NAME
from maxscore.training import evidence
from maxscore.training.validation_set import paired_difference

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
#: Accuracy of guessing (%), per bundled task: uniform over the choices (BoolQ: the majority
#: class of its validation split, 62.2%; LAMBADA: an open answer, 0).
CHANCE: dict[str, float] = {
    "arc_challenge": 25.0,
    "arc_easy": 25.0,
    "boolq": 62.2,
    "hellaswag": 25.0,
    "lambada_openai": 0.0,
    "piqa": 50.0,
    "sciq": 25.0,
    "openbookqa": 25.0,
}


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


def _mean_std(values: list[float]) -> dict[str, Any] | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return None
    std = statistics.stdev(values) if len(values) > 1 else None
    return {
        "mean": statistics.fmean(values),
        "std": std,
        "sem": std / math.sqrt(len(values)) if std is not None else None,
        "n": len(values),
    }


def _device(run: dict[str, Any]) -> str:
    return run.get("device") or "unknown"


def _card(device: str) -> str:
    """A short card name for tables: ``NVIDIA H100 80GB HBM3`` -> ``H100``."""
    words = device.removeprefix("NVIDIA ").split()
    return words[0] if words else device


def _per_card(speeds: dict[str, Any]) -> str:
    """``mean (card)`` per card, ``; ``-separated; ``pending`` without runs."""
    parts = [
        f"{v['mean']:,.0f} ({_card(device)}{', n=' + str(v['n']) if len(speeds) > 1 else ''})"
        for device, v in speeds.items()
        if v is not None
    ]
    return "; ".join(parts) or "pending"


#: Equivalence margin (nats) of the verdicts: a 1% change in perplexity.
MARGIN = 0.01


def _paired(runs: dict[str, list[dict[str, Any]]], a: str, b: str) -> dict[str, Any] | None:
    """``loss(a) - loss(b)`` per common seed (paired by validation document), over seeds, with
    the per-seed values (``per_seed``) and their t interval (``evidence``)."""
    by_seed = {r["seed"]: r for r in runs.get(b, [])}
    diffs, ses, seeds = [], [], []
    for run in runs.get(a, []):
        other = by_seed.get(run["seed"])
        if other is None or run["eval_loss"] is None or other["eval_loss"] is None:
            continue
        paired = (
            paired_difference(run["validation"], other["validation"])
            if run.get("validation") and other.get("validation")
            else None
        )
        diffs.append(paired[0] if paired else run["eval_loss"] - other["eval_loss"])
        ses.append(paired[1] if paired else None)
        seeds.append(run["seed"])
    stats = _mean_std(diffs)
    if stats is not None:
        stats["per_seed"] = dict(zip(seeds, diffs, strict=True))
        stats["evidence"] = evidence.describe(diffs, margin=MARGIN)
        known = [s for s in ses if s is not None]
        stats["validation_se"] = (
            math.sqrt(sum(s * s for s in known)) / len(known) if known else None
        )
    return stats


def verdict(diff: dict[str, Any] | None, expected_sign: int) -> str:
    """``reproduces`` / ``opposite`` / ``no difference beyond ±m`` / ``inconclusive`` /
    ``pending`` from the 95% t interval of ``diff``'s per-seed values (module docstring)."""
    if diff is None:
        return "pending"
    found = diff.get("evidence") or evidence.describe(
        list(diff.get("per_seed", {}).values()) or [diff["mean"]], margin=MARGIN
    )
    if found["low"] is None:
        return "inconclusive (one seed)"
    low, high = sorted((expected_sign * found["low"], expected_sign * found["high"]))
    if low > 0:
        return "reproduces"
    if high < 0:
        return "opposite"
    if found["within_margin"]:
        return f"no difference beyond ±{MARGIN}"
    return "inconclusive"


def negligible_verdict(diff: dict[str, Any] | None) -> str:
    """The paper's "negligible improvement" claims (GShard-M, GShard-I): ``reproduces`` when
    the interval lies within ±:data:`MARGIN` or wholly on the losing side; a clear gain does
    not reproduce; an interval that reaches past the margin is inconclusive."""
    found = verdict(diff, 1)
    return {
        "reproduces": "does not reproduce (a clear gain)",
        "opposite": "reproduces (no gain; worse than GShard)",
        f"no difference beyond ±{MARGIN}": f"reproduces (within ±{MARGIN})",
    }.get(found, found)


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


# ------------------------------------------------------------------------------------------------
# README
# ------------------------------------------------------------------------------------------------
#: The claims with a gain over GShard, as the README names them.
CLAIM_LABELS: tuple[tuple[str, str], ...] = (
    ("maxscore_beats_gshard", "MaxScore beats GShard (Table 2)"),
    ("maxscore_i_beats_gshard", "MaxScore-I beats GShard (Table 2)"),
    ("maxscore_beats_gshard_i", "MaxScore beats GShard-I (Table 2: every baseline)"),
    ("softtopk_alone_helps", "SoftTopk alone helps: GShard-S (Table 3)"),
    ("flow_alone_negligible", "Flow alone gives a negligible gain: GShard-M (Table 3)"),
    ("rerouting_alone_negligible", "Rerouting alone gives a negligible gain: GShard-I (Table 3)"),
)


def _rerun_lines(found: dict[str, Any] | None) -> list[str]:
    """The paragraph on runs trained twice with one seed (none: nothing)."""
    if not found or not found["pairs"]:
        return []
    listed = "; ".join(
        f"{p['run']} {p['first']:.4f} -> {p['second']:.4f} ({p['difference']:+.4f}, "
        f"{' -> '.join(p['cards'])})"
        for p in found["pairs"]
    )
    return [
        f"Run-to-run variation: {len(found['pairs'])} runs were trained twice with the same seed "
        "and settings (again, for their lm-eval: the later run's numbers are the ones above). "
        f"Their validation losses differ by {found['mean_abs_difference']:.4f} on average and "
        f"by up to {found['max_abs_difference']:.4f}: {listed}. Nondeterministic GPU kernels (and "
        "another card, where the cards differ) move a run's loss this much with its seed fixed: "
        "between two routers on one seed, a difference of this size says nothing; the claims' "
        "errors over seeds include this variation.",
        "",
    ]


def _additivity(add: dict[str, Any]) -> str:
    excess = add["excess"]
    found = (excess or {}).get("evidence")
    text = evidence.format_interval(found) if found else "pending"
    return (
        f"gain(SM) {add['gain_sm']:+.4f} vs gain(S) + gain(M) {add['gain_s_plus_gain_m']:+.4f}: "
        f"excess per seed {text}"
    )


def _f(value: float | None, fmt: str = "{:.4f}") -> str:
    return "pending" if value is None else fmt.format(value)


def _pm(stats: dict[str, Any] | None, fmt: str = "{:.4f}") -> str:
    if not stats:
        return "pending"
    text = fmt.format(stats["mean"])
    return (
        text
        + (f" ± {stats['std']:.4f}" if stats.get("std") is not None else "")
        + f" (n={stats['n']})"
    )


def _gain(stats: dict[str, Any] | None) -> str:
    if not stats:
        return "pending"
    found = stats.get("evidence")
    vse = f"; validation SE {stats['validation_se']:.4f}" if stats.get("validation_se") else ""
    if found and found.get("low") is not None:
        return f"{evidence.format_interval(found)}{vse}"
    return f"{stats['mean']:+.4f}, {stats['n']} seed(s){vse}"


def render_readme(
    data: dict[str, Any],
    status: list[dict[str, Any]],
    results_path: str = "results",
    other_reports: tuple[str, ...] = (),
) -> str:
    """The README, generated from ``results.json`` (and the plan's status); ``results_path``:
    the results folder as seen from the README; ``other_reports``: READMEs of other profiles'
    results beside it, linked."""
    s = data["settings"]
    routers = data["routers"]
    claims = data["claims"]
    done = sum(1 for r in status if r["trained"])
    lines = [
        "# Miniature reproduction of the paper's claims",
        "",
        f"Generated from the study's summary `{results_path}/results.json` (every run's numbers "
        f"and every number below) and `{results_path}/analysis/analysis.json` (the figures' "
        "numbers) by `study_report.py` (commands below). Do not edit by hand.",
        "",
    ]
    for other in other_reports:
        lines += [f"Another profile's runs (their own report): [`{other}`]({other}).", ""]
    if done == 0:
        lines += [
            "**Status: no run has been made yet. Every number below is pending until the GPU runs "
            "are made; nothing here is a result.**",
            "",
        ]
    else:
        lines += [
            f"**Status: {done} of {len(status)} runs trained.** Claims on missing runs say pending.",
            "",
        ]
    passes = data.get("passes_over_corpus")
    lines += [
        "## Setup",
        "",
        f"- Model preset `{s['model']}` (DeepSeek: `deepseek-base`), the embedded corpus, "
        f"seq {s['seq_len']}, batch {s['batch_size']} x {s['grad_accum']}, "
        f"{s['tokens']:,} training tokens per run (every run the same budget)"
        + (f", {passes:.2f} passes over the training split" if passes else "")
        + (
            f"; {'compiled' if s.get('compile', True) else 'eager (no torch.compile)'}; "
            f"validation every {s['eval_steps']} optimizer steps."
        ),
        f"- Recipe `{s['recipe']}`: AdamW betas (0.9, 0.95), eps 1e-6, weight decay 0.1, lr "
        f"{s['lr']}, WSD with warmup over 2/180 and decay over the last 6/180 of the run, SoftTopk "
        "t annealed 3 -> 0 over 1/6 of it (the paper's 2k / 6k / 30k of 180k steps).",
        "- Validation: the whole validation split of the embedded corpus (all five sources); "
        "± is a standard error over validation documents, or a standard deviation over seeds "
        "where marked (n = seeds).",
        "- Devices: " + (", ".join(data["devices"]) or "pending") + ".",
    ]
    if s["tokens"] < 25_000_000:
        lines += [
            f"- Budget: this is the `one-call` profile, sized for ONE device call of about nine "
            f"minutes on two H100s (one run per GPU at a time). {s['tokens']:,} tokens per run is "
            f"{s['tokens'] / 25e6:.0%} of the 25M the full study (`--profile full`) asks for. "
            "Eager steps, because compiling costs 30-60 s per run against ~70 ms saved per step "
            "(it pays off only beyond ~550 steps); micro-batch 64 for twice the optimizer steps "
            "of 128 at the same tokens; no checkpoints and no lm-eval. `study_plan.ONE_CALL` "
            "gives the arithmetic.",
        ]
    lines += [
        "",
        "## How to regenerate",
        "",
        "This README and its figures, from the summaries (a CPU, seconds):",
        "",
        "```bash",
        "python benchmarks/paper_reproduction/study_report.py",
        "python benchmarks/paper_reproduction/study_report.py --results-dir \\",
        "  benchmarks/paper_reproduction/results_full --readme benchmarks/paper_reproduction/results_full/README.md",
        "```",
        "",
        "The runs:",
        "",
        "```bash",
        "# on a machine with two GPUs (one device call, ~9 minutes): the one-call profile",
        "OUT=/tmp/out bash benchmarks/paper_reproduction/run_gpu.sh",
        "tar -xzf /tmp/out/results.tar.gz -C benchmarks/paper_reproduction",
        "python benchmarks/paper_reproduction/study.py plan     # done / pending, per run",
        "python benchmarks/paper_reproduction/study.py report   # adds raw/ to results.json; README",
        "# the full study (25M tokens per run, lm-eval), one run per GPU per ~10-minute call",
        "# (training: ~5 min on an H200, ~6.5 on an H100; then lm-eval, ~1 min per routing on an",
        "# H200); first, once, on a machine with registry access: pack lm-eval's wheels and the",
        "# tasks' documents into .whl/lmeval/ and carry that folder to the GPU machine",
        "bash benchmarks/paper_reproduction/lmeval_wheels.sh",
        "PROFILE=full RESULTS=benchmarks/paper_reproduction/results_full DEADLINE=510 \\",
        "  OUT=/tmp/out bash benchmarks/paper_reproduction/run_gpu.sh --retrain-for-eval",
        "# on an H100 a run's training and causal lm-eval fill a call: the next call, made on the",
        "# same machine while it is held, evaluates the train routing from the checkpoints left",
        "PROFILE=full RESULTS=benchmarks/paper_reproduction/results_full DEADLINE=200 RESTORE=1 \\",
        "  OUT=/tmp/out2 bash benchmarks/paper_reproduction/run_gpu.sh",
        "python benchmarks/paper_reproduction/study.py report --results-dir \\",
        "  benchmarks/paper_reproduction/results_full --readme benchmarks/paper_reproduction/results_full/README.md",
        "```",
        "",
        "`run` takes the pending (router, seed) pairs in queue order (the claims first: GShard and "
        "MaxScore x 3 seeds, then GShard-S / -M / -I and MaxScore-I x 2 seeds, then Dense and "
        "DropLess, the ablation's third seeds, then the other baselines); with `--devices` one "
        "worker per GPU takes the next one, and starts it only while it has time to finish it. "
        "Each run trains into `runs/paper_reproduction/`, runs lm-eval on its final checkpoint "
        "where the profile asks for it (both routings for capacity / flow routers) and copies the "
        "small result files to `results/raw/`; `results/study.json` records the settings. "
        "`report` adds the runs in `raw/` to the summary `results.json` (a run's raw files take "
        "precedence over its record there); after it `raw/` is not needed, and git ignores it. A "
        "run "
        "cut by the deadline is not counted (the `full` profile keeps checkpoints and resumes "
        "it in the next call while its machine is held). lm-eval needs the run's final "
        "checkpoint, which lives only on the machine that trained it: a run trained in an "
        "earlier call without its lm-eval is evaluated only if trained again: `run "
        "--retrain-for-eval` (`run_gpu.sh --retrain-for-eval`) does that after the runs never "
        "trained, one run of each router without a complete lm-eval first, and the new run's "
        "files replace the old ones once it is complete (the old ones move to "
        f"`raw/<router>/seed-<seed>/{SUPERSEDED}/`). `run_gpu.sh` installs "
        "the carried wheels the machine lacks and points `MAXSCORE_CACHE_DIR` at the carried "
        "documents.",
        "",
        "## Runs",
        "",
        "| router | paper name | seeds planned | seeds done | val loss (mean ± std over seeds) | "
        "val SE (documents) | Δ loss vs GShard (paired; < 0: better) | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in routers.items():
        lines.append(
            f"| {name} | {r['paper_name']} | {len(r['seeds_planned'])} | {len(r['seeds_done'])} | "
            f"{_pm(r['eval_loss'])} | {_f((r['eval_loss_se'] or {}).get('mean'))} | "
            f"{_gain(r['delta_vs_gshard']) if name != 'gshard' else '0'} | "
            f"{_per_card(r['tokens_per_s'])} |"
        )
    lines += [
        "",
        "tokens/s: training tokens per second, the mean of the router's runs on each card (named "
        "in parentheses, with the number of runs when there are several cards); compare speeds "
        "only on one card.",
    ]
    ranking = claims["ranking"]
    rho = ranking["spearman"]
    lines += [
        "",
        "## Claims",
        "",
        "Gains are GShard's validation loss minus the router's (positive: better than GShard), "
        "paired by seed and validation document: the mean over seeds with its 95% Student-t "
        f"interval (n - 1 degrees of freedom); equivalence margin ±{MARGIN} nats. The claims "
        "resolved over more paired seeds, with common routing groups and the sparsity sweep: "
        "[`../paper_claims/`](../paper_claims/README.md).",
        "",
        "| claim (paper) | ours | verdict |",
        "|---|---|---|",
        f"| Table 2 ranking (by average accuracy) | Spearman {_f(rho, '{:.2f}')} between our "
        f"loss order and the paper's over {len(ranking['routers'])} routers | "
        f"{'pending' if rho is None else 'see the orders below'} |",
    ]
    for key, label in CLAIM_LABELS:
        lines.append(f"| {label} | {_gain(claims[key]['gain'])} | {claims[key]['verdict']} |")
    add = claims["s_and_m_superadditive"]
    lines.append(
        "| S and M are superadditive (Table 3) | "
        + ("pending" if add is None else _additivity(add))
        + f" | {'pending' if add is None else add['verdict']} |"
    )
    lines += [
        "",
        f"Our order by validation loss: {', '.join(ranking['our_order_by_loss']) or 'pending'}.",
        f"The paper's by average accuracy: {', '.join(ranking['paper_order_by_accuracy']) or 'pending'}.",
        "",
        *_rerun_lines(data.get("reruns")),
        "## Routing (the paper's Fig. 2, Fig. 7 and Fig. 8)",
        "",
        "Mean over MoE layers of the last training log (training routing), mean over seeds. Dropped: "
        "the choice not given and the slot left empty; rerouted: given to another expert instead. "
        "Load / capacity: experts of the middle MoE layer (paper: GShard 0.8237, MaxScore 0.9996, "
        "DropLess 0.55-1.74).",
        "",
        "| router | dropped 1st / 2nd | rerouted 1st / 2nd | mean affinity 1st / 2nd | load / capacity mean (min-max) |",
        "|---|---|---|---|---|",
    ]
    for name, r in routers.items():

        def pair(values: list[float] | None, fmt: str) -> str:
            return "pending" if not values else " / ".join(fmt.format(v) for v in values[:2])

        load = r["load_over_capacity_middle_layer"]
        if name == "dense":
            lines.append(f"| {name} | no router | no router | no router | no router |")
            continue
        lines.append(
            f"| {name} | {pair(r['dropped_by_rank'], '{:.1%}')} | {pair(r['rerouted_by_rank'], '{:.1%}')} | "
            f"{pair(r['mean_affinity_by_rank'], '{:.3f}')} | "
            + (
                "pending"
                if not load
                else f"{load['mean']:.4f} ({load['min']:.2f}-{load['max']:.2f})"
            )
            + " |"
        )
    if data.get("figures"):
        lines += [
            "",
            "Figures (first seed of each router; `results/analysis/analysis.md` has the per-layer "
            "tables):",
            "",
        ]
        lines += [f"![{name}](results/analysis/{name})" for name in data["figures"]]
    lines += [
        "",
        "## lm-eval (eight offline tasks, zero-shot)",
        "",
        "Accuracy in percent, mean over seeds; `*`: no better than chance (less than two "
        "standard errors above it, or below it; chance: uniform guessing, BoolQ: the majority "
        "class), where models this small are expected to sit. Causal: the evaluation routing "
        "without capacity (no token's experts depend on later tokens); train: the training "
        "routing, for the capacity / flow routers."
        + (
            f" Each task's first {s['eval_limit']:,} documents (lm-eval's `limit`; OpenBookQA "
            "has 500), so a task's standard error is about 1.5 points."
            if s.get("eval_limit")
            else ""
        ),
        "",
        "| router | routing | " + " | ".join(CHANCE) + " |",
        "|---|---|" + "---:|" * len(CHANCE),
    ]
    if not s.get("lm_eval", True):
        lines[-4:] = [
            "Not run in this profile: lm-eval is not installed on the device machine (nor its "
            "task data), and models of this size trained on a few million tokens score at chance "
            "on these tasks (uniform guessing; BoolQ: the majority class), so the accuracies "
            "could not tell routers apart. The study's comparisons rest on validation loss. "
            "`--profile full` runs the eight tasks with both routings where lm-eval is installed.",
        ]
    for name, r in routers.items():
        if not s.get("lm_eval", True):
            break
        if not r["lm_eval"]:
            lines.append(f"| {name} | - | " + " | ".join("pending" for _ in CHANCE) + " |")
        for routing, tasks in r["lm_eval"].items():
            cells = [
                "-"
                if t not in tasks
                else f"{tasks[t]['score']:.1f}{'*' if tasks[t]['no_better_than_chance'] else ''}"
                for t in CHANCE
            ]
            lines.append(f"| {name} | {routing} | " + " | ".join(cells) + " |")
    if s.get("lm_eval", True):
        above = {  # routers above chance on the task, in either routing
            task: sum(
                any(
                    task in tasks and not tasks[task]["no_better_than_chance"]
                    for tasks in r["lm_eval"].values()
                )
                for r in routers.values()
            )
            for task in CHANCE
        }
        evaluated = any(r["lm_eval"] for r in routers.values())
        lines += [
            "",
            "Above chance: "
            + (
                "; ".join(f"{task} ({count} router(s))" for task, count in above.items() if count)
                or "no task, for any router evaluated so far"
                if evaluated
                else "pending"
            )
            + ". Where every router sits at chance the task cannot rank routers at this scale.",
        ]
    lines += [
        "",
        "## What reproduces and what does not",
        "",
        f"Each verdict rests on the seeds it lists and on {s['tokens']:,} training tokens per run, "
        f"1/{65e9 / s['tokens']:,.0f} of the paper's 65B.",
        "",
    ]
    for key, label in CLAIM_LABELS:
        claim = claims[key]
        lines.append(f"- {label}: **{claim['verdict']}** ({_gain(claim['gain'])}).")
    lines.append(
        "- S and M superadditive: "
        + ("pending." if add is None else f"**{add['verdict']}** ({_additivity(add)}).")
    )
    lines.append(
        "- Table 2 ranking: "
        + (
            "pending."
            if rho is None
            else f"Spearman {rho:.2f} over {len(ranking['routers'])} routers."
        )
    )
    return "\n".join(lines) + "\n"


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
