"""Every router variant of the paper, by name (paper Tables 3-5).

A preset is plain data (:data:`maxscore.preset_tables.ROUTER_PRESET_TABLE`, readable without
torch): a :class:`~maxscore.routing.config.RouterConfig` (operator, strategy, capacity, routing
group, loss, options) plus a description and the name the paper uses; here each becomes a checked
``RouterConfig``. The router builds itself from the config; nothing branches on the preset name.

Routing groups follow the authors' public code: capacity per 512-token *sequence* for the
MaxScore family (MaxScore, MaxScore-I and the flow ablation GShard-M, whose solver works per
sequence), per *micro-batch* for the baselines. Override ``group`` to compare like with like.
See ``docs/routing.md`` for the table.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from maxscore.preset_tables import ROUTER_PRESET_TABLE
from maxscore.routing.config import RouterConfig

__all__ = ["ROUTER_PRESETS", "RouterPreset", "get_router_config"]


@dataclass(frozen=True)
class RouterPreset:
    """A named router: its config, a one-line description and the paper's name for it."""

    config: RouterConfig
    description: str
    paper_name: str


def _presets() -> dict[str, RouterPreset]:
    return {
        name: RouterPreset(
            RouterConfig(**copy.deepcopy(data.fields)), data.description, data.paper_name
        )
        for name, data in ROUTER_PRESET_TABLE.items()
    }


#: Preset name -> :class:`RouterPreset`. The keys are the names users pass as ``router=...``.
ROUTER_PRESETS: dict[str, RouterPreset] = _presets()


def get_router_config(router: str | RouterConfig, **overrides: Any) -> RouterConfig:
    """The one place a router is resolved: a preset name or a config becomes a RouterConfig.

    ``router`` is a preset name (a fresh copy of its config is taken) or a
    :class:`RouterConfig` (copied by the overrides, returned as is without any). ``overrides``
    are RouterConfig fields; unknown preset names and fields raise a ValueError that lists the
    known ones, and the resulting config checks its own values (``RouterConfig.__post_init__``).
    The router, the MoE layer, the Llama-MoE model config and the trainer all resolve through
    here.
    """
    if isinstance(router, RouterConfig):
        return router.with_overrides(**overrides) if overrides else router
    if not isinstance(router, str):
        raise TypeError(f"a router is a preset name or a RouterConfig, got {type(router).__name__}")
    try:
        preset = ROUTER_PRESETS[router]
    except KeyError:
        raise ValueError(
            f"unknown router preset {router!r}; known presets: {sorted(ROUTER_PRESETS)}"
        ) from None
    return copy.deepcopy(preset.config).with_overrides(**overrides)
