"""Sparse upcycling: a dense Llama-style checkpoint becomes a Llama-MoE model.

Sparse Upcycling (Komatsuzaki et al., 2023): every MLP is replaced by an MoE layer whose ``e``
experts start as copies of that MLP, plus a new router (gate weights ``N(0, std)``, seeded); the
attention, norms and embeddings are kept. Any router preset can then train it.

The combine weights are renormalised over a token's experts by default
(``normalize_weights=True``), so at initialisation every token that keeps its ``k`` experts
computes exactly the dense MLP (``sum_j w_j E(x) = E(x)`` with identical experts): the upcycled
model starts with the dense model's logits under dropless routing (tested), and under a capacity
router only dropped slots differ. Pass ``router_config={"normalize_weights": False}`` for the
paper's unnormalised weights (outputs then start scaled by the top-k probability mass).

Supported dense families (:data:`DENSE_FAMILIES`): Llama, Mistral, Qwen2, Qwen3. The result
records ``upcycled_from`` and, where one holds it, the MoE family of its layout (Mixtral for
Llama / Mistral, Qwen3-MoE for Qwen3: :mod:`maxscore.models.convert.upcycled_layout`), so it
exports to that family's format after fine-tuning. A SoftTopk router starts at ``t = 0``
(:mod:`maxscore.models.convert.warm_start`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import transformers
from transformers import AutoConfig, PreTrainedModel

from maxscore.models.configuration_llama_moe import LlamaMoEConfig
from maxscore.models.convert.family import (
    ConversionError,
    build_with_weights,
    common_config_fields,
)
from maxscore.models.convert.upcycled_layout import upcycled_layout
from maxscore.models.convert.warm_start import warm_start_fields
from maxscore.models.modeling_llama_moe import LlamaMoEForCausalLM

__all__ = ["DENSE_FAMILIES", "upcycle", "upcycle_config", "upcycle_model"]


def _llama(config: Any) -> dict[str, Any]:
    if getattr(config, "mlp_bias", False):
        raise ConversionError("llama: mlp_bias=True; the Llama-MoE experts have no biases")
    bias = bool(getattr(config, "attention_bias", False))
    return {"attention_qkv_bias": bias, "attention_output_bias": bias}


def _mistral(config: Any) -> dict[str, Any]:
    # Llama's attention with a sliding window, which common_config_fields maps.
    return {}


def _qwen2(config: Any) -> dict[str, Any]:
    return {"attention_qkv_bias": True}


def _qwen3(config: Any) -> dict[str, Any]:
    bias = bool(config.attention_bias)
    return {"attention_qkv_bias": bias, "attention_output_bias": bias, "qk_norm": "head"}


#: Dense families by ``model_type`` -> (transformers class, their attention switches).
DENSE_FAMILIES: dict[str, tuple[str, Callable[[Any], dict[str, Any]]]] = {
    "llama": ("LlamaForCausalLM", _llama),
    "mistral": ("MistralForCausalLM", _mistral),
    "qwen2": ("Qwen2ForCausalLM", _qwen2),
    "qwen3": ("Qwen3ForCausalLM", _qwen3),
}


def upcycle_config(
    dense_config: Any,
    num_experts: int,
    top_k: int = 2,
    router: str = "maxscore",
    router_config: dict[str, Any] | None = None,
    **overrides: Any,
) -> LlamaMoEConfig:
    """The Llama-MoE config of a dense config upcycled to ``num_experts`` experts, top-``k``."""
    model_type = getattr(dense_config, "model_type", None)
    if model_type not in DENSE_FAMILIES:
        raise ConversionError(
            f"cannot upcycle model_type {model_type!r}; dense families: {sorted(DENSE_FAMILIES)}"
        )
    fields = common_config_fields(dense_config)
    fields.update(DENSE_FAMILIES[model_type][1](dense_config))
    fields.update(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=dense_config.intermediate_size,
        intermediate_size=dense_config.intermediate_size,
    )
    fields.update(overrides)
    router_fields = {"normalize_weights": True, **(router_config or {})}
    # The copied MLP was trained under plain weights: a SoftTopk schedule starts at t = 0.
    router_fields.update(warm_start_fields(router, router_fields))
    config = LlamaMoEConfig(
        **fields, router=router, router_config=router_fields, upcycled_from=model_type
    )
    # The MoE family whose layout holds it: export and `native` work as for a conversion. When
    # no family holds it, nothing is recorded and export says why (upcycled_layout's message).
    with contextlib.suppress(ConversionError):
        config.source_family, config.source_config = upcycled_layout(config)
    return config


@torch.no_grad()
def upcycle_model(
    dense: PreTrainedModel,
    num_experts: int,
    top_k: int = 2,
    router: str = "maxscore",
    router_config: dict[str, Any] | None = None,
    router_init_std: float | None = None,
    seed: int = 0,
    **overrides: Any,
) -> LlamaMoEForCausalLM:
    """An MoE copy of a loaded dense model: every MLP copied into ``num_experts`` experts."""
    config = upcycle_config(dense.config, num_experts, top_k, router, router_config, **overrides)
    state = dense.state_dict()
    reference = state["model.embed_tokens.weight"]
    new_state = {name: tensor for name, tensor in state.items() if ".mlp." not in name}
    generator = torch.Generator(device="cpu").manual_seed(seed)
    std = config.initializer_range if router_init_std is None else router_init_std
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}.mlp."
        gate, up, down = (state[f"{prefix}{p}_proj.weight"] for p in ("gate", "up", "down"))
        if not config.is_moe_layer(i):
            for p, w in (("gate", gate), ("up", up), ("down", down)):
                new_state[f"{prefix}{p}_proj.weight"] = w
            continue
        e = num_experts
        # Ours: x @ gate_up[j] with gate in the first F columns; transformers: F.linear(x, W).
        new_state[f"{prefix}experts.gate_up"] = torch.cat([gate.T, up.T], dim=1).expand(e, -1, -1)
        new_state[f"{prefix}experts.down"] = down.T.expand(e, -1, -1)
        gate_weight = torch.randn(e, config.hidden_size, generator=generator) * std
        new_state[f"{prefix}router.gate.weight"] = gate_weight.to(reference)
    return build_with_weights(
        lambda: LlamaMoEForCausalLM(config),
        new_state,
        lambda name: (
            ".mlp.router." in name or (config.tie_word_embeddings and name == "lm_head.weight")
        ),
        "upcycling",
    )


def upcycle(
    source: str,
    num_experts: int,
    top_k: int = 2,
    router: str = "maxscore",
    router_config: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    **kwargs: Any,
) -> LlamaMoEForCausalLM:
    """Load the dense checkpoint ``source`` (directory or hub name) and upcycle it."""
    try:
        dense_config = AutoConfig.from_pretrained(source)
    except Exception as err:  # OSError, ValueError, the hub client's errors offline
        raise ConversionError(f"cannot read a model config from {source!r}: {err}") from err
    model_type = getattr(dense_config, "model_type", None)
    if model_type not in DENSE_FAMILIES:
        raise ConversionError(
            f"cannot upcycle model_type {model_type!r}; dense families: {sorted(DENSE_FAMILIES)}"
            " (MoE checkpoints train directly with `maxscore train --model`)"
        )
    model_class = getattr(transformers, DENSE_FAMILIES[model_type][0])
    dense = model_class.from_pretrained(source, dtype=dtype)
    model = upcycle_model(dense, num_experts, top_k, router, router_config, **kwargs)
    model.config.name_or_path = str(source)
    return model
