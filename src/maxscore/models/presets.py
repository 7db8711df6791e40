"""Model size presets: the paper's Llama-MoE family as data.

Every paper size has 12 layers, 12 heads, vocabulary 32,000, untied embeddings, 16 experts with
k = 2 and expert FFN width ``4 * hidden / k``. :func:`get_model_config` turns a preset plus a router
preset name into a :class:`~maxscore.models.configuration_llama_moe.LlamaMoEConfig`.

Parameter-count convention (checked against the paper's table in ``tests/test_model_presets.py``):
*every* parameter counts, including the input embedding **and** the untied LM head (2 × 32,000 ×
hidden) and the router gates; "activated" counts each MoE layer's routed experts ``k / e`` times.
With that convention Base is 162.6M activated / 757.1M total (paper 162M / 757M), Large 316.6M /
1.600B (317M / 1.6B), XL 599.4M / 3.206B (600M / 3.2B).

The paper's 2:32 (1475M) and 2:64 (2867M) totals cannot both be reproduced by this architecture:
going from 16 to 32 experts adds 192 experts (12 layers × 16) of ``3 * 768 * 1536`` = 3.54M
parameters each, i.e. 679.5M, giving 1436.6M for 2:32 and 2795.6M for 2:64 (-2.6% / -2.5%). The
paper's three totals are not even linear in the number of experts (757 → 1475 implies 3.74M per
added expert, 1475 → 2867 implies 3.63M), so no single expert size matches them all; we keep the
stated architecture and record the gap.

DeepSeek (``deepseek-base``): 64 fine-grained experts, k = 6, one shared expert of double size.
We pick the expert width so the *activated* FFN equals Base's: 6 routed + 1 shared of double size =
8 units of ``F``, and Base activates 2 × 1536 = 3072, so ``F = 384`` and the shared expert is 768
wide (this is DeepSeekMoE's fine-grained segmentation of Base's 16 × 1536 experts into 64 × 384).
Activated = Base's 162.6M; total = Base + one 768-wide shared expert per layer = 778.3M.

Fine-grained (``base-8x128``): 128 experts, k = 8, the granularity of today's frontier MoEs
(Qwen3-MoE: 128 experts, k = 8). Expert width 384 keeps the activated FFN at Base's 8 × 384 =
2 × 1536 = 3072, so activated = 163.6M (Base's 162.6M plus the 8 times wider router gate);
total 1.438B (the routed width per layer is 128 × 384, four times Base's 16 × 1536).

Dense baselines (``dense-*``) use one SwiGLU MLP of width ``4 * hidden`` = ``k * 4 * hidden / k``,
so their parameters equal the MoE model's activated parameters (less the router gates).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .configuration_llama_moe import LlamaMoEConfig


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


def get_model_config(preset: str, router: str | None = None, **overrides: Any) -> LlamaMoEConfig:
    """Build the :class:`LlamaMoEConfig` of a model preset.

    Args:
        preset: a key of :data:`MODEL_PRESETS`.
        router: router preset name (``maxscore.routing.presets.ROUTER_PRESETS``); default: the
            model preset's ``default_router`` (``"dense"`` for ``dense-*``).
        **overrides: any :class:`LlamaMoEConfig` field (e.g. ``vocab_size`` from a tokenizer,
            ``router_config={"capacity_factor": 1.25}``).

    Raises:
        ValueError: unknown preset (the message lists the known ones), or an invalid config.
    """
    if preset not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; available: {sorted(MODEL_PRESETS)}")
    spec = MODEL_PRESETS[preset]
    fields_ = {**spec.fields, **overrides}
    return LlamaMoEConfig(router=router or spec.default_router, **fields_)


__all__ = ["MODEL_PRESETS", "ModelPreset", "get_model_config"]
