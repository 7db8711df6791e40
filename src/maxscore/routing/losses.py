"""Auxiliary routing losses: the load-balancing loss (Eq. 9 / GShard) and the router z-loss.

Both return the *unscaled* loss; the router multiplies by ``aux_loss_coef`` / ``z_loss_coef``.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from maxscore.routing.types import assignment_matrix

__all__ = ["assignment_matrix", "load_balancing_loss", "router_z_loss"]


def load_balancing_loss(
    affinities: Tensor,
    expert_index: Tensor,
    form: Literal["gshard", "eq9", "none"] = "gshard",
    scale: float = 1.0,
) -> Tensor:
    """Load-balancing auxiliary loss, per routing group and averaged over groups (times ``scale``).

    Args:
        affinities: ``[G, n, e]`` (or ``[n, e]``) affinities ``A`` (carry the gradient).
        expert_index: ``[G, n, S]`` (or ``[n, S]``) final assignment, ``-1`` = empty slot.
        form: which loss.
        scale: multiplies the result (the router passes λ, saving a kernel per call; for the
            gshard form with ``e`` a power of two the product is bitwise the same as ``λ · L``).

    Forms:

    * ``"gshard"`` (default; the authors' code, GShard / Switch / fairseq):
      ``L = e · sum_j mean_i(A_ij) · f_j`` with ``f_j`` the fraction of the group's tokens whose
      top-1 choice (argmax of ``A``, before any capacity drop) is expert ``j``. Computed as
      ``L = e · mean_i mean_A[argmax_i]`` (the same sum grouped by token; one gather).
    * ``"eq9"``, the paper's Eq. (9) as printed (without λ):
      ``L = (1/e) · sum_j mean_i(A_ij) · mean_i(P_ij)`` with ``P`` the final assignment
      (Eq. 7), i.e. every kept slot, after capacity.
    * ``"none"``: zero.

    Scale: with row-normalised affinities at perfect balance, ``mean_i A_ij = 1/e``,
    ``f_j = 1/e`` and ``mean_i P_ij = k/e``, so ``gshard = 1`` while ``eq9 = k / e²``. Replacing
    ``f`` by ``P/k`` the two differ by exactly ``e²/k``: with e = 16, k = 2 the same λ makes the
    printed Eq. 9 128 times weaker than the GShard form the authors trained with. λ = 1e-2 in the
    paper therefore refers to the GShard form, our default.
    """
    if form == "none":
        return affinities.new_zeros(())
    if affinities.dim() == 2:
        affinities, expert_index = affinities.unsqueeze(0), expert_index.unsqueeze(0)
    if affinities.dim() != 3 or expert_index.dim() != 3:
        raise ValueError(
            "load_balancing_loss needs affinities [G, n, e] and expert_index [G, n, S], got "
            f"{tuple(affinities.shape)} and {tuple(expert_index.shape)}"
        )
    e = affinities.shape[-1]
    mean_affinity = affinities.mean(dim=1)  # [G, e]
    if form == "gshard":
        # sum_j mean_i(A_ij) f_j with f_j = (1/n) #{i: argmax_i = j} is the mean over tokens of
        # mean_A[argmax_i]: one gather instead of a one-hot, its mean and a product-sum (same
        # value up to fp32 summation order; every group has n tokens, so the mean over groups
        # is the mean over all G*n entries).
        top1 = affinities.detach().argmax(dim=-1)  # [G, n]
        return mean_affinity.gather(1, top1).mean() * (e * scale)
    if form == "eq9":
        load = assignment_matrix(expert_index, e, affinities.dtype).mean(dim=1)  # [G, e]
        loss = ((mean_affinity * load).sum(dim=-1) / e).mean()
        return loss * scale if scale != 1.0 else loss
    raise ValueError(f"unknown aux loss form {form!r}; use 'gshard', 'eq9' or 'none'")


def router_z_loss(logits: Tensor) -> Tensor:
    """Router z-loss (ST-MoE): ``mean over tokens of logsumexp_j(logits_ij)²`` (unscaled).

    Keeps gate logits small so the fp32 softmax stays well conditioned. ``logits[..., e]``.
    """
    return (
        torch.logsumexp(logits.float() if logits.dtype != torch.float64 else logits, -1)
        .square()
        .mean()
    )
