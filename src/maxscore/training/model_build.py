"""The model of a run: its :class:`LlamaMoEConfig` from the presets and options, and the model.

:func:`build_model_config` turns a run's model preset, router preset and ``--model-option`` /
``--router-option`` overrides into the model config (the router preset is resolved by the
config itself, through :func:`maxscore.routing.presets.get_router_config`), checking everything
before any training; :func:`build_model` creates the seeded model, on the GPU when asked.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from maxscore.training.config import ConfigError, TrainConfig
from maxscore.training.option_checks import (
    validate_model_options,
    validate_router_options,
    validate_router_setup_of,
)

__all__ = ["build_model", "build_model_config", "check_seq_len"]


def build_model_config(
    config: TrainConfig, vocab_size: int, special_tokens: dict[str, int | None] | None = None
) -> Any:
    """The :class:`LlamaMoEConfig` of a model preset + router preset + overrides.

    The router preset is resolved by the model config (``LlamaMoEConfig``, through
    ``maxscore.routing.presets.get_router_config``). Raises ConfigError for unknown presets or
    invalid overrides (before any training).
    """
    from maxscore.models.presets import get_model_config
    from maxscore.training.pretrained import is_pretrained_model, pretrained_model_config

    if is_pretrained_model(config.model):
        # A checkpoint directory or hub name (its own vocabulary and special tokens).
        return check_seq_len(config, pretrained_model_config(config))
    validate_model_options(config.model_overrides)
    validate_router_options(config.router_overrides)
    overrides = dict(config.model_overrides)
    overrides.setdefault("vocab_size", vocab_size)
    # The tokenizer's BOS/EOS/PAD ids go into the model (and generation) config, so checkpoints
    # generate and pad correctly.
    for key, value in (special_tokens or {}).items():
        if value is not None:
            overrides.setdefault(key, value)
    if config.router_overrides:
        overrides["router_config"] = {
            **(overrides.get("router_config") or {}),
            **config.router_overrides,
        }
    try:
        model_config = get_model_config(config.model, router=config.router, **overrides)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"invalid model/router settings: {err}") from err
    validate_router_setup_of(model_config)
    return check_seq_len(config, model_config)


def check_seq_len(config: TrainConfig, model_config: Any) -> Any:
    """``model_config``, once ``config.seq_len`` fits its ``max_position_embeddings``."""
    max_len = getattr(model_config, "max_position_embeddings", None)
    if max_len is not None and config.seq_len > max_len:
        raise ConfigError(
            f"seq_len={config.seq_len} is above the model's maximum of {max_len} tokens "
            f"(preset {config.model!r}); use a shorter --seq-len or override "
            "max_position_embeddings"
        )
    return model_config


def build_model(model_config: Any, seed: int, on_gpu: bool = False) -> Any:
    """A freshly initialised :class:`LlamaMoEForCausalLM` (seeded).

    With ``on_gpu`` the weights are created and initialised directly on this process's GPU
    (``cuda:LOCAL_RANK``): initialising a Base-size model on the CPU first costs several seconds.
    """
    from transformers import set_seed

    from maxscore.models import LlamaMoEForCausalLM

    set_seed(seed)
    if on_gpu and torch.cuda.is_available():
        with torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"):
            return LlamaMoEForCausalLM(model_config)
    return LlamaMoEForCausalLM(model_config)
