"""Dispatch: where each (token, slot) of a routing goes in the experts' row buffers.

Both execution paths of the MoE layer share one representation, a :class:`DispatchPlan`: a
list of ``R`` buffer rows, each holding one token (``source_token[r]``) with the combine weight
of that slot (``row_weight[r]``), grouped by expert. The experts gather their input rows with
``x[source_token]``, and Eq. (1)'s sum ``y_i = sum_s w_is * E_{j_is}(x_i)`` is a scatter-add of
the (already weighted) expert outputs back to ``source_token``.

* **Padded** (capacity-constrained routers): ``R = e * G * c`` rows, expert-major
  (``[e, G, c]``: expert ``j``'s buffer is the contiguous block ``j*G*c .. (j+1)*G*c - 1``, one
  ``[G*c, D]`` matrix per expert for a single ``bmm``). A slot's row is
  ``(j*G + g) * c + position``, where ``position`` is its rank among the slots of group ``g``
  assigned to expert ``j`` (in token-then-slot order). Rows no slot fills keep weight 0; dropped
  slots (``expert_index == -1``) get no row, so they contribute nothing.
* **Grouped** (``capacity is None``: dropless, causal evaluation): ``R = T * S`` rows sorted by
  expert, with ``group_end[j]`` the exclusive end row of expert ``j`` (the ``offs`` of
  ``torch._grouped_mm``). Empty slots ride along at the end of the last expert's rows with
  weight 0, so every row lies inside some group (no uninitialised rows reach the output).

Everything here is vectorised and sync-free (sort, searchsorted, scatter), so the layer can run
under CUDA graphs and ``torch.compile``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "DispatchPlan",
    "combine_rows",
    "gather_rows",
    "grouped_dispatch_plan",
    "grouped_mm",
    "padded_dispatch_plan",
]


@dataclass
class DispatchPlan:
    """Rows of the experts' buffers (see the module docstring).

    Attributes:
        source_token: ``[R]`` long, the token each row holds (any valid token for an empty row).
        row_weight: ``[R]`` float32, the row's combine weight (0 for empty rows); carries the
            gradient to the router's combine weights.
        num_experts: ``e``.
        rows_per_expert: ``G * c`` for a padded plan, ``None`` for a grouped plan.
        group_end: ``[e]`` int32 exclusive end row of each expert (grouped plans only).
    """

    source_token: Tensor
    row_weight: Tensor
    num_experts: int
    rows_per_expert: int | None = None
    group_end: Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.source_token.shape[0]


def _masked_weights(expert_index: Tensor, combine_weights: Tensor) -> Tensor:
    # The RoutingResult contract already has weight 0 on empty slots; the mask makes "dropped
    # contributes nothing" hold even for a router that leaves a stale weight there.
    return torch.where(expert_index >= 0, combine_weights.float(), 0.0)


def padded_dispatch_plan(
    expert_index: Tensor,
    combine_weights: Tensor,
    num_experts: int,
    num_groups: int,
    capacity: int,
) -> DispatchPlan:
    """Plan for the padded-capacity path (``R = e * G * capacity`` rows, expert-major).

    Args:
        expert_index: ``[T, S]`` long, expert per slot or ``-1``.
        combine_weights: ``[T, S]`` combine weights (differentiable).
        num_experts: ``e``.
        num_groups: ``G``; tokens ``g*n .. (g+1)*n - 1`` form group ``g``.
        capacity: rows per expert per group, a Python int >= every expert's capacity (so the
            buffer shape is static and no host sync is needed). A slot whose position would
            exceed it (a router that broke its own capacity) is dropped, position order.
    """
    t, s = expert_index.shape
    e, g_count, c = num_experts, num_groups, int(capacity)
    device = expert_index.device
    n = t // g_count
    rows = e * g_count * c
    valid = expert_index >= 0
    group = (torch.arange(t, device=device) // n).unsqueeze(1)
    sentinel = e * g_count
    # One key per (expert, group) buffer; the stable sort lists each buffer's slots in token
    # order, and a slot's rank inside its key run is its position in the buffer.
    key = torch.where(valid, expert_index * g_count + group, sentinel).reshape(-1)
    sorted_key, order = torch.sort(key, stable=True)
    run_start = torch.searchsorted(sorted_key, sorted_key)
    position = torch.arange(t * s, device=device) - run_start
    keep = (sorted_key < sentinel) & (position < c)
    dest = torch.where(keep, sorted_key * c + position, rows)  # row `rows` is a trash row
    token = torch.div(order, s, rounding_mode="floor")
    weight = _masked_weights(expert_index, combine_weights).reshape(-1)[order]
    # Empty rows hold some real token (spread over tokens so the final scatter-add has no
    # hot spot) at weight 0: their output is exactly 0, and nothing reads uninitialised data.
    filler = torch.arange(rows + 1, device=device) % t
    source_token = filler.scatter(0, dest, token)[:rows]
    row_weight = weight.new_zeros(rows + 1).scatter(0, dest, weight)[:rows]
    return DispatchPlan(source_token, row_weight, e, rows_per_expert=g_count * c)


def grouped_dispatch_plan(
    expert_index: Tensor, combine_weights: Tensor, num_experts: int
) -> DispatchPlan:
    """Plan for the grouped path (``R = T * S`` rows sorted by expert, no capacity)."""
    s = expert_index.shape[1]
    e = num_experts
    valid = expert_index >= 0
    # Empty slots join the last expert's rows at weight 0 (see the module docstring).
    key = torch.where(valid, expert_index, e - 1).reshape(-1)
    sorted_key, order = torch.sort(key, stable=True)
    group_end = torch.searchsorted(
        sorted_key, torch.arange(e, device=key.device, dtype=sorted_key.dtype), right=True
    ).to(torch.int32)
    token = torch.div(order, s, rounding_mode="floor")
    weight = _masked_weights(expert_index, combine_weights).reshape(-1)[order]
    return DispatchPlan(token, weight, e, rows_per_expert=None, group_end=group_end)


def gather_rows(x: Tensor, plan: DispatchPlan) -> Tensor:
    """``x[T, D] -> [R, D]``: each buffer row's token (backward: scatter-add to the tokens)."""
    return x.index_select(0, plan.source_token)


def combine_rows(out: Tensor, plan: DispatchPlan, num_tokens: int) -> Tensor:
    """Eq. (1)'s sum: scatter-add the weighted expert outputs ``[R, D]`` back to ``[T, D]``."""
    y = out.new_zeros(num_tokens, out.shape[-1])
    return y.index_add_(0, plan.source_token, out)


def _native_grouped_mm_ok(a: Tensor, b: Tensor) -> bool:
    if not (a.is_cuda and hasattr(torch, "_grouped_mm")):
        return False
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        return False
    major, _ = torch.cuda.get_device_capability(a.device)
    return major >= 9  # the CUTLASS grouped GEMM is built for sm90 / sm100


def _grouped_mm_loop(a: Tensor, b: Tensor, group_end: Tensor) -> Tensor:
    # Correct everywhere; reads the offsets on the host (free on the CPU; a sync on a GPU whose
    # dtype or architecture the native kernel does not cover).
    ends = [0, *group_end.tolist()]
    parts = [a[ends[j] : ends[j + 1]] @ b[j] for j in range(b.shape[0])]
    tail = a.shape[0] - ends[-1]
    if tail:  # rows after the last group belong to no expert: zero output
        parts.append(a.new_zeros(tail, b.shape[-1]))
    return torch.cat(parts, dim=0)


_NATIVE_NEEDS_K_MAJOR = False


def grouped_mm(a: Tensor, b: Tensor, group_end: Tensor) -> Tensor:
    """``out[r] = a[r] @ b[j]`` for rows ``r`` of group ``j`` (``a [R, K]``, ``b [e, K, N]``).

    Uses ``torch._grouped_mm(a, b, offs=group_end)`` (CUTLASS, no host sync) on sm90+ GPUs in
    bf16; a per-expert loop elsewhere.
    """
    global _NATIVE_NEEDS_K_MAJOR
    if _native_grouped_mm_ok(a, b):
        if not _NATIVE_NEEDS_K_MAJOR:
            try:
                return torch._grouped_mm(a, b, offs=group_end)
            except RuntimeError:  # a build that only takes K-major (column-major) weights
                _NATIVE_NEEDS_K_MAJOR = True
        return torch._grouped_mm(
            a, b.transpose(-2, -1).contiguous().transpose(-2, -1), offs=group_end
        )
    return _grouped_mm_loop(a, b, group_end)
