"""What a Hugging Face MoE family is to the converter: one :class:`FamilySpec` per family.

A family module (``mixtral.py``, ``qwen2_moe.py``, ...) says, as data and small functions, how its
configuration maps onto :class:`~maxscore.models.LlamaMoEConfig` and onto router fields, what it
cannot express, and how to write the routing back into its configuration on export. The weights
need no per-family code: every supported family names its tensors like Llama except inside the
MoE block, and :data:`WEIGHT_RENAMES` covers those names.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers.initialization import no_init_weights

__all__ = [
    "WEIGHT_RENAMES",
    "ConversionError",
    "FamilySpec",
    "build_with_weights",
    "common_config_fields",
    "family_to_maxscore_state",
    "maxscore_to_family_state",
    "rope_fields",
    "softmax_topk_routing",
    "window_fields",
]


class ConversionError(ValueError):
    """A checkpoint or model that cannot be converted as asked (the message says why / what to do)."""


@dataclass(frozen=True)
class FamilySpec:
    """How one transformers MoE family converts to and from the Llama-MoE model.

    Attributes:
        model_type: transformers' ``model_type`` (the key in :data:`FAMILIES`).
        model_class: name of its causal-LM class in ``transformers``.
        config_fields: ``hf_config -> dict`` of family-specific :class:`LlamaMoEConfig` fields
            (architecture switches, expert sizes); the Llama fields come from
            :func:`common_config_fields`.
        router_fields: ``hf_config -> dict`` of :class:`RouterConfig` fields that belong to the
            trained model whatever the router (how expert outputs are weighted:
            ``normalize_weights`` for ``norm_topk_prob``).
        routing_config: ``router_config -> dict`` of fields to write into the family's config
            on export (e.g. ``norm_topk_prob``); raises :class:`ConversionError` when the family
            cannot express the routing.
        check: ``hf_config -> None``, raises :class:`ConversionError` for features the Llama-MoE
            model does not implement.
        note: one line for docs.
    """

    model_type: str
    model_class: str
    config_fields: Callable[[Any], dict[str, Any]]
    router_fields: Callable[[Any], dict[str, Any]]
    routing_config: Callable[[dict[str, Any]], dict[str, Any]]
    check: Callable[[Any], None] = lambda config: None
    note: str = ""


def rope_fields(config: Any) -> dict[str, Any]:
    """A family config's RoPE as :class:`LlamaMoEConfig` fields (``rope_parameters`` of any type
    transformers computes: plain, ``llama3``, ``yarn``, ``dynamic``, ``linear``, ``longrope``)."""
    params = dict(
        getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    )
    if any(isinstance(value, dict) for value in params.values()):
        raise ConversionError(
            f"{config.model_type}: RoPE differs between layer types ({sorted(params)}); the "
            "Llama-MoE model has one RoPE for all layers"
        )
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    params["rope_theta"] = float(theta if theta is not None else 10000.0)
    params.setdefault("rope_type", params.pop("type", "default"))
    return {"rope_theta": params["rope_theta"], "rope_parameters": params}


def window_fields(config: Any) -> dict[str, Any]:
    """A family config's sliding window: in every layer (Mixtral, Mistral, Qwen3-MoE) or in the
    layers its ``layer_types`` name (Qwen2, Qwen2-MoE, Qwen3)."""
    window = getattr(config, "sliding_window", None) or None  # Qwen2-MoE writes 0 for none
    if getattr(config, "use_sliding_window", True) is False or window is None:
        return {"sliding_window": None}
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "full_attention" in layer_types:
        return {"sliding_window": window, "layer_types": list(layer_types)}
    return {"sliding_window": window}


def common_config_fields(config: Any) -> dict[str, Any]:
    """The Llama part of a family config as :class:`LlamaMoEConfig` fields (checked)."""
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ConversionError(
            f"{config.model_type}: hidden_act={act!r}; the Llama-MoE experts are SwiGLU (silu)"
        )
    if getattr(config, "attention_dropout", 0.0):
        warnings.warn(
            f"{config.model_type}: attention_dropout={config.attention_dropout} is not applied "
            "by the Llama-MoE model (no dropout)",
            stacklevel=3,
        )
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        **rope_fields(config),
        **window_fields(config),
        "rms_norm_eps": config.rms_norm_eps,
        "initializer_range": config.initializer_range,
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "pad_token_id": config.pad_token_id,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
    }


#: ``(maxscore name, family name, transposed)``: the tensor names that differ, as regular
#: expression fragments matched inside a decoder layer's ``mlp.``. The stacked expert weights are
#: ``[e, D, 2F]`` / ``[e, F, D]`` here (``x @ W``) and ``[e, 2F, D]`` / ``[e, D, F]`` in
#: transformers (``F.linear``), with the gate projection first in both.
WEIGHT_RENAMES: tuple[tuple[str, str, bool], ...] = (
    ("mlp.router.gate.weight", "mlp.gate.weight", False),
    ("mlp.experts.gate_up", "mlp.experts.gate_up_proj", True),
    ("mlp.experts.down", "mlp.experts.down_proj", True),
    ("mlp.shared_experts.", "mlp.shared_expert.", False),
)

#: Router state that only the Llama-MoE model has (schedule, DeepSeek-V3 bias and loads).
_ROUTER_STATE = re.compile(r"\.mlp\.router\.(schedule\.|expert_bias|expert_load)")


def _rename(name: str, source: int, target: int) -> tuple[str, bool]:
    for names in WEIGHT_RENAMES:
        old, new, transposed = names[source], names[target], names[2]
        if f".{old}" in name and (old.endswith(".") or name.endswith(old)):
            return name.replace(f".{old}", f".{new}"), transposed
    return name, False


def family_to_maxscore_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A family model's state dict (as its transformers class holds it) in Llama-MoE names."""
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        new, transposed = _rename(name, 1, 0)
        out[new] = tensor.transpose(1, 2).contiguous() if transposed else tensor
    return out


def maxscore_to_family_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The inverse of :func:`family_to_maxscore_state`; Llama-MoE-only router state is dropped."""
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        if _ROUTER_STATE.search(name):
            continue
        new, transposed = _rename(name, 0, 1)
        out[new] = tensor.transpose(1, 2).contiguous() if transposed else tensor
    return out


def softmax_topk_routing(router_config: dict[str, Any], family: str) -> None:
    """Raise unless the model routes, in evaluation, as a family's softmax top-k router does.

    transformers' MoE families pick each token's top-k experts of ``softmax(logits)`` with no
    capacity and weight them by those probabilities (optionally renormalised). Our model routes
    that way in ``eval()`` mode for every softmax preset with causal evaluation routing (capacity
    strategies fall back to dropless top-k), and for SoftTopk presets once ``t`` has reached 0.
    """
    operator = router_config["operator"]
    strategy = router_config["strategy"]
    problems = []
    if operator not in ("softmax", "softtopk"):
        problems.append(f"its affinity operator is {operator!r}, not softmax")
    if (
        strategy == "group-limited"
        and router_config["topk_groups"] < router_config["num_expert_groups"]
    ):
        problems.append("it routes group-limited (DeepSeek), which the family cannot express")
    if router_config["eval_routing"] != "causal" and strategy not in ("dropless", "group-limited"):
        problems.append(
            f"it evaluates with the training strategy {strategy!r} (eval_routing='train')"
        )
    if router_config["bias_update_rate"] > 0:
        problems.append("it selects experts with a DeepSeek-V3 balancing bias")
    if problems:
        raise ConversionError(
            f"cannot export to {family}: the model's routing cannot be written in that format ("
            + "; ".join(problems)
            + "). Fine-tune with a softmax preset (gshard, gshard-i, gshard-m, sbase, "
            "expert-choice, dropless) or a SoftTopk preset whose t schedule has ended, or pass "
            "allow_routing_change=True (--allow-routing-change) to export the weights anyway"
        )


def build_with_weights(
    factory: Callable[[], Any],
    state: dict[str, Tensor],
    may_be_missing: Callable[[str], bool],
    what: str,
) -> Any:
    """``factory()`` built without random init on ``state``'s device and dtype, loaded with it.

    ``may_be_missing(name)`` says which of the model's tensors ``state`` may lack (state only
    the target model has, a tied LM head); any other missing or unexpected name raises a
    :class:`ConversionError` naming ``what`` was being built. Buffers of the new model that are
    not in ``state`` (router state) are zeroed, rotary frequency tables computed.
    """
    reference = next(iter(state.values()))
    with no_init_weights(), torch.device(reference.device):
        model = factory()
    model.to(reference.dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [name for name in missing if not may_be_missing(name)]
    if missing or unexpected:
        raise ConversionError(
            f"{what}: weights do not map (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name not in state:  # created uninitialised under no_init_weights
                buffer.zero_()
        for module in model.modules():
            if hasattr(module, "original_inv_freq"):
                # A transformers rotary embedding: its frequency tables are computed, not
                # loaded (the model's own initialiser computes them from its config).
                model._init_weights(module)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    return model
