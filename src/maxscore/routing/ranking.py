"""Each token's experts in descending score order, with deterministic ties.

Every place that ranks a token's experts (the top-k strategies, SoftTopk's rank multiplier, the
drop-rate statistics) uses these, so they agree on ties: equal scores rank by the lower expert
index. ``torch.topk`` gives no tie-breaking guarantee, and on the router's ``[T, e]`` rows with
small ``e`` it is slow on CUDA (one thread block per row: ~140-190 us for ``[65536, 16]`` on an
H100, ``benchmarks/train_throughput.md``); a stable sort of such short rows is one pass.
NaN ranks first (as in ``torch.topk`` and a descending ``torch.sort``).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ranked_experts", "top_experts"]


def ranked_experts(scores: Tensor, allowed: Tensor | None = None) -> Tensor:
    """Experts of each row in descending score order, ties broken by the lower expert index.

    Args:
        scores: ``[..., e]``.
        allowed: optional ``[..., e]`` bool; allowed experts come first (in score order), then the
            others (also in score order). Ordering by the mask, not by writing ``-inf`` into the
            scores, keeps an allowed expert whose own score is ``-inf`` ahead of a masked one.

    Returns:
        ``[..., e]`` long permutation of expert indices.
    """
    # torch.sort(stable=True) keeps equal keys in input order, which makes ties deterministic.
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    if allowed is not None:
        allowed_sorted = allowed.gather(-1, order).to(torch.uint8)
        second = torch.sort(allowed_sorted, dim=-1, descending=True, stable=True).indices
        order = order.gather(-1, second)
    return order


def top_experts(scores: Tensor, k: int) -> Tensor:
    """The ``k`` best experts of each row (``[..., e] -> [..., k]`` long), best first.

    Same order as :func:`ranked_experts`; ``k = 1`` is an ``argmax`` (first maximum), which
    torch.compile fuses into the surrounding kernel.
    """
    if k == 1:
        return scores.argmax(dim=-1, keepdim=True)
    return ranked_experts(scores)[..., :k]
