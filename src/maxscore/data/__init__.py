"""Embedded default data: a permissively licensed English corpus and a 32k LLaMA-style tokenizer.

Both ship inside the package, so ``maxscore train`` works offline on a fresh machine.
Provenance and licences: ``corpus/PROVENANCE.md`` and ``tokenizer/PROVENANCE.md``; both are
rebuilt by the scripts in ``scripts/`` from registry packages.
"""

from __future__ import annotations

import json
import lzma
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

DATA_DIR = Path(__file__).resolve().parent
DEFAULT_CORPUS_FILE = DATA_DIR / "corpus" / "corpus.jsonl.xz"
DEFAULT_TOKENIZER_DIR = DATA_DIR / "tokenizer"

Split = Literal["train", "validation"]


@lru_cache(maxsize=1)
def _corpus_records() -> tuple[dict[str, str], ...]:
    if not DEFAULT_CORPUS_FILE.is_file():
        raise FileNotFoundError(
            f"the embedded corpus {DEFAULT_CORPUS_FILE} is missing; reinstall maxscore or rebuild "
            "it with scripts/build_default_corpus.py"
        )
    with lzma.open(DEFAULT_CORPUS_FILE, "rt", encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f)


def default_corpus_records(split: Split | None = None) -> list[dict[str, str]]:
    """The corpus as records ``{"id", "source", "split", "text"}`` (one per document section)."""
    records = _corpus_records()
    if split is None:
        return list(records)
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    return [r for r in records if r["split"] == split]


def load_default_corpus() -> dict[str, list[str]]:
    """The embedded corpus as ``{"train": [text, ...], "validation": [text, ...]}``.

    About 38M characters (~9M tokens with the default tokenizer) from Project Gutenberg books,
    State of the Union addresses, the Brown corpus, Shakespeare's plays and BBC News articles.
    Documents are sections of at most 2,000 words; 2% of sections (chosen by a hash of their id)
    form the validation split.
    """
    out: dict[str, list[str]] = {"train": [], "validation": []}
    for r in _corpus_records():
        out[r["split"]].append(r["text"])
    return out


def load_default_tokenizer() -> PreTrainedTokenizerFast:
    """The default 32,000-token LLaMA-style tokenizer (SentencePiece BPE with byte fallback).

    Adds ``<s>`` (BOS) in front of every encoded text; ``</s>`` is EOS and doubles as padding.
    """
    # transformers on use: this package is read when the command line starts (DataConfig).
    from transformers import PreTrainedTokenizerFast

    if not (DEFAULT_TOKENIZER_DIR / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"the embedded tokenizer in {DEFAULT_TOKENIZER_DIR} is missing; reinstall maxscore or "
            "rebuild it with scripts/build_default_tokenizer.py"
        )
    return PreTrainedTokenizerFast.from_pretrained(str(DEFAULT_TOKENIZER_DIR))


__all__ = [
    "DEFAULT_CORPUS_FILE",
    "DEFAULT_TOKENIZER_DIR",
    "default_corpus_records",
    "load_default_corpus",
    "load_default_tokenizer",
]
