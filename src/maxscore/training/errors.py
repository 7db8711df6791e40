"""The error a training configuration raises before any training starts.

Its own module so that :mod:`~maxscore.training.config` and the modules that check parts of a
configuration for it (:mod:`~maxscore.training.reporting`) import it without importing each
other.
"""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A training configuration that cannot work; raised before any training starts."""
