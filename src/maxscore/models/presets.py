"""Model size presets: the paper's Llama-MoE family as data.

Every paper size has 12 layers, 12 heads, vocabulary 32,000, untied embeddings, 16 experts with
k = 2 and expert FFN width ``4 * hidden / k``. :func:`get_model_config` turns a preset plus a router
preset name into a :class:`~maxscore.models.configuration_llama_moe.LlamaMoEConfig`. The table
itself, :data:`MODEL_PRESETS`, lives in :mod:`maxscore.preset_tables` (plain data, no
transformers), so that ``maxscore presets`` and the ``--model`` name check read it cheaply.

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

from typing import Any

from maxscore.preset_tables import MODEL_PRESETS, ModelPreset

from .configuration_llama_moe import LlamaMoEConfig


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
