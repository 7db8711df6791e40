"""Configuration of the Llama-MoE causal language model (the paper's model family).

The configuration is a Hugging Face :class:`~transformers.PreTrainedConfig`, so it saves to / loads
from ``config.json`` and is found by ``AutoConfig`` (``model_type = "maxscore_llama_moe"``).

Routing is described by a router preset name (``router``, see :mod:`maxscore.routing.presets`)
plus optional field overrides (``router_config``). On construction the preset is *resolved*: the
full :class:`~maxscore.routing.config.RouterConfig` is written back into ``router_config`` so that a
saved checkpoint is self-describing and reloads with exactly the same router even if the preset
table changes later. Router presets whose strategy is ``"dense"`` make every MLP a dense SwiGLU.

This file is also copied into saved checkpoints (``auto_map``) so that
``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`` works; it therefore only
imports ``maxscore`` with absolute imports.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedConfig


class LlamaMoEConfig(PreTrainedConfig):
    """Configuration of :class:`~maxscore.models.modeling_llama_moe.LlamaMoEForCausalLM`.

    Attributes:
        vocab_size: vocabulary size (input embeddings and LM head rows).
        hidden_size: model width ``D``.
        num_hidden_layers: number of decoder blocks.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (grouped-query attention); ``None`` = multi-head.
        head_dim: per-head width; ``None`` = ``hidden_size // num_attention_heads``.
        max_position_embeddings: longest sequence the model is meant for (RoPE needs no table;
            kept for tooling such as ``generate`` and lm-eval).
        rope_theta: RoPE base frequency.
        rms_norm_eps: epsilon of the RMSNorms.
        initializer_range: std of the normal init of every weight matrix.
        tie_word_embeddings: share input embedding and LM head (the paper's models do not).
        num_experts: experts per MoE layer ``e``.
        num_experts_per_tok: experts per token ``k``.
        moe_intermediate_size: hidden width of one routed expert; ``None`` = ``4 * hidden / k``
            (the paper's rule, which keeps the activated FFN equal to a ``4 * hidden`` dense MLP).
        intermediate_size: hidden width of dense MLP layers (dense models and ``first_k_dense``
            layers); ``None`` = ``k * moe_intermediate_size`` (same activated size as the MoE).
        num_shared_experts: always-active shared experts per MoE layer (DeepSeek).
        shared_expert_intermediate_size: hidden width of one shared expert; ``None`` =
            ``moe_intermediate_size``.
        router: router preset name (:data:`maxscore.routing.presets.ROUTER_PRESETS`).
        router_config: overrides of :class:`~maxscore.routing.config.RouterConfig` fields; after
            construction this holds the full resolved router configuration.
        router_aux_loss_coef: load-balancing loss coefficient λ; ``None`` keeps the preset's.
            When given it wins over ``router_config["aux_loss_coef"]``.
        router_z_loss_coef: router z-loss coefficient; ``None`` keeps the preset's.
        output_router_logits: return every MoE layer's gate logits by default.
        eval_routing: routing used in ``eval()`` mode: ``"causal"`` (default: no token's
            experts depend on later tokens) or ``"train"`` (the training routing, which may leak).
        first_k_dense: the first ``first_k_dense`` layers use a dense MLP (DeepSeek-style).
        moe_layer_freq: after ``first_k_dense``, every ``moe_layer_freq``-th layer is MoE (the
            others dense).
        dense_layers: further layer indices with a dense MLP (Qwen-MoE's ``mlp_only_layers``).
        attention_qkv_bias: biases on the query / key / value projections (Qwen2-MoE).
        attention_output_bias: a bias on the attention output projection (with
            ``attention_qkv_bias``: OLMoE's / Qwen3-MoE's ``attention_bias``).
        qk_norm: RMSNorm of queries and keys before RoPE: ``None`` (Llama), ``"head"`` (over each
            head's ``head_dim``, one weight shared by the heads: Qwen3-MoE) or ``"full"`` (over
            all heads' concatenated width, as OLMoE).
        clip_qkv: clamp queries, keys and values to ``[-clip_qkv, clip_qkv]`` after the norms
            (OLMoE); ``None`` = no clamp.
        sliding_window: attend to at most this many previous tokens in every layer (Mixtral's
            ``sliding_window``); ``None`` = full causal attention.
        shared_expert_gate: scale the shared experts' output by a learned per-token sigmoid gate
            (Qwen2-MoE).
        source_family: the Hugging Face model family the weights were converted from
            (``maxscore.models.convert.FAMILIES``), ``None`` for native models; with
            ``source_config`` (the original configuration) it lets ``export`` write the model
            back in that family's format.
    """

    model_type = "maxscore_llama_moe"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]  # noqa: RUF012 (transformers class attribute)

    vocab_size: int = 32000
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    num_experts: int = 16
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    intermediate_size: int | None = None
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int | None = None
    router: str = "maxscore"
    router_config: dict[str, Any] | None = None
    router_aux_loss_coef: float | None = None
    router_z_loss_coef: float | None = None
    output_router_logits: bool = False
    eval_routing: str = "causal"
    first_k_dense: int = 0
    moe_layer_freq: int = 1
    dense_layers: list[int] | None = None
    attention_qkv_bias: bool = False
    attention_output_bias: bool = False
    qk_norm: str | None = None
    clip_qkv: float | None = None
    sliding_window: int | None = None
    shared_expert_gate: bool = False
    source_family: str | None = None
    source_config: dict[str, Any] | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        self._validate_shapes()
        self._validate_architecture()
        self._resolve_router()
        super().__post_init__(**kwargs)

    def __setattr__(self, key: str, value: Any) -> None:
        # `from_pretrained(path, router_config={...})` sets a partial dict after the stored one
        # was resolved: merge it into the resolved fields instead of dropping the checkpoint's.
        if (
            key == "router_config"
            and isinstance(value, dict)
            and isinstance(self.__dict__.get("router_config"), dict)
            and "_resolved_router" in self.__dict__
        ):
            for field_name, attr in (
                ("aux_loss_coef", "router_aux_loss_coef"),
                ("z_loss_coef", "router_z_loss_coef"),
            ):
                if field_name in value:  # the given value wins over the synced coefficient
                    super().__setattr__(attr, value[field_name])
            value = {**self.__dict__["router_config"], **value}
        super().__setattr__(key, value)

    def to_dict(self) -> dict[str, Any]:
        if self.__dict__.get("_resolved_router", self.router) != self.router:
            self.get_router_config()  # `router` was changed: save the fields it resolves to
        out = super().to_dict()
        out.pop("_resolved_router", None)  # bookkeeping of `router` changes, not configuration
        return out

    # -- validation -------------------------------------------------------------------------------

    def _validate_shapes(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        if not isinstance(self.output_router_logits, bool):
            raise ValueError(
                f"output_router_logits must be true or false, got {self.output_router_logits!r}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_experts",
            "num_experts_per_tok",
            "moe_layer_freq",
        ):
            positive(name)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        positive("num_key_value_heads")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                    f"({self.num_attention_heads}); pass head_dim explicitly to decouple them"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        positive("head_dim")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok (k={self.num_experts_per_tok}) cannot exceed num_experts "
                f"(e={self.num_experts})"
            )
        if self.moe_intermediate_size is None:
            # Paper rule: expert FFN = 4 * hidden / k, so k active experts cost one 4*hidden MLP.
            self.moe_intermediate_size = 4 * self.hidden_size // self.num_experts_per_tok
        positive("moe_intermediate_size")
        if self.intermediate_size is None:
            self.intermediate_size = self.num_experts_per_tok * self.moe_intermediate_size
        positive("intermediate_size")
        if self.num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be >= 0, got {self.num_shared_experts}")
        if self.shared_expert_intermediate_size is None:
            self.shared_expert_intermediate_size = self.moe_intermediate_size
        positive("shared_expert_intermediate_size")
        if not 0 <= self.first_k_dense <= self.num_hidden_layers:
            raise ValueError(
                f"first_k_dense must be in [0, num_hidden_layers={self.num_hidden_layers}], "
                f"got {self.first_k_dense}"
            )
        if self.eval_routing not in ("causal", "train"):
            raise ValueError(f"eval_routing must be 'causal' or 'train', got {self.eval_routing!r}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")

    def _validate_architecture(self) -> None:
        if self.qk_norm not in (None, "head", "full"):
            raise ValueError(f"qk_norm must be None, 'head' or 'full', got {self.qk_norm!r}")
        if self.clip_qkv is not None and not self.clip_qkv > 0:
            raise ValueError(f"clip_qkv must be > 0 or None, got {self.clip_qkv}")
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise ValueError(
                f"sliding_window must be a positive int or None, got {self.sliding_window!r}"
            )
        if self.shared_expert_gate and self.num_shared_experts < 1:
            raise ValueError("shared_expert_gate needs num_shared_experts >= 1")
        for index in self.dense_layers or []:
            if not isinstance(index, int) or not 0 <= index < self.num_hidden_layers:
                raise ValueError(
                    f"dense_layers holds {index!r}, not a layer index in "
                    f"[0, num_hidden_layers={self.num_hidden_layers})"
                )

    def _resolve_router(self) -> None:
        """Resolve ``router`` + overrides into a full RouterConfig dict stored on the config."""
        # Imported here so that `import maxscore` stays light and this file can be copied
        # verbatim into checkpoints as remote code.
        from maxscore.routing.presets import ROUTER_PRESETS, get_router_config

        if self.router not in ROUTER_PRESETS:
            raise ValueError(
                f"unknown router preset {self.router!r}; available presets: {sorted(ROUTER_PRESETS)}"
            )
        overrides = dict(self.router_config or {})
        # The explicit HF-style coefficients win over router_config (and over the preset).
        if self.router_aux_loss_coef is not None:
            overrides["aux_loss_coef"] = float(self.router_aux_loss_coef)
        if self.router_z_loss_coef is not None:
            overrides["z_loss_coef"] = float(self.router_z_loss_coef)
        overrides["eval_routing"] = self.eval_routing
        resolved = get_router_config(self.router, **overrides)
        self.router_config = resolved.to_dict()
        self.router_aux_loss_coef = resolved.aux_loss_coef
        self.router_z_loss_coef = resolved.z_loss_coef
        # The preset `router_config` was resolved for: `from_pretrained(path, router="gshard")`
        # sets `router` after construction, and get_router_config() must then re-resolve.
        self._resolved_router = self.router

    # -- derived quantities -----------------------------------------------------------------------

    @property
    def is_dense(self) -> bool:
        """True when the router preset is the dense baseline (every MLP is a dense SwiGLU)."""
        return bool(self.get_router_config().is_dense)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` has an MoE MLP (else a dense SwiGLU MLP)."""
        if self.is_dense or layer_idx < self.first_k_dense:
            return False
        if layer_idx in (self.dense_layers or []):
            return False
        return (layer_idx - self.first_k_dense) % self.moe_layer_freq == 0

    def get_router_config(self) -> Any:
        """The resolved :class:`~maxscore.routing.config.RouterConfig` of every MoE layer.

        The top-level ``eval_routing`` / ``router_aux_loss_coef`` / ``router_z_loss_coef`` win over
        the stored dict and the result is synced back into it: ``from_pretrained(path,
        eval_routing="train")`` (or ``router_config={...}``) sets attributes after the config was
        resolved, and they must still reach the routers.

        ``from_pretrained(path, router="gshard")`` replaces the preset after the stored
        ``router_config`` was resolved for the checkpoint's preset. Then the stored fields that
        the old preset did not have (the checkpoint's own overrides, e.g. ``normalize_weights``
        of a converted Mixtral) are kept and everything else comes from the new preset.
        """
        from maxscore.routing.presets import ROUTER_PRESETS, get_router_config

        # Preset + stored fields: identical to the stored dict when it is complete (the normal
        # case), and still the preset's values for fields a partial override left out.
        data = dict(self.router_config or {})
        previous = getattr(self, "_resolved_router", self.router)
        if previous != self.router and previous in ROUTER_PRESETS:
            if self.router not in ROUTER_PRESETS:
                raise ValueError(
                    f"unknown router preset {self.router!r}; available presets: "
                    f"{sorted(ROUTER_PRESETS)}"
                )
            old = get_router_config(previous).to_dict()
            data = {key: value for key, value in data.items() if old.get(key) != value}
            # The coefficients were synced from the old preset; keep only real overrides.
            for name, attr in (
                ("aux_loss_coef", "router_aux_loss_coef"),
                ("z_loss_coef", "router_z_loss_coef"),
            ):
                if getattr(self, attr) == old[name]:
                    setattr(self, attr, None)
            self._resolved_router = self.router
        data["eval_routing"] = self.eval_routing
        if self.router_aux_loss_coef is not None:
            data["aux_loss_coef"] = float(self.router_aux_loss_coef)
        if self.router_z_loss_coef is not None:
            data["z_loss_coef"] = float(self.router_z_loss_coef)
        resolved = get_router_config(self.router, **data)
        self.router_config = resolved.to_dict()
        self.router_aux_loss_coef = resolved.aux_loss_coef
        self.router_z_loss_coef = resolved.z_loss_coef
        return resolved


# Saved configs carry `auto_map` and a copy of this file (see modeling_llama_moe.py).
LlamaMoEConfig.register_for_auto_class()

__all__ = ["LlamaMoEConfig"]
