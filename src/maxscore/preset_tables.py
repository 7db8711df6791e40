"""The preset tables as plain data, readable without torch or transformers.

``maxscore presets`` lists the model and router presets, and ``--model`` names are checked
against the model presets before anything heavy is imported (a typo is refused at once). This
module lives beside :mod:`maxscore.cli`, not in :mod:`maxscore.models`: importing that package
imports transformers (it registers the model with the Auto classes), and importing
:mod:`maxscore.routing` imports torch.

* :data:`MODEL_PRESETS`: the model sizes. Their one home is here; :mod:`maxscore.models.presets`
  re-exports them and turns one into a ``LlamaMoEConfig`` (its docstring explains the sizes and
  the parameter-count convention).
* :data:`ROUTER_PRESET_TABLE`: the router presets (paper name, description, RouterConfig
  fields). Their one home is here; :mod:`maxscore.routing.presets` builds the
  ``RouterConfig`` values from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MODEL_PRESETS", "ROUTER_PRESET_TABLE", "ModelPreset", "RouterPresetData"]


@dataclass(frozen=True)
class ModelPreset:
    """One named model size.

    Attributes:
        fields: :class:`LlamaMoEConfig` fields of this size.
        description: one line for docs and ``--help``.
        default_router: router preset used when :func:`get_model_config` gets none.
        paper_activated / paper_total: the paper's parameter counts (``None`` if not reported).
    """

    fields: dict[str, Any]
    description: str
    default_router: str = "maxscore"
    paper_activated: int | None = None
    paper_total: int | None = None


_PAPER_COMMON: dict[str, Any] = {
    "vocab_size": 32000,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "tie_word_embeddings": False,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 2048,
}


def _paper(hidden: int, **overrides: Any) -> dict[str, Any]:
    # moe_intermediate_size is left to the config default 4 * hidden / k.
    return {**_PAPER_COMMON, "hidden_size": hidden, **overrides}


MODEL_PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset(
        fields={
            # CPU-trainable in minutes: ~1.3M non-embedding parameters; with a 32k vocabulary the
            # embeddings dominate (2 × 32000 × 128 = 8.2M), pass vocab_size from a smaller
            # tokenizer to shrink it further.
            "vocab_size": 32000,
            "hidden_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "max_position_embeddings": 1024,
        },
        description="4 layers, hidden 128, 8 experts k=2: smoke tests and CPU training",
    ),
    "base": ModelPreset(
        fields=_paper(768),
        description="paper Base: hidden 768, 16 experts k=2 (162M activated / 757M total)",
        paper_activated=162_000_000,
        paper_total=757_000_000,
    ),
    "large": ModelPreset(
        fields=_paper(1128),
        description="paper Large: hidden 1128, 16 experts k=2 (317M / 1.6B)",
        paper_activated=317_000_000,
        paper_total=1_600_000_000,
    ),
    "xl": ModelPreset(
        fields=_paper(1608),
        description="paper XL: hidden 1608, 16 experts k=2 (600M / 3.2B)",
        paper_activated=600_000_000,
        paper_total=3_200_000_000,
    ),
    "base-2x16": ModelPreset(
        fields=_paper(768),
        description="sparsity 2:16 (same as base)",
        paper_activated=162_000_000,
        paper_total=757_000_000,
    ),
    "base-2x32": ModelPreset(
        fields=_paper(768, num_experts=32),
        description="sparsity 2:32: Base with 32 experts (paper: 1475M total)",
        paper_activated=162_000_000,
        paper_total=1_475_000_000,
    ),
    "base-2x64": ModelPreset(
        fields=_paper(768, num_experts=64),
        description="sparsity 2:64: Base with 64 experts (paper: 2867M total)",
        paper_activated=162_000_000,
        paper_total=2_867_000_000,
    ),
    "base-8x128": ModelPreset(
        fields=_paper(768, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=384),
        description="fine-grained Base: 128 experts of 384, k=8 (activated as Base: 8 x 384 = "
        "2 x 1536)",
        paper_activated=162_000_000,
    ),
    "deepseek-base": ModelPreset(
        fields=_paper(
            768,
            num_experts=64,
            num_experts_per_tok=6,
            moe_intermediate_size=384,
            num_shared_experts=1,
            shared_expert_intermediate_size=768,
        ),
        description="DeepSeek-style Base: 64 experts of 384, k=6, one shared expert of 768",
        default_router="deepseek",
        paper_activated=162_000_000,
    ),
    "dense-base": ModelPreset(
        fields=_paper(768),
        description="dense Base: SwiGLU MLP of 4*768, same activated size as base",
        default_router="dense",
        paper_activated=162_000_000,
    ),
    "dense-large": ModelPreset(
        fields=_paper(1128),
        description="dense Large: SwiGLU MLP of 4*1128",
        default_router="dense",
        paper_activated=317_000_000,
    ),
    "dense-xl": ModelPreset(
        fields=_paper(1608),
        description="dense XL: SwiGLU MLP of 4*1608",
        default_router="dense",
        paper_activated=600_000_000,
    ),
}


# ------------------------------------------------------------------------------------------------
# router presets
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RouterPresetData:
    """A router preset as plain data: the paper's name for it, one line, and the
    :class:`~maxscore.routing.config.RouterConfig` fields that differ from the defaults
    (:mod:`maxscore.routing.presets` builds and checks the configs)."""

    paper_name: str
    description: str
    fields: dict[str, Any]


def _router(paper_name: str, description: str, **fields: Any) -> RouterPresetData:
    return RouterPresetData(paper_name, description, fields)


_PAPER_AUX = 1e-2  # λ of Eq. 9 for every router but DeepSeek (Sec. 4, "Hyperparameters")
_DEEPSEEK_AUX = 1e-3

# Routing groups follow the authors' public code: capacity per 512-token sequence for the MaxScore
# family (MaxScore, MaxScore-I and the flow ablation GShard-M), per micro-batch for the baselines.
# The flow presets keep RouterConfig's flow_method="auto": the GPU global solver on CUDA, the
# exact solver on the CPU (routing/flow/choice.py); Algorithm 1 is
# flow_method="two-stage-sinkhorn"; the authors' two-stage code is "two-stage-authors", our
# capacity-limited variant of it "two-stage-score-exact" (routing/flow/two_stage.py).
#: Preset name -> :class:`RouterPresetData`, in the order ``maxscore presets`` lists them.
ROUTER_PRESET_TABLE: dict[str, RouterPresetData] = {
    "dense": _router(
        "Dense",
        "no router: the layer is a dense SwiGLU MLP of the same activated size",
        strategy="dense",
        aux_loss="none",
        aux_loss_coef=0.0,
    ),
    "gshard": _router(
        "GShard",
        "softmax + top-k with capacity (factor 1.0), overflow dropped by position",
        operator="softmax",
        strategy="topk",
        group="batch",
    ),
    "gshard-i": _router(
        "GShard-I",
        "GShard + iterative rerouting of dropped slots (Switch Transformers)",
        operator="softmax",
        strategy="topk-reroute",
        group="batch",
    ),
    "gshard-s": _router(
        "GShard-S",
        "ablation: SoftTopk operator + top-k with capacity",
        operator="softtopk",
        strategy="topk",
        group="batch",
    ),
    "gshard-m": _router(
        "GShard-M",
        "ablation: softmax + min-cost max-flow assignment (Eq. 7-8)",
        operator="softmax",
        strategy="min-cost-flow",
        group="sequence",
    ),
    "sbase": _router(
        "SBASE",
        "softmax + Sinkhorn optimal transport (balanced assignment)",
        operator="softmax",
        strategy="sinkhorn",
        group="batch",
    ),
    "expert-choice": _router(
        "ExpertChoice",
        "softmax + each expert takes its top-c tokens (non-causal in training)",
        operator="softmax",
        strategy="expert-choice",
        group="batch",
    ),
    "dropless": _router(
        "DropLess",
        "softmax + top-k without capacity (MegaBlocks / OLMoE)",
        operator="softmax",
        strategy="dropless",
        group="batch",
    ),
    "deepseek": _router(
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
    "maxscore-i": _router(
        "MaxScore-I",
        "SoftTopk + top-k with capacity + iterative rerouting",
        operator="softtopk",
        strategy="topk-reroute",
        group="sequence",
    ),
    "maxscore": _router(
        "MaxScore",
        "SoftTopk + min-cost max-flow assignment (Eq. 7-8, Algorithm 1 / global solver)",
        operator="softtopk",
        strategy="min-cost-flow",
        group="sequence",
    ),
    "deepseek-v3": _router(
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
