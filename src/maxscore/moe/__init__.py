"""MoE layer (Eq. 1): router + stacked SwiGLU experts (padded or grouped execution) + shared experts."""

from maxscore.moe.dispatch import (
    DispatchPlan,
    combine_rows,
    dispatch_plan,
    gather_rows,
    grouped_dispatch_plan,
    grouped_mm,
    padded_dispatch_plan,
)
from maxscore.moe.experts import DenseMLP, SwiGLUExperts, weighted_swiglu
from maxscore.moe.layer import MoE, default_intermediate_size

__all__ = [
    "DenseMLP",
    "DispatchPlan",
    "MoE",
    "SwiGLUExperts",
    "combine_rows",
    "default_intermediate_size",
    "dispatch_plan",
    "gather_rows",
    "grouped_dispatch_plan",
    "grouped_mm",
    "padded_dispatch_plan",
    "weighted_swiglu",
]
