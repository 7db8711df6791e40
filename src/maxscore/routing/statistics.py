"""Per-call routing statistics, computed on the device with no host synchronisation.

These are the quantities the paper plots (Fig. 2: drop rate and mean affinity of the 1st / 2nd
choice, the missed choices split here into dropped and rerouted ones; Fig. 8: per-expert load
over capacity) plus unused experts and load imbalance (max / mean tokens per expert). Every
statistic is computed per routing group and averaged over groups; the result is a dict of device
tensors, so reading one (``.item()``) is the caller's only sync.

Off the hot path: the router does not compute them in its forward. It returns a
:class:`LazyRoutingStatistics`, a read-only mapping with the same keys that keeps detached
references to what the statistics need (affinities, assignment, capacity, ``k``) and runs
:func:`routing_statistics` once, on the first access of a value (``stats["tokens_per_expert"]``,
``dict(stats)``, ``.items()``, ``.values()``), then caches the result. Listing the keys
(``set(stats)``, ``len(stats)``, ``key in stats``) computes nothing. A forward therefore issues
no statistics kernels unless someone reads them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import Tensor

from maxscore.compiled import call_compiled
from maxscore.routing.losses import assignment_matrix
from maxscore.routing.ranking import top_experts

__all__ = [
    "STAT_KEYS",
    "LazyRoutingStatistics",
    "dropped_and_rerouted",
    "routing_statistics",
    "with_extra_statistics",
]

#: The keys of :func:`routing_statistics`' result.
STAT_KEYS: tuple[str, ...] = (
    "dropped_by_rank",
    "rerouted_by_rank",
    "tokens_per_expert",
    "load_over_capacity",
    "unused_experts",
    "load_imbalance",
    "mean_affinity_by_rank",
)


@torch.no_grad()
def routing_statistics(
    affinities: Tensor,
    expert_index: Tensor,
    capacity: Tensor | None,
    k: int,
    rank_scores: Tensor | None = None,
    token_mask: Tensor | None = None,
) -> dict[str, Tensor]:
    """Routing statistics of one call, as fp32 device tensors (averaged over routing groups).

    Args:
        affinities: ``[G, n, e]`` (or ``[n, e]``) affinities ``A``.
        expert_index: ``[G, n, S]`` (or ``[n, S]``) assignment, ``-1`` = empty slot.
        capacity: ``[e]`` per-expert capacity of one group, or ``None`` (dropless); then the
            reference capacity ``k·n/e`` is used for ``load_over_capacity`` (as in Fig. 8).
        k: experts per token (the number of choice ranks reported).
        rank_scores: scores that define each token's choice ranks, shaped like ``affinities``
            (the router passes its selection scores: for SoftTopk, the softmax, i.e. the
            logits' order); ``None`` ranks by ``affinities``.
        token_mask: ``[G, n]`` (or ``[n]``) bool, True = real token: the per-token rates and
            means are taken over real tokens only (padding has no assigned expert, so it never
            adds to the loads either). ``None``: every token is real.

    Returns:
        ``dropped_by_rank[k]`` and ``rerouted_by_rank[k]`` split the tokens whose r-th choice
        (r-th highest selection score) is not among their assigned experts (see
        :func:`dropped_and_rerouted`): *dropped* if the token is processed by fewer than ``k``
        experts, the slot left empty; *rerouted* if another expert fills the slot. Their sum
        is the share of tokens that lost their r-th choice (Fig. 2a plots one minus the
        dropped share; with rerouting, "not dropped" and "got its r-th choice" differ).
        ``tokens_per_expert[e]``: tokens assigned to each expert.
        ``load_over_capacity[e]``: tokens / capacity per expert (Fig. 8).
        ``unused_experts[]``: number of experts with no token. ``load_imbalance[]``: max / mean
        tokens per expert. ``mean_affinity_by_rank[k]``: mean of each token's r-th highest
        affinity (Fig. 2b).
    """
    if rank_scores is None:
        rank_scores = affinities
    if affinities.dim() == 2:
        affinities, expert_index = affinities.unsqueeze(0), expert_index.unsqueeze(0)
        rank_scores = rank_scores.unsqueeze(0)
        token_mask = None if token_mask is None else token_mask.unsqueeze(0)
    a = affinities.detach().float()
    _, n, e = a.shape
    k = min(k, e)
    assigned = assignment_matrix(expert_index, e, torch.float32)  # [G, n, e]

    top_idx = top_experts(rank_scores.detach().float(), k)
    kept = assigned.gather(-1, top_idx)  # 1 where the r-th choice was assigned
    # Padding has no assigned expert, so it would count as dropped at every rank: the
    # per-token statistics are means over real tokens only.
    dropped, rerouted = dropped_and_rerouted(kept, assigned.sum(dim=-1))
    top_affinity = a.gather(-1, top_idx)
    if token_mask is None:
        dropped_by_rank = dropped.mean(dim=(0, 1))
        rerouted_by_rank = rerouted.mean(dim=(0, 1))
        mean_affinity_by_rank = top_affinity.mean(dim=(0, 1))
    else:
        real = token_mask.to(torch.float32).unsqueeze(-1)  # [G, n, 1]
        count = real.sum().clamp_min(1.0)
        dropped_by_rank = (dropped * real).sum(dim=(0, 1)) / count
        rerouted_by_rank = (rerouted * real).sum(dim=(0, 1)) / count
        mean_affinity_by_rank = (top_affinity * real).sum(dim=(0, 1)) / count

    load = assigned.sum(dim=1)  # [G, e] tokens per expert in each group
    if capacity is None:
        cap = torch.full((e,), k * n / e, dtype=torch.float32, device=a.device)
    else:
        cap = capacity.to(device=a.device, dtype=torch.float32).clamp_min(1e-9)
    mean_load = load.mean(dim=-1)  # [G]
    imbalance = load.amax(dim=-1) / mean_load.clamp_min(1e-9)
    return {
        "dropped_by_rank": dropped_by_rank,
        "rerouted_by_rank": rerouted_by_rank,
        "tokens_per_expert": load.mean(dim=0),
        "load_over_capacity": (load / cap).mean(dim=0),
        "unused_experts": (load == 0).float().sum(dim=-1).mean(),
        "load_imbalance": imbalance.mean(),
        "mean_affinity_by_rank": mean_affinity_by_rank,
    }


def dropped_and_rerouted(kept: Tensor, experts_per_token: Tensor) -> tuple[Tensor, Tensor]:
    """Split each token's missed choices into dropped and rerouted slots (0/1, by rank).

    Args:
        kept: ``[..., k]`` float, 1 where the token's r-th choice is among its assigned experts.
        experts_per_token: ``[...]`` float, how many experts the token is processed by.

    A token that misses ``m`` of its top-``k`` choices and holds ``s`` other experts (its
    substitutes: ``experts_per_token - sum(kept)``) had ``min(s, m)`` of those choices
    *rerouted* and the rest *dropped* (``k - experts_per_token`` empty slots). The substitutes
    are credited to the missed choices in rank order, best first: iterative rerouting
    (GShard-I) re-serves a token's dropped slots in rank order too. For GShard without
    rerouting every miss is a drop; for min-cost flow, which leaves no slot empty while
    capacity remains, every miss is a reroute. Elementwise on the device, no host sync.

    Returns:
        ``(dropped, rerouted)``, each ``[..., k]`` float 0/1 with ``dropped + rerouted = 1 - kept``.
    """
    missed = 1.0 - kept
    substitutes = (experts_per_token - kept.sum(dim=-1)).clamp_min(0.0)
    # The m-th missed choice (1-based, in rank order) is rerouted while m <= substitutes.
    rerouted = missed * (missed.cumsum(dim=-1) <= substitutes.unsqueeze(-1)).to(missed.dtype)
    return missed - rerouted, rerouted


class _PendingStatistics:
    """The inputs of one :func:`routing_statistics` call, evaluated at most once."""

    __slots__ = (
        "affinities",
        "capacity",
        "expert_index",
        "k",
        "rank_scores",
        "result",
        "token_mask",
    )

    def __init__(
        self,
        affinities: Tensor,
        expert_index: Tensor,
        capacity: Tensor | None,
        k: int,
        rank_scores: Tensor | None = None,
        token_mask: Tensor | None = None,
    ) -> None:
        self.affinities: Tensor | None = affinities.detach()
        self.expert_index: Tensor | None = expert_index.detach()
        self.capacity = None if capacity is None else capacity.detach()
        self.rank_scores = None if rank_scores is None else rank_scores.detach()
        self.token_mask = token_mask
        self.k = k
        self.result: dict[str, Tensor] | None = None

    def get(self) -> dict[str, Tensor]:
        if self.result is None:
            assert self.affinities is not None and self.expert_index is not None
            # The trainer reads every MoE layer's statistics after every optimizer step (for
            # the logged means). Eagerly that is ~25 small kernels per layer on [G, n, e]
            # tensors; compiled on CUDA, ~0.04 ms per Base layer
            # (benchmarks/train_throughput/README.md).
            self.result = call_compiled(
                "routing_statistics",
                routing_statistics,
                self.affinities,
                self.expert_index,
                self.capacity,
                self.k,
                self.rank_scores,
                self.token_mask,
                enabled=self.affinities.is_cuda,
            )
            # The inputs are no longer needed: let them be freed.
            self.affinities = self.expert_index = self.capacity = self.rank_scores = None
            self.token_mask = None
        return self.result


class LazyRoutingStatistics(Mapping[str, Tensor]):
    """:func:`routing_statistics` of one call, computed on first value access and cached.

    A read-only mapping with the keys :data:`STAT_KEYS` (plus any ``extra`` entries, e.g. a
    layer's ``aux_loss``), whose values equal ``routing_statistics(affinities, expert_index,
    capacity, k)``. Construction issues no kernels; it only keeps detached references to the
    inputs (``[G, n, e]`` fp32 affinities and ``[G, n, S]`` long indices of one call), which are
    released once the statistics have been computed. Key listing never computes. Values are
    device tensors without gradient, as before (reading them is the caller's only host sync).
    """

    __slots__ = ("_extra", "_pending")

    def __init__(
        self,
        affinities: Tensor,
        expert_index: Tensor,
        capacity: Tensor | None,
        k: int,
        extra: Mapping[str, Tensor] | None = None,
        rank_scores: Tensor | None = None,
        token_mask: Tensor | None = None,
    ) -> None:
        self._pending = _PendingStatistics(
            affinities, expert_index, capacity, k, rank_scores, token_mask
        )
        self._extra: dict[str, Tensor] = dict(extra or {})

    @property
    def computed(self) -> bool:
        """Whether the statistics have been evaluated already."""
        return self._pending.result is not None

    def with_extra(self, **extra: Tensor) -> LazyRoutingStatistics:
        """A mapping with additional entries that shares this one's (single) evaluation."""
        other = LazyRoutingStatistics.__new__(LazyRoutingStatistics)
        other._pending = self._pending
        other._extra = {**self._extra, **extra}
        return other

    def __getitem__(self, key: str) -> Tensor:
        if key in self._extra:
            return self._extra[key]
        if key not in STAT_KEYS:
            raise KeyError(key)
        return self._pending.get()[key]

    def __iter__(self) -> Iterator[str]:
        yield from STAT_KEYS
        yield from (key for key in self._extra if key not in STAT_KEYS)

    def __len__(self) -> int:
        return len(STAT_KEYS) + sum(key not in STAT_KEYS for key in self._extra)

    def __contains__(self, key: object) -> bool:
        return key in STAT_KEYS or key in self._extra

    def __repr__(self) -> str:
        state = "computed" if self.computed else "pending"
        return f"LazyRoutingStatistics({state}, keys={list(self)})"


def with_extra_statistics(stats: Mapping[str, Tensor], **extra: Tensor) -> Mapping[str, Tensor]:
    """``stats`` plus ``extra`` entries, without evaluating lazy statistics.

    For a :class:`LazyRoutingStatistics` the result shares its single evaluation; any other
    mapping is copied into a dict of detached tensors.
    """
    if isinstance(stats, LazyRoutingStatistics):
        return stats.with_extra(**extra)
    return {**{name: value.detach() for name, value in stats.items()}, **extra}
