"""The registry of min-cost-flow solvers for Eq. (7)–(8).

Kept in its own module (not in ``flow/__init__.py``) so that solver modules, including the GPU
global solver in ``flow/global_solver.py``, can ``from .registry import register_flow_solver``
without an import cycle through the package ``__init__``.

Every solver has one signature::

    solve(affinities: Tensor[G, n, e] fp32, k: int, capacity: Tensor[e] long,
          *, iterations: int | None = None) -> Tensor[G, n, k] long

The result holds, for each token, the experts it is assigned to, in decreasing order of affinity
(slot ``r`` is the token's ``r``-th choice among its assigned experts), never the same expert
twice, with no expert used by more than ``capacity[j]`` tokens of a group; ``-1`` marks an empty
slot, which an exact solver leaves only when no assignment gives every token ``k`` experts (then
the assignment is a maximum flow of maximal affinity). ``iterations`` is the iteration budget of
iterative solvers (the ``"min-cost-flow"`` strategy passes ``RouterConfig.sinkhorn_iterations``);
``None`` means the solver's own default, and solvers without iterations ignore it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from torch import Tensor

__all__ = ["FLOW_SOLVERS", "FlowSolveFn", "FlowSolverSpec", "register_flow_solver"]


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
    """

    solve: FlowSolveFn
    exact: bool
    device: Literal["cpu", "any"]
    description: str


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
