"""Gradients under expert parallelism: the experts' reduction and the global gradient norm.

After the backward pass of a data-parallel step, DDP (or FSDP2) has averaged the replicated
(dense) parameters' gradients over all ``W`` processes: ``(1/W) sum_r dL_r/dtheta``, the gradient
of the mean of the processes' losses, i.e. of the loss of the global batch. An expert's gradient
on its ``ep`` rank already sums the contributions of the tokens of every process of its ``ep``
group (they came back through the backward all-to-all); :func:`sync_expert_gradients` adds the
other replicas of the same experts (an all-reduce over the ``dp`` group) and divides by ``W``,
which gives the experts the same ``(1/W) sum_r dL_r/dW`` as the dense parameters.

The gradient norm of the whole model (:func:`total_grad_norm`) counts every expert once: the
squared norm of the local experts is summed over the ``ep`` group (each process of it holds
other experts, and the ``dp`` replicas hold equal ones after the sync) and added to the
replicated parameters' squared norm, which is the same on every process. Clipping by this norm
(:func:`clip_grad_norm_`) therefore scales every process's gradients by the same factor, so the
replicated parameters stay equal everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from maxscore.parallel.sharding import ExpertSharding

__all__ = ["clip_grad_norm_", "sync_expert_gradients", "total_grad_norm"]

#: clip_grad_norm_'s epsilon, so the clip coefficient is the same number.
_EPS = 1e-6


def _grads(params: Sequence[nn.Parameter]) -> list[Tensor]:
    return [p.grad for p in params if p.grad is not None]


@torch.no_grad()
def sync_expert_gradients(experts: Sequence[nn.Parameter], sharding: ExpertSharding) -> None:
    """Sum the local experts' gradients over the ``dp`` group and divide by the world size."""
    grads = _grads(experts)
    if not grads:
        return
    if sharding.dp_size > 1:
        for grad in grads:
            dist.all_reduce(grad, group=sharding.dp_group)
    torch._foreach_div_(grads, float(sharding.world_size))


def _is_dtensor(t: Tensor) -> bool:
    return isinstance(t, DTensor)


def _norm(grads: list[Tensor]) -> Tensor | None:
    if not grads:
        return None
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    # FSDP2-sharded gradients (DTensors) give a DTensor norm; its full value is the global one.
    return norm.full_tensor() if _is_dtensor(norm) else norm


@torch.no_grad()
def total_grad_norm(
    dense: Sequence[nn.Parameter], experts: Sequence[nn.Parameter], sharding: ExpertSharding
) -> Tensor:
    """The 2-norm of the whole model's gradient (every expert counted once), on every process.

    ``dense``: the replicated parameters (plain tensors under DDP, DTensors under FSDP2);
    ``experts``: this process's experts, after :func:`sync_expert_gradients`. One all-reduce of
    a scalar over the ``ep`` group, no host synchronisation.
    """
    grads = _grads(dense)
    parts = [
        _norm([g for g in grads if not _is_dtensor(g)]),
        _norm([g for g in grads if _is_dtensor(g)]),
    ]
    squares = [p.float().square() for p in parts if p is not None]
    expert_norm = _norm(_grads(experts))
    device = next((g.device for g in (*grads, *_grads(experts))), torch.device("cpu"))
    expert_sq = (
        expert_norm.float().square() if expert_norm is not None else torch.zeros((), device=device)
    )
    if sharding.ep_size > 1:
        expert_sq = expert_sq.clone()
        dist.all_reduce(expert_sq, group=sharding.ep_group)
    return torch.stack([*squares, expert_sq.to(device)]).sum().sqrt()


@torch.no_grad()
def clip_grad_norm_(
    dense: Sequence[nn.Parameter],
    experts: Sequence[nn.Parameter],
    sharding: ExpertSharding,
    max_norm: float,
    optimizer: torch.optim.Optimizer | None = None,
) -> Tensor:
    """Clip every gradient by the global norm (:func:`total_grad_norm`); returns the norm.

    With a fused torch Adam / AdamW (``maxscore.training.clipping.fused_adam``) the coefficient
    goes into the optimizer's ``grad_scale`` (one pass fewer over the gradients, as
    ``clip_grad_norm_in_fused_adam`` does); otherwise the gradients are scaled in place.
    """
    norm = total_grad_norm(dense, experts, sharding)
    if max_norm <= 0 or max_norm == float("inf"):
        return norm
    coefficient = torch.clamp(max_norm / (norm + _EPS), max=1.0)
    if optimizer is not None:
        optimizer.grad_scale = coefficient.reciprocal().to(torch.float32)  # type: ignore[attr-defined]
        return norm
    # A sharded (DTensor) gradient is scaled through its local shard: the same in-place multiply.
    grads = [g.to_local() if _is_dtensor(g) else g for g in _grads([*dense, *experts])]
    if grads:
        torch._foreach_mul_(grads, coefficient.to(grads[0].device))
    return norm
