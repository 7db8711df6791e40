"""Resolving a router: the one place a router's description becomes a checked RouterConfig.

Every entry point resolves through :func:`resolve_router`: the Llama-MoE model config (and with
it ``maxscore train``'s ``--router`` / ``--router-option`` and ``from_pretrained``),
:func:`~maxscore.routing.router.build_router` and the :class:`~maxscore.moe.MoE` layer. It takes

* where the router comes from: a preset name (:data:`~maxscore.routing.presets.ROUTER_PRESETS`),
  a mapping of RouterConfig fields (a saved config) or a :class:`RouterConfig`;
* ``overrides``: the fields a user changes (``--router-option``, ``capacity_factor=1.25``);
* ``sizes``: the layer the router is for (:class:`RouterSizes`), when known,

and checks, in order: unknown option names, the values (the config checks its own types and
ranges when it is made: :func:`maxscore.config_types.check_fields`), the registered names
(operator, strategy, flow solver), that every override has an effect for the chosen router
(:func:`ineffective_options`), then the layer's sizes and the strategy's own setup check. Every
problem is a ValueError that says what is wrong and what to do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from maxscore.routing.config import RouterConfig
from maxscore.routing.flow import FLOW_SOLVERS
from maxscore.routing.flow.choice import AUTO
from maxscore.routing.operators import get_operator_spec
from maxscore.routing.presets import ROUTER_PRESETS
from maxscore.routing.strategies import ASSIGNMENT_STRATEGIES, get_strategy

__all__ = [
    "RouterSizes",
    "RouterSource",
    "ineffective_options",
    "preset_config",
    "resolve_router",
    "strategy_options",
]

#: Where a router comes from: a preset name, RouterConfig fields, or a RouterConfig.
RouterSource = str | Mapping[str, Any] | RouterConfig


@dataclass(frozen=True)
class RouterSizes:
    """The sizes of the layer a router is for: ``D``, ``e`` and ``k`` (checked when made)."""

    hidden_size: int
    num_experts: int
    top_k: int

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k={self.top_k} exceeds num_experts={self.num_experts}: a token cannot use "
                "more experts than exist"
            )


def strategy_options() -> frozenset[str]:
    """The RouterConfig fields that only some strategies read (``StrategySpec.options``)."""
    return frozenset().union(*(spec.options for spec in ASSIGNMENT_STRATEGIES.values()))


def ineffective_options(config: RouterConfig) -> dict[str, str]:
    """``{field: why it has no effect}`` for the fields ``config``'s router never reads.

    Strategy options (capacity, drop policy, solver, expert groups) act only for the strategies
    that list them; ``group_size`` only with ``group="tokens"``. (The SoftTopk ``t`` schedule is
    not among them: a training run writes its length into every router's config.)
    """
    read = frozenset() if config.is_dense else get_strategy(config.strategy).options
    out = {}
    for name in sorted(strategy_options() - read):
        users = sorted(s for s, spec in ASSIGNMENT_STRATEGIES.items() if name in spec.options)
        only = f"only {users[0]} does" if len(users) == 1 else f"only {', '.join(users)} do"
        out[name] = f"the {config.strategy!r} strategy does not use it ({only})"
    if config.group != "tokens":
        out["group_size"] = f"group={config.group!r} does not use it (only group='tokens' does)"
    return out


def preset_config(name: str) -> RouterConfig:
    """The config of router preset ``name`` (shared, frozen), or a ValueError listing them."""
    try:
        return ROUTER_PRESETS[name].config
    except KeyError:
        raise ValueError(
            f"unknown router preset {name!r}; known presets: {sorted(ROUTER_PRESETS)}"
        ) from None


def _base(router: RouterSource) -> RouterConfig:
    if isinstance(router, RouterConfig):
        return router
    if isinstance(router, str):
        return preset_config(router)
    if isinstance(router, Mapping):
        return RouterConfig.from_dict(dict(router))
    raise TypeError(
        "a router is a preset name, a mapping of RouterConfig fields or a RouterConfig, got "
        f"{type(router).__name__}"
    )


def _check_names(config: RouterConfig) -> None:
    get_operator_spec(config.operator)
    if not config.is_dense:
        get_strategy(config.strategy)
    if config.flow_method != AUTO and config.flow_method not in FLOW_SOLVERS:
        raise ValueError(
            f"unknown flow_method {config.flow_method!r}; known: {[AUTO, *sorted(FLOW_SOLVERS)]}"
        )


def _check_effect(config: RouterConfig, base: RouterConfig, overrides: Mapping[str, Any]) -> None:
    """Refuse an override that changes a field the resolved router never reads."""
    unused = ineffective_options(config)
    for name in overrides:
        if name in unused and getattr(config, name) != getattr(base, name):
            raise ValueError(
                f"router option {name}={getattr(config, name)!r} has no effect: {unused[name]}; "
                "remove it, or choose a router that uses it"
            )


def _check_setup(config: RouterConfig, sizes: RouterSizes) -> None:
    if not config.is_dense:  # a dense layer has no router to fit (the Router refuses one)
        get_strategy(config.strategy).validate(config, sizes.num_experts, sizes.top_k)


def resolve_router(
    router: RouterSource,
    overrides: Mapping[str, Any] | None = None,
    sizes: RouterSizes | None = None,
) -> RouterConfig:
    """The checked :class:`RouterConfig` of ``router`` with ``overrides`` (module docstring).

    A preset's config is shared, frozen data; overrides make a new one. Raises ValueError naming
    the problem (unknown preset or option, a bad value, an option without effect for this
    router, sizes the router cannot route) and TypeError for a ``router`` of another type.
    """
    base = _base(router)
    overrides = dict(overrides or {})
    known = sorted(f.name for f in fields(RouterConfig))
    for name in overrides:
        if name not in known:
            raise ValueError(f"unknown router option {name!r}; valid options: {known}")
    config = replace(base, **overrides) if overrides else base
    _check_names(config)
    _check_effect(config, base, overrides)
    if sizes is not None:
        _check_setup(config, sizes)
    return config
