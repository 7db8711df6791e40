"""maxscore.routing: affinity operators, assignment strategies, flow solvers, losses, the Router.

Public API::

    from maxscore.routing import build_router, min_cost_flow_assignment

    router = build_router("maxscore", hidden_size=768, num_experts=16, top_k=2)
    result = router(hidden)                    # RoutingResult: expert_index, combine_weights, ...
    idx = min_cost_flow_assignment(affinities, k=2, capacity=64, method="exact")

See ``docs/routing.md`` for the preset table and ``docs/ARCHITECTURE.md`` for the contracts.
Names are imported on first use, so :mod:`maxscore.routing.config` (plain data) loads without
torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from maxscore._lazy import lazy_exports

if TYPE_CHECKING:
    from maxscore.routing.config import RouterConfig, TemperatureScheduleConfig
    from maxscore.routing.flow import (
        FLOW_SOLVERS,
        flow_objective,
        min_cost_flow_assignment,
    )
    from maxscore.routing.groups import expert_capacity, split_into_groups
    from maxscore.routing.losses import load_balancing_loss, router_z_loss
    from maxscore.routing.operators import (
        AFFINITY_OPERATORS,
        AffinityOperator,
        OperatorSpec,
        get_operator,
        get_operator_spec,
        gradtopk_affinity,
        itertopk_affinity,
        relu_affinity,
        sigmoid_affinity,
        softkmax_affinity,
        softmax_affinity,
        softtopk_affinity,
    )
    from maxscore.routing.presets import ROUTER_PRESETS, RouterPreset
    from maxscore.routing.resolve import RouterSizes, resolve_router
    from maxscore.routing.router import (
        Router,
        advance_routers,
        build_router,
        register_router_step_hook,
    )
    from maxscore.routing.schedule import TemperatureSchedule
    from maxscore.routing.statistics import routing_statistics
    from maxscore.routing.strategies import (
        ASSIGNMENT_STRATEGIES,
        StrategySpec,
        get_strategy,
    )
    from maxscore.routing.types import DROPPED, RoutingResult

_EXPORTS = {
    "maxscore.routing.config": ("RouterConfig", "TemperatureScheduleConfig"),
    "maxscore.routing.flow": ("FLOW_SOLVERS", "flow_objective", "min_cost_flow_assignment"),
    "maxscore.routing.groups": ("expert_capacity", "split_into_groups"),
    "maxscore.routing.losses": ("load_balancing_loss", "router_z_loss"),
    "maxscore.routing.operators": (
        "AFFINITY_OPERATORS",
        "AffinityOperator",
        "OperatorSpec",
        "get_operator",
        "get_operator_spec",
        "gradtopk_affinity",
        "itertopk_affinity",
        "relu_affinity",
        "sigmoid_affinity",
        "softkmax_affinity",
        "softmax_affinity",
        "softtopk_affinity",
    ),
    "maxscore.routing.presets": ("ROUTER_PRESETS", "RouterPreset"),
    "maxscore.routing.resolve": ("RouterSizes", "resolve_router"),
    "maxscore.routing.router": (
        "Router",
        "advance_routers",
        "build_router",
        "register_router_step_hook",
    ),
    "maxscore.routing.schedule": ("TemperatureSchedule",),
    "maxscore.routing.statistics": ("routing_statistics",),
    "maxscore.routing.strategies": ("ASSIGNMENT_STRATEGIES", "StrategySpec", "get_strategy"),
    "maxscore.routing.types": ("DROPPED", "RoutingResult"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = [
    "AFFINITY_OPERATORS",
    "ASSIGNMENT_STRATEGIES",
    "DROPPED",
    "FLOW_SOLVERS",
    "ROUTER_PRESETS",
    "AffinityOperator",
    "OperatorSpec",
    "Router",
    "RouterConfig",
    "RouterPreset",
    "RouterSizes",
    "RoutingResult",
    "StrategySpec",
    "TemperatureSchedule",
    "TemperatureScheduleConfig",
    "advance_routers",
    "build_router",
    "expert_capacity",
    "flow_objective",
    "get_operator",
    "get_operator_spec",
    "get_strategy",
    "gradtopk_affinity",
    "itertopk_affinity",
    "load_balancing_loss",
    "min_cost_flow_assignment",
    "register_router_step_hook",
    "relu_affinity",
    "resolve_router",
    "router_z_loss",
    "routing_statistics",
    "sigmoid_affinity",
    "softkmax_affinity",
    "softmax_affinity",
    "softtopk_affinity",
    "split_into_groups",
]
