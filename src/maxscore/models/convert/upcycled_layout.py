"""The transformers MoE family whose layout holds an upcycled model, so that it exports.

An upcycled Llama or Mistral is a Mixtral (Llama attention, every MLP an MoE of SwiGLU experts,
top-k weights renormalised); an upcycled Qwen3 is a Qwen3-MoE (per-head QK-norm, optional
attention biases, dense layers through ``mlp_only_layers``, ``norm_topk_prob``). At upcycling
the model records that family and its config (``source_family``, ``source_config``), so
:func:`~maxscore.models.convert.export_pretrained` writes it in that family's format like a
converted model, and ``router="native"`` means that family's routing. A model the layout cannot
hold (attention biases for Mixtral, windows in some layers only, dense layers for Mixtral, an
upcycled Qwen2, whose MoE family always has a shared expert) records none, and export says why
(:func:`upcycled_layout` raises with the reason).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import AutoConfig

from maxscore.models.convert.family import ConversionError

__all__ = ["UPCYCLED_LAYOUTS", "upcycled_layout"]


def _common(config: Any) -> dict[str, Any]:
    """The Llama part, the expert count and the routing coefficients, in transformers' names."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "initializer_range": config.initializer_range,
        "tie_word_embeddings": config.tie_word_embeddings,
        "pad_token_id": config.pad_token_id,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "rope_parameters": dict(config.rope_parameters),
        "num_experts_per_tok": config.num_experts_per_tok,
        "router_aux_loss_coef": config.router_config.aux_loss_coef,
    }


def _window_everywhere(config: Any) -> list[str]:
    """Problems of a sliding window that covers some layers only (these families slide all)."""
    kinds = {config.layer_attention(i) for i in range(config.num_hidden_layers)}
    return ["its sliding window covers some layers only"] if len(kinds) > 1 else []


def _dense_layers(config: Any) -> list[int]:
    return [i for i in range(config.num_hidden_layers) if not config.is_moe_layer(i)]


def _mixtral(config: Any) -> tuple[dict[str, Any], list[str]]:
    problems = _window_everywhere(config)
    if config.attention_qkv_bias or config.attention_output_bias:
        problems.append("its attention has biases (Mixtral's has none)")
    if config.qk_norm is not None or config.clip_qkv is not None:
        problems.append("it normalises or clamps queries and keys")
    if _dense_layers(config):
        problems.append(f"layers {_dense_layers(config)} are dense (every Mixtral layer is MoE)")
    fields = {
        **_common(config),
        "num_local_experts": config.num_experts,
        "intermediate_size": config.moe_intermediate_size,
        "sliding_window": config.sliding_window,
    }
    return fields, problems


def _qwen3_moe(config: Any) -> tuple[dict[str, Any], list[str]]:
    problems = _window_everywhere(config)
    if config.attention_qkv_bias != config.attention_output_bias:
        problems.append("only some attention projections have biases")
    if config.qk_norm != "head" or config.clip_qkv is not None:
        problems.append("its queries and keys are not normalised per head as Qwen3's")
    fields = {
        **_common(config),
        "num_experts": config.num_experts,
        "moe_intermediate_size": config.moe_intermediate_size,
        "intermediate_size": config.intermediate_size,
        "attention_bias": config.attention_qkv_bias,
        "use_sliding_window": config.sliding_window is not None,
        "sliding_window": config.sliding_window,
        "decoder_sparse_step": 1,
        "mlp_only_layers": _dense_layers(config),
        "norm_topk_prob": bool(config.router_config.normalize_weights),
    }
    return fields, problems


#: Dense ``model_type`` -> (the MoE family holding it upcycled, its fields and problems).
UPCYCLED_LAYOUTS: dict[str, tuple[str, Callable[[Any], tuple[dict[str, Any], list[str]]]]] = {
    "llama": ("mixtral", _mixtral),
    "mistral": ("mixtral", _mixtral),
    "qwen3": ("qwen3_moe", _qwen3_moe),
}


def upcycled_layout(config: Any) -> tuple[str, dict[str, Any]]:
    """``(family, its config as a dict)`` for the upcycled model ``config`` (a
    :class:`LlamaMoEConfig` with ``upcycled_from``); :class:`ConversionError` saying why when no
    family holds it."""
    dense = config.upcycled_from
    if dense not in UPCYCLED_LAYOUTS:
        holders = ", ".join(f"{k} -> {f}" for k, (f, _) in UPCYCLED_LAYOUTS.items())
        raise ConversionError(
            f"no transformers MoE family holds a model upcycled from {dense!r} (upcycled models "
            f"export as {holders}); keep it as a maxscore checkpoint"
        )
    family, layout = UPCYCLED_LAYOUTS[dense]
    fields, problems = layout(config)
    if problems:
        raise ConversionError(
            f"this model upcycled from {dense} cannot be written as {family}: "
            + "; ".join(problems)
        )
    return family, AutoConfig.for_model(family, **fields).to_dict()
