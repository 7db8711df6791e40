"""Training: typed config, data packing, HF Trainer integration, run directories, comparisons.

``maxscore train`` and ``maxscore compare`` are thin wrappers over :func:`train` and
:func:`compare`. See :mod:`maxscore.training.run` for what the run directory holds and
:mod:`maxscore.training.data` for how documents are packed into blocks. Names are imported on
first use, so ``maxscore.training.config`` loads without torch or transformers.
"""

from typing import TYPE_CHECKING

from maxscore._lazy import lazy_exports

if TYPE_CHECKING:
    from maxscore.data.sources import DataError
    from maxscore.training.config import ConfigError, TrainConfig, apply_recipe
    from maxscore.training.data import build_training_data, load_tokenizer
    from maxscore.training.metrics import METRICS_SCHEMA
    from maxscore.training.recipes import PAPER_RECIPE
    from maxscore.training.run import PreparedRun, TrainResult, format_summary, prepare, train

_EXPORTS = {
    "maxscore.training.config": ("ConfigError", "TrainConfig", "apply_recipe"),
    "maxscore.training.recipes": ("PAPER_RECIPE",),
    "maxscore.data.sources": ("DataError",),
    "maxscore.training.data": ("build_training_data", "load_tokenizer"),
    "maxscore.training.metrics": ("METRICS_SCHEMA",),
    "maxscore.training.run": (
        "PreparedRun",
        "TrainResult",
        "format_summary",
        "prepare",
        "train",
    ),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = [
    "METRICS_SCHEMA",
    "PAPER_RECIPE",
    "ConfigError",
    "DataError",
    "PreparedRun",
    "TrainConfig",
    "TrainResult",
    "apply_recipe",
    "build_training_data",
    "format_summary",
    "load_tokenizer",
    "prepare",
    "train",
]
