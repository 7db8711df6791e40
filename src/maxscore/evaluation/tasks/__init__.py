"""Bundled lm-eval task definitions (YAML) for offline evaluation; see ``maxscore.evaluation``."""
