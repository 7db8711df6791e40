"""Typed configuration of a router: which operator, which strategy, which loss, which options.

A :class:`RouterConfig` is plain, frozen data that checks its own values when it is made
(types and ``Literal`` choices from its annotations, ranges from each field's ``rules``:
:func:`maxscore.config_types.check_fields`). What depends on the registries (operator, strategy
and flow-solver names), on the chosen strategy (options it ignores) or on a layer's sizes is
checked where a router is resolved, :func:`maxscore.routing.resolve.resolve_router`: this module
imports nothing of the routing package, the registries read it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from maxscore.config_types import at_least, check_fields, greater_than

__all__ = [
    "AuxLossForm",
    "AuxLossGranularity",
    "DropPolicy",
    "EvalRouting",
    "GroupMode",
    "RouterConfig",
    "ScheduleShape",
    "TemperatureScheduleConfig",
]

DropPolicy = Literal["position", "score"]
GroupMode = Literal["sequence", "tokens", "batch"]
AuxLossForm = Literal["gshard", "eq9", "none"]
AuxLossGranularity = Literal["group", "sequence", "micro-batch", "global"]
EvalRouting = Literal["causal", "train"]
ScheduleShape = Literal["linear", "cosine", "constant"]


def _known_keys(cls: type, data: dict[str, Any], what: str) -> None:
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"unknown {what} key(s) {unknown}; known keys: {known}")


@dataclass(frozen=True)
class TemperatureScheduleConfig:
    """Schedule of the SoftTopk scale ``t`` (Eq. "SoftTopk"), advanced once per optimizer step.

    The default reproduces the authors' public code: for k = 2 the second expert's weight is
    multiplied by ``1 + t``, with ``t`` going linearly from 3 to 0 over 30,000 steps (their
    factor 4 -> 1). The paper's text quotes "t0 = 4 decaying to 1"; taken literally in the
    equation that is factor 5 -> 2, so we follow the code's effective weights.
    """

    start: float = 3.0
    end: float = 0.0
    steps: int = field(default=30_000, metadata={"rules": (at_least(0),)})
    shape: ScheduleShape = "linear"

    def __post_init__(self) -> None:
        check_fields(self, "temperature schedule")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TemperatureScheduleConfig:
        """From ``{"start": 3.0, "end": 0.0, "steps": 30000, "shape": "linear"}`` (any subset)."""
        _known_keys(cls, data, "temperature schedule")
        return cls(**data)


@dataclass(frozen=True)
class RouterConfig:
    """Everything that defines a router, apart from the layer sizes.

    Attributes:
        operator: affinity operator name (``maxscore.routing.operators.AFFINITY_OPERATORS``).
        strategy: assignment strategy name (``maxscore.routing.strategies.ASSIGNMENT_STRATEGIES``);
            ``"dense"`` means no router at all (the layer is a dense MLP).
        capacity_factor: expert capacity ``c = ceil(capacity_factor * k * n / e)`` per routing
            group (strategies with a capacity only; :mod:`maxscore.routing.resolve` refuses it
            for the others).
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
            CUDA, the exact solver on the CPU (:mod:`maxscore.routing.flow.choice`).
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
    capacity_factor: float = field(default=1.0, metadata={"rules": (greater_than(0),)})
    min_capacity: int = field(default=1, metadata={"rules": (at_least(0),)})
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
    bias_update_rate: float = field(default=0.0, metadata={"rules": (at_least(0),)})
    eval_routing: EvalRouting = "causal"

    def __post_init__(self) -> None:
        if isinstance(self.temperature, dict):  # from JSON, YAML or a KEY=VALUE flag
            object.__setattr__(
                self, "temperature", TemperatureScheduleConfig.from_dict(self.temperature)
            )
        check_fields(self, "router config")
        if self.group == "tokens" and (self.group_size is None or self.group_size < 1):
            raise ValueError("group='tokens' needs group_size >= 1 (tokens per routing group)")
        if self.num_expert_groups < 1 or not 1 <= self.topk_groups <= self.num_expert_groups:
            raise ValueError(
                "need num_expert_groups >= 1 and 1 <= topk_groups <= num_expert_groups, got "
                f"{self.num_expert_groups} and {self.topk_groups}"
            )

    @property
    def is_dense(self) -> bool:
        """True for the ``"dense"`` preset: no router, the layer is a dense MLP."""
        return self.strategy == "dense"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RouterConfig:
        """From RouterConfig fields (a saved config; missing fields take the defaults)."""
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(
                f"unknown router option {sorted(unknown)[0]!r}; valid options: "
                f"{sorted(f.name for f in fields(cls))}"
            )
        return cls(**data)
