"""The result types that flow from a router to the experts.

One :class:`RoutingResult` is produced per MoE layer call. Every assignment strategy returns an
expert-index tensor of one shape, ``[groups, tokens, slots]`` with ``-1`` marking an empty slot
(a dropped choice, or no expert picked this token), so the dispatch code never needs to know which
strategy ran.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

#: Marker stored in ``expert_index`` for a slot that holds no expert (dropped / unassigned).
DROPPED: int = -1


def assignment_matrix(
    expert_index: Tensor, num_experts: int, dtype: torch.dtype = torch.bool
) -> Tensor:
    """``[..., n, S]`` expert indices (``-1`` = empty) -> the ``[..., n, e]`` 0/1 matrix P of Eq. (7).

    Empty slots scatter into an extra column ``e`` that is cut off afterwards (no boolean
    indexing, so no host sync). A repeated expert within a token collapses to one entry; use the
    slot layout to detect duplicates.
    """
    p = torch.zeros(
        (*expert_index.shape[:-1], num_experts + 1), dtype=dtype, device=expert_index.device
    )
    p.scatter_(-1, torch.where(expert_index >= 0, expert_index, num_experts), 1)
    return p[..., :num_experts]


@dataclass
class RoutingResult:
    """What a :class:`~maxscore.routing.router.Router` hands to the experts.

    Shapes use ``T`` = number of tokens in the call (``G * n``, flattened in the input's order),
    ``S`` = slots per token (``k`` for token-choice strategies, ``e`` for expert choice),
    ``e`` = number of experts.

    Attributes:
        expert_index: ``[T, S]`` long, the expert of each slot, or :data:`DROPPED` (``-1``).
            Within a token, a valid expert never appears twice.
        combine_weights: ``[T, S]`` float32, the weight of each slot's expert output in Eq. (1);
            0 where the slot is dropped. Differentiable w.r.t. the gate weights.
        capacity: ``[e]`` long, the per-expert capacity of one routing group, or ``None`` for
            strategies without a capacity (dropless, causal evaluation routing).
        num_groups: ``G``, the number of routing groups the ``T`` tokens were split into
            (tokens ``g*n .. (g+1)*n-1`` form group ``g``).
        logits: ``[T, e]`` float32 gate logits ``x · W_g`` (before the affinity operator).
        affinities: ``[T, e]`` float32 affinities ``A`` (after the operator), the scores the
            combine weights are taken from.
        aux_loss: scalar, the load-balancing auxiliary loss, already multiplied by its
            coefficient (0 when the preset uses none).
        z_loss: scalar, the router z-loss, already multiplied by its coefficient.
        stats: per-call routing statistics as device tensors (see
            :mod:`maxscore.routing.statistics`); reading them is the only host sync. The
            router fills a lazy mapping, evaluated on first read; empty without statistics.
    """

    expert_index: Tensor
    combine_weights: Tensor
    capacity: Tensor | None
    num_groups: int
    logits: Tensor
    affinities: Tensor
    aux_loss: Tensor
    z_loss: Tensor
    stats: Mapping[str, Tensor] = field(default_factory=dict)

    @property
    def num_experts(self) -> int:
        return self.logits.shape[-1]

    @property
    def group_size(self) -> int:
        return self.expert_index.shape[0] // self.num_groups

    @property
    def slot_mask(self) -> Tensor:
        """``[T, S]`` bool, True where the slot holds an expert."""
        return self.expert_index >= 0

    def dense_assignment(self) -> Tensor:
        """``[T, e]`` 0/1 float matrix P of Eq. (7) (for tests and statistics, not the hot path)."""
        return assignment_matrix(self.expert_index, self.num_experts, torch.float32)
