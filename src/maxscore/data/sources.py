"""Text sources: the documents of a :class:`~maxscore.data.config.DataConfig`'s ``dataset``,
split into train and validation.

Sources (``dataset``):

* ``"default"`` — the embedded corpus of :mod:`maxscore.data` (train / validation split shipped).
* a local ``.txt`` file, ``.jsonl`` file (one JSON object per line, text in ``text_field``) or
  a folder of them. A ``.txt`` file's documents are separated by blank lines (lines empty or only
  white space), or with ``txt_documents="lines"`` each non-blank line is one
  (:func:`split_txt_documents`). ``validation_fraction`` of the documents (at least one) is held
  out for validation; a source of fewer than two documents is refused with the reason (an empty
  or white-space file, a whole file without blank lines read as one document).
* any Hugging Face dataset name (``"c4"`` means ``allenai/c4`` with config ``en``, streamed).

Read by training (:mod:`maxscore.training.data`) and by the analysis of a saved checkpoint,
which rebuilds its run's validation blocks.
"""

from __future__ import annotations

import json
import random
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maxscore.config_types import ConfigError
from maxscore.data import load_default_corpus
from maxscore.data.config import DataConfig

__all__ = [
    "DATASET_ALIASES",
    "STREAMING_EVAL_BLOCKS",
    "DataError",
    "TextSplits",
    "load_text_splits",
    "local_files",
    "read_jsonl_records",
    "split_txt_documents",
    "too_few_for_fraction",
]

#: Short names for well-known Hugging Face datasets: name -> (path, config, streaming default).
DATASET_ALIASES: dict[str, tuple[str, str | None, bool]] = {
    "c4": ("allenai/c4", "en", True),
    "allenai/c4": ("allenai/c4", "en", True),
}

#: Validation blocks aimed at when streaming without ``max_eval_blocks`` (512 x 512 tokens).
STREAMING_EVAL_BLOCKS = 512


class DataError(ConfigError):
    """A data source that cannot be used (missing, empty, too small); raised before training."""


@dataclass
class TextSplits:
    """Documents of a source: ``train`` and ``validation`` lists, or a streaming ``train``."""

    train: list[str] | None
    validation: list[str]
    description: str
    stream_factory: Callable[[int], Iterable[str]] | None = None
    #: ``validation_fraction`` when the validation documents were held out of one list of
    #: documents (None: the source's own validation split).
    held_out_fraction: float | None = None


#: Share of a text file's characters that may be control characters or undecodable bytes
#: before it is refused as binary; above the first threshold it is trained on with a warning.
BINARY_WARN_FRACTION = 0.001
BINARY_REFUSE_FRACTION = 0.05
#: ASCII control bytes other than white space (tab, newlines, form feed).
_CONTROL_BYTES = bytes(b for b in range(32) if b not in b"\t\n\v\f\r")


def _non_text_fraction(raw: bytes, text: str) -> float:
    """Share of ``text``'s characters that are control characters or undecodable bytes
    (``text`` is ``raw`` decoded with replacement; counted in C, not per character)."""
    if not text:
        return 0.0
    controls = len(raw) - len(raw.translate(None, _CONTROL_BYTES))
    return (controls + text.count("\ufffd")) / len(text)


def _first_undecodable_line(raw: bytes) -> int | None:
    """1-based line of the first byte sequence that is not UTF-8, or None."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return raw.count(b"\n", 0, err.start) + 1
    return None


#: A blank line between two documents of a ``.txt`` file: empty or only white space (so
#: ``\r\n`` line ends count too); several in a row are one separator.
_BLANK_LINES = re.compile(r"\n\s*\n")


def split_txt_documents(text: str, rule: str = "paragraphs") -> list[str]:
    """The documents of a ``.txt`` file's text (``TrainConfig.txt_documents``), stripped.

    ``"paragraphs"``: separated by blank lines (lines empty or only white space);
    ``"lines"``: every non-blank line. Empty documents are dropped.
    """
    if rule not in ("paragraphs", "lines"):
        raise DataError(f"unknown .txt document rule {rule!r}; use 'paragraphs' or 'lines'")
    parts = text.split("\n") if rule == "lines" else _BLANK_LINES.split(text)
    return [d.strip() for d in parts if d.strip()]


def _read_txt(file: Path, rule: str = "paragraphs") -> list[str]:
    """Documents of a ``.txt`` file (:func:`split_txt_documents`); refuses files that are not
    text.

    Undecodable bytes are replaced (U+FFFD) with a warning naming the first bad line; a file
    whose characters are more than ``BINARY_REFUSE_FRACTION`` control characters or bad bytes
    (an archive, a model file renamed ``.txt``) is refused.
    """
    raw = file.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    fraction = _non_text_fraction(raw, text)
    if fraction > BINARY_REFUSE_FRACTION:
        raise DataError(
            f"{file} does not look like text: {fraction:.0%} of its characters are control "
            "characters or bytes that are not UTF-8 (a binary file?); convert it to UTF-8 text"
        )
    bad_line = _first_undecodable_line(raw)
    if bad_line is not None or fraction > BINARY_WARN_FRACTION:
        where = f" (first at line {bad_line})" if bad_line is not None else ""
        print(
            f"maxscore: warning: {file}: {fraction:.2%} of the characters are control characters"
            f" or bytes that are not UTF-8{where}; training on it with those replaced",
            file=sys.stderr,
        )
    return split_txt_documents(text, rule)


def read_jsonl_records(file: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, record)`` of a ``.jsonl`` file: one JSON object per non-blank line."""
    with file.open("rb") as handle:
        for line_no, raw in enumerate(handle, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{file}:{line_no}: not UTF-8 (byte {raw[err.start]:#04x} at column "
                    f"{err.start + 1}); JSON Lines files must be UTF-8"
                ) from err
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{file}:{line_no}: not valid JSON ({err})") from err
            if not isinstance(record, dict):
                raise DataError(
                    f"{file}:{line_no}: expected a JSON object, got {type(record).__name__}"
                )
            yield line_no, record


def _read_jsonl(file: Path, text_field: str) -> list[str]:
    """Documents of a ``.jsonl`` file: one JSON object per line, text in ``text_field``."""
    docs: list[str] = []
    for line_no, record in read_jsonl_records(file):
        if text_field not in record:
            raise DataError(
                f"{file}:{line_no}: no field {text_field!r} (fields: {sorted(record)}); set "
                "--text-field, or --data-format for chat / prompt-completion records"
            )
        value = record[text_field]
        if not isinstance(value, str):
            raise DataError(
                f"{file}:{line_no}: field {text_field!r} holds {type(value).__name__}, not text"
            )
        docs.append(value)
    return docs


#: Readers of local files, by suffix: ``reader(file, text_field, txt_documents)``.
_LOCAL_READERS: dict[str, Callable[[Path, str, str], list[str]]] = {
    ".txt": lambda file, _field, rule: _read_txt(file, rule),
    ".jsonl": lambda file, field, _rule: _read_jsonl(file, field),
}


def local_files(path: Path) -> list[Path]:
    """The data files of a local source: the file itself, or a folder's .txt / .jsonl files."""
    if not path.is_dir():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.suffix in _LOCAL_READERS)
    if not files:
        raise DataError(f"folder {str(path)!r} holds no .txt or .jsonl files")
    return files


def _read_local(path: Path, text_field: str, txt_documents: str = "paragraphs") -> list[str]:
    docs: list[str] = []
    for file in local_files(path):
        reader = _LOCAL_READERS.get(file.suffix)
        if reader is None:
            raise DataError(
                f"unsupported file type {file.suffix!r} for {str(file)!r}: use .txt or .jsonl"
            )
        docs.extend(reader(file, text_field, txt_documents))
    return docs


def _why_too_few_documents(path: Path, docs: list[str], config: DataConfig) -> str:
    """Why a local source of fewer than two documents gives no validation document."""
    files = local_files(path)
    one = len(files) == 1 and not path.is_dir()
    if not docs:
        if all(f.stat().st_size == 0 for f in files):
            return "the file is empty" if one else f"its {len(files)} data files are empty"
        return (
            "the file holds only white space"
            if one
            else f"its {len(files)} data files hold only white space (or nothing)"
        )
    if config.txt_documents == "paragraphs":
        txt_lines = sum(
            sum(
                1
                for line in f.read_text(encoding="utf-8", errors="replace").split("\n")
                if line.strip()
            )
            for f in files
            if f.suffix == ".txt"
        )
        if txt_lines > 1:
            what = "the whole file is" if one else "all its .txt text is"
            return (
                f"{what} one document: documents in a .txt file are separated by blank lines, "
                f"and its {txt_lines:,} lines have no blank line between them; for one document "
                "per line pass --txt-documents lines"
            )
    return too_few_for_fraction(1, config.validation_fraction, "the file" if one else "it")


def too_few_for_fraction(n_docs: int, fraction: float, subject: str = "it") -> str:
    return (
        f"{subject} holds {n_docs} document{'s' if n_docs != 1 else ''}, and holding "
        f"validation_fraction={fraction:g} of the documents out for validation needs at least 2 "
        "(one to validate on, the rest to train on)"
    )


def _split_validation(docs: list[str], fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Seeded shuffle, then hold out ``fraction`` of the documents (at least one)."""
    docs = list(docs)
    random.Random(seed).shuffle(docs)
    n_val = max(1, round(fraction * len(docs))) if len(docs) > 1 else 0
    return docs[n_val:], docs[:n_val]


def _hf_source(config: DataConfig) -> TextSplits:
    name, ds_config, stream_default = DATASET_ALIASES.get(
        config.dataset, (config.dataset, None, False)
    )
    ds_config = config.dataset_config or ds_config
    streaming = stream_default if config.streaming is None else config.streaming
    try:  # heavy (pyarrow): only Hugging Face datasets need it
        import datasets
    except ImportError as err:
        raise DataError(
            f"dataset {config.dataset!r} needs the 'datasets' package (pip install datasets)"
        ) from err

    def load(split: str) -> Any:
        return datasets.load_dataset(name, ds_config, split=split, streaming=streaming)

    try:
        train = load("train")
    except Exception as err:  # hub / file-not-found / offline errors come in many types
        raise DataError(
            f"cannot load dataset {config.dataset!r} (path {name!r}, config {ds_config!r}): "
            f"{type(err).__name__}: {err}. Known offline sources: 'default' or a local "
            ".txt/.jsonl file or folder."
        ) from err
    field = config.text_field
    try:
        validation = load("validation")
    except Exception:
        validation = None

    if streaming:
        # First documents of the validation split (or of train, skipped by training) for eval.
        if validation is None:
            raise DataError(
                f"streaming dataset {config.dataset!r} has no 'validation' split; "
                "use a non-streaming load (--no-streaming) to hold documents out"
            )
        # The first documents of the stream: four per block wanted (64 at least).
        wanted = config.max_eval_blocks or STREAMING_EVAL_BLOCKS
        val_docs = [str(row[field]) for _, row in zip(range(max(64, 4 * wanted)), validation)]

        def factory(seed: int) -> Iterable[str]:
            # A seeded shuffle buffer: same seed, same order.
            ds = train.shuffle(seed=seed, buffer_size=10_000)
            return (str(row[field]) for row in ds)

        return TextSplits(None, val_docs, f"{name} ({ds_config}), streaming", factory)

    if field not in train.column_names:
        raise DataError(
            f"dataset {config.dataset!r} has no column {field!r} (columns: {train.column_names});"
            " set --text-field"
        )
    train_docs = [str(t) for t in train[field]]
    if validation is not None:
        val_docs = [str(t) for t in validation[field]]
        held_out = None
    else:
        train_docs, val_docs = _split_validation(
            train_docs, config.validation_fraction, config.seed
        )
        held_out = config.validation_fraction
    return TextSplits(train_docs, val_docs, f"{name} ({ds_config})", held_out_fraction=held_out)


def load_text_splits(config: DataConfig) -> TextSplits:
    """The documents of ``config.dataset`` split into train and validation."""
    source = config.dataset
    if source in ("default", "embedded"):
        if config.txt_documents != "paragraphs":
            raise DataError(
                f"--txt-documents {config.txt_documents} applies to local .txt files, and the "
                "embedded corpus is not one"
            )
        corpus = load_default_corpus()
        return TextSplits(
            list(corpus["train"]), list(corpus["validation"]), "embedded default corpus"
        )
    path = Path(source).expanduser()
    if path.exists() or source.endswith((".txt", ".jsonl")) or source.startswith((".", "/")):
        if not path.exists():
            raise DataError(f"data file or folder {source!r} does not exist")
        if config.txt_documents != "paragraphs" and not any(
            f.suffix == ".txt" for f in local_files(path)
        ):
            raise DataError(
                f"--txt-documents {config.txt_documents} applies to .txt files, and {source!r} "
                "has none (a .jsonl line is always one document)"
            )
        docs = _read_local(path, config.text_field, config.txt_documents)
        if len(docs) < 2:
            raise DataError(
                f"dataset {source!r} gives no validation documents: "
                f"{_why_too_few_documents(path, docs, config)}"
            )
        train, val = _split_validation(docs, config.validation_fraction, config.seed)
        return TextSplits(
            train, val, f"local {source}", held_out_fraction=config.validation_fraction
        )
    if config.txt_documents != "paragraphs":
        raise DataError(
            f"--txt-documents {config.txt_documents} applies to local .txt files, and dataset "
            f"{source!r} is not one"
        )
    return _hf_source(config)
