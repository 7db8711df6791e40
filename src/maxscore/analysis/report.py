"""``maxscore report``: compare, eval and analyze outputs combined on one markdown page.

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
from typing import Any

from maxscore.analysis.markdown import ANALYSIS_JSON, ANALYSIS_MD
from maxscore.evaluation.results import RESULTS_JSON, load_results, markdown_table, routing_table
from maxscore.write_errors import reported_write, write_text_atomically

COMPARISON_MD = "comparison.md"
_IMAGE_LINK = re.compile(r"!\[([^\]]*)\]\(([^)\s]+)\)")


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
    """Write one markdown page combining compare, eval and analyze outputs; return its path.

    A full disk or a read-only folder is a :class:`~maxscore.write_errors.FileWriteError`; an
    earlier page at ``output`` then stays as it was."""
    sources = classify(paths)
    out = Path(output)
    if out.suffix.lower() != ".md":
        out = out / "report.md"
    with reported_write("the report's folder", out.parent):
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
            md_path = path / ANALYSIS_MD
            if md_path.is_file():
                body = md_path.read_text()
                body = re.sub(r"^# .*\n", "", body, count=1)
            else:
                body = (
                    "```json\n"
                    + json.dumps(json.loads((path / ANALYSIS_JSON).read_text()), indent=1)[:4000]
                    + "\n```"
                )
            lines += [
                f"Source: `{path}`",
                "",
                _demote(_relink(body, path, report_dir), 1).strip(),
                "",
            ]
    # Whole or not at all: a full disk leaves an earlier report as it was.
    write_text_atomically(out, "\n".join(lines), "the report")
    return out
