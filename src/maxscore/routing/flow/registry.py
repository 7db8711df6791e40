"""The registry of min-cost-flow solvers for Eq. (7)–(8).

Kept in its own module (not in ``flow/__init__.py``) so that solver modules, including the GPU
global solver in ``flow/global_solver.py``, can ``from .registry import register_flow_solver``
without an import cycle through the package ``__init__``.

Every solver has one signature::

    solve(affinities: Tensor[G, n, e] fp32, k: int, capacity: Tensor[e] long,
          *, iterations: int | None = None[, capacity_bound: int | None = None])
        -> Tensor[G, n, k] long

The result holds, for each token, the experts it is assigned to, in decreasing order of affinity
(slot ``r`` is the token's ``r``-th choice among its assigned experts), never the same expert
twice, with no expert used by more than ``capacity[j]`` tokens of a group; ``-1`` marks an empty
slot, which an exact solver leaves only when no assignment gives every token ``k`` experts (then
the assignment is a maximum flow of maximal affinity). ``iterations`` is the iteration budget of
iterative solvers (the ``"min-cost-flow"`` strategy passes ``RouterConfig.sinkhorn_iterations``);
``None`` means the solver's own default, and solvers without iterations ignore it.
Optional keywords, passed only to solvers that list them in ``FlowSolverSpec.keywords``
(:func:`solve_with`): ``capacity_bound``, an int known on the host that no ``capacity[j]``
exceeds (it lets a GPU solver size its state without reading the capacities back; the router
passes its capacity); ``token_mask``, ``[G, n]`` bool, False for padded positions, which then
take no expert and do not influence the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from torch import Tensor

__all__ = [
    "FLOW_SOLVERS",
    "FlowSolveFn",
    "FlowSolverSpec",
    "register_flow_solver",
    "solve_with",
]


class FlowSolveFn(Protocol):
    """Signature of a flow solver (see the module docstring for the contract)."""

    def __call__(
        self, affinities: Tensor, k: int, capacity: Tensor, *, iterations: int | None = None
    ) -> Tensor: ...


@dataclass(frozen=True)
class FlowSolverSpec:
    """A registered solver of Eq. (8).

    Attributes:
        solve: the solver (:class:`FlowSolveFn`).
        exact: True if it returns a global optimum of Eq. (8) (a maximum flow of maximal affinity).
        device: ``"cpu"`` if it computes on the host (it copies to the CPU, so it synchronises and
            cannot be captured in a CUDA graph); ``"any"`` if it runs on the input's device with no
            host synchronisation.
        description: one line for docs and ``--help``.
        keywords: the optional keywords ``solve`` accepts (``"capacity_bound"``,
            ``"token_mask"``).
    """

    solve: FlowSolveFn
    exact: bool
    device: Literal["cpu", "any"]
    description: str
    keywords: frozenset[str] = frozenset()


#: Solvers by name. Filled by the solver modules through :func:`register_flow_solver`.
FLOW_SOLVERS: dict[str, FlowSolverSpec] = {}


def register_flow_solver(name: str, spec: FlowSolverSpec, *, replace: bool = False) -> None:
    """Add ``spec`` to :data:`FLOW_SOLVERS` under ``name``.

    Raises ``ValueError`` if the name is taken, unless ``replace=True`` (so that two modules cannot
    silently shadow each other).
    """
    if name in FLOW_SOLVERS and not replace:
        raise ValueError(f"flow solver {name!r} is already registered")
    FLOW_SOLVERS[name] = spec


def solve_with(
    spec: FlowSolverSpec,
    affinities: Tensor,
    k: int,
    capacity: Tensor,
    *,
    iterations: int | None = None,
    **options: object,
) -> Tensor:
    """Call ``spec.solve``, passing each option that is not ``None`` and that the solver takes.

    Raises ``ValueError`` for an option the solver does not take (the caller must then solve a
    problem without it, e.g. padding by sink experts).
    """
    given = {key: value for key, value in options.items() if value is not None}
    unknown = set(given) - spec.keywords - {"capacity_bound"}
    if unknown:
        raise ValueError(f"this flow solver does not take {sorted(unknown)}")
    # capacity_bound is only a hint: solvers that do not take it ignore it
    passed = {key: value for key, value in given.items() if key in spec.keywords}
    return spec.solve(affinities, k, capacity, iterations=iterations, **passed)  # type: ignore[call-arg]
