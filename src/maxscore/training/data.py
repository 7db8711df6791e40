"""Training data: text sources, tokenisation and packing into fixed-length blocks.

Sources (``TrainConfig.dataset``):

* ``"default"`` — the embedded corpus of :mod:`maxscore.data` (train / validation split shipped).
* a local ``.txt`` file, ``.jsonl`` file (one JSON object per line, text in ``text_field``) or
  a folder of them. A ``.txt`` file's documents are separated by blank lines (lines empty or only
  white space), or with ``txt_documents="lines"`` each non-blank line is one
  (:func:`split_txt_documents`). ``validation_fraction`` of the documents (at least one) is held
  out for validation; a source of fewer than two documents is refused with the reason (an empty
  or white-space file, a whole file without blank lines read as one document).
* any Hugging Face dataset name (``"c4"`` means ``allenai/c4`` with config ``en``, streamed).

Packing (:mod:`~maxscore.training.packing`; every source goes through it): documents, in a
fixed order given the seed, are tokenised without special tokens, each is followed by the
tokenizer's EOS token, all are concatenated into one stream, and the stream is cut into
consecutive blocks of ``seq_len`` tokens; the last incomplete block is dropped. Attention is not masked at document boundaries
(the usual pre-training practice; EOS marks them). A block is one training sequence; ``labels``
equal ``input_ids`` (the model shifts them).

Determinism and resuming: map-style sources become a :class:`PackedDataset` (a tensor of blocks)
whose order the Trainer's seeded sampler draws, so HF Trainer can skip the batches already
trained on when resuming. Streaming sources become a :class:`PackedStream`, an
``IterableDataset`` with a deterministic order (seeded shuffle buffer) whose ``state_dict`` holds
the number of blocks produced; on resume the Trainer re-reads and skips the consumed batches.
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

from maxscore.training.config import ConfigError, TrainConfig
from maxscore.training.packing import (
    PackedDataset,
    PackedStream,
    collate_blocks,
    pack_documents,
    pack_token_stream,
)
from maxscore.training.validation_set import ValidationDataset, pack_validation

__all__ = [
    "DATASET_ALIASES",
    "STREAMING_EVAL_BLOCKS",
    "DataError",
    "PackedDataset",
    "PackedStream",
    "TextSplits",
    "TrainingData",
    "build_training_data",
    "collate_blocks",
    "load_text_splits",
    "load_tokenizer",
    "pack_documents",
    "pack_token_stream",
    "split_txt_documents",
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


# ------------------------------------------------------------------------------------------------
# tokenizer
# ------------------------------------------------------------------------------------------------
def load_tokenizer(name: str) -> Any:
    """The embedded default tokenizer (``"default"``) or a HF tokenizer name / local path."""
    if name in ("default", "embedded"):
        from maxscore.data import load_default_tokenizer

        tokenizer = load_default_tokenizer()
    else:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(name)
        except Exception as err:  # transformers raises OSError / ValueError / HF hub errors
            raise ConfigError(
                f"cannot load tokenizer {name!r}: {type(err).__name__}: {err}. Use 'default' for "
                "the embedded 32k tokenizer, a local tokenizer folder, or a Hub name (online)."
            ) from err
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"tokenizer {name!r} has no EOS token; packing needs one")
    return tokenizer


# ------------------------------------------------------------------------------------------------
# sources
# ------------------------------------------------------------------------------------------------
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


def _read_jsonl_records(file: Path) -> Iterator[tuple[int, dict[str, Any]]]:
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
    for line_no, record in _read_jsonl_records(file):
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


def _local_files(path: Path) -> list[Path]:
    """The data files of a local source: the file itself, or a folder's .txt / .jsonl files."""
    if not path.is_dir():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.suffix in _LOCAL_READERS)
    if not files:
        raise DataError(f"folder {str(path)!r} holds no .txt or .jsonl files")
    return files


def _read_local(path: Path, text_field: str, txt_documents: str = "paragraphs") -> list[str]:
    docs: list[str] = []
    for file in _local_files(path):
        reader = _LOCAL_READERS.get(file.suffix)
        if reader is None:
            raise DataError(
                f"unsupported file type {file.suffix!r} for {str(file)!r}: use .txt or .jsonl"
            )
        docs.extend(reader(file, text_field, txt_documents))
    return docs


def _why_too_few_documents(path: Path, docs: list[str], config: TrainConfig) -> str:
    """Why a local source of fewer than two documents gives no validation document."""
    files = _local_files(path)
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
    return _too_few_for_fraction(1, config.validation_fraction, "the file" if one else "it")


def _too_few_for_fraction(n_docs: int, fraction: float, subject: str = "it") -> str:
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


def _hf_source(config: TrainConfig) -> TextSplits:
    name, ds_config, stream_default = DATASET_ALIASES.get(
        config.dataset, (config.dataset, None, False)
    )
    ds_config = config.dataset_config or ds_config
    streaming = stream_default if config.streaming is None else config.streaming
    try:
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


def load_text_splits(config: TrainConfig) -> TextSplits:
    """The documents of ``config.dataset`` split into train and validation."""
    source = config.dataset
    if source in ("default", "embedded"):
        if config.txt_documents != "paragraphs":
            raise DataError(
                f"--txt-documents {config.txt_documents} applies to local .txt files, and the "
                "embedded corpus is not one"
            )
        from maxscore.data import load_default_corpus

        corpus = load_default_corpus()
        return TextSplits(
            list(corpus["train"]), list(corpus["validation"]), "embedded default corpus"
        )
    path = Path(source).expanduser()
    if path.exists() or source.endswith((".txt", ".jsonl")) or source.startswith((".", "/")):
        if not path.exists():
            raise DataError(f"data file or folder {source!r} does not exist")
        if config.txt_documents != "paragraphs" and not any(
            f.suffix == ".txt" for f in _local_files(path)
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


# ------------------------------------------------------------------------------------------------
# instruction records (maxscore.training.instruction_data)
# ------------------------------------------------------------------------------------------------
@dataclass
class InstructionSplits:
    """Instruction records of a source (``data_format``: a key of ``RECORD_FORMATS``)."""

    train: list[dict[str, Any]]
    validation: list[dict[str, Any]]
    data_format: str
    description: str


def _first_record(config: TrainConfig) -> dict[str, Any] | None:
    """The first record of a local .jsonl source or a (downloaded) HF dataset; None for .txt,
    streamed and embedded sources (plain text)."""
    if config.dataset in ("default", "embedded") or config.dataset in DATASET_ALIASES:
        return None
    path = Path(config.dataset).expanduser()
    if path.exists():
        jsonl = [f for f in _local_files(path) if f.suffix == ".jsonl"]
        return (
            next((record for _, record in _read_jsonl_records(jsonl[0])), None) if jsonl else None
        )
    return None


def _instruction_format(config: TrainConfig, first: dict[str, Any] | None) -> str | None:
    """The instruction format of the source, or None for plain text (``data_format``)."""
    from maxscore.training.instruction_data import detect_format

    if config.data_format == "text":
        return None
    if config.data_format != "auto":
        return config.data_format
    if first is None or config.text_field in first:
        return None
    return detect_format(first)


def load_instruction_splits(config: TrainConfig) -> InstructionSplits | None:
    """The instruction records of ``config.dataset`` split into train and validation, or None
    when the source is plain text (``data_format="auto"``: a .jsonl whose first record has
    ``messages`` or ``prompt`` + ``completion`` and no ``text_field``)."""
    from maxscore.training.instruction_data import split_records

    path = Path(config.dataset).expanduser()
    local = path.exists()
    first = _first_record(config) if local else None
    if not local and config.data_format not in ("auto", "text"):
        return _hf_instruction_splits(config, config.data_format)
    data_format = _instruction_format(config, first)
    if data_format is None:
        return None
    files = [f for f in _local_files(path) if f.suffix == ".jsonl"]
    if not files or len(files) != len(_local_files(path)):
        raise DataError(
            f"--data-format {data_format} reads .jsonl records, and {config.dataset!r} holds "
            "other files"
        )
    records = [record for file in files for _, record in _read_jsonl_records(file)]
    if len(records) < 2:
        raise DataError(
            f"dataset {config.dataset!r} gives no validation records: "
            + _too_few_for_fraction(len(records), config.validation_fraction)
        )
    train, validation = split_records(records, config.validation_fraction, config.seed)
    return InstructionSplits(
        train, validation, data_format, f"local {config.dataset} ({data_format})"
    )


def _hf_instruction_splits(config: TrainConfig, data_format: str) -> InstructionSplits:
    """Instruction records of a Hugging Face dataset (downloaded, not streamed)."""
    from maxscore.training.instruction_data import split_records

    if config.streaming:
        raise DataError(f"--data-format {data_format} needs a downloaded dataset (--no-streaming)")
    import datasets

    try:
        train = datasets.load_dataset(config.dataset, config.dataset_config, split="train")
    except Exception as err:  # hub / file-not-found / offline errors come in many types
        raise DataError(
            f"cannot load dataset {config.dataset!r}: {type(err).__name__}: {err}"
        ) from err
    try:
        validation = list(
            datasets.load_dataset(config.dataset, config.dataset_config, split="validation")
        )
        records = list(train)
    except Exception:
        records, validation = split_records(list(train), config.validation_fraction, config.seed)
    return InstructionSplits(records, validation, data_format, f"{config.dataset} ({data_format})")


def build_instruction_data(
    config: TrainConfig,
    tokenizer: Any,
    splits: InstructionSplits,
    min_train_blocks: int = 1,
    max_train_blocks: int | None = None,
) -> TrainingData:
    """Encode and pack instruction records (``maxscore.training.instruction_data``)."""
    from maxscore.training.instruction_data import (
        InstructionDataset,
        InstructionValidation,
        encode_records,
        pack_examples,
    )

    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )

    def pack(records: list[dict[str, Any]], which: str, limit: int | None) -> Any:
        examples = encode_records(
            records, splits.data_format, tokenizer, config.completion_only_loss, which
        )
        packed = pack_examples(examples, config.seq_len, pad_id, max_blocks=limit)
        if packed.truncated:
            print(
                f"maxscore: warning: {packed.truncated} {which} example(s) longer than "
                f"seq_len={config.seq_len} tokens were cut to it; a longer --seq-len keeps them",
                file=sys.stderr,
            )
        return packed

    train_records = list(splits.train)
    random.Random(config.seed).shuffle(train_records)
    if config.max_train_documents is not None:
        train_records = train_records[: config.max_train_documents]
    train = pack(train_records, f"{config.dataset} training", max_train_blocks)
    validation = pack(splits.validation, f"{config.dataset} validation", config.max_eval_blocks)
    if len(validation) == 0:
        raise DataError(f"the validation records of {config.dataset!r} give no block to evaluate")
    if len(train) < min_train_blocks:
        raise DataError(
            f"training data of {config.dataset!r} is too small: {len(train_records)} records give "
            f"{len(train)} blocks of {config.seq_len} tokens, fewer than one global batch of "
            f"{min_train_blocks} sequences"
        )
    return TrainingData(
        InstructionDataset(train), InstructionValidation(validation), splits.description
    )


# ------------------------------------------------------------------------------------------------
# the datasets the trainer uses
# ------------------------------------------------------------------------------------------------
@dataclass
class TrainingData:
    """Train and validation datasets plus what is needed to describe them."""

    train: PackedDataset | PackedStream
    validation: ValidationDataset
    description: str

    @property
    def train_blocks(self) -> int | None:
        return len(self.train) if isinstance(self.train, PackedDataset) else None


def build_training_data(
    config: TrainConfig,
    tokenizer: Any,
    min_train_blocks: int = 1,
    max_train_blocks: int | None = None,
) -> TrainingData:
    """Tokenise and pack the configured source; check it is large enough (raises DataError).

    Args:
        config: the training configuration (source, seq_len, seed, limits).
        tokenizer: a tokenizer with ``eos_token_id``.
        min_train_blocks: fewest training blocks accepted (one global batch, normally).
        max_train_blocks: stop packing after this many blocks (the run's budget): tokenising a
            large corpus only to train on its first part wastes minutes on a CPU. The blocks kept
            are a prefix of the full packing, so a longer budget sees the same first blocks.
    """
    instruction = load_instruction_splits(config)
    if instruction is not None:
        return build_instruction_data(
            config, tokenizer, instruction, min_train_blocks, max_train_blocks
        )
    splits = load_text_splits(config)
    if not splits.validation:
        if splits.held_out_fraction is not None:
            why = _too_few_for_fraction(len(splits.train or []), splits.held_out_fraction)
        else:
            why = "its validation split is empty"
        raise DataError(f"dataset {config.dataset!r} gives no validation documents: {why}")
    validation = pack_validation(
        splits.validation, tokenizer, config.seq_len, max_blocks=config.max_eval_blocks
    )
    if len(validation) == 0:
        n_val = len(splits.validation)
        which = f"the {n_val} validation document{'s' if n_val != 1 else ''} of {config.dataset!r}"
        if splits.held_out_fraction is not None:
            total = n_val + len(splits.train or [])
            which += (
                f" (validation_fraction={splits.held_out_fraction:g} of {total} documents, "
                "at least one)"
            )
        raise DataError(
            f"{which} {'give' if n_val != 1 else 'gives'} no block of seq_len={config.seq_len} "
            "tokens; use more or longer documents, a larger validation_fraction (a --config "
            "field), or a shorter --seq-len"
        )
    if splits.stream_factory is not None:
        train: PackedDataset | PackedStream = PackedStream(
            splits.stream_factory, tokenizer, config.seq_len, config.seed
        )
    else:
        docs = splits.train or []
        # Seeded document order, so that packing (which documents share a block) is
        # reproducible and independent of how the source happens to be ordered.
        docs = list(docs)
        random.Random(config.seed).shuffle(docs)
        if config.max_train_documents is not None:
            docs = docs[: config.max_train_documents]
        blocks = pack_documents(docs, tokenizer, config.seq_len, max_blocks=max_train_blocks)
        if len(blocks) < min_train_blocks:
            n_tokens = len(blocks) * config.seq_len
            raise DataError(
                f"training data of {config.dataset!r} is too small: {len(docs)} documents give "
                f"{len(blocks)} blocks of {config.seq_len} tokens (~{n_tokens} tokens), fewer "
                f"than one global batch of {min_train_blocks} sequences"
            )
        train = PackedDataset(blocks)
    return TrainingData(train, validation, splits.description)
