"""Markdown reports: the ``analysis.md`` of ``maxscore analyze`` and the combined ``maxscore report``.

``maxscore report`` takes any mix of output directories and puts them on one page:

* a ``maxscore compare`` directory (``comparison.md``): the router comparison table and plot;
* a ``maxscore eval`` directory (``eval_results.json``): all models merged into one
  paper-layout table;
* a ``maxscore analyze`` directory (``analysis.json`` + ``analysis.md``): its figures and tables;
* a run directory: its ``eval/`` and ``analysis/`` sub-directories, if present.

Image links are rewritten relative to the report file, so the page renders where it is written.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from maxscore.analysis.plots import rank_name

if TYPE_CHECKING:
    from maxscore.analysis.analyze import AnalysisResult

COMPARISON_MD = "comparison.md"
_IMAGE_LINK = re.compile(r"!\[([^\]]*)\]\(([^)\s]+)\)")


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


def analysis_markdown(result: AnalysisResult) -> str:
    """The ``analysis.md`` page: figures side by side for all runs, numbers as tables."""
    data = result.data
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
    if result.notes:
        lines += ["## Notes", "", *(f"- {note}" for note in result.notes), ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# combined report
# ------------------------------------------------------------------------------------------
@dataclass
class ReportSources:
    """Output directories found for ``maxscore report``, by kind."""

    compare: list[Path] = field(default_factory=list)
    eval: list[Path] = field(default_factory=list)
    analysis: list[Path] = field(default_factory=list)


class ReportError(ValueError):
    """Nothing usable at a path given to ``maxscore report``."""


def classify(paths: Sequence[str | Path]) -> ReportSources:
    """Sort directories into compare / eval / analysis outputs.

    Outputs are looked for in each given directory and up to two levels below it, so a run
    directory contributes its ``eval/`` and ``analysis/``, and a compare directory those of
    its runs too.
    """
    from maxscore.analysis.analyze import ANALYSIS_JSON
    from maxscore.evaluation.results import RESULTS_JSON

    found = ReportSources()

    def add(bucket: list[Path], directory: Path) -> None:
        if directory.resolve() not in [p.resolve() for p in bucket]:
            bucket.append(directory)

    for raw in paths:
        path = Path(raw).expanduser()
        if not path.exists():
            raise ReportError(f"not found: {path}")
        if path.is_file():
            path = path.parent
        # Counted per path, duplicates included: a run inside a compare directory given as
        # well holds outputs even though the compare directory already contributed them.
        matched = 0
        if (path / COMPARISON_MD).is_file():
            add(found.compare, path)
            matched += 1
        for pattern in (RESULTS_JSON, f"*/{RESULTS_JSON}", f"*/*/{RESULTS_JSON}"):
            for hit in sorted(path.glob(pattern)):
                add(found.eval, hit.parent)
                matched += 1
        for pattern in (ANALYSIS_JSON, f"*/{ANALYSIS_JSON}", f"*/*/{ANALYSIS_JSON}"):
            for hit in sorted(path.glob(pattern)):
                add(found.analysis, hit.parent)
                matched += 1
        if matched:
            continue
        is_run = (path / "metrics.jsonl").is_file()
        if is_run and any(path.resolve().is_relative_to(c.resolve()) for c in found.compare):
            continue  # a run of a compare directory given too: its training is in that table
        hint = f"; run `maxscore eval {path}` or `maxscore analyze {path}` first" if is_run else ""
        raise ReportError(
            f"{path} holds no compare ({COMPARISON_MD}), eval ({RESULTS_JSON}) or analyze "
            f"({ANALYSIS_JSON}) output{hint}"
        )
    return found


def _relink(markdown: str, source_dir: Path, report_dir: Path) -> str:
    """Rewrite relative image links of ``markdown`` (written in ``source_dir``) for ``report_dir``."""

    def fix(match: re.Match[str]) -> str:
        alt, target = match.group(1), match.group(2)
        if re.match(r"^[a-z]+://", target) or Path(target).is_absolute():
            return match.group(0)
        rel = os.path.relpath((source_dir / target).resolve(), report_dir.resolve())
        return f"![{alt}]({Path(rel).as_posix()})"

    return _IMAGE_LINK.sub(fix, markdown)


def _demote(markdown: str, levels: int = 1) -> str:
    """Push headings down so embedded pages nest under the report's sections."""
    return re.sub(r"^(#+)", lambda m: m.group(1) + "#" * levels, markdown, flags=re.MULTILINE)


def combined_report(
    paths: Sequence[str | Path], output: str | Path, title: str = "maxscore report"
) -> Path:
    """Write one markdown page combining compare, eval and analyze outputs; return its path."""
    from maxscore.evaluation.results import load_results, markdown_table, routing_table

    sources = classify(paths)
    out = Path(output)
    if out.suffix.lower() != ".md":
        out = out / "report.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    report_dir = out.parent
    lines = [f"# {title}", ""]
    if sources.compare:
        lines += ["## Router comparison (training)", ""]
        for path in sources.compare:
            body = (path / COMPARISON_MD).read_text()
            body = re.sub(r"^# .*\n", "", body, count=1)  # the page's own title
            lines += [
                f"Source: `{path}`",
                "",
                _demote(_relink(body, path, report_dir), 1).strip(),
                "",
            ]
    if sources.eval:
        models: list[dict[str, Any]] = []
        limits = set()
        for path in sources.eval:
            payload = load_results(path)
            limits.add(payload.get("limit"))
            for model in payload["models"]:
                # The same checkpoint evaluated twice (e.g. per run and in a combined
                # directory) shows once: the later result wins.
                key = (model.get("name"), model.get("checkpoint"))
                models = [m for m in models if (m.get("name"), m.get("checkpoint")) != key]
                models.append(model)
        lines += ["## Downstream evaluation (lm-evaluation-harness, zero-shot)", ""]
        lines += [
            "Scores in percent (accuracy; ReCoRD: F1); Avg. over the columns shown.",
            "",
            markdown_table(models),
            "",
        ]
        if limits - {None}:
            shown = ", ".join(sorted(str(x) for x in limits if x is not None))
            lines += [f"Note: evaluated on at most {shown} documents per task (--limit).", ""]
        lines += ["Evaluation routing:", "", routing_table(models), ""]
    if sources.analysis:
        lines += ["## Routing analysis", ""]
        for path in sources.analysis:
            from maxscore.analysis.analyze import ANALYSIS_MD

            md_path = path / ANALYSIS_MD
            if md_path.is_file():
                body = md_path.read_text()
                body = re.sub(r"^# .*\n", "", body, count=1)
            else:
                body = (
                    "```json\n"
                    + json.dumps(json.loads((path / "analysis.json").read_text()), indent=1)[:4000]
                    + "\n```"
                )
            lines += [
                f"Source: `{path}`",
                "",
                _demote(_relink(body, path, report_dir), 1).strip(),
                "",
            ]
    out.write_text("\n".join(lines))
    return out
