"""Argument checks and padding helpers shared by every assignment strategy.

The strategies of :mod:`maxscore.routing.strategies` and :mod:`maxscore.routing.flow.assignment`
check their common arguments here (scores ``[G, n, e]`` fp32, ``k``, a per-expert ``capacity``,
a ``[G, n]`` token mask) with messages that name the strategy, and empty the slots of padded rows
with :func:`without_padding`.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from maxscore.routing.types import DROPPED

__all__ = ["check_inputs", "check_token_mask", "without_padding"]


_SCORE_DTYPES = (torch.float32, torch.float64)


def check_inputs(
    name: str, scores: Tensor, k: int, capacity: Tensor | None, *, needs_capacity: bool
) -> Tensor | None:
    """Check the common arguments; return ``capacity`` as a long tensor on ``scores``' device."""
    if not isinstance(scores, Tensor):
        raise TypeError(f"{name}: scores must be a torch.Tensor, got {type(scores).__name__}")
    if scores.ndim != 3:
        raise ValueError(
            f"{name}: scores must have shape [groups, tokens, experts] (3 dims), "
            f"got {scores.ndim} dims with shape {tuple(scores.shape)}"
        )
    if scores.dtype not in _SCORE_DTYPES:
        # Router math is fp32 (ARCHITECTURE.md); float64 is accepted for gradcheck-style tests.
        raise ValueError(
            f"{name}: scores must be float32 (or float64), got {scores.dtype}; "
            "cast router scores to fp32 before assignment"
        )
    e = scores.shape[-1]
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(f"{name}: k must be an int, got {type(k).__name__}")
    if k < 1:
        raise ValueError(f"{name}: k (experts per token) must be >= 1, got {k}")
    if k > e:
        raise ValueError(f"{name}: k={k} exceeds the number of experts e={e}")
    if capacity is None:
        if needs_capacity:
            raise ValueError(
                f"{name}: this strategy needs a per-expert capacity tensor of shape [{e}], got None"
            )
        return None
    if not isinstance(capacity, Tensor):
        raise TypeError(
            f"{name}: capacity must be a torch.Tensor of shape [{e}] or None, "
            f"got {type(capacity).__name__}"
        )
    if capacity.shape != (e,):
        raise ValueError(
            f"{name}: capacity must have shape [e] = [{e}], got {tuple(capacity.shape)}"
        )
    if (
        capacity.dtype.is_floating_point
        or capacity.dtype.is_complex
        or capacity.dtype == torch.bool
    ):
        raise ValueError(f"{name}: capacity must be an integer (long) tensor, got {capacity.dtype}")
    # A negativity check reads the values; that is free on the CPU but a host sync on an
    # accelerator, where negative entries instead behave as 0 (nothing is kept). Skipped while
    # torch.compile traces (reading a value would split the graph).
    if (
        capacity.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and bool((capacity < 0).any())
    ):
        raise ValueError(f"{name}: capacity must be >= 0 for every expert, got {capacity.tolist()}")
    return capacity.to(device=scores.device, dtype=torch.long)


def without_padding(expert_index: Tensor, token_mask: Tensor | None) -> Tensor:
    """``expert_index[G, n, S]`` with every slot of a padded row (``token_mask`` False) emptied."""
    if token_mask is None:
        return expert_index
    return torch.where(token_mask.unsqueeze(-1), expert_index, DROPPED)


def check_token_mask(name: str, scores: Tensor, token_mask: Tensor | None) -> Tensor | None:
    """``token_mask`` as a ``[G, n]`` bool tensor on ``scores``' device (shape checked)."""
    if token_mask is None:
        return None
    if token_mask.shape != scores.shape[:2]:
        raise ValueError(
            f"{name}: token_mask must have shape [groups, tokens] = {tuple(scores.shape[:2])}, "
            f"got {tuple(token_mask.shape)}"
        )
    return token_mask.to(device=scores.device, dtype=torch.bool)
