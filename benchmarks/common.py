"""Helpers shared by the benchmark scripts of several studies.

The scripts live one folder per study (``benchmarks/<study>/``) and import this module with
``benchmarks/`` on ``sys.path``, which each of them puts there itself.
"""

from __future__ import annotations

import gc
import importlib.util
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
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


def load_script(path: Path, name: str) -> ModuleType:
    """Import the benchmark script at ``path`` as module ``name`` (scripts of different studies
    share file names such as ``bench.py``, so they cannot all be imported by name)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def step_timer(warmup: int, say: Callable[[str], None] | None = None) -> Any:
    """A ``transformers.TrainerCallback`` timing optimizer steps ``warmup + 1 .. max_steps``.

    After training: ``t0`` / ``t1`` (host clock, CUDA-synchronised at both ends), ``steps``
    (the timed steps), ``step_ends`` (the host clock at the end of every timed step, not
    synchronised: in the steady state the host waits for the GPU inside the step, so their
    differences show a run's slow steps without adding a synchronisation), ``device_mallocs``
    (the caching allocator's cudaMalloc calls and retries during the timed steps: a steady
    state makes none), ``gc_pauses`` (Python's garbage collections during the timed steps:
    generation and milliseconds), ``compilations`` (torch.compile frames compiled during them),
    ``first_step_s`` (step 1's arrival: model build and compilation, also
    passed to ``say``) and ``model`` (the trained model, for :func:`flops_per_token`).
    """
    from transformers import TrainerCallback

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def allocator_counts() -> dict[str, int]:
        stats = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
        return {key: stats.get(key, 0) for key in ("num_device_alloc", "num_alloc_retries")}

    def compiled_frames() -> int:
        from torch._dynamo.utils import counters

        return sum(counters["frames"].values())

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.t0 = self.t1 = 0.0
            self.gc_pauses: list[tuple[int, float]] = []
            self.gc_started = 0.0
            self.compilations = 0
            self.steps = 0
            self.step_ends: list[float] = []
            self.device_mallocs: dict[str, int] = {}
            self.started = time.perf_counter()
            self.first_step_s: float | None = None
            self.model: Any = None

        def on_gc(self, phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                self.gc_started = time.perf_counter()
            else:
                ms = 1000 * (time.perf_counter() - self.gc_started)
                self.gc_pauses.append((info["generation"], round(ms, 3)))

        def on_step_end(
            self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
        ) -> Any:
            if state.global_step == 1:
                self.first_step_s = time.perf_counter() - self.started
                if say is not None:
                    say(f"  step 1 after {self.first_step_s:.0f} s (model build, compilation)")
            if state.global_step == warmup:
                sync()
                self.t0 = time.perf_counter()
                self.device_mallocs = allocator_counts()
                self.compilations = -compiled_frames()
                gc.callbacks.append(self.on_gc)  # the timed steps' collections only
            elif state.global_step > warmup:
                self.step_ends.append(time.perf_counter())
            if state.global_step == state.max_steps:
                sync()
                self.t1 = time.perf_counter()
                gc.callbacks.remove(self.on_gc)
                self.compilations += compiled_frames()
                counts = allocator_counts()
                self.device_mallocs = {k: counts[k] - self.device_mallocs[k] for k in counts}
                self.steps = state.global_step - warmup
                self.model = model
            return control

    return StepTimer()


def timing_train_config(**fields: Any) -> Any:
    """A ``maxscore.training.TrainConfig`` for a timing run: lr 3e-4 after 10 warmup steps, bf16
    on a GPU, no evaluation, checkpoints or reports, the run folder overwritten; ``fields`` give
    the rest (model, router, batch, steps, output_dir, ...) and may override these."""
    from maxscore.training import TrainConfig

    settings: dict[str, Any] = {
        "lr": 3e-4,
        "warmup_steps": 10,
        "precision": "bf16" if torch.cuda.is_available() else "fp32",
        "eval_steps": 0,
        "save_steps": 0,
        "save_final": False,
        "overwrite": True,
        "report_to": "none",
        "quiet": True,
    }
    return TrainConfig(**{**settings, **fields})


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
