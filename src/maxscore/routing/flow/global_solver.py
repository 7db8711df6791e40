"""The global solver of Eq. (7)–(8) (``flow_method="global"``) and the choice of its backend.

One algorithm (auction, augmenting paths and cycle cancelling on the expert graph; see
:mod:`.global_reference`) with two backends, named in :data:`GLOBAL_BACKENDS` in order of
preference reversed (the reference first):

- ``"reference"``: NumPy on the host, any shape. It copies the affinities to the CPU, so on a GPU
  it synchronises; it is the CPU path and the tests' reference.
- ``"cuda"``: two CUDA kernels per call (:mod:`.global_cuda`: the starting prices, then the
  solver), no host synchronisation,
  capturable in CUDA graphs: a CUDA GPU of compute capability 8.0+ with NVRTC, ``e <= 256``,
  ``k <= 8``, any group size (sizes off :func:`.global_cuda.compiled_size`'s list are padded
  with masked tokens, so a few compiled kernels serve group sizes that vary between calls).

``backend="auto"`` is decided by :func:`.choice.choose_flow_solver`, the one place that
chooses solvers and backends.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from . import global_cuda
from .choice import AUTO, choose_flow_solver
from .global_reference import GlobalBudget, solve_reference
from .objective import mask_to_expert_index
from .registry import FlowSolverSpec, register_flow_solver

__all__ = ["GLOBAL_BACKENDS", "GlobalBackend", "solve_global"]


@dataclass(frozen=True)
class GlobalBackend:
    """A way to run the global solver.

    ``solve(affinities[G, n, e] fp32, k, capacity[G, e] long, holders, budget, token_mask)``
    returns the ``[G, n, k]`` long expert indices (each token's experts by decreasing affinity,
    ``-1`` last); ``holders`` bounds every capacity (the most tokens an expert can hold);
    ``token_mask`` (``[G, n]`` bool or ``None``) marks the real tokens.
    """

    supported: Callable[[Tensor, int], bool]
    solve: Callable[[Tensor, int, Tensor, int, GlobalBudget, Tensor | None], Tensor]
    description: str


def _solve_reference(
    affinities: Tensor,
    k: int,
    capacity: Tensor,
    holders: int,
    budget: GlobalBudget,
    token_mask: Tensor | None,
) -> Tensor:
    del holders  # the reference sizes its state from the capacities themselves
    a = affinities.detach().to("cpu", torch.float64)
    mask = None if token_mask is None else token_mask.cpu().numpy()
    held = solve_reference(a.numpy(), k, capacity.cpu().numpy(), budget, mask)
    index = mask_to_expert_index(torch.from_numpy(np.ascontiguousarray(held)), a, k)
    return index.to(affinities.device)


def _solve_cuda(
    affinities: Tensor,
    k: int,
    capacity: Tensor,
    holders: int,
    budget: GlobalBudget,
    token_mask: Tensor | None,
) -> Tensor:
    # The kernel is compiled per (group size, holders). A group size off the short list of
    # global_cuda.compiled_size (evaluation batches padded to their longest sequence change it
    # from call to call) is padded with masked tokens, which take no expert and leave the real
    # tokens' optimum as it was, and the holders bound is rounded up the same way: a few
    # compiled kernels serve every size. Sizes on the list (training's) run as they are.
    n = affinities.shape[1]
    size = global_cuda.compiled_size(n)
    if size == n or size * k >= global_cuda.MAX_SLOTS:  # on the list, or no room to pad
        return global_cuda.solve_cuda(
            affinities, k, capacity, holders, budget, token_mask=token_mask
        )
    if token_mask is None:  # [size], broadcast over the groups
        mask = torch.arange(size, device=affinities.device) < n
    else:
        mask = torch.nn.functional.pad(token_mask, (0, size - n), value=False)
    padded = torch.nn.functional.pad(affinities, (0, 0, 0, size - n))
    holders = min(global_cuda.compiled_size(holders), size)
    out = global_cuda.solve_cuda(padded, k, capacity, holders, budget, token_mask=mask)
    return out[:, :n].contiguous()


# Built once: the router calls solve_global on every routing call, and a GlobalBudget
# validates its fields when it is made (frozen, so one instance serves every call).
_DEFAULT_BUDGET = GlobalBudget()


#: The backends, the reference first (:func:`.choice.choose_flow_solver` picks one).
GLOBAL_BACKENDS: dict[str, GlobalBackend] = {
    "reference": GlobalBackend(
        supported=lambda affinities, k: True,
        solve=_solve_reference,
        description="NumPy on the host, any shape (synchronises on a GPU)",
    ),
    "cuda": GlobalBackend(
        supported=global_cuda.supported,
        solve=_solve_cuda,
        description="two CUDA kernels per call (NVRTC), e <= 256, k <= 8, no host sync",
    ),
}


def solve_global(
    affinities: Tensor,
    k: int,
    capacity: Tensor,
    *,
    capacity_bound: int | None = None,
    token_mask: Tensor | None = None,
    budget: GlobalBudget | None = None,
    backend: str = AUTO,
) -> Tensor:
    """Solve Eq. (8) over Eq. (7)'s feasible set, batched over routing groups.

    Args:
        affinities: ``[G, n, e]`` (or ``[n, e]``) finite affinities ``A``; computed in fp32
            (the reference in float64).
        k: experts per token, ``1 <= k <= e``.
        capacity: ``[e]`` (or ``[G, e]``, or 0-dim) long capacities ``c_j >= 0`` of one group.
        capacity_bound: an int that no ``c_j`` exceeds, known on the host (the router passes its
            capacity). It sizes the CUDA kernel's per-expert state; ``None`` assumes ``n``
            (always correct, more memory).
        token_mask: ``[G, n]`` (or ``[n]``) bool, False for padded positions: they take no
            expert (their slots are ``-1``) and the real tokens' result does not depend on them.
        budget: step counts (:class:`.GlobalBudget`; default: the measured defaults).
        backend: ``"auto"`` (:func:`.choice.choose_flow_solver`) or a name in
            :data:`GLOBAL_BACKENDS`.

    Returns:
        ``[G, n, k]`` long expert indices (``[n, k]`` for a 2-D input), each token's experts in
        decreasing affinity; no expert above its capacity, no expert twice in a token, every slot
        filled whenever ``sum_j min(c_j, n) >= n k`` (else a maximum flow).
    """
    single = affinities.dim() == 2
    scores = (affinities.unsqueeze(0) if single else affinities).float()
    groups, n, e = scores.shape
    if not 1 <= k <= e:
        raise ValueError(f"k must satisfy 1 <= k <= e = {e}, got {k}")
    cap = capacity.to(device=scores.device, dtype=torch.long)
    cap = (cap.expand(e) if cap.dim() == 0 else cap).expand(groups, e).clamp(0, n)
    holders = n if capacity_bound is None else max(1, min(int(capacity_bound), n))
    mask = None
    if token_mask is not None:
        mask = (token_mask.unsqueeze(0) if token_mask.dim() == 1 else token_mask).to(
            device=scores.device, dtype=torch.bool
        )
        if mask.shape != (groups, n):
            raise ValueError(
                f"token_mask must have shape [G, n] = {(groups, n)}, got {tuple(mask.shape)}"
            )
    budget = budget or _DEFAULT_BUDGET
    if backend == AUTO:
        auto_backend = choose_flow_solver("global", scores, k).backend
        chosen = GLOBAL_BACKENDS[auto_backend or "reference"]  # supported by construction
    elif backend not in GLOBAL_BACKENDS:
        raise ValueError(
            f"unknown global-solver backend {backend!r}; known: {sorted(GLOBAL_BACKENDS)}"
        )
    else:
        chosen = GLOBAL_BACKENDS[backend]
        if not chosen.supported(scores, k):
            raise ValueError(
                f"the {backend!r} backend does not apply to this input ({chosen.description})"
            )
    try:
        out = chosen.solve(scores, k, cap, holders, budget, mask)
    except global_cuda.KernelCompileError as exc:
        if backend != AUTO:
            raise
        # A toolchain that cannot build the kernel here: say so once, use the reference.
        warnings.warn(
            f"maxscore: the CUDA flow-solver kernel is unavailable ({exc}); using the reference "
            "solver on the host",
            RuntimeWarning,
            stacklevel=2,
        )
        global_cuda.disable(str(exc))
        out = GLOBAL_BACKENDS["reference"].solve(scores, k, cap, holders, budget, mask)
    return out[0] if single else out


def _solve(
    affinities: Tensor,
    k: int,
    capacity: Tensor,
    *,
    iterations: int | None = None,
    capacity_bound: int | None = None,
    token_mask: Tensor | None = None,
) -> Tensor:
    """Registry entry point (see :mod:`maxscore.routing.flow.registry` for the contract).

    ``iterations`` (the routers' ``sinkhorn_iterations``) does not apply: the solver's budget is
    its own (:class:`.GlobalBudget`).
    """
    del iterations
    return solve_global(
        affinities, k, capacity, capacity_bound=capacity_bound, token_mask=token_mask
    )


register_flow_solver(
    "global",
    FlowSolverSpec(
        solve=_solve,
        exact=False,
        device="any",
        description=(
            "Global solver of Eq. 8: auction from dual prices, augmenting paths and cycle "
            "cancelling on the expert graph; two CUDA kernels per call on GPUs (no host sync), "
            "NumPy on the host elsewhere"
        ),
        keywords=frozenset({"capacity_bound", "token_mask"}),
    ),
)
