"""Each token's experts in descending score order, with deterministic ties.

Every place that ranks a token's experts (the top-k strategies, SoftTopk's rank multiplier, the
drop-rate statistics) uses these, so they agree on ties: equal scores rank by the lower expert
index. ``torch.topk`` gives no tie-breaking guarantee, and on the router's ``[T, e]`` rows with
small ``e`` it is slow on CUDA (one thread block per row: ~140-190 us for ``[65536, 16]``,
``benchmarks/train_throughput/README.md``); a stable sort of such short rows is one pass.
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


#: Up to this many ranks, :func:`top_experts` takes repeated argmaxes instead of a sort.
_ARGMAX_RANKS = 4


def _order_key(scores: Tensor) -> Tensor:
    """Integer keys ordered like the scores in a descending sort: NaN largest, -0.0 == 0.0.

    A float's bits, read as a signed integer, order the non-negative floats; flipping the value
    bits of the negative ones orders those too (the usual total-order trick). Every NaN maps to
    the largest key, as NaN sorts first. The smallest key (a NaN bit pattern before the
    mapping) is never produced, so it can mark taken entries.
    """
    wide = scores.dtype == torch.float64
    x = (scores if wide else scores.float()) + 0.0  # -0.0 + 0.0 = +0.0: equal keys, as in sort
    bits = x.view(torch.int64 if wide else torch.int32)
    info = torch.iinfo(bits.dtype)
    key = bits ^ ((bits >> (info.bits - 1)) & info.max)
    return torch.where(torch.isnan(x), info.max, key)


def top_experts(scores: Tensor, k: int) -> Tensor:
    """The ``k`` best experts of each row (``[..., e] -> [..., k]`` long), best first.

    Same order as :func:`ranked_experts`; ``k = 1`` is an ``argmax`` (first maximum), which
    torch.compile fuses into the surrounding kernel. Up to ``_ARGMAX_RANKS`` ranks (fewer than
    ``e``) it is ``k`` argmaxes over integer order keys, each taking the first maximum (the
    lower index on ties) and then marking it taken: a few passes over the row instead of a
    sort, which on CUDA costs ~0.23 ms for ``[65536, 16]`` rows (the per-step routing
    statistics rank every layer's tokens).
    """
    if k == 1:
        return scores.argmax(dim=-1, keepdim=True)
    if not scores.is_floating_point() or k > _ARGMAX_RANKS or k >= scores.shape[-1]:
        return ranked_experts(scores)[..., :k]
    key = _order_key(scores)
    taken = torch.iinfo(key.dtype).min
    ranks = []
    for r in range(k):
        best = key.argmax(dim=-1, keepdim=True)
        ranks.append(best)
        if r + 1 < k:
            key = key.scatter(-1, best, taken)
    return torch.cat(ranks, dim=-1)
