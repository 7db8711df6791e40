"""OLMoE (``OlmoeForCausalLM``): QK-norm over the full projected width, optional q/k/v clamping.

``q_norm`` is an RMSNorm over all query heads' concatenated width (``hidden_size``) and
``k_norm`` over the key heads' width, applied before the heads are split, then ``clip_qkv``
clamps q, k and v; ``attention_bias`` puts biases on all four projections. Router: ``softmax``
in fp32, top-k, renormalised when ``norm_topk_prob`` (False in the released OLMoE).
"""

from __future__ import annotations

from typing import Any

from .family import FamilySpec, softmax_topk_routing


def _config_fields(config: Any) -> dict[str, Any]:
    return {
        "num_experts": config.num_experts,
        "moe_intermediate_size": config.intermediate_size,
        "intermediate_size": config.intermediate_size,
        "attention_qkv_bias": bool(config.attention_bias),
        "attention_output_bias": bool(config.attention_bias),
        "qk_norm": "full",
        "clip_qkv": config.clip_qkv,
    }


def _routing_config(router_config: dict[str, Any]) -> dict[str, Any]:
    softmax_topk_routing(router_config, "olmoe")
    return {"norm_topk_prob": bool(router_config["normalize_weights"])}


OLMOE = FamilySpec(
    model_type="olmoe",
    model_class="OlmoeForCausalLM",
    config_fields=_config_fields,
    router_fields=lambda config: {"normalize_weights": bool(config.norm_topk_prob)},
    routing_config=_routing_config,
    note="QK-norm over the full width, clip_qkv, attention_bias, norm_topk_prob",
)
