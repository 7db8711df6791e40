"""The process-wide float32 matmul precision, as it was before a run.

``TrainingArguments`` switches TF32 on for the whole process when it is built on a GPU with bf16
or ``tf32=True`` (transformers' ``enable_tf32``), and never switches it back. A program that
trains and then computes in float32 (a test comparing two models, an analysis after training)
would silently get TF32 matmuls (about 1e-3 relative error instead of 1e-7).
:func:`kept_matmul_precision` puts the setting back when the run ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["kept_matmul_precision"]


def _read() -> dict[str, object]:
    # torch >= 2.9: one generic setting that transformers writes; reading the legacy
    # ``allow_tf32`` flags after it was written through the new API raises, so only the API in
    # use is read.
    if hasattr(torch.backends, "fp32_precision"):
        return {"fp32_precision": torch.backends.fp32_precision}
    return {
        "matmul": torch.backends.cuda.matmul.allow_tf32,
        "cudnn": torch.backends.cudnn.allow_tf32,
    }


def _write(saved: dict[str, object]) -> None:
    if "fp32_precision" in saved:
        torch.backends.fp32_precision = saved["fp32_precision"]  # type: ignore[attr-defined]
    else:
        torch.backends.cuda.matmul.allow_tf32 = bool(saved["matmul"])
        torch.backends.cudnn.allow_tf32 = bool(saved["cudnn"])


@contextmanager
def kept_matmul_precision() -> Iterator[None]:
    """Run the block; afterwards the float32 matmul / cuDNN precision is what it was before."""
    saved = _read()
    try:
        yield
    finally:
        _write(saved)
