"""Auxiliary routing losses: the load-balancing loss (Eq. 9 / GShard) and the router z-loss.

Both return the *unscaled* loss; the router multiplies by ``aux_loss_coef`` / ``z_loss_coef``.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from maxscore.routing.types import assignment_matrix

__all__ = [
    "assignment_matrix",
    "balance_loss_from_terms",
    "balance_terms",
    "load_balancing_loss",
    "masked_load_balancing_loss",
    "router_z_loss",
]


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
            gshard form with ``e`` and ``G·n`` powers of two the product is bitwise ``λ · L``).

    Forms:

    * ``"gshard"`` (default; the authors' code, GShard / Switch / fairseq):
      ``L = e · sum_j mean_i(A_ij) · f_j`` with ``f_j`` the fraction of the group's tokens whose
      top-1 choice (argmax of ``A``, before any capacity drop) is expert ``j``, computed from
      the per-expert top-1 counts (a one-hot sum: no scatter in the backward pass, whose
      atomic adds onto ``e`` addresses cost ~0.1 ms per Base layer on a GPU).
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
        # f_j = (1/n) #{i: argmax_i = j}, from a one-hot sum (constant: no gradient). Every
        # group has n tokens, so the mean over groups of sum_j mean_A f_j is one sum over G*n.
        top1 = affinities.detach().argmax(dim=-1, keepdim=True)  # [G, n, 1]
        experts = torch.arange(e, device=affinities.device)
        counts = (top1 == experts).sum(dim=1, dtype=affinities.dtype)  # [G, e]
        g, n = affinities.shape[:2]
        return (mean_affinity * counts).sum() * (e * scale / (g * n))
    if form == "eq9":
        load = assignment_matrix(expert_index, e, affinities.dtype).mean(dim=1)  # [G, e]
        loss = ((mean_affinity * load).sum(dim=-1) / e).mean()
        return loss * scale if scale != 1.0 else loss
    raise ValueError(f"unknown aux loss form {form!r}; use 'gshard', 'eq9' or 'none'")


def balance_terms(
    affinities: Tensor,
    expert_index: Tensor,
    form: Literal["gshard", "eq9"],
    token_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The three sums every load-balancing loss is made of, per group, over real tokens only.

    Args:
        affinities: ``[G, n, e]`` affinities ``A`` (carry the gradient).
        expert_index: ``[G, n, S]`` assignment (``-1`` = empty slot).
        form: ``"gshard"`` (the load is the top-1 choice) or ``"eq9"`` (every kept slot).
        token_mask: ``[G, n]`` bool, True = real token; ``None`` = all real.

    Returns:
        ``prob_sum [G, e]`` (``sum_i m_i A_ij``), ``load [G, e]`` (real tokens whose top-1 is
        ``j``, or real slots kept on ``j``; no gradient) and ``tokens [G]`` (real tokens).
    """
    g, n, e = affinities.shape
    weight = affinities.new_ones(g, n) if token_mask is None else token_mask.to(affinities.dtype)
    prob_sum = (affinities * weight.unsqueeze(-1)).sum(dim=1)
    with torch.no_grad():
        if form == "gshard":
            top1 = affinities.detach().argmax(dim=-1, keepdim=True)  # [G, n, 1]
            hits = (top1 == torch.arange(e, device=affinities.device)).to(affinities.dtype)
        else:
            hits = assignment_matrix(expert_index, e, affinities.dtype)
        load = (hits * weight.unsqueeze(-1)).sum(dim=1)
    return prob_sum, load, weight.sum(dim=1)


def balance_loss_from_terms(
    prob_sum: Tensor,
    load: Tensor,
    tokens: Tensor,
    form: Literal["gshard", "eq9"],
    load_tokens: Tensor | None = None,
) -> Tensor:
    """The load-balancing loss of :func:`load_balancing_loss` from :func:`balance_terms`' sums.

    Per group ``g``: ``gshard`` ``e * sum_j (prob_sum / tokens) * (load / load_tokens)``;
    ``eq9`` the same with ``1/e`` in front. Averaged over the groups that hold a real token
    (a group of padding only contributes nothing). ``load_tokens`` (default ``tokens``) is the
    token count the load was measured over, which differs from ``tokens`` when the load comes
    from a larger batch than the affinities (the global-batch loss).
    """
    e = prob_sum.shape[-1]
    load_tokens = tokens if load_tokens is None else load_tokens
    factor = e if form == "gshard" else 1.0 / e
    per_group = (prob_sum * load).sum(dim=-1) / (tokens.clamp(min=1.0) * load_tokens.clamp(min=1.0))
    present = (tokens > 0).to(per_group.dtype)
    return factor * (per_group * present).sum() / present.sum().clamp(min=1.0)


def masked_load_balancing_loss(
    affinities: Tensor,
    expert_index: Tensor,
    form: Literal["gshard", "eq9", "none"],
    token_mask: Tensor | None,
    scale: float = 1.0,
) -> Tensor:
    """:func:`load_balancing_loss` over the real tokens of each group (``token_mask``).

    Equal to ``load_balancing_loss`` when every token is real (up to rounding); padded positions
    enter neither the mean affinity nor the load, so the loss does not depend on them.
    """
    if form == "none":
        return affinities.new_zeros(())
    prob_sum, load, tokens = balance_terms(affinities, expert_index, form, token_mask)
    return balance_loss_from_terms(prob_sum, load, tokens, form) * scale


def router_z_loss(logits: Tensor, token_mask: Tensor | None = None) -> Tensor:
    """Router z-loss (ST-MoE): ``mean over tokens of logsumexp_j(logits_ij)²`` (unscaled).

    Keeps gate logits small so the fp32 softmax stays well conditioned. ``logits[..., e]``;
    ``token_mask[...]`` (True = real token) restricts the mean to real tokens.
    """
    z = torch.logsumexp(logits.float() if logits.dtype != torch.float64 else logits, -1).square()
    if token_mask is None:
        return z.mean()
    weight = token_mask.to(z.dtype)
    return (z * weight).sum() / weight.sum().clamp(min=1.0)
