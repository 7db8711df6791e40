"""Configuration of the Llama-MoE causal language model (the paper's model family).

The configuration is a Hugging Face :class:`~transformers.PreTrainedConfig`, so it saves to / loads
from ``config.json`` and is found by ``AutoConfig`` (``model_type = "maxscore_llama_moe"``).

Routing is described by a router preset name (``router``, see :mod:`maxscore.routing.presets`)
plus optional field overrides (``router_config``). On construction the preset is *resolved*, once,
by :func:`maxscore.routing.resolve.resolve_router` for this model's sizes: ``router_config`` then
holds the :class:`~maxscore.routing.config.RouterConfig` object, the one home of every router
setting, which every MoE layer receives as it is. :meth:`LlamaMoEConfig.to_dict` writes it as a
dict, so a saved checkpoint is self-describing and reloads with exactly the same router even if
the preset table changes later; ``from_pretrained(path, router=..., router_config=...)`` resolves
the saved router with the new preset or fields (:meth:`LlamaMoEConfig.from_dict`). Router
presets whose strategy is ``"dense"`` make every MLP a dense SwiGLU.

This file is also copied into saved checkpoints (``auto_map``) so that
``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`` works; it therefore only
imports ``maxscore`` with absolute imports.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Literal

from transformers import PreTrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from maxscore.config_types import check_value
from maxscore.models.config_names import FOREIGN_NAMES, apply_foreign_names, check_unknown_keys
from maxscore.routing.config import EvalRouting, RouterConfig
from maxscore.routing.presets import ROUTER_PRESETS
from maxscore.routing.resolve import (
    RouterSizes,
    ineffective_options,
    preset_config,
    resolve_router,
)

QkNorm = Literal["head", "full"]

#: Router settings that also have a top-level name, and the RouterConfig field each one is:
#: transformers' MoE configs call the aux-loss coefficient ``router_aux_loss_coef`` and the
#: renormalisation of the top-k weights ``norm_topk_prob`` (Qwen-MoE, OLMoE). The
#: constructor, ``from_pretrained`` and ``--model-option`` accept them; reading them reads
#: ``router_config``, their one home, and setting one resolves the router with it (they are not
#: saved separately).
ROUTER_SETTING_ALIASES: dict[str, str] = {
    "router_aux_loss_coef": "aux_loss_coef",
    "router_z_loss_coef": "z_loss_coef",
    "eval_routing": "eval_routing",
    "norm_topk_prob": "normalize_weights",
}
#: The types the aliases accept (``None`` for a coefficient: the preset's value).
ROUTER_SETTING_TYPES: dict[str, Any] = {
    "router_aux_loss_coef": float | None,
    "router_z_loss_coef": float | None,
    "eval_routing": EvalRouting,
    "norm_topk_prob": bool,
}

#: Attention kinds of ``layer_types`` (transformers' names).
LAYER_TYPES: tuple[str, ...] = ("full_attention", "sliding_attention")


def _setting_overrides(settings: Mapping[str, Any]) -> dict[str, Any]:
    """RouterConfig overrides of top-level settings (a ``None`` setting sets nothing)."""
    out = {}
    for alias, value in settings.items():
        field = ROUTER_SETTING_ALIASES[alias]
        if value is not None:
            out[field] = float(value) if field.endswith("_coef") else value
    return out


def _router_setting(alias: str) -> property:
    """The top-level ``alias`` of a router setting: ``router_config``'s field, and setting it
    resolves the router with the new value (``None``: the preset's)."""
    field = ROUTER_SETTING_ALIASES[alias]

    def get(self: LlamaMoEConfig) -> Any:
        return getattr(self.router_config, field)

    def set_(self: LlamaMoEConfig, value: Any) -> None:
        if value is None:
            value = getattr(preset_config(self.router), field)
        overrides = _setting_overrides({alias: value})
        self.router_config = resolve_router(self.router_config, overrides, self.router_sizes())

    return property(get, set_, doc=f"``router_config.{field}``")


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
        rope_theta: RoPE base frequency (the same value as ``rope_parameters["rope_theta"]``;
            setting either sets both).
        rope_parameters: transformers' RoPE description: ``{"rope_type": "default"}`` (plain
            RoPE) or a scaled RoPE of ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``
            (``"linear"``, ``"dynamic"``, ``"yarn"``, ``"longrope"``, ``"llama3"``) with its
            parameters. ``rope_scaling`` (the older name) is read into it.
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
        router_config: overrides of :class:`~maxscore.routing.config.RouterConfig` fields, or a
            whole RouterConfig; after construction the resolved RouterConfig, the one home of
            every router setting (a dict only in :meth:`to_dict`).
        router_aux_loss_coef: load-balancing loss coefficient λ, ``router_config.aux_loss_coef``
            (a constructor argument wins over the one in ``router_config``; ``None`` keeps it).
        router_z_loss_coef: router z-loss coefficient, ``router_config.z_loss_coef`` (as above).
        output_router_logits: return every MoE layer's gate logits by default.
        eval_routing: routing used in ``eval()`` mode, ``router_config.eval_routing``:
            ``"causal"`` (the presets' default: no token's experts depend on later tokens) or
            ``"train"`` (the training routing, which may leak).
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
        sliding_window: attend to at most this many previous tokens (Mixtral's
            ``sliding_window``) in every layer, or with ``layer_types`` in its
            ``"sliding_attention"`` layers; ``None`` (or 0) = full causal attention.
        layer_types: per layer ``"full_attention"`` or ``"sliding_attention"`` (transformers'
            name; Qwen2 / Qwen2-MoE / Qwen3 windows on some layers only); ``None`` = every layer
            as ``sliding_window`` says.
        shared_expert_gate: scale the shared experts' output by a learned per-token sigmoid gate
            (Qwen2-MoE).
        source_family: the Hugging Face model family the weights were converted from
            (``maxscore.models.convert.FAMILIES``), ``None`` for native models; with
            ``source_config`` (the original configuration) it lets ``export`` write the model
            back in that family's format. For an upcycled model: the MoE family whose layout
            holds it (Mixtral for Llama / Mistral, Qwen3-MoE for Qwen3), so it exports the same
            way; ``None`` when no family does.
        upcycled_from: ``model_type`` of the dense checkpoint an upcycled model was made from
            (:mod:`maxscore.models.upcycle`), ``None`` otherwise.

    Names other families give the same settings (``num_local_experts``, ``mlp_only_layers``,
    ``decoder_sparse_step``, ``norm_topk_prob``, ``rope_scaling``, ...) are honoured or refused
    with the reason (:mod:`maxscore.models.config_names`); any other unknown key is refused.
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
    rope_parameters: dict[str, Any] | None = None
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
    router_config: RouterConfig | dict[str, Any] | None = None
    output_router_logits: bool = False
    first_k_dense: int = 0
    moe_layer_freq: int = 1
    dense_layers: list[int] | None = None
    attention_qkv_bias: bool = False
    attention_output_bias: bool = False
    qk_norm: QkNorm | None = None
    clip_qkv: float | None = None
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    shared_expert_gate: bool = False
    source_family: str | None = None
    source_config: dict[str, Any] | None = None
    upcycled_from: str | None = None

    # Views of router_config (not dataclass fields: no annotation), see ROUTER_SETTING_ALIASES.
    router_aux_loss_coef = _router_setting("router_aux_loss_coef")
    router_z_loss_coef = _router_setting("router_z_loss_coef")
    eval_routing = _router_setting("eval_routing")
    norm_topk_prob = _router_setting("norm_topk_prob")

    def __post_init__(self, **kwargs: Any) -> None:
        settings = {alias: kwargs.pop(alias) for alias in ROUTER_SETTING_ALIASES if alias in kwargs}
        apply_foreign_names(self, kwargs)
        check_unknown_keys(kwargs, [*LlamaMoEConfig.__annotations__, *ROUTER_SETTING_ALIASES])
        self._standardize_rope(kwargs.pop("rope_scaling", None))
        self._validate_shapes()
        self._validate_architecture()
        self.router_config = self._resolve_router(settings)
        super().__post_init__(**kwargs)
        self._validate_rope()

    def _resolve_router(self, settings: Mapping[str, Any]) -> RouterConfig:
        """The RouterConfig of ``router`` + ``router_config`` + top-level ``settings``, for this
        model's sizes (:func:`~maxscore.routing.resolve.resolve_router`)."""
        given = self.router_config
        overrides = _setting_overrides(settings)
        if isinstance(given, RouterConfig):
            return resolve_router(given, overrides, self.router_sizes())
        if given is not None and not isinstance(given, Mapping):
            raise ValueError(
                "router_config must be an object of RouterConfig fields or a RouterConfig, got "
                f"{given!r} ({type(given).__name__})"
            )
        return resolve_router(self.router, {**(given or {}), **overrides}, self.router_sizes())

    def __setattr__(self, key: str, value: Any) -> None:
        constructed = isinstance(self.__dict__.get("router_config"), RouterConfig)
        # The router is resolved once, when the config is made; a later `router = ...` would
        # only rename it. Routers change through a new config or from_pretrained(router=...).
        if key == "router" and constructed:
            raise AttributeError(
                "the router is set when the config is made: LlamaMoEConfig(router=...), "
                "get_model_config(preset, router=...) or from_pretrained(path, router=...)"
            )
        if key in FOREIGN_NAMES and constructed:
            # Another family's name (`from_pretrained(path, num_local_experts=8)` sets it).
            apply_foreign_names(self, {key: value})
            return
        if key in ("rope_parameters", "rope_scaling") and self.__dict__.get("_post_init_done"):
            self.__dict__["rope_parameters"] = None  # replaced, not merged
            self._standardize_rope(value)
            self._validate_rope()
            return
        super().__setattr__(key, value)
        if key == "rope_theta" and self.__dict__.get("rope_parameters") is not None:
            # rope_theta and rope_parameters["rope_theta"] are one setting.
            self.rope_parameters["rope_theta"] = value

    def __getattr__(self, key: str) -> Any:
        # Only reached when normal lookup fails: other families' names read our fields.
        entry = FOREIGN_NAMES.get(key)
        constructed = isinstance(self.__dict__.get("router_config"), RouterConfig)
        if entry is not None and entry.read is not None and constructed:
            return entry.read(self)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {key!r}")

    def router_sizes(self) -> RouterSizes:
        """The sizes every MoE layer's router is resolved for."""
        return RouterSizes(self.hidden_size, self.num_experts, self.num_experts_per_tok)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        """A saved config (``config.json``) with ``from_pretrained``'s keyword changes.

        The saved ``router_config`` is the router the model was built with (fields it lacks,
        from older files, take its preset's values). ``router=`` switches to another preset,
        keeping the saved fields that differ from the old preset's (the model's own settings,
        e.g. a converted Mixtral's ``normalize_weights``) where the new router uses them;
        ``router_config=`` (fields, or a RouterConfig replacing the router) and the top-level
        settings (``router_aux_loss_coef=``; ``None``: the preset's) change it further. Top-level
        settings saved by older versions win over the saved fields, as they did then.

        A keyword this config does not know is refused instead of dropped
        (``LlamaMoEConfig.from_pretrained(path, bogus=1)``); with ``return_unused_kwargs`` (how
        ``from_pretrained`` of a model asks) they go back as usual.
        """
        data = dict(config_dict)
        name = data.get("router", cls.router)
        saved = _saved_router(name, data.get("router_config"))
        new_name = kwargs.pop("router", None)
        if new_name is not None and new_name != name:
            saved, name = _switched_router(saved, name, new_name), new_name
        changes = kwargs.pop("router_config", None)
        if isinstance(changes, RouterConfig):
            saved, changes = changes, None
        legacy = {alias: data.pop(alias) for alias in ROUTER_SETTING_ALIASES if alias in data}
        given = {alias: kwargs.pop(alias) for alias in ROUTER_SETTING_ALIASES if alias in kwargs}
        for alias, value in given.items():
            if value is None:  # the preset's value
                given[alias] = getattr(preset_config(name), ROUTER_SETTING_ALIASES[alias])
        overrides = {
            **dict(changes or {}),
            **_setting_overrides(legacy),
            **_setting_overrides(given),
        }
        data["router"] = name
        data["router_config"] = resolve_router(saved, overrides)
        if kwargs.get("return_unused_kwargs"):
            return super().from_dict(data, **kwargs)
        config, unused = super().from_dict(data, **kwargs, return_unused_kwargs=True)
        unknown = {k: v for k, v in unused.items() if not k.startswith("_")}
        check_unknown_keys(unknown, [*LlamaMoEConfig.__annotations__, *ROUTER_SETTING_ALIASES])
        return config

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if isinstance(self.router_config, RouterConfig):
            out["router_config"] = self.router_config.to_dict()
        return out

    # -- RoPE ---------------------------------------------------------------------------------------

    def _standardize_rope(self, rope_scaling: dict[str, Any] | None = None) -> None:
        """``rope_parameters`` (or the older ``rope_scaling``) as transformers standardises it,
        with ``rope_theta`` in it and in the top-level field alike."""
        params = dict(rope_scaling or self.__dict__.get("rope_parameters") or {})
        if "type" in params:  # the older key of rope_type
            params.setdefault("rope_type", params.pop("type"))
        params.setdefault("rope_type", "default")
        if params.get("rope_theta") is not None:
            self.__dict__["rope_theta"] = float(params["rope_theta"])
        params["rope_theta"] = self.rope_theta
        if params["rope_type"] in ("llama3", "yarn", "longrope"):
            # The pretraining length the scaling is relative to (transformers' default).
            params.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        self.__dict__["rope_parameters"] = params

    def _validate_rope(self) -> None:
        """The RoPE type is one transformers computes, with the parameters it needs."""
        params = self.rope_parameters
        rope_type = params["rope_type"]
        known = ["default", *ROPE_INIT_FUNCTIONS]
        if rope_type not in known:
            raise ValueError(f"rope_parameters: unknown rope_type {rope_type!r}; known: {known}")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(
                "rope_parameters: partial_rotary_factor (RoPE on part of each head) is not "
                "implemented by the Llama-MoE model; use 1.0"
            )
        try:
            self.validate_rope()
        except KeyError as err:  # transformers' "Missing required keys in rope_parameters"
            raise ValueError(f"rope_parameters: {err.args[0] if err.args else err}") from None

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
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")

    def _validate_architecture(self) -> None:
        problem = check_value("qk_norm", self.qk_norm, QkNorm | None)
        if problem is not None:
            raise ValueError(problem)
        if self.clip_qkv is not None and not self.clip_qkv > 0:
            raise ValueError(f"clip_qkv must be > 0 or None, got {self.clip_qkv}")
        if self.sliding_window == 0:
            self.sliding_window = None  # Qwen writes 0 for "no window"
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise ValueError(
                f"sliding_window must be a positive int or None, got {self.sliding_window!r}"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers or any(
                kind not in LAYER_TYPES for kind in self.layer_types
            ):
                raise ValueError(
                    f"layer_types must list one of {LAYER_TYPES} per layer "
                    f"({self.num_hidden_layers}), got {self.layer_types!r}"
                )
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types has 'sliding_attention' layers but no sliding_window")
        if self.shared_expert_gate and self.num_shared_experts < 1:
            raise ValueError("shared_expert_gate needs num_shared_experts >= 1")
        for index in self.dense_layers or []:
            if not isinstance(index, int) or not 0 <= index < self.num_hidden_layers:
                raise ValueError(
                    f"dense_layers holds {index!r}, not a layer index in "
                    f"[0, num_hidden_layers={self.num_hidden_layers})"
                )

    # -- derived quantities -----------------------------------------------------------------------

    @property
    def is_dense(self) -> bool:
        """True when the router preset is the dense baseline (every MLP is a dense SwiGLU)."""
        return self.router_config.is_dense

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` has an MoE MLP (else a dense SwiGLU MLP)."""
        if self.is_dense or layer_idx < self.first_k_dense:
            return False
        if layer_idx in (self.dense_layers or []):
            return False
        return (layer_idx - self.first_k_dense) % self.moe_layer_freq == 0

    def layer_attention(self, layer_idx: int) -> str:
        """``"sliding_attention"`` or ``"full_attention"``: the attention of layer ``layer_idx``."""
        if self.layer_types is not None:
            return self.layer_types[layer_idx]
        return "full_attention" if self.sliding_window is None else "sliding_attention"


def _saved_router(name: str, saved: Any) -> RouterConfig:
    """The router a saved config was built with: its fields over its preset's (older files
    lack newer fields); a RouterConfig as it is. (:meth:`LlamaMoEConfig.from_dict` resolves
    it.)"""
    if isinstance(saved, RouterConfig):
        return saved
    preset = ROUTER_PRESETS[name].config.to_dict() if name in ROUTER_PRESETS else {}
    return RouterConfig.from_dict({**preset, **dict(saved or {})})


def _switched_router(saved: RouterConfig, old: str, new: str) -> RouterConfig:
    """Preset ``new`` with the fields of ``saved`` that differ from preset ``old`` (the model's
    own settings), except those the new router would not use."""
    before = ROUTER_PRESETS[old].config.to_dict() if old in ROUTER_PRESETS else {}
    own = {key: value for key, value in saved.to_dict().items() if before.get(key) != value}
    unused = ineffective_options(replace(preset_config(new), **own))
    return replace(
        preset_config(new), **{key: value for key, value in own.items() if key not in unused}
    )


# Saved configs carry `auto_map` and a copy of this file (see modeling_llama_moe.py).
LlamaMoEConfig.register_for_auto_class()

__all__ = ["LlamaMoEConfig"]
