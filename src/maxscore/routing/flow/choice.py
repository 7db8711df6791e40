"""Which solver, and which backend of it, a min-cost-flow routing runs: the one chooser.

``flow_method="auto"`` (the presets' setting) and the global solver's ``backend="auto"`` are
decided here, by :func:`choose_flow_solver`, from the input itself:

* on a GPU, the global solver (``"global"``): its CUDA kernel when the kernel handles the shape
  (``global_cuda.supported``: no host sync), else its NumPy reference on the host;
* on the CPU, the exact successive-shortest-path solver (``"exact"``): optimal, and faster than
  the global solver's reference for routing groups of a few hundred tokens; a host sync costs
  nothing there.

An explicit ``flow_method`` runs as given (``"global"`` still gets its backend here).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from . import global_cuda

__all__ = ["AUTO", "FlowChoice", "choose_flow_method", "choose_flow_solver"]

#: The value of ``flow_method`` (and of the global solver's ``backend``) that asks this module.
AUTO = "auto"


@dataclass(frozen=True)
class FlowChoice:
    """A solver of :data:`~maxscore.routing.flow.FLOW_SOLVERS` and, for ``"global"``, its
    backend (:data:`~maxscore.routing.flow.global_solver.GLOBAL_BACKENDS`; ``None`` otherwise)."""

    method: str
    backend: str | None = None


def choose_flow_method(flow_method: str, affinities: Tensor) -> str:
    """The solver (not its backend) for ``affinities``: a decision on the device alone.

    The router calls this inside compiled layers, so it reads nothing dynamo cannot trace; the
    backend (which asks the CUDA toolchain, :func:`.global_cuda.supported`) is chosen inside the
    solver's opaque operator (:mod:`.compiled_call`), where a call into the toolchain breaks no
    compiled graph.
    """
    if flow_method == AUTO:
        return "global" if affinities.is_cuda else "exact"
    return flow_method


def choose_flow_solver(flow_method: str, affinities: Tensor, k: int) -> FlowChoice:
    """The solver and backend for ``affinities [G, n, e]`` with ``k`` experts per token."""
    method = choose_flow_method(flow_method, affinities)
    if method != "global":
        return FlowChoice(method)
    return FlowChoice(method, "cuda" if global_cuda.supported(affinities, k) else "reference")
