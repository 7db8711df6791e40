"""Hooks the bundled task YAMLs reference with ``!function utils.<name>``.

lm-eval imports this file by path, so it must only depend on the installed ``maxscore``
package (which is what lets the plain ``lm_eval --include_path <this dir>`` command work).
"""

from __future__ import annotations

import re
from typing import Any

from maxscore.evaluation.data import load_task_dataset


def load_bundled(maxscore_source: str, **_ignored: Any) -> Any:
    """``custom_dataset`` hook: the cached (downloaded on first use) splits of one task.

    lm-eval passes the task metadata and ``dataset_kwargs`` as keyword arguments; only
    ``maxscore_source`` (the standard task name whose documents to load) matters here.
    """
    return load_task_dataset(maxscore_source)


_BRACKETED = re.compile(r"\[.*?\]")


def _clean_hellaswag(text: str) -> str:
    """Normalise HellaSwag text the way the standard lm-eval task does.

    WikiHow contexts carry markup such as ``[title]`` and ``[step]``; a title marker becomes a
    sentence break, every other bracketed marker is removed, and double spaces collapse.
    """
    text = text.strip().replace(" [title]", ". ")
    text = _BRACKETED.sub("", text)
    return text.replace("  ", " ")


# lm-eval calls process_docs each time it asks for the documents (several times per run);
# HellaSwag has 10k of them, so the processed dataset is kept per source fingerprint.
_PROCESSED: dict[str, Any] = {}


def hellaswag_docs(dataset: Any) -> Any:
    """``process_docs`` for HellaSwag: build the query, the cleaned endings and the gold index."""
    key = getattr(dataset, "_fingerprint", None)
    if key is not None and key in _PROCESSED:
        return _PROCESSED[key]

    def build(doc: dict[str, Any]) -> dict[str, Any]:
        context = f"{doc['ctx_a']} {doc['ctx_b'].capitalize()}"
        return {
            "query": _clean_hellaswag(f"{doc['activity_label']}: {context}"),
            "choices": [_clean_hellaswag(ending) for ending in doc["endings"]],
            "gold": int(doc["label"]),
        }

    processed = dataset.map(build)
    if key is not None:
        _PROCESSED[key] = processed
    return processed
