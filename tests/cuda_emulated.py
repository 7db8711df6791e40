"""Run ``global_fused.cu`` on the CPU: g++ with ``cuda_block_emulator.h`` (one std::thread per
CUDA thread). Lets the tests check the CUDA kernel's logic without a GPU (slow: small shapes)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from maxscore.routing.flow import global_cuda

HERE = Path(__file__).resolve().parent
_RUNNER = """
#include "cuda_block_emulator.h"
#include "{kernel}"
extern "C" void run_solver(const float* a, const int* cap, long long* out, int* stats,
                           long long* clocks, int groups) {{
  launch_blocks(groups, THREADS, [&] {{ global_fused_kernel(a, cap, out, stats, clocks, 1); }});
}}
"""


@functools.cache
def compiler_available() -> bool:
    """g++ with C++20 ``<barrier>`` (GCC 11+), which the emulator needs."""
    if shutil.which("g++") is None:
        return False
    probe = "#include <barrier>\nint main() { std::barrier<> b(1); b.arrive_and_wait(); }\n"
    done = subprocess.run(
        ["g++", "-std=c++20", "-pthread", "-x", "c++", "-", "-o", "/dev/null"],
        input=probe,
        capture_output=True,
        text=True,
    )
    return done.returncode == 0


@functools.cache
def _library(defines: tuple[tuple[str, str], ...]) -> ctypes.CDLL:
    kernel = Path(global_cuda.__file__).with_name("global_fused.cu")
    emulator = (HERE / "cuda_block_emulator.h").read_text()
    text = repr(defines) + kernel.read_text() + emulator
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    build = Path(tempfile.gettempdir()) / "maxscore_cuda_emulated"
    build.mkdir(exist_ok=True)
    lib = build / f"solver_{key}.so"
    if not lib.exists():
        src = build / f"runner_{key}.cpp"
        src.write_text(_RUNNER.format(kernel=kernel))
        flags = [f"-D{name}={value}" for name, value in defines]
        tmp = build / f"solver_{key}.tmp.so"
        done = subprocess.run(
            [
                "g++",
                "-std=c++20",
                "-O1",
                "-pthread",
                "-shared",
                "-fPIC",
                f"-I{HERE}",
                *flags,
                str(src),
                "-o",
                str(tmp),
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"g++ could not build the emulated kernel:\n{done.stderr[-3000:]}")
        tmp.replace(lib)
    return ctypes.CDLL(str(lib))


def solve_emulated(
    affinities: torch.Tensor, k: int, capacity: torch.Tensor, **budget: int | float | bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``global_cuda.solve_cuda``'s result on the CPU, and the ``[G, 4]`` rounds used."""
    groups, n, e = affinities.shape
    defines = global_cuda.kernel_defines(n, e, k, **budget)
    lib = _library(tuple(defines.items()))
    a = np.ascontiguousarray(affinities.float().numpy())
    cap = np.ascontiguousarray(capacity.to(torch.int32).expand(groups, e).numpy())
    out = np.zeros((groups, n, k), dtype=np.int64)
    stats = np.zeros((groups, 4), dtype=np.int32)
    clocks = np.zeros((groups, 8), dtype=np.int64)
    ptr = ctypes.c_void_p
    lib.run_solver(
        ptr(a.ctypes.data),
        ptr(cap.ctypes.data),
        ptr(out.ctypes.data),
        ptr(stats.ctypes.data),
        ptr(clocks.ctypes.data),
        ctypes.c_int(groups),
    )
    return torch.from_numpy(out), torch.from_numpy(stats)
