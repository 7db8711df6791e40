"""Bring your own MoE: Hugging Face MoE checkpoints as Llama-MoE models, and back.

Design: a checkpoint of a supported family is *converted* into
:class:`~maxscore.models.LlamaMoEForCausalLM` (the model gains the few switches a family needs:
q/k/v biases, QK-norm, q/k/v clamping, a sliding window, a gated shared expert, dense layers),
instead of swapping routers inside transformers' own classes. One model class then carries
everything routing research needs for every family alike: the padding mask reaching the router,
every router preset with its capacity buffers and flow solver, causal evaluation routing, routing
statistics, aux-loss granularity, the SoftTopk schedule in the checkpoint, compiled layers, and
the trainer / eval / analyze / compare commands unchanged. transformers' blocks would need each
of these patched per family (their decoder layers do not pass the attention mask to the MoE
block, and their outputs have no place for the statistics). With the router that matches the
family (``router="native"``) the converted model's logits equal the original's (fp32, tested per
family to 1e-5); :func:`export_pretrained` writes the model back in the family's own format.

Families (:data:`FAMILIES`): Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE. Not supported, and why:
DeepSeek-V3 (multi-head latent attention: low-rank q/kv projections with a decoupled RoPE part,
YaRN RoPE, sigmoid routing with group-limited top-k over a correction bias: a different attention
module, not a switch on Llama's) and GPT-OSS (attention sinks, alternating sliding-window layers,
YaRN RoPE, experts with biases and a clamped SwiGLU, router bias with a softmax over the top-k
only). Both would need their own attention and expert modules; the converter refuses them with
that explanation.
"""

from __future__ import annotations

from maxscore.models.convert.export import export_pretrained, to_family_model
from maxscore.models.convert.family import ConversionError, FamilySpec
from maxscore.models.convert.load import (
    NATIVE_ROUTER,
    UNSUPPORTED_FAMILIES,
    convert_model,
    load_pretrained,
    maxscore_config_from_family,
)
from maxscore.models.convert.registry import FAMILIES

__all__ = [
    "FAMILIES",
    "NATIVE_ROUTER",
    "UNSUPPORTED_FAMILIES",
    "ConversionError",
    "FamilySpec",
    "convert_model",
    "export_pretrained",
    "load_pretrained",
    "maxscore_config_from_family",
    "to_family_model",
]
