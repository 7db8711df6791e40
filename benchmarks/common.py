"""Helpers shared by the benchmark scripts of several studies.

The scripts live one folder per study (``benchmarks/<study>/``) and import this module with
``benchmarks/`` on ``sys.path``, which each of them puts there itself.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention import SDPBackend

#: The fused SDPA backends PyTorch offers, by the names ``--sdpa-backend`` takes.
SDPA_BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}

#: H100 SXM dense bf16 peak (the H200 has the same), the denominator of every MFU here.
H100_BF16_PEAK = 989e12


def flops_per_token(model: Any, seq_len: int) -> tuple[float, int]:
    """Model FLOPs per trained token (forward + backward) and the activated matmul parameters.

    ``6 * N_active + 12 * L * H * Q * T`` (PaLM appendix B): ``N_active`` the activated
    parameters that take part in matrix products (all but the input embedding; a routed expert
    counts k/e times), attention counted as non-causal. ``model`` may live on the meta device.
    """
    cfg = model.config
    counts = model.parameter_counts()
    n_active = counts["activated"] - model.get_input_embeddings().weight.numel()
    attention = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq_len
    return 6.0 * n_active + attention, n_active


def timed(
    step: Callable[[], None], warmup: int, iters: int, *, cuda: bool = True
) -> tuple[float, list[float]]:
    """Median ms of ``step`` over ``iters`` runs after ``warmup`` runs, and every run's ms.

    On CUDA each run is bracketed by CUDA events (the GPU time of the run); with ``cuda=False``
    by the host clock (a smoke run of a script on the CPU).
    """
    for _ in range(warmup):
        step()
    times = []
    if not cuda:
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), times
    torch.cuda.synchronize()
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), times
