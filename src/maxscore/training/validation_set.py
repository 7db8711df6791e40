"""Validation that can tell routers apart: the whole split, every token's document, a standard error.

Which blocks. By default (``TrainConfig.max_eval_blocks=None``) every block of the validation
split: for the embedded corpus 195k tokens from 124 document sections of all five sources (381
blocks at seq 512, 1,526 at seq 128). The first 64 blocks alone come from only two sources
(Gutenberg, SOTU) and sit 0.4 nats below the training loss. When a limit is given
(or the split is larger than :data:`DEFAULT_MAX_EVAL_TOKENS`), blocks are taken evenly spaced
over the packed split, which is in source order, so every source keeps its share.

Standard error over documents. The split is a random sample of document sections (2% chosen by
a hash of their id), so the document is the unit of sampling; tokens of one document, and the
blocks cut from it, are correlated, and a per-token or per-block error would understate the
uncertainty (blocks also straddle documents). The validation loss is the token mean
``L = sum_d S_d / sum_d T_d`` (``S_d``: summed loss of document ``d``'s tokens, ``T_d``: their
number), and its standard error is the usual one of a ratio estimator over the ``D`` documents:
``SE = sqrt(D / (D - 1) * sum_d (S_d - L T_d)^2) / sum_d T_d``. The per-document sums are kept
(``validation.json``), so two runs on the same split can be compared *paired*
(:func:`paired_difference`): their difference has a much smaller error than either loss.

Each token's loss is attributed to the document of the token it predicts; the first token of
every block is predicted by nothing (the model sees each block on its own).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from maxscore.data.packing import PackedDataset, tokenize_each

__all__ = [
    "DEFAULT_MAX_EVAL_TOKENS",
    "DOCUMENT_KEY",
    "VALIDATION_FILE",
    "DocumentLosses",
    "ValidationDataset",
    "pack_validation",
    "paired_difference",
    "ratio_standard_error",
]

#: The run-directory file with the final evaluation's per-document sums.
VALIDATION_FILE = "validation.json"
#: Batch key of the per-token document index (removed before the model sees the batch).
DOCUMENT_KEY = "document_ids"
#: Default cap on validation tokens when no ``max_eval_blocks`` is given (the embedded corpus's
#: split, 195k tokens, is far below it; a large held-out split is sampled evenly).
DEFAULT_MAX_EVAL_TOKENS = 1 << 20
#: Sequences per cross-entropy chunk: bounds the fp32 copy of the logits.
_CE_ROWS = 16
#: The target of each sequence's last position, which predicts nothing.
_IGNORED = -100


class ValidationDataset(PackedDataset):
    """Packed validation blocks plus the document index of every token."""

    def __init__(self, blocks: Tensor, documents: Tensor, num_documents: int) -> None:
        super().__init__(blocks)
        self.documents = documents
        self.num_documents = num_documents

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        item = super().__getitem__(index)
        item[DOCUMENT_KEY] = self.documents[index]
        return item


def pack_validation(
    texts: Iterable[str], tokenizer: Any, seq_len: int, max_blocks: int | None = None
) -> ValidationDataset:
    """Pack ``texts`` like training data (``doc EOS doc EOS ...``) keeping each token's document.

    Returns every block, or ``max_blocks`` of them evenly spaced over the split (the default cap
    is :data:`DEFAULT_MAX_EVAL_TOKENS` tokens). A document's EOS belongs to that document.
    """
    ids: list[int] = []
    docs: list[int] = []
    eos = tokenizer.eos_token_id
    for doc, tokens in enumerate(tokenize_each(texts, tokenizer)):
        ids.extend(tokens)
        ids.append(eos)
        docs.extend([doc] * (len(tokens) + 1))
    n_blocks = len(ids) // seq_len
    cut = n_blocks * seq_len
    blocks = torch.tensor(ids[:cut], dtype=torch.long).view(n_blocks, seq_len)
    documents = torch.tensor(docs[:cut], dtype=torch.long).view(n_blocks, seq_len)
    limit = max_blocks if max_blocks is not None else max(1, DEFAULT_MAX_EVAL_TOKENS // seq_len)
    if n_blocks > limit:
        keep = torch.arange(limit) * n_blocks // limit  # evenly spaced: every source in share
        blocks, documents = blocks[keep], documents[keep]
    num_documents = int(documents.max()) + 1 if documents.numel() else 0
    return ValidationDataset(blocks, documents, num_documents)


def per_token_loss(logits: Tensor, input_ids: Tensor) -> Tensor:
    """``[B, L-1]`` fp32 cross-entropy of predicting token ``p + 1`` from position ``p``.

    Computed in chunks of :data:`_CE_ROWS` sequences so the fp32 copy of bf16 / fp16 logits stays
    small. Each chunk is taken whole, with the last position's target ignored and its loss
    dropped afterwards, rather than as ``logits[:, :-1]``: that slice is not contiguous, and
    flattening it would copy every fp32 logit of the batch (a ``[B, L, vocab]`` copy per
    validation batch) to get the same values.
    """
    targets = F.pad(input_ids[:, 1:], (0, 1), value=_IGNORED)
    out = []
    for start in range(0, logits.shape[0], _CE_ROWS):
        chunk = logits[start : start + _CE_ROWS].float()
        losses = F.cross_entropy(
            chunk.reshape(-1, chunk.shape[-1]),
            targets[start : start + _CE_ROWS].reshape(-1),
            reduction="none",
            ignore_index=_IGNORED,
        )
        out.append(losses.view(chunk.shape[0], -1)[:, :-1])
    return torch.cat(out)


class DocumentLosses:
    """Per-document loss sums and token counts of one evaluation, accumulated on the device."""

    def __init__(self) -> None:
        self.loss_sum: Tensor | None = None
        self.tokens: Tensor | None = None

    def clear(self) -> None:
        """No sums: the evaluated dataset carries no documents."""
        self.loss_sum = self.tokens = None

    def reset(self, size: int, device: torch.device | str = "cpu") -> None:
        """Zero sums for ``size`` documents on ``device`` (allocated here, so that a process
        given no validation batch still takes part in :meth:`gather`'s all-reduce)."""
        self.loss_sum = torch.zeros(size, dtype=torch.float64, device=device)
        self.tokens = torch.zeros(size, dtype=torch.float64, device=device)

    @torch.no_grad()
    def add(self, model: Any, inputs: dict[str, Tensor], documents: Tensor) -> Tensor:
        """Run ``model`` on one batch, add its token losses by document; return the batch mean."""
        if self.loss_sum is None or self.tokens is None:
            raise RuntimeError("DocumentLosses.add before reset(num_documents)")
        outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        losses = per_token_loss(logits, inputs["input_ids"])
        targets = documents.to(self.loss_sum.device)[:, 1:].reshape(-1)
        # Only targets count (instruction data: the completion; weights, not a boolean index,
        # so nothing waits for the device).
        labels = inputs.get("labels")
        weight = (
            torch.ones_like(losses, dtype=torch.float64)
            if labels is None
            else (labels[:, 1:] != -100).to(torch.float64)
        ).reshape(-1)
        self.loss_sum.index_add_(0, targets, losses.reshape(-1).to(self.loss_sum) * weight)
        self.tokens.index_add_(0, targets, weight)
        mean = (losses.reshape(-1) * weight).sum() / weight.sum().clamp(min=1)
        return mean.to(losses.dtype)

    def gather(self) -> tuple[list[float], list[float]]:
        """``(loss sums, token counts)`` per document, summed over all processes.

        Under data parallelism accelerate may repeat a few blocks at the end so that every
        process gets full batches; those are counted twice (a few blocks out of hundreds).
        """
        if self.loss_sum is None or self.tokens is None:
            return [], []
        both = torch.stack([self.loss_sum, self.tokens])
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(both)
        sums, counts = both.tolist()
        return sums, counts


def ratio_standard_error(sums: Sequence[float], counts: Sequence[float]) -> tuple[float, float]:
    """``(L, SE)``: the token-mean loss over documents and its standard error (module docstring).

    Documents without tokens are left out; with fewer than two documents the error is NaN.
    """
    pairs = [(s, t) for s, t in zip(sums, counts, strict=True) if t > 0]
    total = sum(t for _, t in pairs)
    if not pairs or total <= 0:
        return math.nan, math.nan
    mean = sum(s for s, _ in pairs) / total
    d = len(pairs)
    if d < 2:
        return mean, math.nan
    spread = sum((s - mean * t) ** 2 for s, t in pairs)
    return mean, math.sqrt(d / (d - 1) * spread) / total


def paired_difference(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float] | None:
    """``(L_a - L_b, SE)`` of two runs' validation on the same documents, paired by document.

    ``a`` and ``b`` are ``validation.json`` payloads (``loss_sum`` / ``tokens`` per document).
    Returns ``None`` when they were not measured on the same tokens.
    """
    if a.get("tokens") != b.get("tokens") or not a.get("tokens"):
        return None
    diff = [x - y for x, y in zip(a["loss_sum"], b["loss_sum"], strict=True)]
    return ratio_standard_error(diff, a["tokens"])


@dataclass
class ValidationSummary:
    """One evaluation's loss, its standard error and what it rests on."""

    loss: float
    se: float
    tokens: int
    documents: int
    loss_sum: list[float]
    token_counts: list[float]

    @classmethod
    def from_sums(cls, sums: list[float], counts: list[float]) -> ValidationSummary:
        loss, se = ratio_standard_error(sums, counts)
        return cls(loss, se, int(sum(counts)), sum(1 for c in counts if c > 0), sums, counts)

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        """The logged metrics: ``<prefix>_loss`` (replacing the Trainer's batch mean) and more."""
        return {
            f"{prefix}_loss": self.loss,
            f"{prefix}_loss_se": self.se,
            f"{prefix}_tokens": self.tokens,
            f"{prefix}_documents": self.documents,
        }

    def to_dict(self) -> dict[str, Any]:
        """The ``validation.json`` payload (per-document sums for paired comparisons)."""
        return {
            "loss": self.loss,
            "se": self.se,
            "se_unit": "document",
            "tokens_total": self.tokens,
            "documents": self.documents,
            "loss_sum": self.loss_sum,
            "tokens": self.token_counts,
        }
