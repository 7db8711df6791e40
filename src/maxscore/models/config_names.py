"""Configuration names of other Hugging Face families, and what each one is in a Llama-MoE config.

A Mixtral, Qwen2/3-MoE, OLMoE, Llama or Qwen3 ``config.json`` names some settings differently
from :class:`~maxscore.models.LlamaMoEConfig` (``num_local_experts`` for ``num_experts``,
``mlp_only_layers`` for ``dense_layers``). Every such name the config meets is, by the table
:data:`FOREIGN_NAMES`:

* **mapped** onto our fields (``num_local_experts=4`` sets ``num_experts=4``), and readable back
  under its own name (``config.num_local_experts``), so code written for that family works;
* **accepted** only with the value that needs no missing feature (``router_jitter_noise=0``,
  ``hidden_act="silu"``), and **refused** with the reason otherwise;

and any other unknown name is refused (:func:`check_unknown_keys`). Nothing is stored and ignored.
Router settings with a family name (``router_aux_loss_coef``, ``norm_topk_prob``) are views of
``router_config`` (``ROUTER_SETTING_ALIASES`` in the configuration module).

This module is imported by the configuration file that is copied into checkpoints, so it only
imports ``maxscore`` absolutely and nothing heavy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BASE_CONFIG_KEYS",
    "FOREIGN_NAMES",
    "ForeignName",
    "apply_foreign_names",
    "check_unknown_keys",
]


@dataclass(frozen=True)
class ForeignName:
    """One name of another family's config.

    Attributes:
        name: the key as that family's ``config.json`` writes it.
        to_fields: ``(value, config) -> {our field: value}``, given the config with its own
            fields set (and earlier names of the table applied); raises ``ValueError`` saying
            why a value cannot be honoured.
        read: ``config -> value`` under this name (``None``: not readable as an attribute).
        meaning: what it is here, one line (docs and messages).
    """

    name: str
    to_fields: Callable[[Any, Any], dict[str, Any]]
    read: Callable[[Any], Any] | None
    meaning: str


def _only(default: Any, feature: str) -> Callable[[Any, Any], dict[str, Any]]:
    """Accept ``default`` (nothing to do); refuse any other value, saying what is missing."""

    def check(value: Any, config: Any) -> dict[str, Any]:
        if value == default or (default == 0 and value is None):
            return {}
        raise ValueError(f"{feature} is not implemented by the Llama-MoE model; use {default!r}")

    return check


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _sparse_step(value: Any, config: Any) -> dict[str, Any]:
    # Qwen-MoE: layer i is MoE iff (i + 1) % step == 0, i.e. first_k_dense = step - 1 and then
    # every step-th layer ((i - (step - 1)) % step == 0 for i >= step - 1).
    step = _positive_int("decoder_sparse_step", value)
    return {"first_k_dense": min(step - 1, config.num_hidden_layers), "moe_layer_freq": step}


def _read_sparse_step(config: Any) -> int | None:
    step = config.moe_layer_freq
    return step if config.first_k_dense == min(step - 1, config.num_hidden_layers) else None


def _attention_bias(value: Any, config: Any) -> dict[str, Any]:
    return {"attention_qkv_bias": bool(value), "attention_output_bias": bool(value)}


def _use_sliding_window(value: Any, config: Any) -> dict[str, Any]:
    # Qwen keeps a `sliding_window` size even when the window is switched off.
    return {} if value else {"sliding_window": None, "layer_types": None}


def _max_window_layers(value: Any, config: Any) -> dict[str, Any]:
    if config.sliding_window is None or config.layer_types is not None:
        return {}  # no window, or the layers are named explicitly: nothing left to decide
    raise ValueError(
        "which layers slide differs between the Qwen families (Qwen2/Qwen3: "
        "layers >= max_window_layers; Qwen2-MoE: even layers below it); give layer_types "
        "instead, one 'full_attention' or 'sliding_attention' per layer"
    )


#: Every other family's name the config honours or refuses, in the order they are applied.
FOREIGN_NAMES: dict[str, ForeignName] = {
    entry.name: entry
    for entry in (
        ForeignName(
            "num_local_experts",
            lambda v, c: {"num_experts": v},
            lambda c: c.num_experts,
            "Mixtral's name of num_experts",
        ),
        ForeignName(
            "n_routed_experts",
            lambda v, c: {"num_experts": v},
            lambda c: c.num_experts,
            "DeepSeek's name of num_experts",
        ),
        ForeignName(
            "n_shared_experts",
            lambda v, c: {"num_shared_experts": v or 0},
            lambda c: c.num_shared_experts,
            "DeepSeek's name of num_shared_experts",
        ),
        ForeignName(
            "first_k_dense_replace",
            lambda v, c: {"first_k_dense": v},
            lambda c: c.first_k_dense,
            "DeepSeek's name of first_k_dense",
        ),
        ForeignName(
            "mlp_only_layers",
            lambda v, c: {"dense_layers": sorted(v) or None},
            lambda c: list(c.dense_layers or []),
            "Qwen-MoE's name of dense_layers",
        ),
        ForeignName(
            "decoder_sparse_step",
            _sparse_step,
            _read_sparse_step,
            "Qwen-MoE: every step-th layer is MoE (first_k_dense = step - 1, moe_layer_freq = step)",
        ),
        ForeignName(
            "qkv_bias",
            lambda v, c: {"attention_qkv_bias": bool(v)},
            lambda c: c.attention_qkv_bias,
            "Qwen2's name of attention_qkv_bias",
        ),
        ForeignName(
            "attention_bias",
            _attention_bias,
            lambda c: c.attention_qkv_bias and c.attention_output_bias,
            "biases on the q/k/v and output projections (Llama, Qwen3, OLMoE)",
        ),
        ForeignName(
            "use_sliding_window",
            _use_sliding_window,
            lambda c: c.sliding_window is not None,
            "Qwen: false switches the sliding window off",
        ),
        ForeignName(
            "max_window_layers",
            _max_window_layers,
            None,
            "Qwen's rule for which layers slide; refused while a window is on (use layer_types)",
        ),
        ForeignName(
            "router_jitter_noise",
            _only(0.0, "router_jitter_noise (Mixtral's multiplicative noise on the router input)"),
            lambda c: 0.0,
            "accepted as 0 only",
        ),
        ForeignName(
            "attention_dropout",
            _only(0.0, "attention_dropout"),
            lambda c: 0.0,
            "accepted as 0 only",
        ),
        ForeignName(
            "hidden_act",
            _only("silu", "an MLP activation other than SiLU (the experts are SwiGLU)"),
            lambda c: "silu",
            "accepted as 'silu' only",
        ),
        ForeignName(
            "mlp_bias",
            _only(False, "mlp_bias (biases in the MLP / expert projections)"),
            lambda c: False,
            "accepted as false only",
        ),
        ForeignName(
            "partial_rotary_factor",
            _only(1.0, "partial_rotary_factor (RoPE on part of each head)"),
            None,
            "accepted as 1 only",
        ),
        ForeignName(
            # Llama's pretraining_tp split the same matrix products over tensor-parallel ranks;
            # the result is the same, and transformers ignores it too.
            "pretraining_tp",
            lambda v, c: {},
            lambda c: 1,
            "accepted and dropped (the same products split over ranks)",
        ),
    )
}

#: Keys that transformers' base configuration consumes or keeps itself (from ``config.json`` or
#: ``from_pretrained``), so they are not unknown to this config.
BASE_CONFIG_KEYS: frozenset[str] = frozenset(
    {
        "auto_map",
        "model_type",
        "name_or_path",
        "_name_or_path",
        "_commit_hash",
        "torch_dtype",
        "num_labels",
        "output_attentions",
        "attn_implementation",
        "experts_implementation",
        "_attn_implementation_internal",
        "_experts_implementation_internal",
        "per_layer_config",
        "rope_scaling",
        "tokenizer_class",
        # Loading arguments that callers of from_pretrained (lm-eval's, for one) pass through
        # to the config: not settings of the model.
        "gguf_file",
        "_from_auto",
        "_from_pipeline",
        "trust_remote_code",
        "revision",
        "subfolder",
        "return_unused_kwargs",
    }
)


def apply_foreign_names(config: Any, kwargs: dict[str, Any]) -> None:
    """Pop the :data:`FOREIGN_NAMES` out of ``kwargs`` and set the fields they map to.

    Raises ``ValueError`` naming the key when a value cannot be honoured.
    """
    for name, entry in FOREIGN_NAMES.items():
        if name not in kwargs:
            continue
        value = kwargs.pop(name)
        try:
            fields = entry.to_fields(value, config)
        except ValueError as err:
            raise ValueError(f"{name}={value!r}: {err}") from None
        for field, mapped in fields.items():
            setattr(config, field, mapped)


def _generation_keys() -> Iterable[str]:
    """Generation settings old configs carry; transformers' base config drops them."""
    # On use: only an unknown key is looked up here, and this module stays light (it is read by
    # the configuration file copied into checkpoints).
    from transformers import GenerationConfig

    return GenerationConfig._get_default_generation_params().keys()


def check_unknown_keys(kwargs: dict[str, Any], fields: Iterable[str]) -> None:
    """Refuse keys that are neither ``fields``, a foreign name nor a base-config key."""
    unknown = sorted(set(kwargs) - BASE_CONFIG_KEYS - set(FOREIGN_NAMES))
    if unknown:
        unknown = sorted(set(unknown) - set(_generation_keys()))
    if unknown:
        raise ValueError(
            f"unknown Llama-MoE config key(s) {unknown}: neither a field of this config nor "
            f"another family's name it maps. Fields: {sorted(fields)}; other families' names: "
            f"{sorted(FOREIGN_NAMES)}"
        )
