"""The paper-reproduction study's README, rendered from its ``results.json`` by
:func:`render_readme` (every number and verdict in it comes from that file)."""

from __future__ import annotations

from typing import Any

from study_plan import SUPERSEDED
from study_verdicts import CHANCE, MARGIN, _per_card

from maxscore.training import evidence

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
