"""Expert parallelism: a MoE layer's experts spread over the ranks of a process group.

Each of the ``P`` ranks of an expert-parallel (EP) group holds ``e / P`` of the ``e`` experts, as
one contiguous block (rank ``r`` holds experts ``r * e/P .. (r+1) * e/P - 1``), and every rank
routes its own tokens: the router, each routing group's capacity and the flow solver run on the
rank that holds the group, exactly as on one device. Only the experts' buffer rows travel::

    plan = dispatch_plan(routing, capacity)   # the one-device plan (moe.dispatch), all e experts
    rows = experts.gather(tokens, plan)      # [R, D], grouped by expert
    recv = all_to_all(rows)                  # rows for my experts, from every rank
    out  = experts.padded_rows / grouped_rows(recv)   # the one-device computation (experts.py)
    back = all_to_all(out)                   # the reverse exchange
    y    = combine_rows(back, plan)          # Eq. (1)'s sum, on the token's own rank

Because both dispatch plans group rows by expert (``[e, G*c]`` expert-major for capacity
routers, sorted by expert for dropless ones) and rank ``r``'s experts are contiguous, the rows
for rank ``r`` are one contiguous slice of ``rows``: the send buffer needs no permutation.

* **Padded** (capacity routers): every rank sends ``(e/P) * G*c`` rows to every rank, an
  all-to-all with equal splits. ``G*c`` is a host integer derived from the input shape, so in
  training nothing is exchanged but the rows: no host synchronisation. This needs every rank of
  the group to run the layer on inputs of the same shape, which the trainer guarantees (full
  micro-batches only). In ``eval()`` mode the ranks' ``G*c`` are exchanged first (one small
  all-gather read on the host), so batches of different sizes work there.
* **Grouped** (dropless, causal evaluation): expert loads vary, so the ranks first exchange their
  per-expert row counts (an all-to-all of ``e`` integers) and read them on the host: the split
  sizes of the variable all-to-all. That is the one host synchronisation of the layer.

The rows' combine weights (one fp32 value per row) travel with them, so the weighted SwiGLU on
the expert's rank is the one-device kernel, and their gradient (towards the router) returns
through the reverse exchange. The all-to-all is PyTorch's differentiable functional collective
(``torch.distributed._functional_collectives.all_to_all_single_autograd``, the one torchtitan
uses): its backward is the reverse all-to-all, and ``torch.compile`` can trace it.

Gradients. On rank ``r`` the local experts' gradient is the sum of the contributions of the
tokens of every rank of the EP group (they arrive through the backward all-to-all). Everything
else (router, attention, embeddings) gets only the local tokens' gradient, as under data
parallelism; ``maxscore.parallel.gradients`` reduces both kinds over the right groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from maxscore.moe.dispatch import combine_rows, dispatch_plan
from maxscore.moe.experts import SwiGLUExperts
from maxscore.routing.types import RoutingResult

__all__ = [
    "ExpertParallel",
    "ShardableLayer",
    "all_gather_rows",
    "expert_parallel_forward",
    "shard_moe_experts",
]


@dataclass(frozen=True)
class ExpertParallel:
    """Where a MoE layer's experts live: an EP process group and this rank's block of experts.

    Attributes:
        group: the expert-parallel process group (``P`` ranks; ``mesh.get_group("ep")``).
        size: ``P``.
        rank: this process's rank inside ``group``.
        num_experts: ``e``, the layer's experts over all ranks.
    """

    group: dist.ProcessGroup
    size: int
    rank: int
    num_experts: int

    def __post_init__(self) -> None:
        if self.size < 1 or self.num_experts % self.size != 0:
            raise ValueError(
                f"expert parallelism over {self.size} ranks needs a number of experts divisible "
                f"by {self.size}; the layer has {self.num_experts}"
            )
        if not 0 <= self.rank < self.size:
            raise ValueError(
                f"rank {self.rank} is outside the expert-parallel group of {self.size}"
            )

    @classmethod
    def of_group(cls, group: dist.ProcessGroup, num_experts: int) -> ExpertParallel:
        """The layout of ``num_experts`` experts over ``group`` (this process's view)."""
        return cls(group, dist.get_world_size(group), dist.get_rank(group), num_experts)

    @property
    def local_experts(self) -> int:
        """``e / P``, the experts this rank holds."""
        return self.num_experts // self.size

    @property
    def first_expert(self) -> int:
        """Global index of this rank's first expert."""
        return self.rank * self.local_experts

    def local_slice(self) -> slice:
        """This rank's experts along the stacked experts' first axis."""
        return slice(self.first_expert, self.first_expert + self.local_experts)


class ShardableLayer(Protocol):
    """What :func:`shard_moe_experts` needs of a MoE layer (:class:`maxscore.moe.MoE`)."""

    expert_parallel: ExpertParallel | None
    num_experts: int
    experts: SwiGLUExperts


def shard_moe_experts(moe: ShardableLayer, ep: ExpertParallel) -> None:
    """Keep only this rank's experts in ``moe`` and run its experts through ``ep`` from now on.

    The stacked weights ``gate_up [e, D, 2F]`` and ``down [e, F, D]`` become this rank's block
    ``[e/P, ...]`` (new parameters, same names: a state dict then holds the local block); the
    router, its buffers and the shared experts stay whole (they are replicated, like any dense
    parameter). Call before the optimizer is built.
    """
    if moe.expert_parallel is not None:
        raise ValueError("this MoE layer's experts are already sharded")
    if ep.num_experts != moe.num_experts:
        raise ValueError(
            f"expert-parallel layout for {ep.num_experts} experts, the layer has {moe.num_experts}"
        )
    experts = moe.experts
    part = ep.local_slice()
    with torch.no_grad():
        experts.gate_up = nn.Parameter(experts.gate_up[part].clone())
        experts.down = nn.Parameter(experts.down[part].clone())
    experts.num_experts = ep.local_experts
    moe.expert_parallel = ep


# --------------------------------------------------------------------------------------------
# The exchange
# --------------------------------------------------------------------------------------------
def _all_to_all(x: Tensor, recv_splits: list[int] | None, send_splits: list[int] | None, ep):
    """Differentiable all-to-all along dim 0 (``None`` splits: equal parts)."""
    # On first use: a torch built without distributed support has no functional collectives,
    # and one-device layers never get here.
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    out = all_to_all_single_autograd(x.contiguous(), recv_splits, send_splits, ep.group)
    # The functional collective returns a tensor that waits on first use; wait here so the
    # layer's later reshapes see a plain tensor.
    return out.wait() if hasattr(out, "wait") else out


class _PermuteRows(torch.autograd.Function):
    """``x[perm]`` along dim 0 for a permutation; backward gathers by the inverse (no atomics)."""

    @staticmethod
    def forward(ctx, x: Tensor, perm: Tensor, inverse: Tensor):  # type: ignore[override]
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def _exclusive_cumsum(x: Tensor) -> Tensor:
    return x.cumsum(0) - x


def _source_to_expert_order(recv_counts: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """The permutation that sorts received rows by local expert, and its inverse.

    Rows arrive grouped by source rank, then by local expert (``recv_counts[s, j]`` rows from
    rank ``s`` for expert ``j``); the experts want them grouped by expert, then source. Built on
    the device from the counts (``total`` = their sum, already on the host): no host sync.
    """
    device = recv_counts.device
    in_start = _exclusive_cumsum(recv_counts.reshape(-1)).view_as(recv_counts)
    seg_counts = recv_counts.t().reshape(-1)  # segments in (expert, source) order
    seg_in_start = in_start.t().reshape(-1)
    seg_out_start = _exclusive_cumsum(seg_counts)
    shift = torch.repeat_interleave(seg_in_start - seg_out_start, seg_counts, output_size=total)
    perm = torch.arange(total, device=device) + shift
    inverse = torch.empty_like(perm).scatter_(0, perm, torch.arange(total, device=device))
    return perm, inverse


def _to_experts(
    ep: ExpertParallel,
    rows: Tensor,
    weights: Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    recv_counts: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Send rows and weights to their experts' ranks; return them sorted by local expert, with
    the permutation that sorted them and its inverse (for the way back)."""
    recv = _all_to_all(rows, recv_splits, send_splits, ep)
    recv_w = _all_to_all(weights, recv_splits, send_splits, ep)
    perm, inverse = _source_to_expert_order(recv_counts, sum(recv_splits))
    return (
        _PermuteRows.apply(recv, perm, inverse),
        _PermuteRows.apply(recv_w, perm, inverse),
        perm,
        inverse,
    )


def _padded_uniform(
    ep: ExpertParallel, experts: SwiGLUExperts, rows: Tensor, weights: Tensor
) -> Tensor:
    """Equal splits: every rank sends ``(e/P) * G*c`` rows to every rank (static shapes)."""
    p, el, d = ep.size, ep.local_experts, rows.shape[-1]
    recv = _all_to_all(rows, None, None, ep)  # [P * el * Gc, D], source-major
    recv_w = _all_to_all(weights, None, None, ep)
    xd = recv.view(p, el, -1, d).transpose(0, 1).reshape(el, -1, d)  # [el, P * Gc, D]
    w = recv_w.view(p, el, -1).transpose(0, 1).reshape(-1)
    out = experts.padded_rows(xd, w)  # [el * P * Gc, D], expert-major
    back = out.view(el, p, -1, d).transpose(0, 1).reshape(-1, d)  # source-major again
    return _all_to_all(back, None, None, ep)


def all_gather_rows(local: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The group's ``local`` tensors concatenated along dim 0, in group-rank order."""
    size = dist.get_world_size(group)
    out = local.new_empty((local.shape[0] * size, *local.shape[1:]))
    # torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local.contiguous(), group=group)
    return out


def _gathered_sizes(ep: ExpertParallel, value: int, device: torch.device) -> list[int]:
    """``value`` of every rank of the group (one small all-gather, read on the host)."""
    mine = torch.tensor([value], dtype=torch.long, device=device)
    return [int(v) for v in all_gather_rows(mine, ep.group).tolist()]


def _padded_varying(
    ep: ExpertParallel, experts: SwiGLUExperts, rows: Tensor, weights: Tensor, per_expert: int
) -> Tensor:
    """Padded buffers whose size ``G*c`` may differ between ranks (evaluation batches)."""
    p, el, d = ep.size, ep.local_experts, rows.shape[-1]
    sizes = _gathered_sizes(ep, per_expert, rows.device)
    if len(set(sizes)) == 1:
        return _padded_uniform(ep, experts, rows, weights)
    send = [el * per_expert] * p
    recv = [el * s for s in sizes]
    counts = torch.tensor(sizes, device=rows.device).unsqueeze(1).expand(p, el).contiguous()
    xd, w, perm, inverse = _to_experts(ep, rows, weights, send, recv, counts)
    out = experts.padded_rows(xd.view(el, -1, d), w)
    return _all_to_all(_PermuteRows.apply(out, inverse, perm), send, recv, ep)


def _grouped(ep: ExpertParallel, experts: SwiGLUExperts, rows: Tensor, plan) -> Tensor:
    """Variable expert loads: exchange the row counts, then the rows (dropless routing)."""
    p, el, e = ep.size, ep.local_experts, ep.num_experts
    ends = plan.group_end.long()
    counts = ends - torch.cat([ends.new_zeros(1), ends[:-1]])  # [e] rows per expert
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=ep.group)  # [P * el]: source-major
    # The one host synchronisation: the split sizes of the all-to-all below.
    host = torch.cat([counts, recv_counts]).tolist()
    send = [sum(host[r * el : (r + 1) * el]) for r in range(p)]
    recv = [sum(host[e + s * el : e + (s + 1) * el]) for s in range(p)]
    recv_counts = recv_counts.view(p, el)
    xd, w, perm, inverse = _to_experts(ep, rows, plan.row_weight, send, recv, recv_counts)
    group_end = recv_counts.sum(0).cumsum(0).to(torch.int32)
    out = experts.grouped_rows(xd, w, group_end)
    return _all_to_all(_PermuteRows.apply(out, inverse, perm), send, recv, ep)


def expert_parallel_forward(
    ep: ExpertParallel,
    experts: SwiGLUExperts,
    tokens: Tensor,
    routing: RoutingResult,
    capacity: int | None,
    uniform_shapes: bool = True,
) -> Tensor:
    """Eq. (1) with the experts spread over ``ep``: ``tokens[T, D] -> y[T, D]`` (routed part).

    ``routing`` is this rank's routing of its own ``T`` tokens over all ``e`` experts;
    ``capacity`` the padded buffers' rows per expert and group (``None``: the grouped path).
    ``uniform_shapes`` promises that every rank of the group calls with the same ``G*c`` (the
    padded path then exchanges nothing but rows); the MoE layer passes ``self.training``.
    Every rank of the group must call this the same number of times, in the same order.
    """
    if experts.num_experts != ep.local_experts:
        raise ValueError(
            f"the experts module holds {experts.num_experts} experts, the expert-parallel layout "
            f"gives this rank {ep.local_experts}: shard it with shard_moe_experts first"
        )
    plan = dispatch_plan(routing, capacity)
    rows = experts.gather(tokens, plan)
    if plan.rows_per_expert is None:
        out = _grouped(ep, experts, rows, plan)
    elif uniform_shapes:
        out = _padded_uniform(ep, experts, rows, plan.row_weight)
    else:
        out = _padded_varying(ep, experts, rows, plan.row_weight, plan.rows_per_expert)
    return combine_rows(out, plan, tokens.shape[0])
