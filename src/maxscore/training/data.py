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
from dataclasses import dataclass
from typing import Any

from transformers import AutoTokenizer

from maxscore.config_types import ConfigError
from maxscore.data import load_default_tokenizer
from maxscore.data.packing import PackedDataset, PackedStream, pack_documents
from maxscore.data.sources import DataError, load_text_splits, too_few_for_fraction
from maxscore.training.config import TrainConfig
from maxscore.training.validation_set import ValidationDataset, pack_validation

__all__ = ["TrainingData", "build_training_data", "load_tokenizer"]


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
