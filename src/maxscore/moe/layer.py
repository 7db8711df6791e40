"""The MoE layer: a router, ``e`` SwiGLU experts and optional shared experts.

Eq. (1): ``y_i = sum_j P_ij * w_ij * E_j(x_i)`` (+ the shared experts' output for every token,
optionally scaled by a per-token sigmoid gate ``sigmoid(x_i W_s)`` as in Qwen-MoE), where ``P`` is the router's 0/1 assignment and ``w`` its combine weights. Dropped slots have
``P_ij = 0`` and contribute nothing; the residual connection around the layer carries the token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from maxscore.moe.dispatch import dispatch_plan
from maxscore.moe.expert_parallel import ExpertParallel, expert_parallel_forward
from maxscore.moe.experts import DenseMLP, SwiGLUExperts
from maxscore.routing.config import RouterConfig
from maxscore.routing.groups import expert_capacity
from maxscore.routing.resolve import RouterSizes, RouterSource, resolve_router
from maxscore.routing.router import Router
from maxscore.routing.types import RoutingResult

__all__ = ["MoE", "default_intermediate_size"]


def default_intermediate_size(hidden_size: int, top_k: int) -> int:
    """Expert width ``4 * hidden / k`` (the paper's), so k experts cost one dense MLP."""
    return 4 * hidden_size // top_k


class MoE(nn.Module):
    """Mixture-of-Experts layer (Eq. 1) with any router of the paper.

    Args:
        hidden_size: ``D``.
        num_experts: ``e``.
        top_k: ``k``, experts per token (for expert choice: the average).
        intermediate_size: each expert's width ``F``; default ``4 * D // k``.
        router: a preset name (``maxscore.routing.ROUTER_PRESETS``), RouterConfig fields or a
            :class:`RouterConfig`, resolved with ``router_overrides`` for this layer's sizes by
            :func:`~maxscore.routing.resolve.resolve_router` (the ``"dense"`` preset has no
            router: use :class:`~maxscore.moe.DenseMLP`).
        num_shared_experts: experts every token goes through (DeepSeek), summed into the output.
        shared_intermediate_size: width of each shared expert; default ``intermediate_size``.
        shared_expert_gate: scale the shared experts' output by ``sigmoid(x W_s)`` with a
            learned ``W_s`` (``Linear(D, 1)``; Qwen2-MoE's ``shared_expert_gate``).
        init_std: normal init std of all expert weights (Llama ``initializer_range``).
        **router_overrides: :class:`RouterConfig` fields replacing the preset's.

    ``forward(x[B, L, D], token_mask=None) -> (y[B, L, D], RoutingResult)``; ``token_mask``
    (``[B, L]``, True = real token) keeps padded positions out of routing (they get no routed
    expert, so their routed output is 0), losses and statistics. Capacity routers run the padded
    path (``[e, G*c, D]`` buffers, ``bmm``), routings with ``capacity is None`` the grouped path
    (``torch._grouped_mm``). ``last_stats`` is the last call's routing statistics, a dict of
    detached device tensors (reading them is the only host sync). They are computed when
    ``last_stats`` is first read after a forward (then cached), not in the forward itself: the
    layer keeps the router's :class:`~maxscore.routing.statistics.LazyRoutingStatistics`, which
    holds detached references to the call's affinities and assignment until then.

    ``expert_parallel``: ``None``, or the :class:`~maxscore.moe.expert_parallel.ExpertParallel`
    layout this layer's experts were sharded with (``shard_moe_experts``); the experts then run
    on the ranks that hold them, tokens travelling by all-to-all.
    """

    expert_parallel: ExpertParallel | None = None

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int | None = None,
        router: RouterSource = "maxscore",
        num_shared_experts: int = 0,
        shared_intermediate_size: int | None = None,
        init_std: float = 0.02,
        shared_expert_gate: bool = False,
        **router_overrides: Any,
    ) -> None:
        super().__init__()
        # The router first: resolving it checks the sizes, and the default expert width
        # divides by top_k.
        sizes = RouterSizes(hidden_size, num_experts, top_k)
        config = resolve_router(router, router_overrides, sizes)
        self.router = Router(hidden_size, num_experts, top_k, config)
        for name, value in (
            ("intermediate_size", intermediate_size),
            ("shared_intermediate_size", shared_intermediate_size),
        ):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if not isinstance(num_shared_experts, int) or num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be an int >= 0, got {num_shared_experts!r}")
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.intermediate_size = intermediate_size or default_intermediate_size(hidden_size, top_k)
        self.experts = SwiGLUExperts(num_experts, hidden_size, self.intermediate_size, init_std)
        self.num_shared_experts = num_shared_experts
        self.shared_experts: DenseMLP | None = None
        if num_shared_experts > 0:
            width = shared_intermediate_size or self.intermediate_size
            self.shared_experts = DenseMLP(hidden_size, num_shared_experts * width, init_std)
        self.shared_expert_gate: nn.Linear | None = None
        if shared_expert_gate:
            if self.shared_experts is None:
                raise ValueError("shared_expert_gate needs num_shared_experts >= 1")
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
            nn.init.normal_(self.shared_expert_gate.weight, mean=0.0, std=init_std)
        self._last_stats: Mapping[str, Tensor] = {}

    @property
    def router_config(self) -> RouterConfig:
        """The router's :class:`RouterConfig` (held by the router alone)."""
        return self.router.config

    @property
    def last_stats(self) -> dict[str, Tensor]:
        """Routing statistics of the last forward (``routing_statistics`` keys, detached).

        Evaluated on first access after a forward (a few dozen small kernels, no host sync) and
        cached, so forwards whose statistics are never read do not pay for them.
        """
        return dict(self._last_stats)  # computed under no_grad: already detached

    @last_stats.setter
    def last_stats(self, value: Mapping[str, Tensor]) -> None:
        self._last_stats = {name: tensor.detach() for name, tensor in value.items()}

    def buffer_capacity(self, result: RoutingResult) -> int | None:
        """Rows per expert per group for the padded path, as a Python int (no host sync).

        Recomputed from the router config with the same formula the router uses
        (``groups.expert_capacity``); on the CPU, where reading is free, it is checked against
        the routing's own capacity tensor.
        """
        if result.capacity is None:
            return None
        cfg = self.router_config
        c = expert_capacity(
            result.group_size, self.num_experts, self.top_k, cfg.capacity_factor, cfg.min_capacity
        )
        if result.capacity.device.type == "cpu" and not torch.compiler.is_compiling():
            c_max = int(result.capacity.max())
            if c_max > c:
                raise RuntimeError(f"router capacity {c_max} exceeds the buffer capacity {c}")
        return c

    def forward(self, x: Tensor, token_mask: Tensor | None = None) -> tuple[Tensor, RoutingResult]:
        """``x[B, L, D] -> (y[B, L, D], RoutingResult)``.

        Outside autocast, an input whose dtype differs from the experts' weights (fp16 tokens
        into an fp32 layer) is computed in the weights' dtype, as ``torch.autocast`` would pick
        one dtype for the matmuls, rather than failing inside ``bmm``; ``y`` is cast back.
        """
        shape, dtype = x.shape, x.dtype
        if not x.is_floating_point():
            raise ValueError(f"MoE input must be a floating-point tensor, got {x.dtype}")
        # A LoRA wrapper (peft's ParamWrapper) holds the experts as its base layer.
        experts = getattr(self.experts, "get_base_layer", lambda: self.experts)()
        weight_dtype = experts.gate_up.dtype
        cast = dtype != weight_dtype and not torch.is_autocast_enabled(x.device.type)
        if cast:
            x = x.to(weight_dtype)
        x, token_mask, real = self._pad_to_whole_groups(x, token_mask)
        result: RoutingResult = self.router(x, token_mask)
        tokens = x.reshape(-1, shape[-1])
        if self.expert_parallel is not None:
            y = expert_parallel_forward(
                self.expert_parallel,
                self.experts,
                tokens,
                result,
                self.buffer_capacity(result),
                self.training,
            )
        else:
            y = self.experts(tokens, dispatch_plan(result, self.buffer_capacity(result)))
        if self.shared_experts is not None:
            shared = self.shared_experts(tokens)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(tokens)) * shared
            y = y + shared
        self._last_stats = result.stats  # lazy: evaluated when last_stats is read
        if real is not None:
            y = y[:real]
        y = y.view(shape)
        return (y.to(dtype) if cast else y), result

    def _pad_to_whole_groups(
        self, x: Tensor, token_mask: Tensor | None
    ) -> tuple[Tensor, Tensor | None, int | None]:
        """Append masked sequences until ``B * L`` is a multiple of a fixed routing group.

        With ``group="tokens"`` a batch need not fill whole groups (the last evaluation batch of
        a validation set usually does not). The missing rows are routed as masked padding, which
        the router leaves out of routing, losses and statistics, so the last group keeps the
        capacity of a full group. Returns ``(x, token_mask, real tokens)``; ``None`` when nothing
        was appended. Shapes only: no host synchronisation.
        """
        cfg = self.router_config
        if cfg.group != "tokens" or cfg.group_size is None or x.dim() != 3:
            return x, token_mask, None
        batch, seq = x.shape[0], x.shape[1]
        n = int(cfg.group_size)
        if (batch * seq) % n == 0:
            return x, token_mask, None
        # Whole sequences keep per-sequence losses well defined: B' * L must be a multiple of n.
        rows = n // math.gcd(n, seq)
        extra = -batch % rows
        mask = (
            torch.ones(batch, seq, dtype=torch.bool, device=x.device)
            if token_mask is None
            else token_mask.reshape(batch, seq).to(device=x.device, dtype=torch.bool)
        )
        x = torch.cat([x, x.new_zeros(extra, seq, x.shape[-1])])
        mask = torch.cat([mask, mask.new_zeros(extra, seq)])
        return x, mask, batch * seq

    def extra_repr(self) -> str:
        return (
            f"strategy={self.router_config.strategy!r}, operator={self.router_config.operator!r}, "
            f"num_shared_experts={self.num_shared_experts}"
        )
