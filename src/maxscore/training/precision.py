"""Precision of a run: which one ``"auto"`` means here, and half-precision model outputs.

The Trainer's ``bf16`` / ``fp16`` flags run the model under autocast; :func:`resolve_precision`
picks the precision and :func:`keep_half_precision_outputs` removes accelerate's fp32 copy of the
outputs.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch
from accelerate.utils.operations import ConvertOutputsToFp32

from maxscore.training.config import ConfigError
from maxscore.training.distributed import unwrap

__all__ = ["keep_half_precision_outputs", "resolve_precision"]


def resolve_precision(precision: str) -> str:
    """``"auto"`` -> bf16 on a CUDA GPU that supports it, else fp32."""
    if precision != "auto":
        if precision in ("bf16", "fp16") and not torch.cuda.is_available():
            raise ConfigError(f"precision {precision} needs a CUDA GPU; use fp32 (or auto) on CPU")
        return precision
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


def keep_half_precision_outputs(model: Any) -> bool:
    """Undo accelerate's fp32 conversion of the model's outputs (bf16 / fp16 autocast runs).

    With native mixed precision, accelerate wraps ``forward`` so that every half-precision output
    is cast to fp32. The loss is already computed in fp32 inside ``forward``; the other outputs
    are the logits, ``[B, L, vocab]``, whose fp32 copy costs 6.5 ms per Base micro-batch of
    128 x 512 tokens (4% of the step) and 3.9 GiB of peak memory
    (``benchmarks/train_throughput/README.md``). The autocast wrapper stays; only the conversion
    is removed. Accelerate wraps the model before DDP does, so the wrapper sits on the inner module;
    the outer one is checked too. Returns whether a conversion was removed.
    """
    removed = False
    for target in {id(m): m for m in (model, unwrap(model))}.values():
        forward = target.__dict__.get("forward")  # accelerate sets an instance attribute
        if forward is None:
            continue
        bound = isinstance(forward, MethodType)
        wrapper = getattr(forward.__func__ if bound else forward, "__wrapped__", None)
        if isinstance(wrapper, ConvertOutputsToFp32):
            inner = wrapper.model_forward
            target.forward = MethodType(inner, target) if bound else inner
            removed = True
    return removed
