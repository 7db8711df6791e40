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

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from maxscore.routing.types import RoutingResult

__all__ = [
    "DispatchPlan",
    "combine_rows",
    "dispatch_plan",
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
        slot_row: ``[T, S]`` long, the row of each slot, ``-1`` where the slot has none.

    ``source_token`` and ``slot_row`` are inverse maps; with both, the gather and the combine
    have a scatter-free backward (no atomics, deterministic): gathering rows backward is a
    per-token sum over its slots' rows, combining rows backward is a per-row gather.
    """

    source_token: Tensor
    row_weight: Tensor
    num_experts: int
    rows_per_expert: int | None = None
    group_end: Tensor | None = None
    slot_row: Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.source_token.shape[0]


def _masked_weights(valid: Tensor, combine_weights: Tensor) -> Tensor:
    # The RoutingResult contract already has weight 0 on empty slots; the mask makes "dropped
    # contributes nothing" hold even for a router that leaves a stale weight there.
    return torch.where(valid, combine_weights.float(), 0.0)


# Index constants (aranges and simple functions of them) reused across calls: each one is a
# kernel launch per call otherwise, and the plans are launch-bound at training sizes. Keyed by
# name, sizes and device; never handed out for in-place use (every use below is out of place).
_CONSTANTS: dict[tuple[object, ...], Tensor] = {}
_CONSTANTS_LIMIT = 64


def _constant(name: str, sizes: tuple[int, ...], device: torch.device) -> Tensor:
    """A cached index tensor (see ``_build_constant``); fresh under inference mode / tracing."""
    # is_compiling() first: dynamo cannot trace is_inference_mode_enabled (a graph break).
    if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
        return _build_constant(name, sizes, device)
    key = (name, sizes, device)
    value = _CONSTANTS.get(key)
    if value is None:
        if len(_CONSTANTS) >= _CONSTANTS_LIMIT:
            _CONSTANTS.clear()
        with torch.no_grad():
            value = _build_constant(name, sizes, device)
        _CONSTANTS[key] = value
    return value


def _build_constant(name: str, sizes: tuple[int, ...], device: torch.device) -> Tensor:
    if name == "arange":  # [m]: 0 .. m-1
        (m,) = sizes
        return torch.arange(m, device=device)
    if name == "div":  # [m]: i // s (the token of flat slot i)
        m, s = sizes
        return torch.arange(m, device=device) // s
    if name == "mod":  # [m]: i % t (filler tokens of empty rows)
        m, t = sizes
        return torch.arange(m, device=device) % t
    if name == "column":  # [g, 1]: i * step (per-row offsets)
        g, step = sizes
        return (torch.arange(g, device=device) * step).unsqueeze(1)
    raise KeyError(name)


#: Above this many one-hot entries (``T * S * (e + 1)``) positions come from a sort instead.
_ONE_HOT_LIMIT = 1 << 25


def _positions(
    key: Tensor, num_keys: int, with_counts: bool = True
) -> tuple[Tensor, Tensor | None]:
    """Rank of each entry among the earlier entries of its row with the same key, and counts.

    ``key [G, m]`` in ``[0, num_keys]`` (``num_keys`` = "no key"); returns ``position [G, m]``
    and ``counts [G, num_keys + 1]`` (``None`` on the GPU path when ``with_counts`` is False,
    saving three kernels on the sort path). On the CPU a running count over a one-hot (one
    cumsum) while that stays small. On a GPU, rows of up to ``_SCAN_ROW_LIMIT`` entries (routing
    groups of a few hundred tokens, as MaxScore's) take one Triton program per row: the same
    running count over a one-hot, in registers (the sort path costs ~85 us per Base layer at
    ``[128, 1024]``: sort, searchsorted, scatter). Longer rows (one group for the whole batch)
    take a stable sort: torch's cumsum along a non-innermost dimension runs one thread per
    column, serial along the tokens (5.7 ms per layer step for ``[1, 32768, 17]``, against
    ~0.1 ms for the sort).
    """
    g, m = key.shape
    k1 = num_keys + 1
    device = key.device
    if use_triton_kernels(key) and m <= _SCAN_ROW_LIMIT and k1 <= _SCAN_KEY_LIMIT:
        return _key_positions(key.contiguous(), k1)
    if not key.is_cuda and g * m * k1 <= _ONE_HOT_LIMIT:
        hit = key.unsqueeze(-1) == torch.arange(k1, device=device)
        running = hit.cumsum(1, dtype=torch.int32)
        position = running.gather(2, key.unsqueeze(-1)).squeeze(-1).long() - 1
        return position, running[:, -1].long()
    flat = (key + _constant("column", (g, k1), device)).reshape(-1) if g > 1 else key.reshape(-1)
    sorted_key, order = torch.sort(flat, stable=True)
    rank = _constant("arange", (flat.numel(),), device) - torch.searchsorted(sorted_key, sorted_key)
    position = torch.empty_like(rank).scatter_(0, order, rank).view(g, m)
    if not with_counts:
        return position, None
    counts = torch.zeros(g * k1, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return position, counts.view(g, k1)


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
    rows = e * g_count * c
    valid = expert_index >= 0
    # A slot's position in its (expert, group) buffer is its rank among the group's earlier
    # slots (token order, then slot order) on the same expert.
    key = torch.where(valid, expert_index, e).reshape(g_count, -1)
    position, _ = _positions(key, e, with_counts=False)
    keep = valid.reshape(g_count, -1) & (position < c)
    # (j*G + g) * c + position, as j*(G*c) + g*c + position (the g*c column is a constant).
    row = key * (g_count * c) + position
    if g_count > 1:
        row = row + _constant("column", (g_count, c), device)
    dest = torch.where(keep, row, rows).reshape(-1)
    token = _constant("div", (t * s, s), device)
    weight = _masked_weights(valid, combine_weights).reshape(-1)
    # Empty rows hold some real token (spread over tokens) at weight 0: their output is
    # exactly 0, and nothing reads uninitialised memory. Row `rows` is a trash row for the
    # slots that get none; it is cut off.
    filler = _constant("mod", (rows + 1, t), device)
    source_token = filler.scatter(0, dest, token)[:rows]
    row_weight = weight.new_zeros(rows + 1).scatter(0, dest, weight)[:rows]
    slot_row = torch.where(keep.view(t, s), dest.view(t, s), -1)
    return DispatchPlan(source_token, row_weight, e, rows_per_expert=g_count * c, slot_row=slot_row)


def grouped_dispatch_plan(
    expert_index: Tensor, combine_weights: Tensor, num_experts: int
) -> DispatchPlan:
    """Plan for the grouped path (``R = T * S`` rows sorted by expert, no capacity)."""
    t, s = expert_index.shape
    e = num_experts
    device = expert_index.device
    valid = expert_index >= 0
    # Empty slots join the last expert's rows at weight 0 (see the module docstring).
    key = torch.where(valid, expert_index, e - 1).reshape(1, -1)
    position, all_counts = _positions(key, e)
    assert all_counts is not None
    counts = all_counts[0, :e]
    ends = counts.cumsum(0)
    flat_key = key.view(-1)
    row = (ends - counts)[flat_key] + position.view(-1)
    token = _constant("div", (t * s, s), device)
    weight = _masked_weights(valid, combine_weights).reshape(-1)
    source_token = torch.empty_like(token).scatter_(0, row, token)  # every row exactly once
    row_weight = weight.new_zeros(t * s).scatter(0, row, weight)
    return DispatchPlan(
        source_token,
        row_weight,
        e,
        rows_per_expert=None,
        group_end=ends.to(torch.int32),
        slot_row=torch.where(valid, row.view(t, s), -1),
    )


def dispatch_plan(result: RoutingResult, capacity: int | None) -> DispatchPlan:
    """The MoE layer's plan for a routing: padded when ``capacity`` is given, else grouped."""
    if capacity is None:
        return grouped_dispatch_plan(
            result.expert_index, result.combine_weights, result.num_experts
        )
    return padded_dispatch_plan(
        result.expert_index,
        result.combine_weights,
        result.num_experts,
        result.num_groups,
        capacity,
    )


# Triton gather-sum: out[t] = sum over t's slots of src[slot_row[t, s]] in one pass, fp32
# accumulation, deterministic (embedding_bag did the same ~6x slower at these shapes).
try:  # pragma: no cover - exercised on GPU machines (and with TRITON_INTERPRET=1)
    import triton
    import triton.language as tl

    # `t` (tokens per call) is not specialised: evaluation batches change it from call to call,
    # and each new specialisation would compile (and first autotune) the kernel again.
    @triton.jit(do_not_specialize=["t"])
    def _sum_slot_rows_kernel(
        src_ptr, row_ptr, out_ptr, t, d, slots: tl.constexpr, tokens: tl.constexpr,
        block: tl.constexpr,
    ):  # fmt: skip
        tok = tl.program_id(0).to(tl.int64) * tokens + tl.arange(0, tokens)  # [tokens]
        cols = tl.program_id(1) * block + tl.arange(0, block)  # [block]
        in_tile = (tok < t)[:, None] & (cols < d)[None, :]
        acc = tl.zeros([tokens, block], dtype=tl.float32)
        for slot in tl.static_range(slots):
            r = tl.load(row_ptr + tok * slots + slot, mask=tok < t, other=-1)  # [tokens]
            ptrs = src_ptr + r[:, None] * d + cols[None, :]
            v = tl.load(ptrs, mask=in_tile & (r >= 0)[:, None], other=0.0)
            acc += v.to(tl.float32)
        out = out_ptr + tok[:, None] * d + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=in_tile)

    # On a GPU the tile shape and warp count are picked per (d, slots) by Triton's autotuner on
    # the first call (a one-off benchmark of these configurations, which synchronises: run one
    # eager step before capturing a CUDA graph, as cuBLAS needs anyway). The interpreter (CPU
    # tests) cannot benchmark: it runs the first configuration.
    _SUM_SLOT_ROWS_CONFIGS = [
        triton.Config({"tokens": 1, "block": 256}, num_warps=1),
        triton.Config({"tokens": 4, "block": 256}, num_warps=4),
        triton.Config({"tokens": 2, "block": 512}, num_warps=4),
        triton.Config({"tokens": 8, "block": 128}, num_warps=4),
        triton.Config({"tokens": 4, "block": 512}, num_warps=8),
    ]
    _sum_slot_rows_tuned = triton.autotune(configs=_SUM_SLOT_ROWS_CONFIGS, key=["d", "slots"])(
        _sum_slot_rows_kernel
    )

    @triton.jit(do_not_specialize=["m", "k1"])
    def _key_positions_kernel(
        key_ptr, position_ptr, count_ptr, m, k1, block: tl.constexpr, keys: tl.constexpr,
        chunks: tl.constexpr,
    ):  # fmt: skip
        # One program per row: a running count per key over a [block, keys] one-hot, chunk by
        # chunk, carried between chunks. An entry's position is the count of its key before it.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, keys)
        carry = tl.zeros([keys], dtype=tl.int32)
        # A loop, not unrolled (tl.static_range): unrolled, the 16-chunk variant took 28 s to
        # compile (2 s as a loop; Triton 3.9, sm_90, on a 2-core CPU), and lm-eval stalled that
        # long each time its batches' rows, shorter and shorter, reached the next power of two.
        # The bound stays a constexpr (a runtime one breaks Triton 3.6's interpreter); chunks
        # past the row are masked out: they count nothing.
        for chunk in range(chunks):
            offs = chunk * block + tl.arange(0, block)
            inside = offs < m
            key = tl.load(key_ptr + row * m + offs, mask=inside, other=-1)
            hit = (key[:, None] == cols[None, :]).to(tl.int32)  # [block, keys]
            running = tl.cumsum(hit, axis=0) + carry[None, :]  # inclusive, with earlier chunks
            position = tl.sum(hit * running, axis=1) - 1
            tl.store(position_ptr + row * m + offs, position.to(tl.int64), mask=inside)
            carry += tl.sum(hit, axis=0)
        tl.store(count_ptr + row * k1 + cols, carry.to(tl.int64), mask=cols < k1)

    _HAVE_TRITON = True
except Exception:  # no Triton: the torch fallback below
    _HAVE_TRITON = False


def use_triton_kernels(t: Tensor) -> bool:
    """Whether the Triton kernels (here and in ``experts.py``) run for ``t``: on a GPU, or on the
    CPU under the interpreter (tests); ``MAXSCORE_TRITON=0`` turns them off."""
    if not _HAVE_TRITON or os.environ.get("MAXSCORE_TRITON", "1") == "0":
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


#: Rows (routing groups x slots) up to this long take the Triton position kernel, with up to
#: this many keys (experts + 1): beyond, a row's serial chunks cost more than the sort.
_SCAN_ROW_LIMIT = 8192
_SCAN_KEY_LIMIT = 64


def _key_positions_triton(key: Tensor, k1: int) -> tuple[Tensor, Tensor]:
    g, m = key.shape
    position = torch.empty(g, m, dtype=torch.long, device=key.device)
    if g == 0 or m == 0:
        return position, torch.zeros(g, k1, dtype=torch.long, device=key.device)
    counts = torch.empty(g, k1, dtype=torch.long, device=key.device)
    keys = max(16, triton.next_power_of_2(k1))
    # Every constexpr depends on the keys and on a power of two of the chunks only, and `m` is not
    # specialised: rows whose length changes from call to call (evaluation batches of varying
    # sequence length) reuse a few compiled variants instead of compiling one per length.
    # A [block, keys] tile of 16,384 entries per chunk (8 warps).
    block = min(1024, 16384 // keys)
    chunks = triton.next_power_of_2(triton.cdiv(m, block))
    _key_positions_kernel[(g,)](
        key, position, counts, m, k1, block=block, keys=keys, chunks=chunks, num_warps=8,
    )  # fmt: skip
    return position, counts


# Under torch.compile, one custom operator (as the gather-sum and the SwiGLU kernels).
@torch.library.custom_op("maxscore::key_positions", mutates_args=())
def _key_positions_op(key: Tensor, k1: int) -> tuple[Tensor, Tensor]:
    return _key_positions_triton(key, k1)


@_key_positions_op.register_fake
def _key_positions_fake(key: Tensor, k1: int) -> tuple[Tensor, Tensor]:
    g, m = key.shape
    return key.new_empty(g, m, dtype=torch.long), key.new_empty(g, k1, dtype=torch.long)


def _key_positions(key: Tensor, k1: int) -> tuple[Tensor, Tensor]:
    """``_positions`` of ``key [G, m]`` (values in ``[0, k1)``) by the Triton kernel."""
    if torch.compiler.is_compiling():
        return _key_positions_op(key, k1)
    return _key_positions_triton(key, k1)


def _sum_slot_rows_triton(src: Tensor, slot_row: Tensor) -> Tensor:
    t, s = slot_row.shape
    src = src.contiguous()
    d = src.shape[-1]
    out = src.new_empty(t, d)

    def grid(meta: dict) -> tuple[int, int]:
        return triton.cdiv(t, meta["tokens"]), triton.cdiv(d, meta["block"])

    # Under torch's deterministic mode Triton's autotuner finds no configuration (its timing
    # run fails: "'NoneType' object is not a mapping", Triton 3.6 / torch 2.11), and
    # every configuration gives the same sums (each token's slots added in slot order), so that
    # mode, like the interpreter, runs one fixed configuration.
    if src.is_cuda and not torch.are_deterministic_algorithms_enabled():
        _sum_slot_rows_tuned[grid](src, slot_row.contiguous(), out, t, d, slots=s)
    else:  # the Triton interpreter, or deterministic mode
        fixed = _SUM_SLOT_ROWS_CONFIGS[0 if not src.is_cuda else 1]
        _sum_slot_rows_kernel[grid(fixed.kwargs)](
            src, slot_row.contiguous(), out, t, d, slots=s, num_warps=fixed.num_warps,
            **fixed.kwargs,
        )  # fmt: skip
    return out


# Under torch.compile the kernel is one custom operator (as the SwiGLU kernels, ``experts.py``).
@torch.library.custom_op("maxscore::sum_slot_rows", mutates_args=())
def _sum_slot_rows_op(src: Tensor, slot_row: Tensor) -> Tensor:
    return _sum_slot_rows_triton(src, slot_row)


@_sum_slot_rows_op.register_fake
def _sum_slot_rows_fake(src: Tensor, slot_row: Tensor) -> Tensor:
    return src.new_empty(slot_row.shape[0], src.shape[-1])


def _sum_slot_rows(src: Tensor, slot_row: Tensor) -> Tensor:
    """``out[t] = sum_{s: slot_row[t, s] >= 0} src[slot_row[t, s]]`` (``[R, D] -> [T, D]``)."""
    t, s = slot_row.shape
    if use_triton_kernels(src):
        if torch.compiler.is_compiling():
            return _sum_slot_rows_op(src, slot_row)
        return _sum_slot_rows_triton(src, slot_row)
    valid = (slot_row >= 0).unsqueeze(-1)
    rows = src.index_select(0, slot_row.clamp(min=0).reshape(-1)).view(t, s, -1)
    # A select, not a multiply by a 0/1 mask: a slot without a row reads row 0 here, and
    # 0 * NaN would carry one token's non-finite output into every token with a dropped slot.
    return torch.where(valid, rows, 0.0).sum(dim=1)


class _GatherRows(torch.autograd.Function):
    """``x[T, D] -> x[source_token]``; backward sums each token's slot rows (no atomics)."""

    @staticmethod
    def forward(ctx, x: Tensor, source_token: Tensor, slot_row: Tensor):  # type: ignore[override]
        ctx.save_for_backward(slot_row)
        return x.index_select(0, source_token)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        (slot_row,) = ctx.saved_tensors
        # Rows no slot owns hold a filler token at weight 0: their input gradient is exactly 0
        # (d gate_up = dh * w * ... = 0), so leaving them out is exact.
        return _sum_slot_rows(grad, slot_row), None, None


class _CombineRows(torch.autograd.Function):
    """Eq. (1)'s sum over slots, ``[R, D] -> [T, D]``; backward is a gather (no atomics)."""

    @staticmethod
    def forward(ctx, out: Tensor, source_token: Tensor, slot_row: Tensor):  # type: ignore[override]
        ctx.save_for_backward(source_token)
        return _sum_slot_rows(out, slot_row)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        (source_token,) = ctx.saved_tensors
        # A row no slot owns gets its filler token's gradient instead of 0; harmless and exact:
        # its activation h is 0 (weight 0), so it adds nothing to the down-projection gradient,
        # its gate_up gradient is 0, and its weight gradient lands on a constant.
        return grad.index_select(0, source_token), None, None


def gather_rows(x: Tensor, plan: DispatchPlan) -> Tensor:
    """``x[T, D] -> [R, D]``: each buffer row's token."""
    if plan.slot_row is None:
        return x.index_select(0, plan.source_token)
    return _GatherRows.apply(x, plan.source_token, plan.slot_row)


def combine_rows(out: Tensor, plan: DispatchPlan, num_tokens: int) -> Tensor:
    """Eq. (1)'s sum: add each token's weighted expert-output rows, ``[R, D] -> [T, D]``."""
    if plan.slot_row is None:  # a plan built by hand: scatter-add (atomics)
        y = out.new_zeros(num_tokens, out.shape[-1])
        return y.index_add_(0, plan.source_token, out)
    return _CombineRows.apply(out, plan.source_token, plan.slot_row)


def _native_grouped_mm_ok(a: Tensor, b: Tensor) -> bool:
    if not (a.is_cuda and hasattr(torch, "_grouped_mm")):
        return False
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        return False
    if a.shape[-1] % 8 or b.shape[-1] % 8:  # the kernel needs 16-byte aligned rows
        return False
    major, _ = torch.cuda.get_device_capability(a.device)
    return major >= 9  # the CUTLASS grouped GEMM is built for sm90 / sm100


@torch.compiler.disable
def _grouped_mm_loop(a: Tensor, b: Tensor, group_end: Tensor) -> Tensor:
    # Correct everywhere; reads the offsets on the host (free on the CPU; a sync on a GPU whose
    # dtype or architecture the native kernel does not cover). Not traced by torch.compile: the
    # host read would split the graph, and the part after it would be compiled again for every
    # shape of its slices (the recompile limit, 8, is reached in one training step of the tiny
    # model on the CPU).
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
    if torch.is_autocast_enabled(a.device.type):
        # torch._grouped_mm is not on autocast's list: cast as autocast casts torch.mm, so a
        # bf16-autocast training step (fp32 master weights) takes the native kernel, not the
        # per-expert loop with its host sync.
        dtype = torch.get_autocast_dtype(a.device.type)
        a, b = a.to(dtype), b.to(dtype)
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
