"""Training data: the run's tokenizer, and its text source packed into fixed-length blocks.

The documents come from :func:`maxscore.data.sources.load_text_splits` (the embedded corpus, a
local ``.txt`` / ``.jsonl`` file or folder, or a Hugging Face dataset). Packing
(:mod:`maxscore.data.packing`): documents, in a fixed order given the seed, are tokenised
without special tokens, each is followed by the tokenizer's EOS token, all are concatenated into
one stream, and the stream is cut into consecutive blocks of ``seq_len`` tokens; the last
incomplete block is dropped. Attention is not masked at document boundaries (the usual
pre-training practice; EOS marks them). A block is one training sequence; ``labels`` equal
``input_ids`` (the model shifts them).

Determinism and resuming: map-style sources become a :class:`PackedDataset` (a tensor of blocks)
whose order the Trainer's seeded sampler draws, so HF Trainer can skip the batches already
trained on when resuming. Streaming sources become a :class:`PackedStream`, an
``IterableDataset`` with a deterministic order (seeded shuffle buffer) whose ``state_dict`` holds
the number of blocks produced; on resume the Trainer re-reads and skips the consumed batches.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from maxscore.config_types import ConfigError
from maxscore.data import load_default_tokenizer
from maxscore.data.packing import PackedDataset, PackedStream, pack_documents
from maxscore.data.sources import (
    DATASET_ALIASES,
    DataError,
    load_text_splits,
    local_files,
    read_jsonl_records,
    too_few_for_fraction,
)
from maxscore.training.config import TrainConfig
from maxscore.training.instruction_data import (
    InstructionDataset,
    InstructionValidation,
    detect_format,
    encode_records,
    pack_examples,
    split_records,
)
from maxscore.training.validation_set import ValidationDataset, pack_validation

__all__ = [
    "InstructionSplits",
    "TrainingData",
    "build_instruction_data",
    "build_training_data",
    "load_instruction_splits",
    "load_tokenizer",
]


# ------------------------------------------------------------------------------------------------
# tokenizer
# ------------------------------------------------------------------------------------------------
def load_tokenizer(name: str) -> Any:
    """The embedded default tokenizer (``"default"``) or a HF tokenizer name / local path."""
    if name in ("default", "embedded"):
        tokenizer = load_default_tokenizer()
    else:
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
    """The first record of a local .jsonl source; None for .txt, hub and embedded sources
    (plain text)."""
    if config.dataset in ("default", "embedded") or config.dataset in DATASET_ALIASES:
        return None
    path = Path(config.dataset).expanduser()
    if path.exists():
        jsonl = [f for f in local_files(path) if f.suffix == ".jsonl"]
        return next((record for _, record in read_jsonl_records(jsonl[0])), None) if jsonl else None
    return None


def _instruction_format(config: TrainConfig, first: dict[str, Any] | None) -> str | None:
    """The instruction format of the source, or None for plain text (``data_format``)."""
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
    path = Path(config.dataset).expanduser()
    local = path.exists()
    first = _first_record(config) if local else None
    if not local and config.data_format not in ("auto", "text"):
        return _hf_instruction_splits(config, config.data_format)
    data_format = _instruction_format(config, first)
    if data_format is None:
        return None
    files = [f for f in local_files(path) if f.suffix == ".jsonl"]
    if not files or len(files) != len(local_files(path)):
        raise DataError(
            f"--data-format {data_format} reads .jsonl records, and {config.dataset!r} holds "
            "other files"
        )
    records = [record for file in files for _, record in read_jsonl_records(file)]
    if len(records) < 2:
        raise DataError(
            f"dataset {config.dataset!r} gives no validation records: "
            + too_few_for_fraction(len(records), config.validation_fraction)
        )
    train, validation = split_records(records, config.validation_fraction, config.seed)
    return InstructionSplits(
        train, validation, data_format, f"local {config.dataset} ({data_format})"
    )


def _hf_instruction_splits(config: TrainConfig, data_format: str) -> InstructionSplits:
    """Instruction records of a Hugging Face dataset (downloaded, not streamed)."""
    if config.streaming:
        raise DataError(f"--data-format {data_format} needs a downloaded dataset (--no-streaming)")
    # On use: `datasets` is slow to import and only a Hub source needs it.
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
            why = too_few_for_fraction(len(splits.train or []), splits.held_out_fraction)
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
            "tokens; use more or longer documents, a larger --validation-fraction, or a shorter "
            "--seq-len"
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
