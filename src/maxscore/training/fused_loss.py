"""``--fused-loss``: the LM head and cross-entropy in one liger-kernel kernel during training.

:func:`check_fused_loss` refuses the option where it cannot work, before anything runs;
:func:`enable_fused_loss` turns the model's switch on
(:meth:`~maxscore.models.LlamaMoEForCausalLM.use_fused_linear_cross_entropy`). The switch is a
runtime attribute of the model object rather than a config field, so ``config.json`` and the
saved checkpoints do not change and load in plain transformers without liger-kernel.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from maxscore.training.config import ConfigError, TrainConfig
from maxscore.training.distributed import zero_stage

__all__ = ["check_fused_loss", "enable_fused_loss"]


def check_fused_loss(config: TrainConfig) -> None:
    """Refuse ``fused_loss`` without a CUDA GPU, with ZeRO-3 or without liger-kernel."""
    if not config.fused_loss:
        return
    if not torch.cuda.is_available():
        raise ConfigError(
            "--fused-loss runs liger-kernel's Triton kernels, which need a CUDA GPU; "
            "leave it off on CPU"
        )
    if config.deepspeed is not None and zero_stage(config.deepspeed) == 3:
        # ZeRO-3 gathers a partitioned weight when its module runs; the fused loss reads
        # lm_head.weight without running lm_head.
        raise ConfigError(
            "--fused-loss does not combine with ZeRO-3 (the LM head's weight stays "
            "partitioned); use --deepspeed zero2 or leave --fused-loss off"
        )
    if importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError(
            "--fused-loss needs liger-kernel, which is not installed: pip install 'maxscore[speed]'"
        )


def enable_fused_loss(model: Any) -> None:
    """Turn on ``model``'s fused LM head + cross-entropy for training forwards."""
    switch = getattr(model, "use_fused_linear_cross_entropy", None)
    if switch is None:
        raise ConfigError(
            f"--fused-loss is implemented for maxscore's Llama-MoE model, not for "
            f"{type(model).__name__}"
        )
    switch(True)
