"""The Router module: gate projection -> affinity operator -> assignment strategy -> weights.

One call routes the ``T = B·L`` tokens of a ``[B, L, D]`` input::

    logits      = x · W_g                                (fp32 matmul, autocast off)
    A           = operator(logits, k, t)                  (Table 2 / SoftTopk; Eq. 2 for softmax)
    A0          = operator(logits, k, 0)                  (selection scores; = A without a t)
    expert_index = strategy(A0 [+ bias], k, capacity)     (per routing group; Eq. 7-8 for flow)
    weights     = A gathered at expert_index              (0 for empty slots; the R(x) of Eq. 1)

For SoftTopk, ``A0`` is the softmax: the operator's boost ``t`` shapes the combine weights (and
so the gradients), never which experts are chosen — as in the authors' code, which selects on
the softmax and scales only the second expert's weight. The aux loss and the choice ranks of
the statistics use ``A0`` too.

plus the load-balancing loss (Eq. 9 / GShard form), the z-loss and device-side statistics, all
returned in one :class:`~maxscore.routing.types.RoutingResult`.

Padding. ``forward(hidden, token_mask)`` takes the ``[B, L]`` mask of real tokens (the model
passes its 2-D ``attention_mask``). Padded positions get no expert (every slot ``-1``), take no
capacity or flow slot (each strategy excludes them, see ``strategies``), and count in neither
the load-balancing loss, the z-loss, the DeepSeek-V3 load nor the statistics, so nothing a real
token gets depends on what the padding holds. The mask is applied with ``where`` and masked
sums, never by selecting rows, so there is no host sync and shapes stay static.

Launch overhead. At the benchmark's sizes the router issues kernels far faster than it can
launch them (hundreds of microseconds of Python and dispatch for tens of microseconds of GPU
work), so the forward issues as few kernels as it can: the statistics are lazy
(:class:`~maxscore.routing.statistics.LazyRoutingStatistics`, evaluated when first read), the
SoftTopk ``t`` and the capacity vector are cached on the device until the schedule's step
changes, and the aux loss uses the gather form of the GShard loss (``losses``).

Non-finite logits. Checking for NaN/inf would be a host sync, so the hot path instead replaces
them: NaN -> 0 and ±inf -> ±``LOGIT_BOUND`` (``torch.nan_to_num`` in fp32). A token with a NaN
logit is thus routed as if that logit were 0; assignments stay in range and duplicate-free and
weights stay finite. Pass ``check_finite=True`` (a debugging aid that syncs) to raise a
ValueError instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from maxscore.routing.config import RouterConfig
from maxscore.routing.groups import expert_capacity, group_size_for
from maxscore.routing.losses import (
    assignment_matrix,
    balance_loss_from_terms,
    balance_terms,
    load_balancing_loss,
    masked_load_balancing_loss,
    router_z_loss,
)
from maxscore.routing.operators import get_operator_spec
from maxscore.routing.resolve import RouterSizes, RouterSource, resolve_router
from maxscore.routing.schedule import TemperatureSchedule
from maxscore.routing.statistics import LazyRoutingStatistics
from maxscore.routing.strategies import ASSIGNMENT_STRATEGIES, StrategySpec
from maxscore.routing.types import RoutingResult

__all__ = [
    "DENSE_HAS_NO_ROUTER",
    "LOGIT_BOUND",
    "Router",
    "advance_routers",
    "build_router",
    "register_router_step_hook",
]

#: Magnitude that ±inf logits are replaced with (large enough to dominate, small enough that
#: softmax, sigmoid and the z-loss stay finite in fp32).
LOGIT_BOUND: float = 1.0e4

_ROUTER_DTYPES = (torch.float32, torch.float64)


#: Why a dense config cannot build a router (the MoE layer and the Llama-MoE model build a
#: dense MLP for it instead).
DENSE_HAS_NO_ROUTER = (
    "the 'dense' preset has no router: use a dense MLP instead (maxscore.moe.DenseMLP of "
    "width k * F; the Llama-MoE model builds one for router='dense')"
)


class Router(nn.Module):
    """MoE router: ``forward(hidden[B, L, D]) -> RoutingResult`` (see the module docstring).

    Args:
        hidden_size: ``D``.
        num_experts: ``e``.
        top_k: ``k``, experts per token.
        config: a resolved :class:`RouterConfig`
            (:func:`~maxscore.routing.resolve.resolve_router`; :func:`build_router` resolves a
            preset name for these sizes). Its values were checked when it was made; the Router
            takes it as it is.
        router_dtype: dtype of the router math, ``torch.float32`` (default) or ``torch.float64``
            (for gradcheck-style tests); assignment always ranks fp32 scores.
        check_finite: debug aid: raise ValueError on NaN/inf logits (a host sync per call)
            instead of sanitising them.
        compute_stats: fill ``RoutingResult.stats`` with the call's routing statistics: a
            :class:`~maxscore.routing.statistics.LazyRoutingStatistics`, evaluated on the
            device (no sync) when first read, so an unread result costs no kernels. ``False``
            leaves it an empty dict.

    Submodules / buffers: ``gate`` (``Linear(D, e, bias=False)``), ``schedule``
    (:class:`TemperatureSchedule`, always present so state-dict keys do not depend on the
    operator), ``expert_bias`` (``[e]`` fp32, the DeepSeek-V3 balancing bias; stays fp32 when
    the module is cast to another dtype), ``expert_load`` (``[e]`` fp32, tokens per expert
    accumulated over the current optimizer step) and ``expert_load_step`` (the step they belong
    to). All are always present, so state-dict keys do not depend on the preset.

    DeepSeek-V3 bias updates (``bias_update_rate > 0``) happen once per optimizer step, like
    DeepSeek-V3, Megatron and torchtitan, and never inside ``forward``: training forwards only
    record their loads in ``expert_load`` (``forward`` is a function of its inputs, the gate and
    the bias); :meth:`advance_schedule`, which counts a finished optimizer step, applies
    ``b_j -= rate · sign(load_j - mean load)`` through :meth:`update_expert_bias` and starts a
    new accumulation. The trainer calls it after every optimizer step (a callback); a plain loop
    calls ``router.advance_schedule()`` (or ``router.update_expert_bias()`` alone) after
    ``optimizer.step()``, or registers :func:`register_router_step_hook` on its optimizer. The
    bias is therefore constant within a step, so activation checkpointing recomputes exactly the
    routing of the original forward. All of this runs on the device with no host sync.
    """

    expert_bias: Tensor
    expert_load: Tensor
    expert_load_step: Tensor

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        config: RouterConfig,
        *,
        router_dtype: torch.dtype = torch.float32,
        check_finite: bool = False,
        compute_stats: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(config, RouterConfig):
            raise TypeError(
                f"config must be a RouterConfig, got {type(config).__name__}; for a preset name "
                "use build_router(name, ...) or resolve_router(name)"
            )
        if config.is_dense:
            raise ValueError(DENSE_HAS_NO_ROUTER)
        if router_dtype not in _ROUTER_DTYPES:
            raise ValueError(f"router_dtype must be float32 or float64, got {router_dtype}")
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.config = config
        self.router_dtype = router_dtype
        self.check_finite = check_finite
        self.compute_stats = compute_stats
        self.operator = get_operator_spec(config.operator)
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.schedule = TemperatureSchedule(config.temperature)
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.register_buffer("expert_load", torch.zeros(num_experts, dtype=torch.float32))
        # The schedule step at which the bias last moved (see update_expert_bias).
        self.register_buffer("expert_load_step", torch.zeros((), dtype=torch.long))
        # Global-batch aux loss: expert loads and token count of the current optimizer step
        # (summed over data-parallel ranks), and the step they belong to. Not checkpointed: they
        # restart with every optimizer step.
        self.register_buffer(
            "aux_load", torch.zeros(num_experts + 1, dtype=torch.float32), persistent=False
        )
        self.register_buffer("aux_load_step", torch.zeros((), dtype=torch.long), persistent=False)
        # Device-side constants reused across calls (see _temperature / _capacity_vector).
        self._t_cache: tuple[tuple[Any, ...], Tensor] | None = None
        self._capacity_cache: dict[tuple[Any, ...], Tensor] = {}

    # ----------------------------------------------------------------------------------------
    # dtype handling: the balancing bias is accumulated in tiny steps and must stay fp32
    # (``model.to(torch.bfloat16)`` must not silently round it away; ``_apply`` keeps it fp32).
    _FP32_BUFFERS = ("expert_bias", "expert_load", "aux_load")

    def _apply(self, fn: Any, recurse: bool = True) -> Router:
        before = {name: self._buffers[name] for name in self._FP32_BUFFERS}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new is not None and old is not None and new.dtype != torch.float32:
                # Re-derive from the fp32 value held before the cast, so no precision is lost.
                self._buffers[name] = old.to(device=new.device, dtype=torch.float32)
        return self

    # ----------------------------------------------------------------------------------------
    def strategy_for_mode(self) -> tuple[str, StrategySpec]:
        """The strategy this call uses: the config's, or ``dropless`` for causal evaluation.

        In ``eval()`` mode with ``eval_routing="causal"`` a non-causal strategy (capacity,
        Sinkhorn, flow, expert choice) is replaced by dropless top-k, so no token's experts
        depend on later tokens.
        """
        name = self.config.strategy
        spec = ASSIGNMENT_STRATEGIES[name]
        if not self.training and self.config.eval_routing == "causal" and not spec.causal:
            name = "dropless"
            spec = ASSIGNMENT_STRATEGIES[name]
        return name, spec

    def advance_schedule(self, n: int = 1) -> None:
        """Count ``n`` finished optimizer steps; call it after ``optimizer.step()``.

        Advances the SoftTopk ``t`` schedule by ``n`` and, with DeepSeek-V3 balancing
        (``bias_update_rate > 0``), applies the bias update of the loads recorded since the last
        update (:meth:`update_expert_bias`; once, whatever ``n``).
        """
        self.schedule.advance(n)
        if self.config.bias_update_rate > 0:
            self.update_expert_bias()

    def temperature(self) -> Tensor:
        """The current SoftTopk ``t`` (0-dim fp32 device tensor)."""
        return self.schedule.value()

    # ----------------------------------------------------------------------------------------
    @staticmethod
    def _cacheable() -> bool:
        # Tensors made under inference mode must not leak into autograd-recorded code, and a
        # torch.compile trace should see the plain computation.
        # is_compiling() first: dynamo cannot trace is_inference_mode_enabled (a graph break).
        return not torch.compiler.is_compiling() and not torch.is_inference_mode_enabled()

    def _temperature(self) -> Tensor:
        """``schedule.value()``, recomputed only when the step buffer changed.

        The key is the step buffer itself (by identity) and its version counter: ``advance``
        (``add_``), ``load_state_dict`` (``copy_``) and any other in-place write bump the
        version, and ``.to()`` replaces the tensor, so a stale ``t`` is never returned. Saves
        the 4-5 small kernels of the schedule formula per call. No host sync.
        """
        step = self.schedule.step
        if not self._cacheable():
            return self.schedule.value()
        c = self.schedule.config
        # The step tensor itself is part of the key (compared by identity and kept alive, so
        # its id cannot be reused), with its version counter and the schedule's settings.
        key = (step._version, step.data_ptr(), c.start, c.end, c.steps, c.shape)
        cached = self._t_cache
        if cached is None or cached[0][0] is not step or cached[0][1:] != key:
            with torch.no_grad():
                value = self.schedule.value()
            self._t_cache = ((step, *key), value)
            return value
        return cached[1]

    def _capacity_vector(self, c: int, device: torch.device) -> Tensor:
        """``[e]`` long tensor filled with ``c`` (cached per value and device; no H2D copy)."""
        if not self._cacheable():
            return torch.full((self.num_experts,), c, dtype=torch.long, device=device)
        key = (c, device)
        cap = self._capacity_cache.get(key)
        if cap is None:
            if len(self._capacity_cache) > 16:
                self._capacity_cache.clear()
            cap = torch.full((self.num_experts,), c, dtype=torch.long, device=device)
            self._capacity_cache[key] = cap
        return cap

    def _gate_logits(self, hidden: Tensor) -> Tensor:
        if hidden.dim() not in (2, 3):
            raise ValueError(
                f"router input must be [batch, seq, hidden] (or [tokens, hidden]), got shape "
                f"{tuple(hidden.shape)}"
            )
        if not hidden.is_floating_point():
            raise ValueError(f"router input must be a floating-point tensor, got {hidden.dtype}")
        if hidden.numel() == 0 and hidden.shape[-1] == self.hidden_size:
            raise ValueError(
                f"router input has no tokens (shape {tuple(hidden.shape)}); route at least one"
            )
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(
                f"router input hidden size {hidden.shape[-1]} does not match the router's "
                f"hidden_size={self.hidden_size}"
            )
        # Router math in fp32 whatever the model dtype: autocast would run the matmul in bf16.
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            logits = F.linear(hidden.to(self.router_dtype), self.gate.weight.to(self.router_dtype))
        if self.check_finite and not bool(torch.isfinite(logits).all()):
            bad = int((~torch.isfinite(logits)).sum())
            raise ValueError(
                f"router logits contain {bad} non-finite value(s) (NaN/inf); check the input "
                "hidden states and gate weights"
            )
        return torch.nan_to_num(logits, nan=0.0, posinf=LOGIT_BOUND, neginf=-LOGIT_BOUND)

    def forward(self, hidden: Tensor, token_mask: Tensor | None = None) -> RoutingResult:
        """Route ``hidden[B, L, D]`` (a 2-D ``[T, D]`` input is one sequence of ``T`` tokens).

        ``token_mask`` (``[B, L]``, or anything with ``B * L`` entries; nonzero / True = real
        token) excludes padded positions from routing, losses and statistics (module docstring).
        """
        logits = self._gate_logits(hidden)
        batch, seq = (1, logits.shape[0]) if logits.dim() == 2 else logits.shape[:2]
        e, k, cfg = self.num_experts, self.top_k, self.config
        n = group_size_for(batch, seq, cfg)
        g = batch * seq // n
        logits = logits.reshape(g, n, e)
        mask = None
        if token_mask is not None:
            if token_mask.numel() != batch * seq:
                raise ValueError(
                    f"token_mask has {token_mask.numel()} entries (shape "
                    f"{tuple(token_mask.shape)}) for {batch} x {seq} routed tokens"
                )
            mask = token_mask.reshape(g, n).to(device=logits.device, dtype=torch.bool)

        # Which experts a token prefers is the operator at t = 0 (for SoftTopk: the softmax,
        # ranked like the logits). The boost t only reshapes the combine weights: boosted
        # scores would rank every non-top-1 expert (x(1+t)) above the top-1 early in training,
        # and the authors' code selects on the softmax and scales only the weights.
        selection = self.operator.fn(logits, k, 0.0)
        affinities = selection
        if self.operator.boost is not None:
            affinities = self.operator.boost(selection, logits, k, self._temperature())

        # Selection scores, plus the DeepSeek-V3 bias, which steers selection only and never
        # enters the weights (it moves between optimizer steps, in update_expert_bias).
        # Strategies only pick, so they get a detached copy.
        scores = selection.detach().float()
        if cfg.bias_update_rate > 0:
            scores = scores + self.expert_bias
        _, spec = self.strategy_for_mode()
        if spec.log_scores:
            # exp(log A) = A: Sinkhorn transports the affinities themselves, not exp(A).
            scores = scores.clamp_min(torch.finfo(torch.float32).tiny).log()
        capacity, c = None, None
        if spec.uses_capacity:
            c = expert_capacity(n, e, k, cfg.capacity_factor, cfg.min_capacity)
            capacity = self._capacity_vector(c, logits.device)
        expert_index = spec.assign(scores, k, capacity, cfg, token_mask=mask, capacity_bound=c)

        gathered = affinities.gather(-1, expert_index.clamp_min(0))
        weights = torch.where(expert_index >= 0, gathered, 0.0)
        if cfg.normalize_weights:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)

        zero = logits.new_zeros(())
        aux = zero
        if cfg.aux_loss != "none" and cfg.aux_loss_coef != 0:
            aux = self._aux_loss(selection, expert_index, mask, batch, seq)
        z = cfg.z_loss_coef * router_z_loss(logits, mask) if cfg.z_loss_coef != 0 else zero

        if cfg.bias_update_rate > 0 and self.training:
            self._record_expert_load(expert_index)

        # Statistics are evaluated when first read (no kernels here).
        stats: Mapping[str, Tensor] = {}
        if self.compute_stats:
            stats = LazyRoutingStatistics(
                affinities, expert_index, capacity, k, rank_scores=selection, token_mask=mask
            )

        num_tokens, slots = g * n, expert_index.shape[-1]
        return RoutingResult(
            expert_index=expert_index.reshape(num_tokens, slots),
            combine_weights=weights.reshape(num_tokens, slots),
            capacity=capacity,
            num_groups=g,
            logits=logits.reshape(num_tokens, e),
            affinities=affinities.reshape(num_tokens, e),
            aux_loss=aux,
            z_loss=z,
            stats=stats,
        )

    def _aux_loss(
        self, selection: Tensor, expert_index: Tensor, mask: Tensor | None, batch: int, seq: int
    ) -> Tensor:
        """The scaled load-balancing loss at ``config.aux_loss_granularity`` (real tokens only).

        The tensors arrive as routing groups ``[G, n, ...]``; groups are contiguous runs of the
        flattened ``[B*L]`` tokens, so a reshape regroups them by sequence or into one batch.
        """
        cfg = self.config
        granularity = cfg.aux_loss_granularity
        if granularity == "group" and mask is None:
            # The unmasked per-group loss keeps its single fused formula (losses.py).
            return load_balancing_loss(
                selection, expert_index, cfg.aux_loss, scale=cfg.aux_loss_coef
            )
        slots = expert_index.shape[-1]
        if granularity == "sequence":
            shape = (batch, seq)
        elif granularity == "group":
            shape = tuple(selection.shape[:2])
        else:
            shape = (1, batch * seq)
        a = selection.reshape(*shape, -1)
        idx = expert_index.reshape(*shape, slots)
        m = None if mask is None else mask.reshape(shape)
        if granularity != "global" or not self.training:
            return masked_load_balancing_loss(a, idx, cfg.aux_loss, m, scale=cfg.aux_loss_coef)
        form = "gshard" if cfg.aux_loss == "gshard" else "eq9"
        prob_sum, load, tokens = balance_terms(a, idx, form, m)
        step_load = self._global_step_load(torch.cat([load[0], tokens]))
        e = self.num_experts
        loss = balance_loss_from_terms(
            prob_sum, step_load[None, :e], tokens, form, load_tokens=step_load[e:]
        )
        return loss * cfg.aux_loss_coef

    @torch.no_grad()
    def _global_step_load(self, counts: Tensor) -> Tensor:
        """Loads + token count ``[e + 1]`` of this optimizer step so far, over all DP ranks.

        ``counts`` (this micro-batch's) are all-reduced over the data-parallel group (a
        collective of ``e + 1`` floats, no host sync) and added to ``aux_load``, which restarts
        when the schedule's step counter has moved since its last update (maxscore's trainer
        advances it once per optimizer step): micro-batch ``m`` of a step sees the loads of
        micro-batches ``1..m`` (Megatron's ``global_aux_loss`` accumulates the same way). The
        recomputation of a checkpointed layer runs inside the backward pass; it must not add
        the micro-batch a second time, and it sees the same total as the original forward,
        which had already added it.
        """
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            counts = counts.clone()
            dist.all_reduce(counts)
        new_step = self.schedule.step != self.aux_load_step
        so_far = torch.where(new_step, torch.zeros_like(self.aux_load), self.aux_load)
        if torch._C._current_graph_task_id() != -1:  # recomputation inside backward
            return so_far
        total = so_far + counts
        self.aux_load.copy_(total)
        self.aux_load_step.copy_(self.schedule.step)
        return total

    @torch.no_grad()
    def _record_expert_load(self, expert_index: Tensor) -> None:
        """Add this training forward's tokens per expert to ``expert_load`` (the bias update's
        input).

        Under activation checkpointing the recomputation in the backward pass adds its
        micro-batch again. Every micro-batch of a checkpointed layer is recomputed, so every load
        doubles and the update, which depends on the sign of each load's difference to the mean,
        is unchanged (telling a recomputation apart would split a compiled graph).
        """
        load = assignment_matrix(expert_index, self.num_experts, torch.float32).sum(dim=(0, 1))
        self.expert_load.add_(load)

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """DeepSeek-V3 auxiliary-loss-free balancing: ``b_j -= rate · sign(load_j - mean load)``.

        Called once per optimizer step (by :meth:`advance_schedule`, or directly by a loop that
        does not use the schedule). Overloaded experts get a LOWER bias (so they are picked
        less); the authors' code has the sign inverted. ``load`` is ``expert_load``, the tokens
        per expert recorded by the training forwards since the last update; it is consumed
        (reset to 0). Under data parallelism the loads are summed over all ranks first (one
        ``e``-long all-reduce, so every rank must call this at the same point), so every rank
        applies the same update and the replicas' biases stay equal. No host sync.
        """
        load = self.expert_load
        total = load
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            total = load.clone()
            torch.distributed.all_reduce(total)
        self.expert_bias.sub_(self.config.bias_update_rate * torch.sign(total - total.mean()))
        load.zero_()
        self.expert_load_step.copy_(self.schedule.step)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"operator={c.operator!r}, strategy={c.strategy!r}, group={c.group!r}"
        )


_ROUTER_KWARGS = ("router_dtype", "check_finite", "compute_stats")


def build_router(
    router: RouterSource,
    hidden_size: int,
    num_experts: int,
    top_k: int,
    **overrides: Any,
) -> Router:
    """Build a :class:`Router` from a preset name or a config, with field overrides.

    ``overrides`` are :class:`RouterConfig` fields (e.g. ``capacity_factor=1.25``,
    ``group="tokens", group_size=1024``) or the Router options ``router_dtype``,
    ``check_finite``, ``compute_stats``. The router, its overrides and the sizes are resolved by
    :func:`~maxscore.routing.resolve.resolve_router`: unknown names, options without effect,
    ``top_k > num_experts`` and other impossible setups raise a ValueError that names the
    problem.

    Example::

        router = build_router("maxscore", hidden_size=768, num_experts=16, top_k=2)
        result = router(hidden)          # hidden: [B, L, 768]
    """
    router_kwargs = {name: overrides.pop(name) for name in _ROUTER_KWARGS if name in overrides}
    config = resolve_router(router, overrides, RouterSizes(hidden_size, num_experts, top_k))
    return Router(hidden_size, num_experts, top_k, config, **router_kwargs)


def advance_routers(module: nn.Module, n: int = 1) -> None:
    """:meth:`Router.advance_schedule` of every router in ``module``: count ``n`` finished
    optimizer steps (the SoftTopk ``t`` schedule, the DeepSeek-V3 bias update)."""
    for router in module.modules():
        if isinstance(router, Router):
            router.advance_schedule(n)


def register_router_step_hook(optimizer: torch.optim.Optimizer, module: nn.Module) -> Any:
    """Advance ``module``'s routers after every ``optimizer.step()`` (:func:`advance_routers`).

    For training loops of one's own (maxscore's trainer does the same with a callback); torchtitan
    updates its balancing biases from an optimizer-step hook in the same way. Returns the hook's
    handle (``handle.remove()`` detaches it). A step skipped by a ``GradScaler`` (inf gradients)
    does not call the hook.
    """
    return optimizer.register_step_post_hook(lambda *_: advance_routers(module))
