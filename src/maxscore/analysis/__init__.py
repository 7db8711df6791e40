"""Routing analysis: run directories in, the paper's figures and markdown reports out.

* :mod:`~maxscore.analysis.runs` -- read ``config.json`` / ``metrics.jsonl`` of a run;
* :mod:`~maxscore.analysis.checkpoint_stats` -- measure routing by running a checkpoint;
* :mod:`~maxscore.analysis.plots` -- the figures (matplotlib, Agg);
* :mod:`~maxscore.analysis.analyze` -- ``maxscore analyze``: figures + ``analysis.md``;
* :mod:`~maxscore.analysis.markdown` -- the ``analysis.md`` page and the analyze output names;
* :mod:`~maxscore.analysis.report` -- ``maxscore report``: compare + eval + analyze on one page.

Names are imported on first use (matplotlib only loads when a figure is drawn).
"""

from typing import TYPE_CHECKING

from maxscore._lazy import lazy_exports

if TYPE_CHECKING:
    from maxscore.analysis.analyze import AnalysisResult, analyze
    from maxscore.analysis.report import ReportError, combined_report
    from maxscore.analysis.runs import RoutingSnapshot, RunData, RunError, load_run

_EXPORTS = {
    "maxscore.analysis.analyze": (
        "AnalysisResult",
        "analyze",
    ),
    "maxscore.analysis.report": (
        "ReportError",
        "combined_report",
    ),
    "maxscore.analysis.runs": (
        "RoutingSnapshot",
        "RunData",
        "RunError",
        "load_run",
    ),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = [
    "AnalysisResult",
    "ReportError",
    "RoutingSnapshot",
    "RunData",
    "RunError",
    "analyze",
    "combined_report",
    "load_run",
]
