"""The objective of Eq. (8) and conversions between the two assignment layouts.

Solvers work on a dense 0/1 matrix ``P`` (``[..., n, e]`` bool, the ``P`` of Eq. 7) and return the
slot layout every strategy shares, ``expert_index[..., n, k]`` (``-1`` = empty slot). Both helpers
are vectorised and sync-free, so GPU solvers can use them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..types import DROPPED, assignment_matrix

__all__ = ["assignment_mask", "flow_objective", "mask_to_expert_index"]


def assignment_mask(expert_index: Tensor, num_experts: int) -> Tensor:
    """``[..., n, k]`` expert indices (``-1`` = empty) -> ``[..., n, e]`` bool matrix ``P``.

    A repeated expert within a token collapses to one ``True``; use the slot layout to detect
    duplicates.
    """
    return assignment_matrix(expert_index, num_experts, torch.bool)


def mask_to_expert_index(mask: Tensor, affinities: Tensor, k: int) -> Tensor:
    """``[..., n, e]`` bool ``P`` -> ``[..., n, k]`` long expert indices.

    Each token's assigned experts are listed in decreasing order of affinity (so slot ``r`` is the
    token's ``r``-th choice among them; ties keep the lower expert index first), padded with ``-1``.
    Rows with more than ``k`` experts are a caller bug; only the best ``k`` would be kept.
    """
    # Unassigned entries sort last; validity is read back from the mask, not from the key, so
    # affinities of -inf cannot be confused with "unassigned".
    key = torch.where(mask, affinities.to(torch.float64), -torch.inf)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :k]
    valid = torch.gather(mask, -1, order)
    return torch.where(valid, order, DROPPED)


def flow_objective(affinities: Tensor, expert_index: Tensor) -> Tensor:
    """The objective of Eq. (8): ``sum_ij P_ij A_ij`` for each routing group.

    Args:
        affinities: ``[..., n, e]``.
        expert_index: ``[..., n, k]`` long, ``-1`` for an empty slot.

    Returns:
        ``[...]`` (a 0-dim tensor for a single ``[n, e]`` group), in float64 so that objective gaps
        of 1e-6 relative are measurable.
    """
    valid = expert_index >= 0
    picked = torch.gather(affinities.to(torch.float64), -1, expert_index.clamp_min(0))
    return torch.where(valid, picked, 0.0).sum(dim=(-2, -1))
