"""The flow solvers as one opaque operator for ``torch.compile``.

A solver of Eq. (8) is a fixed sequence of its own kernels (a CUDA kernel launched through
NVRTC on the GPU) with an integer result and no gradient. Traced by dynamo it gains nothing, and
the kernel launch goes through ctypes, which dynamo cannot trace. Registered as a custom
operator it is one node in the compiled graph: inductor fuses the work around it and calls the solver as it is, and the
call stays capturable in CUDA graphs whenever the solver is (``FlowSolverSpec.device == "any"``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .registry import FLOW_SOLVERS, solve_with

__all__ = ["solve_flow"]


@torch.library.custom_op("maxscore::flow_solve", mutates_args=())
def _flow_solve_op(
    affinities: Tensor,
    k: int,
    capacity: Tensor,
    method: str,
    iterations: int,
    bound: int,
    token_mask: Tensor | None,
) -> Tensor:
    out = solve_with(
        FLOW_SOLVERS[method],
        affinities,
        k,
        capacity,
        iterations=None if iterations < 0 else iterations,
        capacity_bound=None if bound < 0 else bound,
        token_mask=token_mask,
    )
    return out.long()  # a fresh tensor: a custom operator's output may not alias its inputs


@_flow_solve_op.register_fake
def _flow_solve_fake(
    affinities: Tensor,
    k: int,
    capacity: Tensor,
    method: str,
    iterations: int,
    bound: int,
    token_mask: Tensor | None,
) -> Tensor:
    return affinities.new_empty((*affinities.shape[:2], k), dtype=torch.long)


def solve_flow(
    method: str,
    affinities: Tensor,
    k: int,
    capacity: Tensor,
    iterations: int | None,
    capacity_bound: int | None = None,
    token_mask: Tensor | None = None,
) -> Tensor:
    """``FLOW_SOLVERS[method].solve(...)``; through the custom operator while compiling.

    Eager calls go to the solver directly (no operator dispatch overhead); under
    ``torch.compile`` the solver is one opaque graph node (see the module docstring).
    """
    if torch.compiler.is_compiling():
        return _flow_solve_op(
            affinities,
            k,
            capacity,
            method,
            -1 if iterations is None else iterations,
            -1 if capacity_bound is None else capacity_bound,
            token_mask,
        )
    return solve_with(
        FLOW_SOLVERS[method],
        affinities,
        k,
        capacity,
        iterations=iterations,
        capacity_bound=capacity_bound,
        token_mask=token_mask,
    )
