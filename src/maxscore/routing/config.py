"""Typed configuration of a router: which operator, which strategy, which loss, which options.

A :class:`RouterConfig` is plain data. Presets (:mod:`maxscore.routing.presets`) are named
``RouterConfig`` values; :class:`~maxscore.routing.router.Router` builds itself from one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal

from maxscore.config_types import check_dataclass_types

DropPolicy = Literal["position", "score"]
GroupMode = Literal["sequence", "tokens", "batch"]
AuxLossForm = Literal["gshard", "eq9", "none"]
AuxLossGranularity = Literal["group", "sequence", "micro-batch", "global"]
AUX_LOSS_GRANULARITIES: tuple[str, ...] = ("group", "sequence", "micro-batch", "global")
EvalRouting = Literal["causal", "train"]
ScheduleShape = Literal["linear", "cosine", "constant"]


@dataclass
class TemperatureScheduleConfig:
    """Schedule of the SoftTopk scale ``t`` (Eq. "SoftTopk"), advanced once per optimizer step.

    The default reproduces the authors' public code: for k = 2 the second expert's weight is
    multiplied by ``1 + t``, with ``t`` going linearly from 3 to 0 over 30,000 steps (their
    factor 4 -> 1). The paper's text quotes "t0 = 4 decaying to 1"; taken literally in the
    equation that is factor 5 -> 2, so we follow the code's effective weights.
    """

    start: float = 3.0
    end: float = 0.0
    steps: int = 30_000
    shape: ScheduleShape = "linear"

    def __post_init__(self) -> None:
        check_dataclass_types(self, "temperature schedule")
        if self.steps < 0:
            raise ValueError(f"temperature schedule steps must be >= 0, got {self.steps}")
        if self.shape not in ("linear", "cosine", "constant"):
            raise ValueError(
                f"unknown temperature schedule shape {self.shape!r}; "
                "use 'linear', 'cosine' or 'constant'"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TemperatureScheduleConfig:
        """From ``{"start": 3.0, "end": 0.0, "steps": 30000, "shape": "linear"}`` (any subset)."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"unknown temperature schedule key(s) {unknown}; known keys: {known}")
        return cls(**data)


@dataclass
class RouterConfig:
    """Everything that defines a router, apart from the layer sizes.

    Attributes:
        operator: affinity operator name (``maxscore.routing.operators.AFFINITY_OPERATORS``).
        strategy: assignment strategy name (``maxscore.routing.strategies.ASSIGNMENT_STRATEGIES``);
            ``"dense"`` means no router at all (the layer is a dense MLP).
        capacity_factor: expert capacity ``c = ceil(capacity_factor * k * n / e)`` per routing
            group; ignored by strategies without capacity (dropless).
        min_capacity: lower bound on ``c``.
        drop_policy: which slots a full expert keeps: ``"position"`` (all first choices before
            any second choice, each in token order: first come, first served) or ``"score"``
            (highest affinity first). Neither is causal for k >= 2 (a later token's first
            choice can displace an earlier token's second), hence causal evaluation routing.
        group: routing group over which capacity is defined: one ``"sequence"``, a fixed number
            of ``"tokens"`` (``group_size``), or the whole micro-``"batch"``.
        group_size: tokens per group when ``group == "tokens"``.
        aux_loss: ``"gshard"`` (default; ``e * sum_j mean_i A_ij * f_j`` with f the top-1 load
            fraction, equal to 1 at perfect balance) or ``"eq9"`` (the paper's Eq. 9 as printed,
            ``(1/e) * sum_j mean_i A_ij * mean_i P_ij``), or ``"none"``.
        aux_loss_coef: λ, multiplied into the returned aux loss (paper: 1e-2; 1e-3 DeepSeek).
        aux_loss_granularity: over which tokens the load-balancing loss measures balance:
            ``"group"`` (default: each routing group, as capacity), ``"sequence"`` (each
            sequence, averaged over sequences: DeepSeek-V3's sequence-wise loss),
            ``"micro-batch"`` (all tokens of the forward call, as transformers' MoE models) or
            ``"global"`` (the expert loads ``f`` are summed over data-parallel ranks and over
            the micro-batches of the current optimizer step, the mean affinities stay local:
            the global-batch loss of Qwen and Megatron's ``global_aux_loss``). Padding never
            counts. In ``eval()`` mode ``"global"`` is measured per micro-batch.
        z_loss_coef: router z-loss coefficient (0 disables it).
        temperature: SoftTopk ``t`` schedule (only used by operators that take ``t``).
        normalize_weights: renormalise combine weights over a token's selected experts
            (DeepSeek-V3 style); the paper's routers do not.
        sinkhorn_iterations: iterations of Sinkhorn (SBASE and the two-stage flow solver).
        flow_method: min-cost-flow solver used by the ``"min-cost-flow"`` strategy
            (``maxscore.routing.flow.FLOW_SOLVERS``), or ``"auto"``: the GPU global solver on
            CUDA, the exact solver on the CPU.
        num_expert_groups / topk_groups: group-limited routing (DeepSeek): experts are split
            into ``num_expert_groups`` groups and each token may only use its ``topk_groups``
            best groups.
        bias_update_rate: DeepSeek-V3 auxiliary-loss-free balancing: a per-expert fp32 bias is
            added to the selection scores (not to the weights) and, in training, moved by this
            rate against the load error (overloaded experts go DOWN). 0 disables it.
        eval_routing: routing used in eval mode: ``"causal"`` (default; top-k without capacity,
            so no token's experts depend on later tokens) or ``"train"`` (same as training).
    """

    operator: str = "softmax"
    strategy: str = "topk"
    capacity_factor: float = 1.0
    min_capacity: int = 1
    drop_policy: DropPolicy = "position"
    group: GroupMode = "sequence"
    group_size: int | None = None
    aux_loss: AuxLossForm = "gshard"
    aux_loss_coef: float = 1e-2
    aux_loss_granularity: AuxLossGranularity = "group"
    z_loss_coef: float = 0.0
    temperature: TemperatureScheduleConfig = field(default_factory=TemperatureScheduleConfig)
    normalize_weights: bool = False
    sinkhorn_iterations: int = 8
    flow_method: str = "auto"
    num_expert_groups: int = 1
    topk_groups: int = 1
    bias_update_rate: float = 0.0
    eval_routing: EvalRouting = "causal"

    def __post_init__(self) -> None:
        if isinstance(self.temperature, dict):
            self.temperature = TemperatureScheduleConfig.from_dict(self.temperature)
        check_dataclass_types(self, "router config")
        if self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0, got {self.capacity_factor}")
        if self.min_capacity < 0:
            raise ValueError(f"min_capacity must be >= 0, got {self.min_capacity}")
        if self.drop_policy not in ("position", "score"):
            raise ValueError(f"drop_policy must be 'position' or 'score', got {self.drop_policy!r}")
        if self.group not in ("sequence", "tokens", "batch"):
            raise ValueError(f"group must be 'sequence', 'tokens' or 'batch', got {self.group!r}")
        if self.group == "tokens" and (self.group_size is None or self.group_size < 1):
            raise ValueError("group='tokens' needs group_size >= 1 (tokens per routing group)")
        if self.aux_loss not in ("gshard", "eq9", "none"):
            raise ValueError(f"aux_loss must be 'gshard', 'eq9' or 'none', got {self.aux_loss!r}")
        if self.eval_routing not in ("causal", "train"):
            raise ValueError(f"eval_routing must be 'causal' or 'train', got {self.eval_routing!r}")
        if self.aux_loss_granularity not in AUX_LOSS_GRANULARITIES:
            raise ValueError(
                f"aux_loss_granularity must be one of {', '.join(AUX_LOSS_GRANULARITIES)}, "
                f"got {self.aux_loss_granularity!r}"
            )
        if self.num_expert_groups < 1 or not 1 <= self.topk_groups <= self.num_expert_groups:
            raise ValueError(
                "need num_expert_groups >= 1 and 1 <= topk_groups <= num_expert_groups, got "
                f"{self.num_expert_groups} and {self.topk_groups}"
            )
        if self.bias_update_rate < 0:
            raise ValueError(f"bias_update_rate must be >= 0, got {self.bias_update_rate}")
        self._check_registered_names()

    def _check_registered_names(self) -> None:
        """``operator``, ``strategy`` and ``flow_method`` name registered entries.

        The registries are imported here, not at module level: they import torch, and they
        import this module (a strategy's functions take a ``RouterConfig``).
        """
        from maxscore.routing.operators import get_operator_spec
        from maxscore.routing.strategies import get_strategy

        get_operator_spec(self.operator)
        if not self.is_dense:
            get_strategy(self.strategy)
        if self.flow_method != "auto":
            from maxscore.routing.flow import FLOW_SOLVERS

            if self.flow_method not in FLOW_SOLVERS:
                raise ValueError(
                    f"unknown flow_method {self.flow_method!r}; known: "
                    f"{['auto', *sorted(FLOW_SOLVERS)]}"
                )

    @property
    def is_dense(self) -> bool:
        return self.strategy == "dense"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RouterConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                f"unknown router config field(s) {sorted(unknown)}; known fields: {sorted(known)}"
            )
        return cls(**data)

    def with_overrides(self, **overrides: Any) -> RouterConfig:
        """A copy with some fields replaced (unknown names raise)."""
        known = {f.name for f in fields(self)}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(
                f"unknown router option(s) {sorted(unknown)}; known options: {sorted(known)}"
            )
        return replace(self, **overrides)  # __post_init__ converts and checks the values
