"""A run directory's files on disk: where checkpoints are, and whether their files are intact.

Written by :mod:`maxscore.training` and read by :mod:`maxscore.evaluation` and
:mod:`maxscore.analysis`, so it lives below all three and imports none of them (nor torch):
:mod:`~maxscore.checkpoints.layout` (names and locations), :mod:`~maxscore.checkpoints.integrity`
(each checkpoint's ``integrity.json``).
"""
