"""Mixtral (``MixtralForCausalLM``): Llama attention (GQA, optional sliding window), top-k experts.

The window and RoPE (any transformers RoPE type) map in ``family.common_config_fields``.

Router: ``softmax(x W_g)`` in fp32, the top-k probabilities renormalised to sum to 1 (always;
Mixtral has no ``norm_topk_prob`` switch), no capacity. ``router_jitter_noise`` (training only)
is not applied by our router.
"""

from __future__ import annotations

import warnings
from typing import Any

from .family import ConversionError, FamilySpec, softmax_topk_routing


def _config_fields(config: Any) -> dict[str, Any]:
    return {
        "num_experts": config.num_local_experts,
        "moe_intermediate_size": config.intermediate_size,
        "intermediate_size": config.intermediate_size,
    }


def _check(config: Any) -> None:
    if getattr(config, "router_jitter_noise", 0.0):
        warnings.warn(
            f"mixtral: router_jitter_noise={config.router_jitter_noise} is not applied by the "
            "maxscore router",
            stacklevel=3,
        )


def _routing_config(router_config: dict[str, Any]) -> dict[str, Any]:
    softmax_topk_routing(router_config, "mixtral")
    if not router_config["normalize_weights"]:
        raise ConversionError(
            "cannot export to mixtral: Mixtral always renormalises the top-k weights, but the "
            "model's router has normalize_weights=False; pass allow_routing_change=True to "
            "export the weights anyway"
        )
    return {}


MIXTRAL = FamilySpec(
    model_type="mixtral",
    model_class="MixtralForCausalLM",
    config_fields=_config_fields,
    router_fields=lambda config: {"normalize_weights": True},
    routing_config=_routing_config,
    check=_check,
    note="GQA, optional sliding window; top-k weights always renormalised",
)
