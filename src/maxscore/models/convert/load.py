"""Loading a checkpoint (local directory or hub name) as a Llama-MoE model with any router."""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers import AutoConfig, PreTrainedModel

from maxscore.models.configuration_llama_moe import LlamaMoEConfig
from maxscore.models.convert.family import (
    ConversionError,
    build_with_weights,
    common_config_fields,
    family_to_maxscore_state,
)
from maxscore.models.convert.registry import FAMILIES
from maxscore.models.convert.warm_start import warm_start_fields
from maxscore.models.modeling_llama_moe import LlamaMoEForCausalLM
from maxscore.routing.resolve import resolve_router

__all__ = [
    "DENSE_FAMILIES",
    "NATIVE_ROUTER",
    "UNSUPPORTED_FAMILIES",
    "checkpoint_config",
    "convert_model",
    "load_pretrained",
    "maxscore_config_from_family",
    "native_routing",
    "unsupported_message",
]

#: Router name meaning "route as the checkpoint's own family does" (converted models only).
NATIVE_ROUTER = "native"

#: Dense Llama-style families: ``maxscore upcycle`` turns them into MoEs.
DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

#: Families that are not converted, with the reason (shown in the error).
UNSUPPORTED_FAMILIES: dict[str, str] = {
    "deepseek_v3": "multi-head latent attention (low-rank q/kv, decoupled RoPE), YaRN RoPE and "
    "sigmoid group-limited routing over a correction bias need their own modules",
    "gpt_oss": "attention sinks, alternating sliding-window layers, YaRN RoPE, biased experts "
    "with a clamped SwiGLU and a biased router need their own modules",
}


def _router_settings(
    hf_config: Any, router: str | None, router_config: dict[str, Any] | None
) -> tuple[str, dict[str, Any]]:
    """Preset name and router fields: the family's weighting, then the user's overrides."""
    spec = FAMILIES[hf_config.model_type]
    fields = dict(spec.router_fields(hf_config))
    if router is None or router == NATIVE_ROUTER:
        # The family's routing: softmax top-k without capacity (our dropless), its aux-loss
        # coefficient, the loss measured over the whole micro-batch as transformers does.
        router = "dropless"
        fields.update(
            aux_loss_coef=float(getattr(hf_config, "router_aux_loss_coef", 0.01)),
            aux_loss_granularity="micro-batch",
        )
    fields.update(router_config or {})
    # The experts were trained under softmax weights: a SoftTopk preset starts at t = 0.
    fields.update(warm_start_fields(router, fields))
    return router, fields


def maxscore_config_from_family(
    hf_config: Any,
    router: str | None = None,
    router_config: dict[str, Any] | None = None,
    **overrides: Any,
) -> LlamaMoEConfig:
    """The :class:`LlamaMoEConfig` of a supported family's config, routed by ``router``.

    ``router=None`` or ``"native"`` routes as the family does; any preset name routes with that
    preset, keeping how the family weights expert outputs (``normalize_weights``).
    ``router_config`` overrides router fields, ``overrides`` other config fields.
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in FAMILIES:
        raise ConversionError(unsupported_message(model_type))
    spec = FAMILIES[model_type]
    spec.check(hf_config)
    fields = {
        **common_config_fields(hf_config),
        "num_experts_per_tok": hf_config.num_experts_per_tok,
        **spec.config_fields(hf_config),
    }
    name, router_fields = _router_settings(hf_config, router, router_config)
    source = hf_config.to_dict()
    fields.update(overrides)
    return LlamaMoEConfig(
        **fields,
        router=name,
        router_config=router_fields,
        source_family=model_type,
        source_config=source,
    )


def convert_model(
    hf_model: PreTrainedModel,
    router: str | None = None,
    router_config: dict[str, Any] | None = None,
    *,
    config: LlamaMoEConfig | None = None,
    **overrides: Any,
) -> LlamaMoEForCausalLM:
    """A Llama-MoE copy of a loaded family model (same weights, dtype and device).

    ``config``: the model config, when the caller already resolved it
    (:func:`maxscore_config_from_family`); else it is made from ``router``, ``router_config``
    and ``overrides``. Raises :class:`ConversionError` for an unsupported family or feature.
    """
    if config is None:
        config = maxscore_config_from_family(hf_model.config, router, router_config, **overrides)
    model = build_with_weights(
        lambda: LlamaMoEForCausalLM(config),
        family_to_maxscore_state(hf_model.state_dict()),
        # Router state the family has no notion of (schedule, DeepSeek-V3 bias) starts at 0.
        lambda name: (
            (".mlp.router." in name and not name.endswith("gate.weight"))
            or (config.tie_word_embeddings and name == "lm_head.weight")
        ),
        config.source_family or "conversion",
    )
    model.train(hf_model.training)
    return model


def unsupported_message(model_type: str | None) -> str:
    supported = ", ".join(sorted(FAMILIES))
    if model_type in UNSUPPORTED_FAMILIES:
        return (
            f"{model_type} checkpoints are not supported: {UNSUPPORTED_FAMILIES[model_type]}. "
            f"Supported MoE families: {supported}"
        )
    if model_type in DENSE_FAMILIES:
        return (
            f"this is a dense {model_type} checkpoint; turn it into an MoE first with "
            "`maxscore upcycle SOURCE OUTPUT --num-experts E` and train that"
        )
    return f"model_type {model_type!r} is not a supported MoE family (supported: {supported})"


def native_routing(config: LlamaMoEConfig) -> Any:
    """The :class:`~maxscore.routing.config.RouterConfig` of ``router="native"`` for a maxscore
    checkpoint: the routing of the family in ``config.source_family`` (the family it was
    converted from, or whose layout holds an upcycled model), rebuilt from ``source_config``.

    Raises :class:`ConversionError` for a checkpoint that has no such family (trained from
    scratch, or upcycled from a dense family no MoE family holds): "native" would name no
    routing, and keeping the trained router instead would not be what was asked.
    """
    family, source = config.source_family, config.source_config
    if family not in FAMILIES or source is None:
        origin = (
            f"upcycled from a dense {config.upcycled_from} model no MoE family holds"
            if config.upcycled_from
            else "not converted from a Hugging Face MoE family"
        )
        raise ConversionError(
            f"router {NATIVE_ROUTER!r} means the routing of the Hugging Face family a checkpoint "
            f"was converted from, and this checkpoint (trained with router {config.router!r}) "
            f"was {origin}; pass a router preset instead (for instance {config.router!r})"
        )
    family_config = AutoConfig.for_model(family, **_without_bookkeeping(source))
    name, fields = _router_settings(family_config, NATIVE_ROUTER, None)
    return resolve_router(name, fields)


def _without_bookkeeping(config_dict: dict[str, Any]) -> dict[str, Any]:
    """A saved config's fields without what ``save_pretrained`` adds (version, class names)."""
    skip = ("transformers_version", "architectures", "model_type", "auto_map")
    return {key: value for key, value in config_dict.items() if key not in skip}


def checkpoint_config(
    source: str,
    router: str | None = None,
    router_config: dict[str, Any] | None = None,
    **overrides: Any,
) -> LlamaMoEConfig:
    """The config of the maxscore checkpoint ``source`` with ``overrides``, routed by ``router``.

    ``overrides`` are applied by building the config anew from the stored fields and them, so
    they are checked like constructor arguments (an unknown key is refused, another family's
    name such as ``norm_topk_prob`` is honoured, shapes are validated). ``router``: a preset
    re-resolves the routing keeping the checkpoint's own overrides (for the weights of a family
    or an upcycling, a SoftTopk schedule starts at ``t = 0``: :mod:`.warm_start`); ``"native"``
    is the family's routing (:func:`native_routing`); ``None`` keeps the stored router.
    ``router_config`` is merged into the router fields last.
    """
    stored = LlamaMoEConfig.from_pretrained(source)
    given = dict(router_config or {})
    kwargs: dict[str, Any] = {"router_config": given} if given else {}
    if router == NATIVE_ROUTER:
        # A RouterConfig replaces every stored field (LlamaMoEConfig.from_dict).
        kwargs = {
            "router": "dropless",
            "router_config": resolve_router(native_routing(stored), given),
        }
    elif router is not None and router != stored.router:
        kwargs["router"] = router
        if stored.source_family is not None or stored.upcycled_from is not None:
            # Weights of a family or an upcycling given a new router (warm_start.py's rule).
            switched = LlamaMoEConfig.from_pretrained(source, **kwargs).router_config
            start = warm_start_fields(router, switched.to_dict(), given=given)
            kwargs["router_config"] = {**given, **start}
    config = LlamaMoEConfig.from_pretrained(source, **kwargs)
    if overrides:
        config = LlamaMoEConfig(**{**_without_bookkeeping(config.to_dict()), **overrides})
    return config


def load_pretrained(
    source: str,
    router: str | None = None,
    router_config: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    config: LlamaMoEConfig | None = None,
    **overrides: Any,
) -> LlamaMoEForCausalLM:
    """Load a checkpoint directory or hub name as a Llama-MoE model routed by ``router``.

    ``config``: the model config, when the caller already resolved it (``maxscore train`` does,
    before any weight is read); ``router``, ``router_config`` and ``overrides`` then do not apply.

    * a maxscore checkpoint: its weights in :func:`checkpoint_config` (``router`` /
      ``router_config`` / ``overrides`` really change the routing; ``"native"`` is refused for a
      checkpoint converted from no family);
    * a supported family (:data:`FAMILIES`): loaded with its transformers class, then converted
      (``router=None`` / ``"native"`` keeps the family's routing);
    * anything else: :class:`ConversionError` saying what is supported (dense checkpoints are
      pointed to ``maxscore upcycle``).
    """
    try:
        hf_config = AutoConfig.from_pretrained(source)
    except Exception as err:  # OSError, ValueError, the hub client's errors offline
        raise ConversionError(f"cannot read a model config from {source!r}: {err}") from err
    model_type = getattr(hf_config, "model_type", None)
    if model_type == LlamaMoEConfig.model_type and config is not None:
        return LlamaMoEForCausalLM.from_pretrained(source, dtype=dtype, config=config)
    if model_type == LlamaMoEConfig.model_type:
        try:
            config = checkpoint_config(source, router, router_config, **overrides)
        except (TypeError, ValueError) as err:
            if isinstance(err, ConversionError):
                raise
            raise ConversionError(f"invalid model/router settings for {source!r}: {err}") from err
        return LlamaMoEForCausalLM.from_pretrained(source, config=config, dtype=dtype)
    if model_type not in FAMILIES:
        raise ConversionError(unsupported_message(model_type))
    model_class = getattr(transformers, FAMILIES[model_type].model_class)
    hf_model = model_class.from_pretrained(source, dtype=dtype)
    model = convert_model(hf_model, router, router_config, config=config, **overrides)
    model.config.name_or_path = str(source)
    del hf_model
    return model
