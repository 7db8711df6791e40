"""Helpers shared by the benchmark scripts of several studies.

The scripts live one folder per study (``benchmarks/<study>/``) and import this module with
``benchmarks/`` on ``sys.path``, which each of them puts there itself.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend

#: The fused SDPA backends PyTorch offers, by the names ``--sdpa-backend`` takes.
SDPA_BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


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
