"""Packing: documents tokenised, joined with EOS and cut into fixed-length training blocks.

Documents are tokenised without special tokens, each is followed by the tokenizer's EOS token,
all are concatenated into one stream, and the stream is cut into consecutive blocks of
``seq_len`` tokens; the last incomplete block is dropped. :class:`PackedDataset` holds the blocks
of a map-style source, :class:`PackedStream` packs a streaming source on the fly. Used by the
training data (:mod:`maxscore.training.data`), its validation set
(:mod:`maxscore.training.validation_set`) and the analysis of a saved checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

__all__ = [
    "PackedDataset",
    "PackedStream",
    "collate_blocks",
    "pack_documents",
    "pack_token_stream",
    "tokenize_each",
]

#: Documents tokenised per call of the fast tokenizer (bounds memory, keeps Rust threads busy).
_TOKENIZE_BATCH = 64


def _encode_batch(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of ``texts`` without special tokens.

    Uses the Rust tokenizer directly when there is one: it is parallel, and it does not warn
    about documents longer than the model's maximum (we pack them anyway).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [enc.ids for enc in backend.encode_batch(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def pack_token_stream(
    token_lists: Iterable[list[int]], seq_len: int, eos_id: int
) -> Iterator[list[int]]:
    """Yield ``seq_len``-token blocks of the concatenation ``doc_1 EOS doc_2 EOS ...``.

    The final incomplete block is dropped.
    """
    buffer: list[int] = []
    for ids in token_lists:
        buffer.extend(ids)
        buffer.append(eos_id)
        while len(buffer) >= seq_len:
            yield buffer[:seq_len]
            del buffer[:seq_len]


def pack_documents(
    texts: Iterable[str],
    tokenizer: Any,
    seq_len: int,
    max_blocks: int | None = None,
) -> torch.Tensor:
    """Tokenise and pack ``texts`` (in order) into a ``[num_blocks, seq_len]`` long tensor."""
    blocks: list[list[int]] = []
    for block in pack_token_stream(
        tokenize_each(texts, tokenizer), seq_len, tokenizer.eos_token_id
    ):
        blocks.append(block)
        if max_blocks is not None and len(blocks) >= max_blocks:
            break
    if not blocks:
        return torch.empty(0, seq_len, dtype=torch.long)
    return torch.tensor(blocks, dtype=torch.long)


def tokenize_each(texts: Iterable[str], tokenizer: Any) -> Iterator[list[int]]:
    """Each text's token ids (no special tokens; empty texts skipped), tokenised in batches."""
    batch: list[str] = []
    for text in texts:
        if not text:
            continue
        batch.append(text)
        if len(batch) >= _TOKENIZE_BATCH:
            yield from _encode_batch(tokenizer, batch)
            batch = []
    if batch:
        yield from _encode_batch(tokenizer, batch)


def collate_blocks(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack packed blocks (equal length, no padding) into a batch.

    The Trainer's default collator for a model with a tokenizer pads through ``tokenizer.pad``,
    which walks every token id in Python: ~70 ms for 64 x 512 tokens, more than a Base-preset
    GPU step computes. Packed blocks need no padding, so a stack is all there is to do.
    """
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


class PackedDataset(Dataset):
    """Map-style dataset of packed blocks: item ``i`` is ``{"input_ids", "labels"}`` of block i."""

    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        block = self.blocks[index]
        return {"input_ids": block, "labels": block}

    @property
    def num_tokens(self) -> int:
        return self.blocks.numel()


class PackedStream(IterableDataset):
    """Streaming packed blocks of a text iterator, deterministic for a given ``seed``.

    ``text_factory(seed)`` must return the same document sequence for the same seed. In data
    parallel runs accelerate hands each process its share of the batches, so the stream itself is
    not sharded here. ``state_dict()`` records how many blocks were produced (for inspection and
    for loaders that restore iterable state); the Trainer restores the position on resume by
    skipping the batches it already trained on.
    """

    def __init__(
        self,
        text_factory: Callable[[int], Iterable[str]],
        tokenizer: Any,
        seq_len: int,
        seed: int,
    ) -> None:
        self.text_factory = text_factory
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.seed = seed
        self.epoch = 0
        self.blocks_produced = 0
        self._skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "blocks_produced": self.blocks_produced}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self._skip = int(state["blocks_produced"])

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        texts = self.text_factory(self.seed + self.epoch)
        stream = pack_token_stream(
            tokenize_each(texts, self.tokenizer), self.seq_len, self.tokenizer.eos_token_id
        )
        self.blocks_produced = 0
        for block in stream:
            self.blocks_produced += 1
            if self._skip:
                self._skip -= 1
                continue
            ids = torch.tensor(block, dtype=torch.long)
            yield {"input_ids": ids, "labels": ids}
