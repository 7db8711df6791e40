"""SwiGLU experts with stacked weights, and the dense SwiGLU MLP.

An expert is the Llama MLP ``E_j(x) = (silu(x W_g,j) * (x W_u,j)) W_d,j``. The MoE output of
Eq. (1) is ``y = sum_j P_ij * w_ij * E_j(x_i)``: each token's output is the combine-weighted sum of
the outputs of the experts it was assigned to.

:class:`SwiGLUExperts` stores the ``e`` experts' weights stacked, so that one batched matmul
(padded path) or one grouped matmul (grouped path) runs all experts at once:

* ``gate_up`` ``[e, D, 2F]``: gate projection in columns ``[:F]``, up projection in ``[F:]``
  (fused, so the first projection is a single matmul);
* ``down`` ``[e, F, D]``.

The combine weight of a buffer row is multiplied into the SwiGLU activation before the down
projection (``(w * h) W_d = w * (h W_d)``), inside one custom autograd function that keeps only
``gate_up`` for backward and recomputes the activation. That removes one ``[rows, D]`` output
tensor and two ``[rows, F]`` activation tensors from what autograd keeps alive. On CUDA the
activation runs as two hand-written Triton kernels (one pass each way, the weight gradient's row
reduction fused in); elsewhere as plain torch ops.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from maxscore.compiled import call_compiled
from maxscore.moe.dispatch import (
    DispatchPlan,
    combine_rows,
    gather_rows,
    grouped_mm,
    use_triton_kernels,
)

__all__ = ["DenseMLP", "SwiGLUExperts", "weighted_swiglu"]


# --------------------------------------------------------------------------------------------
# Weighted SwiGLU activation: h = w * silu(g) * u, with recomputation in backward.
# --------------------------------------------------------------------------------------------


def _swiglu_forward(gate_up: Tensor, weight: Tensor) -> Tensor:
    # fp32 math whatever the storage dtype: under torch.compile this is one fused kernel, so the
    # upcast costs no memory traffic.
    g, u = gate_up.float().chunk(2, dim=-1)
    h = F.silu(g) * u * weight.float().unsqueeze(-1)
    return h.to(gate_up.dtype)


def _swiglu_backward(gate_up: Tensor, weight: Tensor, grad_h: Tensor) -> tuple[Tensor, Tensor]:
    g, u = gate_up.float().chunk(2, dim=-1)
    w = weight.float().unsqueeze(-1)
    dh = grad_h.float()
    s = torch.sigmoid(g)
    silu = g * s
    d_weight = (dh * silu * u).sum(dim=-1)
    dhw = dh * w
    d_g = dhw * u * (s * (1.0 + g * (1.0 - s)))
    d_u = dhw * silu
    return torch.cat([d_g, d_u], dim=-1).to(gate_up.dtype), d_weight.to(weight.dtype)


# On CUDA without Triton kernels (MAXSCORE_TRITON=0, or Triton missing) the two elementwise
# functions above are compiled with torch.compile (a few fused kernels instead of ~10 eager
# launches over [rows, F]; 2x slower than the Triton kernels below, and 2x faster than
# eager); set MAXSCORE_COMPILE=0 to disable that too. Only the half-precision
# training path is compiled; fp32 on a GPU is for checks.
def _call(name: str, fn: Callable[..., object], *args: Tensor):
    x = args[0]
    half_on_gpu = x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16)
    return call_compiled(name, fn, *args, enabled=half_on_gpu, dynamic=True)


# Hand-written Triton kernels (one pass over [rows, 2F] each way, the row reduction of the
# weight gradient fused into the backward pass); used on CUDA when Triton is importable.
try:  # pragma: no cover - exercised on GPU machines (and with TRITON_INTERPRET=1)
    import triton
    import triton.language as tl

    @triton.jit
    def _swiglu_fwd_kernel(gu_ptr, w_ptr, h_ptr, f, block: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * block + tl.arange(0, block)
        mask = cols < f
        g = tl.load(gu_ptr + row * 2 * f + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * f + f + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + row).to(tl.float32)
        h = g * tl.sigmoid(g) * u * w
        tl.store(h_ptr + row * f + cols, h.to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(gu_ptr, w_ptr, dh_ptr, dgu_ptr, dw_ptr, f, block: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        col_block = tl.program_id(1)
        cols = col_block * block + tl.arange(0, block)
        mask = cols < f
        w = tl.load(w_ptr + row).to(tl.float32)
        g = tl.load(gu_ptr + row * 2 * f + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * f + f + cols, mask=mask, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + row * f + cols, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        dhw = dh * w
        d_g = dhw * u * (sig * (1.0 + g * (1.0 - sig)))
        d_u = dhw * silu
        tl.store(dgu_ptr + row * 2 * f + cols, d_g.to(dgu_ptr.dtype.element_ty), mask=mask)
        tl.store(dgu_ptr + row * 2 * f + f + cols, d_u.to(dgu_ptr.dtype.element_ty), mask=mask)
        # Partial row sum of the weight gradient; the few column blocks are summed after.
        tl.store(dw_ptr + row * tl.num_programs(1) + col_block, tl.sum(dh * silu * u, axis=0))

except Exception:  # no Triton (CPU-only installs): the torch implementations above are used
    pass


def _swiglu_forward_triton(gate_up: Tensor, weight: Tensor) -> Tensor:
    rows, f = gate_up.shape[0], gate_up.shape[1] // 2
    h = gate_up.new_empty(rows, f)
    block = 1024
    _swiglu_fwd_kernel[(rows, triton.cdiv(f, block))](gate_up, weight, h, f, block=block)
    return h


def _swiglu_backward_triton(
    gate_up: Tensor, weight: Tensor, grad_h: Tensor
) -> tuple[Tensor, Tensor]:
    rows, f = gate_up.shape[0], gate_up.shape[1] // 2
    d_gate_up = torch.empty_like(gate_up)
    block = 1024
    col_blocks = triton.cdiv(f, block)
    partial = torch.empty(rows, col_blocks, device=gate_up.device, dtype=torch.float32)
    _swiglu_bwd_kernel[(rows, col_blocks)](
        gate_up, weight, grad_h, d_gate_up, partial, f, block=block, num_warps=4
    )
    return d_gate_up, partial.sum(dim=1).to(weight.dtype)


# Under torch.compile the two kernels run as custom operators (one opaque node each), like the
# flow solver (``routing/flow/compiled_call.py``): the compiled graph then calls them as they are,
# instead of depending on how the torch version's inductor traces user Triton kernels and the
# buffers they write (the same speed either way, torch 2.11).
@torch.library.custom_op("maxscore::weighted_swiglu_fwd", mutates_args=())
def _swiglu_forward_op(gate_up: Tensor, weight: Tensor) -> Tensor:
    return _swiglu_forward_triton(gate_up, weight)


@_swiglu_forward_op.register_fake
def _swiglu_forward_fake(gate_up: Tensor, weight: Tensor) -> Tensor:
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


@torch.library.custom_op("maxscore::weighted_swiglu_bwd", mutates_args=())
def _swiglu_backward_op(gate_up: Tensor, weight: Tensor, grad_h: Tensor) -> tuple[Tensor, Tensor]:
    return _swiglu_backward_triton(gate_up, weight, grad_h)


@_swiglu_backward_op.register_fake
def _swiglu_backward_fake(gate_up: Tensor, weight: Tensor, grad_h: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(gate_up), torch.empty_like(weight)


class _WeightedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: Tensor, weight: Tensor) -> Tensor:  # type: ignore[override]
        gate_up, weight = gate_up.contiguous(), weight.contiguous()
        ctx.save_for_backward(gate_up, weight)
        if gate_up.dim() == 2 and use_triton_kernels(gate_up):
            compiling = torch.compiler.is_compiling()  # eager calls skip the operator dispatch
            return (_swiglu_forward_op if compiling else _swiglu_forward_triton)(gate_up, weight)
        return _call("swiglu_fwd", _swiglu_forward, gate_up, weight)

    @staticmethod
    def backward(ctx, grad_h: Tensor) -> tuple[Tensor, Tensor | None]:  # type: ignore[override]
        gate_up, weight = ctx.saved_tensors
        grad_h = grad_h.contiguous()
        if gate_up.dim() == 2 and use_triton_kernels(gate_up):
            compiling = torch.compiler.is_compiling()
            kernel = _swiglu_backward_op if compiling else _swiglu_backward_triton
            d_gate_up, d_weight = kernel(gate_up, weight, grad_h)
        else:
            d_gate_up, d_weight = _call("swiglu_bwd", _swiglu_backward, gate_up, weight, grad_h)
        return d_gate_up, (d_weight if ctx.needs_input_grad[1] else None)


def weighted_swiglu(gate_up: Tensor, weight: Tensor) -> Tensor:
    """``w * silu(g) * u`` for ``gate_up = [g | u]`` (``[..., 2F]``) and row weights ``[...]``.

    Differentiable in both arguments; saves only its inputs (the activation is recomputed in
    backward), so a MoE layer keeps no ``[rows, F]`` activation besides ``gate_up`` and ``h``.
    """
    return _WeightedSwiGLU.apply(gate_up, weight)


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


def _in_compute_dtype(x: Tensor) -> Tensor:
    """``x`` in the dtype the expert matmuls use (bf16 under bf16 autocast), before the gather.

    Casting the ``[T, D]`` tokens once (fused into the norm before it when compiled) instead of
    the ``[R, D]`` gathered rows halves the bytes the gather reads, and its gradient comes back
    as bf16 rows summed per token into bf16 (fp32 accumulation) rather than as fp32 copies of
    every row: ~3 ms of a 167 ms Base step with an fp32 residual stream.
    """
    if not torch.is_autocast_enabled(x.device.type):
        return x
    return x.to(torch.get_autocast_dtype(x.device.type))


class SwiGLUExperts(nn.Module):
    """``e`` SwiGLU experts with stacked weights (see the module docstring for the layout).

    Args:
        num_experts: ``e``.
        hidden_size: ``D``.
        intermediate_size: ``F``, each expert's hidden width.
        init_std: standard deviation of the normal init (Llama: ``initializer_range = 0.02``).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        init_std: float = 0.02,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.init_std = init_std
        kw = {"device": device, "dtype": dtype}
        self.gate_up = nn.Parameter(
            torch.empty(num_experts, hidden_size, 2 * intermediate_size, **kw)
        )
        self.down = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate_up, mean=0.0, std=self.init_std)
        nn.init.normal_(self.down, mean=0.0, std=self.init_std)

    def expert(self, j: int, x: Tensor) -> Tensor:
        """Expert ``j`` applied to ``x[..., D]`` (plain ops; for references and tests)."""
        f = self.intermediate_size
        gu = x @ self.gate_up[j]
        return (F.silu(gu[..., :f]) * gu[..., f:]) @ self.down[j]

    def gather(self, x: Tensor, plan: DispatchPlan) -> Tensor:
        """The plan's buffer rows ``[R, D]`` of ``x[T, D]``, in the experts' compute dtype."""
        return gather_rows(_in_compute_dtype(x), plan)

    def padded_rows(self, xd: Tensor, row_weight: Tensor) -> Tensor:
        """The experts on equal-size buffers: ``xd[e, n, D]`` (expert ``j``'s rows in
        ``xd[j]``) with row weights ``[e * n]`` -> weighted outputs ``[e * n, D]``.

        One ``bmm`` per projection runs all experts. Expert parallelism calls this on the rows it
        received (``maxscore.moe.expert_parallel``), so both run the same computation.
        """
        e, f, d = xd.shape[0], self.intermediate_size, xd.shape[-1]
        gu = torch.bmm(xd, self.gate_up)
        # 2-D view: the same (compiled) activation kernel serves both paths.
        h = weighted_swiglu(gu.view(-1, 2 * f), row_weight).view(e, -1, f)
        return torch.bmm(h, self.down).view(-1, d)

    def grouped_rows(self, xd: Tensor, row_weight: Tensor, group_end: Tensor) -> Tensor:
        """The experts on rows sorted by expert: ``xd[R, D]``, row weights ``[R]`` and the
        exclusive end row of each expert ``group_end[e]`` -> weighted outputs ``[R, D]``."""
        gu = grouped_mm(xd, self.gate_up, group_end)
        h = weighted_swiglu(gu, row_weight)
        return grouped_mm(h, self.down, group_end)

    def forward_padded(self, x: Tensor, plan: DispatchPlan) -> Tensor:
        """Eq. (1) through capacity buffers: ``x[T, D] -> y[T, D]``, one ``bmm`` per projection.

        The plan's rows are ``[e, G*c]`` (expert-major), so each expert's buffer is one
        contiguous ``[G*c, D]`` matrix and a single batched matmul runs all experts.
        """
        xd = self.gather(x, plan).view(self.num_experts, -1, x.shape[-1])
        out = self.padded_rows(xd, plan.row_weight)
        return combine_rows(out, plan, x.shape[0])

    def forward_grouped(self, x: Tensor, plan: DispatchPlan) -> Tensor:
        """Eq. (1) for variable expert loads: rows sorted by expert, grouped matmul by offsets."""
        assert plan.group_end is not None, "forward_grouped needs a grouped dispatch plan"
        out = self.grouped_rows(self.gather(x, plan), plan.row_weight, plan.group_end)
        return combine_rows(out, plan, x.shape[0])

    def forward(self, x: Tensor, plan: DispatchPlan) -> Tensor:
        """Run the experts on a dispatch plan (padded if it has a capacity, else grouped)."""
        if plan.rows_per_expert is not None:
            return self.forward_padded(x, plan)
        return self.forward_grouped(x, plan)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}"
        )


class DenseMLP(nn.Module):
    """The Llama SwiGLU MLP ``(silu(x W_g) * (x W_u)) W_d`` (dense preset and shared experts).

    Weight names follow Llama (``gate_proj``, ``up_proj``, ``down_proj``) so checkpoints read
    like a Llama model's. ``num_shared_experts`` SwiGLU experts of width ``F`` summed together
    equal one SwiGLU of width ``num_shared_experts * F``, which is how the MoE layer builds its
    shared experts.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        init_std: float = 0.02,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.init_std = init_std
        kw = {"device": device, "dtype": dtype, "bias": False}
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(lin.weight, mean=0.0, std=self.init_std)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
