"""Every router variant of the paper, by name (paper Tables 3-5).

A preset is plain data: a :class:`~maxscore.routing.config.RouterConfig` (operator, strategy,
capacity, routing group, loss, options) plus a description and the name the paper uses. The
router builds itself from the config; nothing branches on the preset name.

Routing groups follow the authors' public code: capacity per 512-token *sequence* for the
MaxScore family (MaxScore, MaxScore-I and the flow ablation GShard-M, whose solver works per
sequence), per *micro-batch* for the baselines. Override ``group`` to compare like with like.
See ``docs/routing.md`` for the table.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from maxscore.routing.config import RouterConfig

__all__ = ["ROUTER_PRESETS", "RouterPreset", "get_router_config"]


@dataclass(frozen=True)
class RouterPreset:
    """A named router: its config, a one-line description and the paper's name for it."""

    config: RouterConfig
    description: str
    paper_name: str


_PAPER_AUX = 1e-2  # λ of Eq. 9 for every router but DeepSeek (Sec. 4, "Hyperparameters")
_DEEPSEEK_AUX = 1e-3


def _presets() -> dict[str, RouterPreset]:
    # The flow presets keep RouterConfig's flow_method="auto": the GPU global solver on CUDA, the
    # exact solver on the CPU (strategies.resolve_flow_method); Algorithm 1 is
    # flow_method="two-stage-sinkhorn"; the authors' two-stage code is "two-stage-authors", our
    # capacity-limited variant of it "two-stage-score-exact" (routing/flow/two_stage.py).

    def preset(paper_name: str, description: str, **cfg: Any) -> RouterPreset:
        return RouterPreset(RouterConfig(**cfg), description, paper_name)

    return {
        "dense": preset(
            "Dense",
            "no router: the layer is a dense SwiGLU MLP of the same activated size",
            strategy="dense",
            aux_loss="none",
            aux_loss_coef=0.0,
        ),
        "gshard": preset(
            "GShard",
            "softmax + top-k with capacity (factor 1.0), overflow dropped by position",
            operator="softmax",
            strategy="topk",
            group="batch",
        ),
        "gshard-i": preset(
            "GShard-I",
            "GShard + iterative rerouting of dropped slots (Switch Transformers)",
            operator="softmax",
            strategy="topk-reroute",
            group="batch",
        ),
        "gshard-s": preset(
            "GShard-S",
            "ablation: SoftTopk operator + top-k with capacity",
            operator="softtopk",
            strategy="topk",
            group="batch",
        ),
        "gshard-m": preset(
            "GShard-M",
            "ablation: softmax + min-cost max-flow assignment (Eq. 7-8)",
            operator="softmax",
            strategy="min-cost-flow",
            group="sequence",
        ),
        "sbase": preset(
            "SBASE",
            "softmax + Sinkhorn optimal transport (balanced assignment)",
            operator="softmax",
            strategy="sinkhorn",
            group="batch",
        ),
        "expert-choice": preset(
            "ExpertChoice",
            "softmax + each expert takes its top-c tokens (non-causal in training)",
            operator="softmax",
            strategy="expert-choice",
            group="batch",
        ),
        "dropless": preset(
            "DropLess",
            "softmax + top-k without capacity (MegaBlocks / OLMoE)",
            operator="softmax",
            strategy="dropless",
            group="batch",
        ),
        "deepseek": preset(
            "DeepSeek",
            "DeepSeek-V2: softmax + group-limited top-k (8 expert groups, best 3), dropless; "
            "use with fine-grained + shared experts (paper: e=64, k=6, one 2x shared expert)",
            operator="softmax",
            strategy="group-limited",
            num_expert_groups=8,
            topk_groups=3,
            aux_loss_coef=_DEEPSEEK_AUX,
            group="batch",
        ),
        "maxscore-i": preset(
            "MaxScore-I",
            "SoftTopk + top-k with capacity + iterative rerouting",
            operator="softtopk",
            strategy="topk-reroute",
            group="sequence",
        ),
        "maxscore": preset(
            "MaxScore",
            "SoftTopk + min-cost max-flow assignment (Eq. 7-8, Algorithm 1 / global solver)",
            operator="softtopk",
            strategy="min-cost-flow",
            group="sequence",
        ),
        "deepseek-v3": preset(
            "DeepSeek-V3 (extra)",
            "sigmoid + dropless top-k on scores + an fp32 balancing bias (auxiliary-loss-free, "
            "rate 1e-3), weights renormalised over the selected experts, tiny sequence-wise aux",
            operator="sigmoid",
            strategy="dropless",
            normalize_weights=True,
            bias_update_rate=1e-3,
            aux_loss_coef=1e-4,
            group="sequence",
        ),
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
