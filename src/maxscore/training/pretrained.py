"""Training from a checkpoint: ``maxscore train --model <directory or hub name>``.

A ``--model`` that is not a model preset names a checkpoint: a maxscore checkpoint (a run's, an
upcycled one) or a supported Hugging Face MoE family (:mod:`maxscore.models.convert`), which is
converted on load. ``--router`` then routes it (``native``: the family's own routing), with
``--router-option`` overrides; ``--model-option`` sets other config fields (for instance
``eval_routing``; architecture fields must keep matching the weights). The tokenizer defaults
to the checkpoint's own when it has one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from maxscore.training.config import ConfigError, TrainConfig

__all__ = [
    "is_pretrained_model",
    "load_pretrained_model",
    "pretrained_model_config",
    "pretrained_tokenizer",
]

_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def is_pretrained_model(name: str) -> bool:
    """True when ``name`` is not a model preset (so it names a checkpoint)."""
    from maxscore.models.presets import MODEL_PRESETS

    return name not in MODEL_PRESETS


def _router_kwargs(config: TrainConfig) -> dict[str, Any]:
    return {
        "router": config.router,
        "router_config": dict(config.router_overrides) or None,
    }


def pretrained_model_config(config: TrainConfig) -> Any:
    """The :class:`LlamaMoEConfig` the checkpoint ``config.model`` loads as (no weights read).

    Raises ConfigError naming the problem: no such directory / hub name, an unsupported family,
    an unknown router preset, bad overrides.
    """
    from transformers import AutoConfig

    from maxscore.models import LlamaMoEConfig
    from maxscore.models.convert import NATIVE_ROUTER, ConversionError, maxscore_config_from_family
    from maxscore.models.convert.load import _unsupported_message
    from maxscore.routing.presets import ROUTER_PRESETS

    if config.router not in ROUTER_PRESETS and config.router != NATIVE_ROUTER:
        raise ConfigError(
            f"unknown router preset {config.router!r}; available: {sorted(ROUTER_PRESETS)} "
            f"(or {NATIVE_ROUTER!r} for a converted model's own routing)"
        )
    try:
        hf_config = AutoConfig.from_pretrained(config.model)
    except Exception as err:  # OSError, ValueError, the hub client's own errors offline
        from maxscore.models.presets import MODEL_PRESETS

        raise ConfigError(
            f"unknown model preset {config.model!r} (presets: {sorted(MODEL_PRESETS)}), and not "
            f"a readable checkpoint directory or hub name either: {type(err).__name__}: {err}"
        ) from err
    kwargs = _router_kwargs(config)
    try:
        if hf_config.model_type == LlamaMoEConfig.model_type:
            if kwargs["router"] == NATIVE_ROUTER:
                kwargs.pop("router")
            return LlamaMoEConfig.from_pretrained(
                config.model,
                **{k: v for k, v in kwargs.items() if v is not None},
                **config.model_overrides,
            )
        return maxscore_config_from_family(hf_config, **kwargs, **config.model_overrides)
    except ConversionError as err:
        raise ConfigError(str(err)) from err
    except (TypeError, ValueError) as err:
        if getattr(hf_config, "model_type", None) is None:
            raise ConfigError(_unsupported_message(None)) from err
        raise ConfigError(f"invalid model/router settings for {config.model!r}: {err}") from err


def load_pretrained_model(
    config: TrainConfig, on_gpu: bool = False, temperature: dict[str, Any] | None = None
) -> Any:
    """The checkpoint's weights in the model :func:`pretrained_model_config` describes.

    ``temperature``: the run's resolved SoftTopk ``t`` schedule (start, end, steps, shape;
    :mod:`maxscore.training.temperature`), which replaces the checkpoint's.
    """
    import os

    from maxscore.models.convert import ConversionError, load_pretrained

    kwargs = _router_kwargs(config)
    if temperature is not None:
        kwargs["router_config"] = {**(kwargs["router_config"] or {}), "temperature": temperature}
    try:
        model = load_pretrained(config.model, **kwargs, **config.model_overrides)
    except ConversionError as err:
        raise ConfigError(str(err)) from err
    if on_gpu and torch.cuda.is_available():
        model.to(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    return model


def pretrained_tokenizer(config: TrainConfig) -> str:
    """The tokenizer to use: ``--tokenizer`` if given, else the checkpoint's own if it has one."""
    if config.tokenizer not in ("default", "embedded"):
        return config.tokenizer
    path = Path(config.model)
    if path.is_dir():
        return str(path) if any((path / m).is_file() for m in _TOKENIZER_MARKERS) else "default"
    return config.model  # a hub name: its tokenizer (needs the hub, like the weights)
