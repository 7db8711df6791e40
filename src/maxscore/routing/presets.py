"""Every router variant of the paper, by name (paper Tables 3-5).

A preset is plain data (:data:`maxscore.preset_tables.ROUTER_PRESET_TABLE`, readable without
torch): a :class:`~maxscore.routing.config.RouterConfig` (operator, strategy, capacity, routing
group, loss, options) plus a description and the name the paper uses; here each becomes a
``RouterConfig``. A preset name becomes a router's config in one place,
:func:`maxscore.routing.resolve.resolve_router`; nothing branches on the preset name.

Routing groups follow the authors' public code: capacity per 512-token *sequence* for the
MaxScore family (MaxScore, MaxScore-I and the flow ablation GShard-M, whose solver works per
sequence), per *micro-batch* for the baselines. Override ``group`` to compare like with like.
See ``docs/routing.md`` for the table.
"""

from __future__ import annotations

from dataclasses import dataclass

from maxscore.preset_tables import ROUTER_PRESET_TABLE
from maxscore.routing.config import RouterConfig

__all__ = ["ROUTER_PRESETS", "RouterPreset"]


@dataclass(frozen=True)
class RouterPreset:
    """A named router: its config, a one-line description and the paper's name for it."""

    config: RouterConfig
    description: str
    paper_name: str


#: Preset name -> :class:`RouterPreset`. The keys are the names users pass as ``router=...``.
ROUTER_PRESETS: dict[str, RouterPreset] = {
    name: RouterPreset(RouterConfig(**data.fields), data.description, data.paper_name)
    for name, data in ROUTER_PRESET_TABLE.items()
}
