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
        t, e = self.expert_index.shape[0], self.num_experts
        p = torch.zeros(t, e + 1, device=self.expert_index.device)
        p.scatter_(1, torch.where(self.slot_mask, self.expert_index, e), 1.0)
        return p[:, :e]
