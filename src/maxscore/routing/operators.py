"""Affinity operators: gate logits ``x · W_g`` -> token-expert affinities ``A``.

Every operator of the paper's Table 2 ("Operators can be used for MoE routing") plus the proposed
SoftTopk operator (the paper's Eq. "SoftTopk", between Eq. 6 and Eq. 7), and ReLU (ReMoE) as an
extra. All operators share one signature::

    fn(logits: Tensor[..., e], k: int, t: Tensor | float) -> Tensor[..., e]

``k`` is the number of experts per token and ``t`` the SoftTopk scale; operators that do not use
them ignore them. Half-precision logits are computed in fp32 (router math is fp32); float64 stays
float64 so gradients can be checked with :func:`torch.autograd.gradcheck`.

The operators are vectorised over all leading dimensions and never synchronise with the host, so
they run under CUDA graphs and ``torch.compile``. Non-finite logits are the router's job
(:class:`~maxscore.routing.router.Router` sanitises them before calling an operator).

The registry :data:`AFFINITY_OPERATORS` maps names to :class:`OperatorSpec` entries (the
function, its ``t`` boost if it has one, a description); the router looks operators up there, so
adding one is adding an entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from maxscore.routing.ranking import top_experts

__all__ = [
    "AFFINITY_OPERATORS",
    "OPERATORS_USING_TEMPERATURE",
    "AffinityOperator",
    "OperatorSpec",
    "TemperatureBoost",
    "get_operator",
    "get_operator_spec",
    "gradtopk_affinity",
    "itertopk_affinity",
    "relu_affinity",
    "sigmoid_affinity",
    "softkmax_affinity",
    "softmax_affinity",
    "softtopk_affinity",
    "softtopk_boost",
]


class AffinityOperator(Protocol):
    """``fn(logits[..., e], k, t) -> affinities[..., e]`` (fp32 or float64)."""

    def __call__(self, logits: Tensor, k: int, t: Tensor | float) -> Tensor: ...


#: ``boost(value_at_t0, logits, k, t) -> value_at_t`` of an operator that depends on ``t``.
TemperatureBoost = Callable[[Tensor, Tensor, int, Tensor | float], Tensor]


def _as_router_float(logits: Tensor) -> Tensor:
    # Router math is fp32: upcast half types, keep fp32/fp64 (fp64 for gradcheck).
    if logits.dtype in (torch.float32, torch.float64):
        return logits
    if not logits.is_floating_point():
        raise ValueError(f"affinity operators need floating-point logits, got {logits.dtype}")
    return logits.float()


def _check_k(logits: Tensor, k: int) -> None:
    # Shape-only check (python ints), so it costs no host sync.
    e = logits.shape[-1]
    if not 1 <= k <= e:
        raise ValueError(f"need 1 <= k <= number of experts, got k={k} with {e} experts")


def _masked_log(w: Tensor) -> Tensor:
    """``log(w)`` with ``-inf`` (and a zero, not NaN, gradient) where ``w <= 0``."""
    positive = w > 0
    safe = torch.where(positive, w, torch.ones_like(w))
    return torch.where(positive, safe.log(), torch.full_like(w, float("-inf")))


def softmax_affinity(logits: Tensor, k: int = 1, t: Tensor | float = 0.0) -> Tensor:
    """Softmax (Table 2, Eq. 2): ``y_i = exp(x_i) / sum_j exp(x_j)``. ``k`` and ``t`` unused."""
    return torch.softmax(_as_router_float(logits), dim=-1)


def sigmoid_affinity(logits: Tensor, k: int = 1, t: Tensor | float = 0.0) -> Tensor:
    """Sigmoid (Table 2; DeepSeek-V3): ``y_i = 1 / (1 + exp(-x_i))``. ``k`` and ``t`` unused."""
    return torch.sigmoid(_as_router_float(logits))


def relu_affinity(logits: Tensor, k: int = 1, t: Tensor | float = 0.0) -> Tensor:
    """ReLU (ReMoE, related work in Sec. 2.2): ``y_i = max(x_i, 0)``. ``k`` and ``t`` unused."""
    return F.relu(_as_router_float(logits))


def softkmax_affinity(logits: Tensor, k: int, t: Tensor | float = 0.0) -> Tensor:
    """SoftKmax (Table 2), ``k`` rounds of a re-weighted softmax.

    ``y^(m) = y^(m-1) + Softmax(g^(m-1))``, ``g^(m-1) = (1 - y^(m-1)) ⊗ x``, with ``y^(0) = 0``
    (so ``y^(1) = Softmax(x)``); returns ``y^(k)``, whose entries sum to ``k``. ``t`` unused.
    """
    x = _as_router_float(logits)
    _check_k(x, k)
    y = torch.zeros_like(x)
    for _ in range(k):  # k rounds, not a loop over tokens or experts
        y = y + torch.softmax((1.0 - y) * x, dim=-1)
    return y


def itertopk_affinity(logits: Tensor, k: int, t: Tensor | float = 0.0) -> Tensor:
    """IterTopk (Table 2): ``y^(m) = y^(m-1) + g(x; 1 - y^(m-1))``, ``y^(0) = 0``.

    ``g(x; w)_i = w_i exp(x_i) / sum_j w_j exp(x_j)``. Each round hands one unit of mass to the
    experts in proportion to their softmax weight times their remaining room ``1 - y``, so
    ``y^(k)`` sums to ``k`` (an entry can pass 1 within a round). ``t`` unused.

    The room is clamped at 0 (an expert already at or past 1 takes no more mass; the table
    leaves negative weights possible for k >= 3, which can make the denominator vanish). Since
    the rooms sum to ``e - m + 1 >= 1`` the denominator stays positive. Computed as
    ``softmax(x + log(max(1 - y, 0)))`` so the largest *available* logit is subtracted before
    exponentiation: a saturated expert gets ``-inf`` and the others never underflow.
    """
    x = _as_router_float(logits)
    _check_k(x, k)
    y = torch.zeros_like(x)
    for _ in range(k):
        y = y + torch.softmax(x + _masked_log(1.0 - y), dim=-1)
    return y


def _log1m_softmax(x: Tensor) -> Tensor:
    """``log(1 - softmax(x))`` without cancellation for the largest entry.

    For the argmax, ``1 - p = sum_{j != argmax} p_j`` is computed as a logsumexp over the other
    logits; elsewhere ``p < 1/2`` (only one entry can exceed 1/2) and ``log1p(-p)`` is accurate.
    """
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    log_p = x - lse
    is_max = F.one_hot(x.argmax(dim=-1), x.shape[-1]).bool()
    if x.shape[-1] == 1:
        return torch.full_like(x, float("-inf"))
    others = torch.logsumexp(x.masked_fill(is_max, float("-inf")), dim=-1, keepdim=True) - lse
    # Where p >= 1/2 log1p would lose everything; the masked value is finite where it is used.
    p = log_p.exp().clamp(max=0.5)
    return torch.where(is_max, others, torch.log1p(-p))


def gradtopk_affinity(logits: Tensor, k: int, t: Tensor | float = 0.0) -> Tensor:
    """GradTopk (Table 2): ``y^(m) = exp(g^(m) - z^(m))`` with

    ``g^(m) = x + log(exp(z^(m-1)) - exp(g^(m-1)))`` and
    ``z^(m) = log(sum_j exp(g^(m)_j)) - log m``, starting from ``g^(0) = -inf``, ``z^(0) = 0``
    (so ``y^(1) = Softmax(x)``). Returns ``y^(k)``, which sums to ``k``; ``t`` unused.

    Since ``exp(z^(m-1)) - exp(g^(m-1)) = exp(z^(m-1)) (1 - y^(m-1))`` and ``z^(m-1)`` is constant
    along the expert axis, the recursion is ``y^(m) = m · Softmax(x + log(1 - y^(m-1)))``, which
    is how it is computed. ``log(1 - y^(1))`` is evaluated without cancellation (so k = 2 is
    accurate for any logit spread); for m >= 2 a saturated entry (``y = 1`` in fp32) drops out.
    """
    x = _as_router_float(logits)
    _check_k(x, k)
    y = torch.softmax(x, dim=-1)
    if k == 1:
        return y
    y = 2.0 * torch.softmax(x + _log1m_softmax(x), dim=-1)
    for m in range(3, k + 1):
        y = m * torch.softmax(x + _masked_log(1.0 - y), dim=-1)
    return y


def softtopk_affinity(logits: Tensor, k: int, t: Tensor | float) -> Tensor:
    """SoftTopk (the paper's Eq. "SoftTopk", Sec. 3.2), the MaxScore operator.

    ``SoftTopk(a)^(m) = SoftTopk(a)^(m-1) + SE(a)`` with ``SoftTopk(a)^(1) = Softmax(a)`` and
    ``SE(a)_i = 0`` if ``a_i`` is in ``Top_(m-1)(a)``, else ``t · Softmax(a)_i``. Unrolled, the
    entry whose logit has rank ``r`` (1 = largest) gets::

        Softmax(a)_i · (1 + t · (min(r, k) - 1))

    so the top-1 keeps its softmax weight, the rank-r choice (r <= k) is boosted by
    ``1 + t (r - 1)`` and every expert outside the top ``k - 1`` by ``1 + t (k - 1)``. Ranks come
    from the logits (ties broken by the lower expert index, :mod:`.ranking`); they are piecewise
    constant, so gradients flow through the softmax only. With ``t > 0`` a boosted lower-ranked
    expert can end up with a larger affinity than the top-1 (e.g. ``p = (.5, .2)``, ``t = 3`` gives ``(.5, .8)``), so the
    router selects experts on this operator at ``t = 0`` (the softmax) and uses the boosted values
    as combine weights only. ``t`` may be a 0-dim tensor (the schedule's value, kept on the
    device) or a float; it decays during training (:mod:`maxscore.routing.schedule`).
    """
    x = _as_router_float(logits)
    _check_k(x, k)
    return softtopk_boost(torch.softmax(x, dim=-1), x, k, t)


def softtopk_boost(probs: Tensor, logits: Tensor, k: int, t: Tensor | float) -> Tensor:
    """SoftTopk from its ``t = 0`` value: ``probs * (1 + t (min(r, k) - 1))``.

    ``probs`` is ``Softmax(logits)`` (the operator at ``t = 0``, which the router already has as
    its selection scores), so the router boosts it instead of computing the softmax twice.
    """
    if k == 1 or (isinstance(t, (int, float)) and t == 0):
        return probs  # no boost: skip the ranking
    x = _as_router_float(logits)
    # Multiplier of rank r is 1 + t*(min(r, k) - 1); only the top k-1 ranks differ from the max.
    # extra = min(r, k) - 1: k - 1 everywhere, less (k - 1 - (r - 1)) at the top k - 1 ranks. Built
    # by comparison with the expert ids, not by a scatter into a constant tensor, which torch
    # 2.11-2.13's inductor miscompiles inside the router (the scattered values are lost).
    steps = torch.arange(k - 1, dtype=x.dtype, device=x.device)  # r - 1 for r = 1 .. k-1
    top = top_experts(x, k - 1)  # [..., k-1]
    at_rank = top.unsqueeze(-1) == torch.arange(x.shape[-1], device=x.device)  # [..., k-1, e]
    extra = (k - 1) - ((k - 1 - steps).unsqueeze(-1) * at_rank).sum(dim=-2)
    # ``t`` is used as given (python float or 0-dim device tensor): converting a float to a
    # device tensor here would be a host-to-device copy on every call.
    return probs * (1.0 + t * extra)


@dataclass(frozen=True)
class OperatorSpec:
    """A registered affinity operator: its function, its ``t`` boost and what it is.

    Attributes:
        fn: the operator, ``fn(logits[..., e], k, t) -> affinities[..., e]``.
        description: one line for docs and listings.
        boost: for operators whose value depends on ``t``: the function that turns the
            operator's ``t = 0`` value into its value at ``t``, ``boost(value_at_0, logits, k, t)``.
            The router selects experts on the ``t = 0`` value and boosts it for the combine
            weights (and only evaluates the ``t`` schedule when an operator has a boost).
            ``None`` for operators that ignore ``t``.

    A spec is callable like its function (``AFFINITY_OPERATORS["softmax"](logits, k, t)``).
    """

    fn: AffinityOperator
    description: str
    boost: TemperatureBoost | None = None

    @property
    def uses_temperature(self) -> bool:
        """Whether the operator's value depends on the SoftTopk scale ``t``."""
        return self.boost is not None

    def __call__(self, logits: Tensor, k: int, t: Tensor | float) -> Tensor:
        return self.fn(logits, k, t)


#: Name -> :class:`OperatorSpec`. The router and presets refer to operators by these names;
#: adding an operator is adding an entry here.
AFFINITY_OPERATORS: dict[str, OperatorSpec] = {
    "softmax": OperatorSpec(softmax_affinity, "softmax over the experts (Table 2, Eq. 2)"),
    "sigmoid": OperatorSpec(sigmoid_affinity, "element-wise sigmoid (Table 2; DeepSeek-V3)"),
    "softkmax": OperatorSpec(softkmax_affinity, "k rounds of a re-weighted softmax (Table 2)"),
    "itertopk": OperatorSpec(
        itertopk_affinity, "k rounds of a softmax over the remaining room (Table 2)"
    ),
    "gradtopk": OperatorSpec(gradtopk_affinity, "GradTopk recursion (Table 2)"),
    "softtopk": OperatorSpec(
        softtopk_affinity,
        "SoftTopk: softmax with the rank-r choice boosted by 1 + t (min(r, k) - 1) (MaxScore)",
        boost=softtopk_boost,
    ),
    "relu": OperatorSpec(relu_affinity, "element-wise ReLU (ReMoE)"),
}

#: Names of the operators whose value depends on ``t`` (those with a boost).
OPERATORS_USING_TEMPERATURE: frozenset[str] = frozenset(
    name for name, spec in AFFINITY_OPERATORS.items() if spec.uses_temperature
)


def get_operator_spec(name: str) -> OperatorSpec:
    """The :class:`OperatorSpec` registered under ``name`` (ValueError listing the known names)."""
    try:
        return AFFINITY_OPERATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown affinity operator {name!r}; known operators: {sorted(AFFINITY_OPERATORS)}"
        ) from None


def get_operator(name: str) -> AffinityOperator:
    """The operator function registered under ``name`` (ValueError listing the known names)."""
    return get_operator_spec(name).fn
