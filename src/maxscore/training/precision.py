"""Precision of a run: which one ``"auto"`` means here, float8 layers, half-precision outputs.

The Trainer's ``bf16`` / ``fp16`` flags run the model under autocast; :func:`resolve_precision`
picks the precision (and refuses one this machine cannot run), :func:`autocast_dtype` is the
autocast a precision runs under, :func:`apply_float8` converts the dense linear layers for
``"fp8"`` and :func:`keep_half_precision_outputs` removes accelerate's fp32 copy of the outputs.
"""

from __future__ import annotations

import importlib.util
from types import MethodType
from typing import Any

import torch
from accelerate.utils.operations import ConvertOutputsToFp32
from torch import nn

from maxscore.training.config import ConfigError
from maxscore.training.distributed import unwrap

__all__ = [
    "FLOAT8_LAYERS",
    "apply_float8",
    "autocast_dtype",
    "check_float8",
    "float8_module_filter",
    "keep_half_precision_outputs",
    "resolve_precision",
]

#: Names of the ``nn.Linear`` layers that ``"fp8"`` converts: the attention projections and
#: the SwiGLU of dense layers and of shared experts. The LM head (its output is the loss's
#: input; torchtitan keeps it in bf16 too), the router gates (tiny, and their logits decide the
#: routing) and the shared-expert gate are not in it. The routed experts are 3-D parameters
#: multiplied by ``torch.bmm`` / ``torch._grouped_mm`` (:mod:`maxscore.moe.experts`), which
#: torchao's float8 training does not convert: they stay bf16.
FLOAT8_LAYERS = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
)


def resolve_precision(precision: str) -> str:
    """``"auto"`` -> bf16 on a CUDA GPU that supports it, else fp32; a precision this machine
    cannot run is refused (:func:`check_float8` for ``"fp8"``)."""
    if precision != "auto":
        if precision in ("bf16", "fp16", "fp8") and not torch.cuda.is_available():
            raise ConfigError(f"precision {precision} needs a CUDA GPU; use fp32 (or auto) on CPU")
        if precision == "fp8":
            check_float8()
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


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype a resolved precision trains under (``None``: fp32, no autocast).

    ``"fp8"`` is bf16 autocast around the float8 layers: everything but their matmuls runs as
    under ``"bf16"``.
    """
    return {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp16": torch.float16}.get(precision)


def check_float8() -> None:
    """Refuse ``"fp8"`` on a GPU without float8 matmuls (compute capability below 8.9) or
    without torchao; call it only where a CUDA GPU is present."""
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        raise ConfigError(
            f"fp8 needs an H100/H200/Ada GPU (compute capability 8.9+), this one is "
            f"{major}.{minor}; use bf16"
        )
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            "precision fp8 needs torchao, which is not installed: pip install 'maxscore[speed]'"
        )


def float8_module_filter(module: nn.Module, fqn: str) -> bool:
    """Whether torchao converts the layer ``fqn``: an ``nn.Linear`` named in
    :data:`FLOAT8_LAYERS` whose in and out features are multiples of 16 (the float8 matmul's
    alignment)."""
    return (
        isinstance(module, nn.Linear)
        and fqn.rsplit(".", 1)[-1] in FLOAT8_LAYERS
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def apply_float8(model: nn.Module) -> list[str]:
    """Convert ``model``'s dense linear layers to torchao float8 training in place; the names of
    the converted layers.

    torchao's ``convert_to_float8_training`` with its default recipe (dynamic tensorwise
    scaling: e4m3 inputs and weights, e5m2 gradients) swaps each layer that
    :func:`float8_module_filter` selects for a ``Float8Linear``, which keeps ``weight`` (and
    ``bias``) as ordinary fp32 parameters and casts to float8 inside its matmuls: the state dict
    keeps its keys and dtypes, so checkpoints and exports are unchanged. Call it before
    ``compile_layers`` (torchao's float8 is meant to be compiled after conversion, which fuses
    its scaling and casts) and before DDP / FSDP wrap the model.
    """
    # Imported here: torchao is an optional dependency (maxscore[speed]) needed only for fp8.
    from torchao.float8 import convert_to_float8_training

    converted: list[str] = []

    def select(module: nn.Module, fqn: str) -> bool:
        chosen = float8_module_filter(module, fqn)
        if chosen:
            converted.append(fqn)
        return chosen

    convert_to_float8_training(model, module_filter_fn=select)
    return converted
