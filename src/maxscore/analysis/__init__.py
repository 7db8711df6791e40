"""Routing analysis: run directories in, the paper's figures and markdown reports out.

* :mod:`~maxscore.analysis.runs` -- read ``config.json`` / ``metrics.jsonl`` of a run;
* :mod:`~maxscore.analysis.checkpoint_stats` -- measure routing by running a checkpoint;
* :mod:`~maxscore.analysis.plots` -- the figures (matplotlib, Agg);
* :mod:`~maxscore.analysis.analyze` -- ``maxscore analyze``: figures + ``analysis.md``;
* :mod:`~maxscore.analysis.report` -- ``maxscore report``: compare + eval + analyze on one page.
"""

from maxscore.analysis.analyze import AnalysisResult, analyze
from maxscore.analysis.report import ReportError, combined_report
from maxscore.analysis.runs import RoutingSnapshot, RunData, RunError, load_run

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
