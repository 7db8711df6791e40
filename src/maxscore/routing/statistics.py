"""Per-call routing statistics, computed on the device with no host synchronisation.

These are the quantities the paper plots (Fig. 2: drop rate and mean affinity of the 1st / 2nd
choice; Fig. 8: per-expert load over capacity) plus the metrics SPEC §3 asks for (unused experts,
load imbalance). Every statistic is computed per routing group and averaged over groups; the
result is a dict of device tensors, so reading one (``.item()``) is the caller's only sync.
"""

from __future__ import annotations

import torch
from torch import Tensor

from maxscore.routing.losses import assignment_matrix

__all__ = ["STAT_KEYS", "routing_statistics"]

#: The keys of :func:`routing_statistics`' result.
STAT_KEYS: tuple[str, ...] = (
    "drop_rate_by_rank",
    "tokens_per_expert",
    "load_over_capacity",
    "unused_experts",
    "load_imbalance",
    "mean_affinity_by_rank",
)


@torch.no_grad()
def routing_statistics(
    affinities: Tensor, expert_index: Tensor, capacity: Tensor | None, k: int
) -> dict[str, Tensor]:
    """Routing statistics of one call, as fp32 device tensors (averaged over routing groups).

    Args:
        affinities: ``[G, n, e]`` (or ``[n, e]``) affinities ``A``.
        expert_index: ``[G, n, S]`` (or ``[n, S]``) assignment, ``-1`` = empty slot.
        capacity: ``[e]`` per-expert capacity of one group, or ``None`` (dropless); then the
            reference capacity ``k·n/e`` is used for ``load_over_capacity`` (as in Fig. 8).
        k: experts per token (the number of choice ranks reported).

    Returns:
        ``drop_rate_by_rank[k]``: for rank ``r``, the fraction of tokens whose r-th
        highest-affinity expert is not among their assigned experts (strategy-independent;
        Fig. 2a plots one minus this). ``tokens_per_expert[e]``: tokens assigned to each expert.
        ``load_over_capacity[e]``: tokens / capacity per expert (Fig. 8).
        ``unused_experts[]``: number of experts with no token. ``load_imbalance[]``: max / mean
        tokens per expert. ``mean_affinity_by_rank[k]``: mean of each token's r-th highest
        affinity (Fig. 2b).
    """
    if affinities.dim() == 2:
        affinities, expert_index = affinities.unsqueeze(0), expert_index.unsqueeze(0)
    a = affinities.detach().float()
    _, n, e = a.shape
    k = min(k, e)
    assigned = assignment_matrix(expert_index, e, torch.float32)  # [G, n, e]

    top_val, top_idx = torch.topk(a, k, dim=-1, sorted=True)  # [G, n, k]
    kept = assigned.gather(-1, top_idx)  # 1 where the r-th choice was assigned
    drop_rate_by_rank = 1.0 - kept.mean(dim=(0, 1))
    mean_affinity_by_rank = top_val.mean(dim=(0, 1))

    load = assigned.sum(dim=1)  # [G, e] tokens per expert in each group
    if capacity is None:
        cap = torch.full((e,), k * n / e, dtype=torch.float32, device=a.device)
    else:
        cap = capacity.to(device=a.device, dtype=torch.float32).clamp_min(1e-9)
    mean_load = load.mean(dim=-1)  # [G]
    imbalance = load.amax(dim=-1) / mean_load.clamp_min(1e-9)
    return {
        "drop_rate_by_rank": drop_rate_by_rank,
        "tokens_per_expert": load.mean(dim=0),
        "load_over_capacity": (load / cap).mean(dim=0),
        "unused_experts": (load == 0).float().sum(dim=-1).mean(),
        "load_imbalance": imbalance.mean(),
        "mean_affinity_by_rank": mean_affinity_by_rank,
    }
