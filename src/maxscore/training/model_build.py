"""The model of a run: its router and :class:`LlamaMoEConfig` from the options, and the model.

One straight line from the training config to the layers: :func:`run_router` resolves
``--router`` with ``--router-option`` (:func:`maxscore.routing.resolve.resolve_router`),
:func:`build_model_config` puts that :class:`~maxscore.routing.config.RouterConfig` into the
model config (which checks it against the model's sizes), and every MoE layer of the model
built by :func:`build_model` receives it as it is. A checkpoint given as ``--model`` resolves
its saved router with the options instead (:mod:`maxscore.training.pretrained`).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from transformers import set_seed

from maxscore.models import LlamaMoEConfig, LlamaMoEForCausalLM, get_model_config
from maxscore.routing.config import RouterConfig
from maxscore.routing.resolve import resolve_router
from maxscore.training.config import ConfigError, TrainConfig
from maxscore.training.fused_loss import enable_fused_loss
from maxscore.training.option_checks import validate_model_options
from maxscore.training.precision import apply_float8
from maxscore.training.pretrained import is_pretrained_model, pretrained_model_config

__all__ = [
    "apply_speed_options",
    "build_model",
    "build_model_config",
    "check_seq_len",
    "run_router",
]


def run_router(config: TrainConfig) -> RouterConfig | None:
    """The run's router: ``--router`` with ``--router-option`` resolved, or ``None`` for a
    checkpoint (its saved router is resolved with them when its config is read).

    Raises ConfigError naming the problem (unknown preset or option, a bad value, an option
    without effect for this router).
    """
    if is_pretrained_model(config.model):
        return None
    try:
        return resolve_router(config.router, config.router_overrides)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"invalid router settings: {err}") from err


def build_model_config(
    config: TrainConfig,
    vocab_size: int | None = None,
    special_tokens: dict[str, int | None] | None = None,
) -> LlamaMoEConfig:
    """The :class:`LlamaMoEConfig` of a model preset + the run's router + overrides, or of the
    checkpoint ``config.model`` names (which has its own vocabulary and special tokens).

    ``vocab_size`` and ``special_tokens`` come from the run's tokenizer (a preset's model).
    Raises ConfigError for unknown presets or invalid options, router sizes included (before
    any training).
    """
    router = run_router(config)
    if router is None:
        # A checkpoint directory or hub name (its own vocabulary and special tokens).
        return check_seq_len(config, pretrained_model_config(config))
    validate_model_options(config.model_overrides)
    overrides = dict(config.model_overrides)
    if vocab_size is not None:
        overrides.setdefault("vocab_size", vocab_size)
    # The tokenizer's BOS/EOS/PAD ids go into the model (and generation) config, so checkpoints
    # generate and pad correctly.
    for key, value in (special_tokens or {}).items():
        if value is not None:
            overrides.setdefault(key, value)
    try:
        model_config = get_model_config(
            config.model, router=config.router, router_config=router, **overrides
        )
    except (TypeError, ValueError) as err:
        raise ConfigError(f"invalid model/router settings: {err}") from err
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


def build_model(
    model_config: Any, seed: int, on_gpu: bool = False, *, to_cpu: bool = False
) -> LlamaMoEForCausalLM:
    """A freshly initialised :class:`LlamaMoEForCausalLM` (seeded).

    With ``on_gpu`` the weights are drawn directly on this process's GPU (``cuda:LOCAL_RANK``):
    initialising a Base-size model on the CPU first costs several seconds. The weights depend on
    where they are drawn (torch's CPU and CUDA generators give other numbers for one seed), so a
    run that hands its model to DeepSpeed (which places and partitions the parameters itself)
    draws them on the GPU too and moves them to the CPU (``to_cpu``): a ZeRO run then starts from
    the weights of a DDP or one-GPU run of the same seed. A model whose weights do not fit the
    GPU's free memory is drawn on the CPU, with a warning that its weights are the CPU's.
    """
    set_seed(seed)
    if on_gpu and torch.cuda.is_available():
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
        if not to_cpu:
            with device:
                return LlamaMoEForCausalLM(model_config)
        needed, free = _parameter_bytes(model_config), torch.cuda.mem_get_info(device)[0]
        if needed < 0.9 * free:
            with device:
                return LlamaMoEForCausalLM(model_config).to("cpu")
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"maxscore: the model's weights ({needed / 2**30:.1f} GiB) do not fit the free "
                f"memory of {device} ({free / 2**30:.1f} GiB), so they are drawn on the CPU; the "
                "CPU's random numbers differ from the GPU's, so this run starts from other "
                "weights than a run without DeepSpeed of the same seed",
                file=sys.stderr,
            )
    return LlamaMoEForCausalLM(model_config)


def _parameter_bytes(model_config: Any) -> int:
    """Bytes of the model's parameters and buffers (transformers' ``get_memory_footprint``),
    counted on the meta device (no memory)."""
    with torch.device("meta"):
        return LlamaMoEForCausalLM(model_config).get_memory_footprint()


def apply_speed_options(model: Any, config: TrainConfig, precision: str) -> None:
    """``--fused-loss`` and ``--precision fp8`` (``precision``: the resolved one) on a built
    model: the fused LM head + cross-entropy switched on
    (:func:`~maxscore.training.fused_loss.enable_fused_loss`), the dense linear layers converted
    to float8 training (:func:`~maxscore.training.precision.apply_float8`).

    Called after the model is built and before it is compiled (torchao's float8 casts compile
    with the layers) or wrapped (LoRA, DDP, expert parallelism); the options were checked by
    :func:`maxscore.training.prepare`. The training run and the throughput benchmarks call it.
    """
    if config.fused_loss:
        enable_fused_loss(model)
    if precision == "fp8":
        apply_float8(model)
