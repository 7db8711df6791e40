"""The paper-claims study's report: every verdict computed from the ``raw/`` result files.

A claim is a combination of arms' validation losses, computed per seed over the seeds that
have every arm (:func:`maxscore.training.evidence.per_seed_combination`), signed so that a
negative value is what the paper claims (e.g. ``L_maxscore - L_gshard``). Its Student-t interval
over seeds gives a verdict on the combination (:func:`maxscore.training.evidence.judge`, margin
:data:`MARGIN`), and the verdict against the paper's expectation an outcome (:func:`outcome`).
``write_report`` writes ``results.json`` (every number), ``README.md`` and the figures.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from claims_plan import ARMS_BY_NAME, STUDY_MODEL, StudyConfig

from maxscore.training import evidence

#: Equivalence margin (nats): differences inside ±MARGIN are negligible (1% perplexity).
MARGIN = 0.01
CONFIDENCE = 0.95
STUDY_LAYERS: int = STUDY_MODEL["num_hidden_layers"]

Expectation = Literal["below 0", "within margin", "none"]


@dataclass(frozen=True)
class Claim:
    """One claim: ``sum_arm coefficient * loss`` per seed; the paper expects it ``expected``."""

    key: str
    paper: str
    source: str
    terms: Mapping[str, float]
    expected: Expectation
    groups: str


def _diff(a: str, b: str) -> dict[str, float]:
    return {a: 1.0, b: -1.0}


def _claims() -> tuple[Claim, ...]:
    out = [
        Claim(
            "maxscore>gshard",
            "MaxScore beats GShard",
            "Table 2",
            _diff("maxscore", "gshard"),
            "below 0",
            "authors' (flow per sequence, GShard per micro-batch)",
        ),
        Claim(
            "maxscore>gshard@seq",
            "MaxScore beats GShard",
            "Table 2",
            _diff("maxscore", "gshard@seq"),
            "below 0",
            "common: per sequence",
        ),
        Claim(
            "maxscore>gshard@8seq",
            "MaxScore beats GShard",
            "Table 2",
            _diff("maxscore@8seq", "gshard@8seq"),
            "below 0",
            "common: per 8 sequences",
        ),
        Claim(
            "group confound",
            "GShard routed per sequence against per micro-batch (a "
            "confound of the authors' groups, not a paper claim)",
            "routing groups",
            _diff("gshard@seq", "gshard"),
            "none",
            "sequence vs micro-batch",
        ),
        Claim(
            "maxscore>gshard-i",
            "MaxScore beats GShard-I (every baseline)",
            "Table 2",
            _diff("maxscore", "gshard-i"),
            "below 0",
            "authors'",
        ),
        Claim(
            "maxscore>gshard-i@seq",
            "MaxScore beats GShard-I (every baseline)",
            "Table 2",
            _diff("maxscore", "gshard-i@seq"),
            "below 0",
            "common: per sequence",
        ),
        Claim(
            "maxscore>dropless",
            "MaxScore beats DropLess",
            "Table 2 / Table 7",
            _diff("maxscore", "dropless"),
            "below 0",
            "authors' (DropLess has no capacity)",
        ),
        Claim(
            "maxscore>maxscore-i",
            "MaxScore beats MaxScore-I",
            "Table 2 / 3",
            _diff("maxscore", "maxscore-i"),
            "below 0",
            "both per sequence",
        ),
        Claim(
            "maxscore-i>gshard",
            "MaxScore-I beats GShard",
            "Table 2 / 3",
            _diff("maxscore-i", "gshard"),
            "below 0",
            "authors'",
        ),
        Claim(
            "S>gshard",
            "SoftTopk alone helps (GShard-S)",
            "Table 3",
            _diff("gshard-s", "gshard"),
            "below 0",
            "authors' (both per micro-batch)",
        ),
        Claim(
            "S>gshard@seq",
            "SoftTopk alone helps (GShard-S)",
            "Table 3",
            _diff("gshard-s@seq", "gshard@seq"),
            "below 0",
            "common: per sequence",
        ),
        Claim(
            "M~gshard",
            "flow alone: negligible gain (GShard-M)",
            "Table 3",
            _diff("gshard-m", "gshard"),
            "within margin",
            "authors'",
        ),
        Claim(
            "M~gshard@seq",
            "flow alone: negligible gain (GShard-M)",
            "Table 3",
            _diff("gshard-m", "gshard@seq"),
            "within margin",
            "common: per sequence",
        ),
        Claim(
            "I~gshard",
            "rerouting alone: negligible gain (GShard-I)",
            "Table 3",
            _diff("gshard-i", "gshard"),
            "within margin",
            "authors' (both per micro-batch)",
        ),
        Claim(
            "I~gshard@seq",
            "rerouting alone: negligible gain (GShard-I)",
            "Table 3",
            _diff("gshard-i@seq", "gshard@seq"),
            "within margin",
            "common: per sequence",
        ),
        Claim(
            "S+M superadditive",
            "S and M together gain more than the sum of their gains",
            "Table 3",
            {"gshard": 1.0, "maxscore": 1.0, "gshard-s": -1.0, "gshard-m": -1.0},
            "below 0",
            "authors'",
        ),
        Claim(
            "S+M superadditive@seq",
            "S and M together gain more than the sum of their gains",
            "Table 3",
            {"gshard@seq": 1.0, "maxscore": 1.0, "gshard-s@seq": -1.0, "gshard-m": -1.0},
            "below 0",
            "common: per sequence",
        ),
    ]
    for shape in ("2:32", "2:64", "8:128", "6:64+1"):
        out += [
            Claim(
                f"maxscore>gshard/{shape}",
                f"MaxScore beats GShard at {shape}",
                "Table 7",
                _diff(f"maxscore/{shape}", f"gshard/{shape}"),
                "below 0",
                "authors'",
            ),
            Claim(
                f"maxscore>dropless/{shape}",
                f"MaxScore beats DropLess at {shape}",
                "Table 7",
                _diff(f"maxscore/{shape}", f"dropless/{shape}"),
                "below 0",
                "authors'",
            ),
        ]
    out += [
        Claim(
            "lead over dropless grows",
            "MaxScore's lead over DropLess grows from 2:16 to 2:64",
            "Table 7 / Fig. 7",
            {"maxscore/2:64": 1.0, "dropless/2:64": -1.0, "maxscore": -1.0, "dropless": 1.0},
            "below 0",
            "authors'",
        ),
        Claim(
            "lead over gshard grows",
            "MaxScore's lead over GShard grows from 2:16 to 2:64",
            "Table 7 / Fig. 6",
            {"maxscore/2:64": 1.0, "gshard/2:64": -1.0, "maxscore": -1.0, "gshard": 1.0},
            "below 0",
            "authors'",
        ),
        Claim(
            "t decays",
            "a decaying t beats a constant one (t 3 -> 0 against t = 3)",
            "Fig. 10",
            _diff("maxscore", "maxscore/t3const"),
            "below 0",
            "per sequence",
        ),
        Claim(
            "t text vs code",
            "t0 = 4 decaying to 1 as printed (factor 5 -> 2) against the "
            "code's factor 4 -> 1 (t 3 -> 0)",
            "Fig. 10 text vs Eq. SoftTopk",
            _diff("maxscore", "maxscore/t4to1"),
            "none",
            "per sequence",
        ),
    ]
    for operator in ("softkmax", "itertopk", "gradtopk", "sigmoid"):
        out.append(
            Claim(
                f"softtopk>{operator}",
                f"SoftTopk beats {operator} (both with flow)",
                "Fig. 9 / Table 2 operators",
                _diff("maxscore", f"flow/{operator}"),
                "below 0",
                "per sequence",
            )
        )
    return tuple(out)


CLAIMS: tuple[Claim, ...] = _claims()


def outcome(verdict: str, expected: Expectation) -> str:
    """The verdict on a claim's combination read against what the paper expects."""
    if verdict == "too few seeds":
        return "pending (fewer than 2 paired seeds)"
    if expected == "none":
        return {"better": "below 0", "worse": "above 0"}.get(verdict, verdict)
    if expected == "below 0":
        return {
            "better": "reproduces",
            "worse": "contradicted",
            "equivalent": "not reproduced (no difference beyond the margin)",
            "inconclusive": "inconclusive",
        }[verdict]
    return {  # the paper expects no gain beyond the margin
        "equivalent": "reproduces",
        "worse": "reproduces (no gain; worse)",
        "better": "contradicted (a gain)",
        "inconclusive": "inconclusive",
    }[verdict]


# ------------------------------------------------------------------------------------------------
# Loading and summarising
# ------------------------------------------------------------------------------------------------
def load_runs(results: Path) -> tuple[dict[str, dict[int, dict[str, Any]]], list[dict[str, Any]]]:
    """``arm -> seed -> record`` for the plan's runs, and the reruns' records."""
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    reruns = []
    for path in sorted((results / "raw").glob("*/*.json")):
        record = json.loads(path.read_text())
        if record.get("rerun"):
            reruns.append(record)
        else:
            runs.setdefault(record["arm"], {})[int(record["seed"])] = record
    return runs, reruns


def losses(runs: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> dict[str, dict[int, float]]:
    return {
        arm: {s: r["eval_loss"] for s, r in by.items() if r.get("eval_loss") is not None}
        for arm, by in runs.items()
    }


def evaluate_claims(
    runs: Mapping[str, Mapping[int, Mapping[str, Any]]], margin: float = MARGIN
) -> list[dict[str, Any]]:
    """Every claim with its per-seed values, interval, verdict and outcome."""
    table = losses(runs)
    out = []
    for claim in CLAIMS:
        values = evidence.per_seed_combination(table, claim.terms)
        row: dict[str, Any] = {
            "key": claim.key,
            "paper": claim.paper,
            "source": claim.source,
            "groups": claim.groups,
            "terms": dict(claim.terms),
            "expected": claim.expected,
            "per_seed": values,
        }
        if values:
            row["evidence"] = evidence.describe(list(values.values()), CONFIDENCE, margin)
            row["outcome"] = outcome(row["evidence"]["verdict"], claim.expected)
        else:
            row["outcome"] = "pending (no paired seeds yet)"
        out.append(row)
    return out


def arm_summary(arm: str, by_seed: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """Mean over seeds of the arm's loss, speed and routing (first layer and all layers)."""

    def mean(values: list[float]) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.fmean(values) if values else None

    records = list(by_seed.values())
    loss = [r["eval_loss"] for r in records]
    first = [r.get("first_layer", {}) for r in records]
    load = [f.get("load_over_capacity") for f in first if f.get("load_over_capacity")]
    tokens = [f.get("tokens_per_expert") for f in first if f.get("tokens_per_expert")]
    spec = ARMS_BY_NAME.get(arm)
    return {
        "arm": arm,
        "router": spec.router if spec else None,
        "shape": spec.shape if spec else None,
        "group": spec.group if spec else None,
        "seeds": sorted(by_seed),
        "eval_loss": mean(loss),
        "eval_loss_sd": statistics.stdev(loss) if len(loss) > 1 else None,
        "dropped_by_rank": _mean_lists([r["routing_mean"].get("dropped_by_rank") for r in records]),
        "rerouted_by_rank": _mean_lists(
            [r["routing_mean"].get("rerouted_by_rank") for r in records]
        ),
        "first_layer_dropped_by_rank": _mean_lists([f.get("dropped_by_rank") for f in first]),
        "first_layer_load_over_capacity": {
            "mean": mean([statistics.fmean(x) for x in load]),
            "min": mean([min(x) for x in load]),
            "max": mean([max(x) for x in load]),
        }
        if load
        else None,
        "first_layer_max_over_mean_load": mean([max(t) / statistics.fmean(t) for t in tokens])
        if tokens
        else None,
        "tokens_per_s": mean([r.get("tokens_per_s") for r in records]),
        "devices": sorted({r.get("device", "?") for r in records}),
        "dates": sorted({r["date"] for r in records if r.get("date")}),
    }


def _mean_lists(lists: list[list[float] | None]) -> list[float] | None:
    lists = [x for x in lists if x]
    if not lists:
        return None
    return [statistics.fmean(col) for col in zip(*lists)]


def rerun_summary(
    runs: Mapping[str, Mapping[int, Mapping[str, Any]]], reruns: list[dict[str, Any]]
) -> dict[str, Any] | None:
    pairs = []
    rows = []
    for record in reruns:
        first = runs.get(record["arm"], {}).get(int(record["seed"]))
        if first is None:
            continue
        pairs.append((first["eval_loss"], record["eval_loss"]))
        rows.append(
            {
                "arm": record["arm"],
                "seed": record["seed"],
                "first": first["eval_loss"],
                "rerun": record["eval_loss"],
            }
        )
    noise = evidence.rerun_noise(pairs)
    return None if noise is None else {**noise, "rows": rows}


# ------------------------------------------------------------------------------------------------
# The README
# ------------------------------------------------------------------------------------------------
def _fmt_evidence(row: dict[str, Any]) -> str:
    found = row.get("evidence")
    return evidence.format_interval(found) if found else "-"


def _seeds_needed(row: dict[str, Any]) -> str:
    found = row.get("evidence")
    if not found or found.get("sd") is None:
        return "-"
    return str(found["seeds_needed"]) if found.get("seeds_needed") else "> 100,000"


def claim_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| claim (paper) | source | routing groups | paired Δ, mean [95% t] (n seeds) | "
        "outcome | seeds needed |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "evidence" not in row:
            continue
        lines.append(
            f"| {row['paper']} | {row['source']} | {row['groups']} | {_fmt_evidence(row)} | "
            f"**{row['outcome']}** | {_seeds_needed(row)} |"
        )
    pending = [f"{row['paper']} ({row['groups']})" for row in rows if "evidence" not in row]
    if pending:
        lines += ["", "Pending (their arms are not trained yet): " + "; ".join(pending) + "."]
    return lines


def _num(value: float | None, fmt: str = "{:.4f}") -> str:
    return "-" if value is None else fmt.format(value)


def arm_table(summaries: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| arm | router | shape | routing group | seeds | val loss (mean ± sd) | dropped 1st / 2nd"
        " (all layers) | rerouted 1st / 2nd | layer-1 load / capacity mean (min-max) | "
        "layer-1 max / mean load | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:

        def pair(values: list[float] | None) -> str:
            return " / ".join(f"{v:.1%}" for v in values[:2]) if values else "-"

        load = s["first_layer_load_over_capacity"]
        load_text = f"{load['mean']:.3f} ({load['min']:.2f}-{load['max']:.2f})" if load else "-"
        spread = f" ± {s['eval_loss_sd']:.4f}" if s["eval_loss_sd"] is not None else ""
        lines.append(
            f"| {s['arm']} | {s['router']} | {s['shape']} | {s['group']} | {len(s['seeds'])} | "
            f"{_num(s['eval_loss'])}{spread} | {pair(s['dropped_by_rank'])} | "
            f"{pair(s['rerouted_by_rank'])} | {load_text} | "
            f"{_num(s['first_layer_max_over_mean_load'], '{:.2f}')} | "
            f"{_num(s['tokens_per_s'], '{:,.0f}')} |"
        )
    return lines


def sparsity_figure(
    summaries: dict[str, dict[str, Any]], claims: dict[str, Any], out: Path
) -> bool:
    """Δ loss of MaxScore against GShard and DropLess per shape (with intervals) and DropLess's
    first-layer max / mean load per shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = ["2:16", "2:32", "2:64", "8:128", "6:64+1"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    drew = False
    for offset, (rival, color) in enumerate((("gshard", "C0"), ("dropless", "C1"))):
        xs, ys, errs = [], [], []
        for i, shape in enumerate(shapes):
            key = f"maxscore>{rival}" + ("" if shape == "2:16" else f"/{shape}")
            found = claims.get(key, {}).get("evidence")
            if found and found.get("low") is not None:
                xs.append(i + 0.1 * (offset - 0.5))
                ys.append(found["mean"])
                errs.append([[found["mean"] - found["low"]], [found["high"] - found["mean"]]])
        if xs:
            drew = True
            yerr = [[e[0][0] for e in errs], [e[1][0] for e in errs]]
            left.errorbar(
                xs, ys, yerr=yerr, fmt="o", color=color, capsize=4, label=f"MaxScore - {rival}"
            )
    left.axhline(0.0, color="grey", lw=0.8)
    left.set_xticks(range(len(shapes)), shapes)
    left.set_xlabel("sparsity (k : e)")
    left.set_ylabel("Δ validation loss, nats (< 0: MaxScore better)")
    left.set_title("MaxScore's paired difference, 95% t interval over seeds")
    left.legend()
    loads = [
        summaries.get("dropless" if s == "2:16" else f"dropless/{s}", {}).get(
            "first_layer_max_over_mean_load"
        )
        for s in shapes
    ]
    right.bar(range(len(shapes)), [v or 0.0 for v in loads], color="C1")
    right.set_xticks(range(len(shapes)), shapes)
    right.set_ylabel("max / mean tokens per expert")
    right.set_title("DropLess, first MoE layer, last training log")
    fig.tight_layout()
    if drew:
        fig.savefig(out, dpi=110)
    plt.close(fig)
    return drew


def write_report(config: StudyConfig, results: Path, readme: Path) -> dict[str, Any]:
    """``results.json``, ``README.md`` and ``sparsity.png`` from ``results/raw``."""
    runs, reruns = load_runs(results)
    claims = evaluate_claims(runs)
    summaries = [arm_summary(a, runs[a]) for a in ARMS_BY_NAME if a in runs]
    noise = rerun_summary(runs, reruns)
    timing_path = results / "group_timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.is_file() else None
    payload = {
        "settings": config.to_dict(),
        "margin": MARGIN,
        "confidence": CONFIDENCE,
        "claims": claims,
        "arms": summaries,
        "same_seed_noise": noise,
        "group_timing": timing,
    }
    (results / "results.json").write_text(json.dumps(payload, indent=1) + "\n")
    by_key = {c["key"]: c for c in claims}
    figure = sparsity_figure({s["arm"]: s for s in summaries}, by_key, results / "sparsity.png")
    readme.write_text("\n".join(readme_lines(config, payload, figure, readme, results)) + "\n")
    return payload


#: The main README's generated summary sits between these two lines.
BLOCK_BEGIN = "<!-- paper-claims summary: generated by claims_study.py report -->"
BLOCK_END = "<!-- end of paper-claims summary -->"


def update_summary_block(path: Path, payload: dict[str, Any]) -> bool:
    """Replace the lines between :data:`BLOCK_BEGIN` and :data:`BLOCK_END` in ``path`` with the
    study's summary, so that a README quoting the study cannot drift from its raw results.
    Returns False (and writes nothing) when ``path`` has no such block."""
    text = path.read_text()
    begin, end = text.find(BLOCK_BEGIN), text.find(BLOCK_END)
    if begin < 0 or end < begin:
        return False
    block = "\n".join([BLOCK_BEGIN, *headline_lines(payload), ""])
    path.write_text(text[:begin] + block + text[end:])
    return True


#: The claims the README's summary states first.
HEADLINE: tuple[str, ...] = (
    "maxscore>gshard@seq",
    "maxscore>gshard@8seq",
    "maxscore>gshard",
    "group confound",
    "maxscore>gshard/2:32",
    "maxscore>gshard/2:64",
    "maxscore>dropless",
    "maxscore>dropless/2:32",
    "maxscore>dropless/2:64",
)


def headline_lines(payload: dict[str, Any]) -> list[str]:
    """The summary: the headline claims in words, then what the noise says about them."""
    by_key = {c["key"]: c for c in payload["claims"]}
    # The headline claims, then every other claim the data resolved either way.
    resolved = [
        c["key"]
        for c in payload["claims"]
        if c["key"] not in HEADLINE and "evidence" in c and c["outcome"] != "inconclusive"
    ]
    lines = []
    for key in (*HEADLINE, *resolved):
        row = by_key.get(key)
        if row is None or "evidence" not in row:
            continue
        found = row["evidence"]
        text = f"- {row['paper']}, routing groups {row['groups']}: Δ "
        text += f"{evidence.format_interval(found)}: "
        text += f"**{row['outcome']}**"
        if row["outcome"] == "inconclusive" and found.get("seeds_needed"):
            text += f" (about {found['seeds_needed']} paired seeds would resolve it)"
        lines.append(text + ".")
    loads = {
        a["shape"]: a["first_layer_max_over_mean_load"]
        for a in payload["arms"]
        if a["router"] == "dropless" and a["first_layer_max_over_mean_load"] is not None
    }
    if loads:
        seeds = {a["shape"]: len(a["seeds"]) for a in payload["arms"] if a["router"] == "dropless"}
        listed = ", ".join(f"{k} {v:.2f} ({seeds[k]} seeds)" for k, v in loads.items())
        lines.append(
            "- DropLess's imbalance by sparsity (the paper, Fig. 7: it grows): the first MoE "
            f"layer's max / mean tokens per expert at the last training log, {listed}."
        )
    noise = payload.get("same_seed_noise")
    spreads = [
        by_key[k]["evidence"]["sd"]
        for k in ("maxscore>gshard", "maxscore>gshard@seq")
        if k in by_key and by_key[k].get("evidence", {}).get("sd")
    ]
    if noise and spreads and not payload["settings"].get("deterministic"):
        lines += [
            "",
            f"Same-seed noise: one seed trained twice lands up to {noise['max_abs_difference']:.3f}"
            f" nats apart (non-deterministic kernels; one run's sd {noise['run_sd']:.4f}), which "
            f"alone gives a paired difference a spread of {2**0.5 * noise['run_sd']:.3f} nats "
            f"of the {min(spreads):.3f}-{max(spreads):.3f} measured over seeds. "
            "`--deterministic` removes it (`benchmarks/determinism/`: reruns equal to the bit, "
            "0.6-0.8x the tokens/s).",
        ]
    return lines


def readme_lines(
    config: StudyConfig, payload: dict[str, Any], figure: bool, readme: Path, results: Path
) -> list[str]:
    from claims_text import HEADER, deviations, method_lines, not_attempted

    claims = payload["claims"]
    runs = sum(len(a["seeds"]) for a in payload["arms"])
    devices = sorted({d for a in payload["arms"] for d in a["devices"]})
    rel = results.relative_to(readme.parent) if results.is_relative_to(readme.parent) else results
    lines = [*HEADER, "", "## Summary", ""]
    lines += headline_lines(payload)
    lines += [""]
    dates = sorted({d for a in payload["arms"] for d in a.get("dates", [])})
    lines += method_lines(config, runs, devices, MARGIN, dates, len(claims))
    lines += ["", "## Claims", ""]
    lines += claim_table(claims)
    noise = payload["same_seed_noise"]
    lines += ["", "## Same-seed noise", ""]
    if noise:
        lines.append(
            f"The first seed of {', '.join(sorted({r['arm'] for r in noise['rows']}))} trained "
            f"twice with identical settings: largest |difference| "
            f"{noise['max_abs_difference']:.2e} nats over {noise['pairs']} pair(s)"
            + (" (deterministic mode)." if config.deterministic else ".")
        )
    else:
        lines.append("Not measured yet (the reruns are pending).")
    timing = payload["group_timing"]
    lines += ["", "## Routing groups", ""]
    if timing:
        lines.append(
            f"The GPU flow solver on one micro-batch of 64 x 512 tokens (e = 16, k = 2, "
            f"{timing['device']}):"
        )
        lines += ["", "| group | groups | ms per micro-batch |", "|---|---|---|"]
        for row in timing["rows"]:
            lines.append(
                f"| {row['group_tokens']:,} tokens | {row['groups']} | "
                f"{row['ms_per_micro_batch']:.2f} |"
            )
        whole = timing["rows"][-1]["ms_per_micro_batch"]
        trained = {a["arm"] for a in payload["arms"]}

        def state(arm: str) -> str:
            return "run" if arm in trained else "planned"

        lines += [
            "",
            f"One group of the whole micro-batch costs {whole:.0f} ms per MoE layer and "
            f"micro-batch ({whole * STUDY_LAYERS / 1e3:.2f} s a step for the study's "
            f"{STUDY_LAYERS} layers, one block of the GPU working alone), so the common groups "
            f"are one sequence (`@seq`, {state('maxscore')}) and 8 sequences (`@8seq`, "
            f"{state('maxscore@8seq')}). In groups of 8 sequences, a validation batch that does "
            "not fill whole groups (the split's last) is routed with masked padding sequences in "
            "its last group, which keeps a full group's capacity.",
        ]
    lines += ["", "## Arms", ""]
    lines += arm_table(payload["arms"])
    if figure:
        lines += ["", f"![sparsity]({rel}/sparsity.png)"]
    lines += ["", "## Deviations from the paper", "", *deviations(config)]
    unrun = [arm for arm in ARMS_BY_NAME if arm not in {a["arm"] for a in payload["arms"]}]
    lines += ["", "## Not attempted", "", *not_attempted(unrun)]
    return lines


__all__ = ["CLAIMS", "Claim", "evaluate_claims", "outcome", "write_report"]
