"""Min-cost-flow routing: solvers of the paper's Eq. (7)–(8).

Eq. (7) is the feasible set ``U'(c, k)`` of 0/1 assignments ``P`` (``n x e``) giving token ``i``
``k`` experts and expert ``j`` at most ``c_j`` tokens; Eq. (8) maximises ``sum_ij P_ij A_ij`` over
it. The paper solves it as min-cost max-flow on the network of its edge table (source -> token
capacity ``k``; token -> expert capacity 1, cost ``-A_ij``; expert -> sink capacity ``c_j``).

Solvers (:data:`FLOW_SOLVERS`, one signature, see :mod:`.registry`):

- ``"exact"``: successive shortest paths, exact, CPU (:mod:`.exact`). The reference.
- ``"two-stage-sinkhorn"``: Algorithm 1 — capacity-limited top-1, then Sinkhorn on the residual
  problem and a feasible rounding; batched, on any device, no host sync (:mod:`.two_stage`).
- ``"two-stage-authors"``: the authors' code: top-1 in token order until the expert is full,
  then ``k - 1`` more experts per token from the residual problem solved exactly on the CPU
  (their Hungarian matching), so a token refused in stage 1 loses a slot (:mod:`.two_stage`).
- ``"two-stage-score-exact"``: our variant: the capacity-limited top-1 of
  ``"two-stage-sinkhorn"`` (each expert keeps its highest-affinity proposers), then the residual
  solved exactly on the CPU, a refused token asking for all ``k`` experts (:mod:`.two_stage`).
  ``"two-stage-exact"`` is a deprecated alias of it (it is not the authors' variant).
- ``"global"``: the global solver (:mod:`.global_solver`): an auction from prices near the
  LP's optimal duals, then augmenting paths and cycle cancelling on the expert graph; two CUDA
  kernels per call on a GPU (the prices, then the solver; no host sync), NumPy on the host
  otherwise.

Public API: :func:`min_cost_flow_assignment` (validated, user-facing; may synchronise),
:func:`flow_objective`, :func:`register_flow_solver`.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from . import exact as exact
from . import global_solver as global_solver  # registers "global"
from . import two_stage as two_stage
from .objective import assignment_mask, flow_objective, mask_to_expert_index
from .registry import (
    FLOW_SOLVERS,
    FlowSolveFn,
    FlowSolverSpec,
    register_flow_solver,
    solve_with,
)

__all__ = [
    "FLOW_SOLVERS",
    "FlowSolveFn",
    "FlowSolverSpec",
    "assignment_mask",
    "flow_objective",
    "mask_to_expert_index",
    "min_cost_flow_assignment",
    "register_flow_solver",
]


def min_cost_flow_assignment(
    affinities: Tensor,
    k: int,
    capacity: int | Sequence[int] | Tensor,
    method: str = "exact",
    *,
    iterations: int | None = None,
    token_mask: Tensor | None = None,
) -> Tensor:
    """Route tokens to experts by solving Eq. (8) (min-cost max-flow over Eq. 7's feasible set).

    Args:
        affinities: ``[n, e]`` (one routing group) or ``[G, n, e]`` finite affinities ``A``; any
            float dtype (computed in fp32, the exact solver in float64).
        k: experts per token, ``1 <= k <= e``.
        capacity: per-expert capacity ``c_j`` of one group: an int (same for every expert), a
            sequence of ``e`` ints, or an ``[e]`` integer tensor; all ``>= 0``.
        method: a name in :data:`FLOW_SOLVERS`.
        iterations: iteration budget for iterative solvers (``None``: the solver's default).
        token_mask: ``[n]`` or ``[G, n]`` bool, False for padded positions: they take no expert
            and the real tokens' result does not depend on them (solvers listing
            ``"token_mask"`` in ``FlowSolverSpec.keywords``: ``"exact"``, ``"global"``).

    Returns:
        ``[n, k]`` or ``[G, n, k]`` long expert indices on ``affinities.device``, each token's
        experts in decreasing affinity, ``-1`` for an empty slot. Exact solvers leave a slot empty
        only when no assignment gives every token ``k`` experts (e.g. ``sum_j c_j < n * k``).

    Raises:
        ValueError: unknown method, bad shape or dtype, ``k`` outside ``[1, e]``, a negative,
            fractional or wrongly sized capacity, NaN / infinite affinities, or a ``token_mask``
            of the wrong shape or for a solver that does not take one.

    This is the user-facing entry point: it validates its input, which reads values from the
    device (a host sync). Routers call ``FLOW_SOLVERS[name].solve`` directly instead.
    """
    if method not in FLOW_SOLVERS:
        raise ValueError(
            f"unknown min-cost-flow method {method!r}; registered: {sorted(FLOW_SOLVERS)}"
        )
    if not isinstance(affinities, Tensor):
        raise ValueError(f"affinities must be a torch.Tensor, got {type(affinities).__name__}")
    if affinities.dim() not in (2, 3):
        raise ValueError(
            f"affinities must be [n, e] or [G, n, e], got shape {tuple(affinities.shape)}"
        )
    if not affinities.is_floating_point():
        raise ValueError(f"affinities must be a float tensor, got dtype {affinities.dtype}")
    single = affinities.dim() == 2
    scores = affinities.unsqueeze(0) if single else affinities
    e = scores.shape[-1]
    if e < 1:
        raise ValueError("affinities must have at least one expert (last dimension e >= 1)")
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(f"k must be an int, got {k!r}")
    if not 1 <= k <= e:
        raise ValueError(f"k must satisfy 1 <= k <= e = {e} (distinct experts), got k = {k}")
    if not bool(torch.isfinite(scores).all()):
        raise ValueError("affinities contain NaN or infinite values")
    cap = _capacity_tensor(capacity, e, scores.device)
    mask = None
    if token_mask is not None:
        mask = torch.as_tensor(token_mask, device=scores.device).bool()
        mask = mask.unsqueeze(0) if mask.dim() == 1 else mask
        if mask.shape != scores.shape[:2]:
            raise ValueError(
                f"token_mask must have shape {tuple(affinities.shape[:-1])} (one entry per "
                f"token), got {tuple(torch.as_tensor(token_mask).shape)}"
            )
    out = solve_with(
        FLOW_SOLVERS[method],
        scores.float(),
        k,
        cap,
        iterations=iterations,
        capacity_bound=int(cap.max()) if cap.numel() else 0,
        token_mask=mask,
    )
    return out[0] if single else out


def _capacity_tensor(
    capacity: int | Sequence[int] | Tensor, e: int, device: torch.device
) -> Tensor:
    """Validate a capacity argument and return it as an ``[e]`` long tensor on ``device``."""
    if isinstance(capacity, bool | float):
        raise ValueError(
            f"capacity must be an int, a sequence of ints or an integer tensor, got {capacity!r} "
            "(round it, e.g. math.ceil(capacity_factor * k * n / e))"
        )
    if isinstance(capacity, int):
        cap = torch.full((e,), capacity, dtype=torch.long)
    elif isinstance(capacity, Tensor):
        if capacity.is_floating_point() or capacity.is_complex() or capacity.dtype == torch.bool:
            raise ValueError(f"capacity tensor must have an integer dtype, got {capacity.dtype}")
        # A 0-dim tensor means "the same for every expert", like an int.
        cap = capacity.expand(e) if capacity.dim() == 0 else capacity
        if cap.shape != (e,):
            raise ValueError(
                f"capacity must have one entry per expert (e = {e}), got shape {tuple(capacity.shape)}"
            )
        cap = cap.long()
    else:
        values = list(capacity)
        if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values):
            raise ValueError(f"capacity values must be ints, got {values!r}")
        if len(values) != e:
            raise ValueError(
                f"capacity must have one entry per expert (e = {e}), got {len(values)} values"
            )
        cap = torch.tensor([int(v) for v in values], dtype=torch.long)
    if bool((cap < 0).any()):
        raise ValueError(f"capacities must be >= 0, got {cap.tolist()}")
    return cap.to(device)
