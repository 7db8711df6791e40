"""Qwen2-MoE and Qwen3-MoE (``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM``).

Both: router ``softmax(x W_g)`` in fp32, top-k, renormalised when ``norm_topk_prob``; dense MLP
layers where ``layer_idx in mlp_only_layers`` or ``(layer_idx + 1) % decoder_sparse_step != 0``
(width ``intermediate_size``). Qwen2-MoE adds biases on q/k/v (``qkv_bias``) and one shared
expert of width ``shared_expert_intermediate_size`` scaled by ``sigmoid(x W_s)``
(``shared_expert_gate``) and slides its attention window in the layers its ``layer_types``
name (``use_sliding_window``: even layers below ``max_window_layers``). Qwen3-MoE has no shared expert, an RMSNorm on each query / key head
(``q_norm`` / ``k_norm`` over ``head_dim``) and ``attention_bias`` on all four projections.
"""

from __future__ import annotations

from typing import Any

from .family import ConversionError, FamilySpec, softmax_topk_routing


def _layout(config: Any) -> dict[str, Any]:
    """Qwen's dense/MoE layer layout in our terms: MoE iff ``(i + 1) % step == 0``."""
    if config.num_experts < 1:
        raise ConversionError(
            f"{config.model_type}: num_experts={config.num_experts}, a dense model; use "
            "`maxscore upcycle` to turn a dense checkpoint into an MoE"
        )
    step = config.decoder_sparse_step
    return {
        "num_experts": config.num_experts,
        "moe_intermediate_size": config.moe_intermediate_size,
        "intermediate_size": config.intermediate_size,
        # (i - (step - 1)) % step == 0 for i >= step - 1 is exactly (i + 1) % step == 0.
        "first_k_dense": min(step - 1, config.num_hidden_layers),
        "moe_layer_freq": step,
        "dense_layers": sorted(config.mlp_only_layers or []) or None,
    }


def _qwen2_fields(config: Any) -> dict[str, Any]:
    return {
        **_layout(config),
        "attention_qkv_bias": bool(config.qkv_bias),
        "num_shared_experts": 1,
        "shared_expert_intermediate_size": config.shared_expert_intermediate_size,
        "shared_expert_gate": True,
    }


def _qwen3_fields(config: Any) -> dict[str, Any]:
    return {
        **_layout(config),
        "attention_qkv_bias": bool(config.attention_bias),
        "attention_output_bias": bool(config.attention_bias),
        "qk_norm": "head",
    }


def _norm_topk(router_config: dict[str, Any], family: str) -> dict[str, Any]:
    softmax_topk_routing(router_config, family)
    return {"norm_topk_prob": bool(router_config["normalize_weights"])}


QWEN2_MOE = FamilySpec(
    model_type="qwen2_moe",
    model_class="Qwen2MoeForCausalLM",
    config_fields=_qwen2_fields,
    router_fields=lambda config: {"normalize_weights": bool(config.norm_topk_prob)},
    routing_config=lambda rc: _norm_topk(rc, "qwen2_moe"),
    note="q/k/v biases, one sigmoid-gated shared expert, norm_topk_prob, dense layers",
)

QWEN3_MOE = FamilySpec(
    model_type="qwen3_moe",
    model_class="Qwen3MoeForCausalLM",
    config_fields=_qwen3_fields,
    router_fields=lambda config: {"normalize_weights": bool(config.norm_topk_prob)},
    routing_config=lambda rc: _norm_topk(rc, "qwen3_moe"),
    note="per-head QK-norm, attention_bias, norm_topk_prob, dense layers",
)
