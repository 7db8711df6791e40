"""Run the flow solver's CUDA kernel on the CPU: g++ with ``cuda_block_emulator.h`` (one
fiber per CUDA thread). Lets the tests check the kernel's logic without a GPU (slow:
small shapes only)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from maxscore.routing.flow import global_cuda
from maxscore.routing.flow.global_reference import GlobalBudget

HERE = Path(__file__).resolve().parent
# The solver kernel's runner: its debug build (MAXSCORE_FLOW_DEBUG) takes the statistics, the
# hooks' counters and the graph check's switch; the shipped build ignores them.
_RUNNER = """
#include "cuda_block_emulator.h"
#include "{kernel}"
extern "C" void run_solver(const float* a, const int* cap, long long* out, unsigned char* scratch,
                           const unsigned char* mask, int has_mask, const float* prices,
                           const int* first_experts, const float* first_values, int groups,
                           int* stats, int* counters, int check_graph) {{
  launch_blocks(groups, THREADS, [&] {{
    global_auction_kernel(a, cap, out, scratch, mask, has_mask, prices, first_experts,
                          first_values DEBUG_ONLY(, stats, counters, check_graph));
  }});
}}
extern "C" int block_struct_bytes() {{ return (int)sizeof(Block); }}
extern "C" void radix_select(const unsigned* values, const unsigned char* is_item, int items,
                             int need, int bits, int* out) {{
  launch_blocks(1, 32, [&] {{
    const SelectResult r = warp_radix_select(items, need, bits, [&](int q, u32& u) {{
      u = values[q];
      return is_item[q] != 0;
    }});
    if (threadIdx.x == 0) {{
      out[0] = (int)r.value;
      out[1] = r.need;
      out[2] = r.at_value;
    }}
  }});
}}
"""
# The starting prices' kernel, its clusters' blocks run together.
_PRICES_RUNNER = """
#include "cuda_block_emulator.h"
#include "{kernel}"
extern "C" void run_prices(const float* a, const int* cap, const unsigned char* mask, int has_mask,
                           float* prices, float* duals, int* first_experts,
                           float* first_values, int groups) {{
  launch_clusters(groups * CLUSTER, CLUSTER, THREADS, [&] {{
    dual_prices_kernel(a, cap, mask, has_mask, prices, duals, first_experts, first_values);
  }});
}}
"""
#: The debug build's define (kernels/debug_hooks.cuh).
DEBUG = (global_cuda.DEBUG_DEFINE, "1")


@functools.cache
def compiler_available() -> bool:
    """g++ with C++20 ``std::atomic_ref`` (GCC 10+) and ``<ucontext.h>`` (the fibers), which
    the emulator needs."""
    if shutil.which("g++") is None:
        return False
    probe = (
        "#include <atomic>\n#include <ucontext.h>\n"
        "int main() { int x = 0; ucontext_t c; getcontext(&c); "
        "return std::atomic_ref<int>(x).fetch_add(1); }\n"
    )
    done = subprocess.run(
        ["g++", "-std=c++20", "-x", "c++", "-", "-o", "/dev/null"],
        input=probe,
        capture_output=True,
        text=True,
    )
    return done.returncode == 0


def _kernel_path(name: str = "global_auction.cu") -> Path:
    return Path(global_cuda.__file__).with_name("kernels") / name


def kernel_texts(name: str = "global_auction.cu") -> str:
    """The text a build of kernel file ``name`` depends on: the file and every header of
    ``kernels/`` (any of them changed, the build is made again)."""
    headers = "".join(text for _, text in global_cuda.kernel_headers())
    return _kernel_path(name).read_text() + headers


# Built libraries by the hash of their defines, kernel texts, emulator and runner.
_LOADED: dict[str, ctypes.CDLL] = {}
_FLAGS = ("-std=c++20", "-O1", "-fPIC")


def _build_dir() -> Path:
    build = Path(tempfile.gettempdir()) / "maxscore_cuda_emulated"
    build.mkdir(exist_ok=True)
    return build


def _compile(command: list[str], target: Path) -> subprocess.CompletedProcess[str]:
    """Run g++ writing to a file of this process, then move it to ``target``: two test processes
    (pytest-xdist workers, or two pytest runs) may build the same library at once."""
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    done = subprocess.run([*command, "-o", str(tmp)], capture_output=True, text=True)
    if done.returncode == 0:
        tmp.replace(target)
    return done


@functools.cache
def _precompiled_header_dir() -> Path | None:
    """A folder with the emulator's header precompiled, or ``None`` where g++ cannot make one.

    Parsing the header's standard library (``<atomic>``, ``<memory>``, ``<vector>``...) is about a
    third of a build; g++ takes ``X.h.gch`` from an include folder searched before the one with ``X.h``,
    and falls back to the header itself where the precompiled one does not fit the build."""
    header = HERE / "cuda_block_emulator.h"
    key = hashlib.sha256((header.read_text() + repr(_FLAGS)).encode()).hexdigest()[:16]
    folder = _build_dir() / f"header_{key}"
    target = folder / f"{header.name}.gch"
    if not target.exists():
        folder.mkdir(exist_ok=True)
        if _compile(["g++", *_FLAGS, "-x", "c++-header", str(header)], target).returncode:
            return None
    return folder


def _library(
    defines: tuple[tuple[str, str], ...], name: str = "global_auction.cu", runner: str = _RUNNER
) -> ctypes.CDLL:
    kernel = _kernel_path(name).resolve()
    emulator = (HERE / "cuda_block_emulator.h").read_text()
    text = repr(defines) + kernel_texts(name) + emulator + runner
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    if key in _LOADED:
        return _LOADED[key]
    build = _build_dir()
    lib = build / f"auction_{key}.so"
    if not lib.exists():
        src = build / f"runner_{key}.{os.getpid()}.cpp"
        src.write_text(runner.format(kernel=kernel))
        flags = [f"-D{define}={value}" for define, value in defines]
        header = _precompiled_header_dir()
        includes = [f"-I{header}"] if header is not None else []
        command = ["g++", *_FLAGS, "-shared", *includes, f"-I{HERE}", *flags, str(src)]
        done = _compile(command, lib)
        src.unlink()
        if done.returncode != 0:
            raise RuntimeError(f"g++ could not build the emulated kernel:\n{done.stderr[-3000:]}")
    _LOADED[key] = ctypes.CDLL(str(lib))
    return _LOADED[key]


def block_struct_bytes(defines: dict[str, str], *, debug: bool = True) -> int:
    """``sizeof(Block)``, the kernel's static shared memory, as g++ lays it out (the same rules
    as NVCC's for its int, float and 64-bit members), of the debug build or the shipped one."""
    items = (*defines.items(), DEBUG) if debug else tuple(defines.items())
    return int(_library(items).block_struct_bytes())


def _defines(
    affinities: torch.Tensor,
    k: int,
    capacity: torch.Tensor,
    budget: GlobalBudget | None,
    state_in_scratch: bool,
    overrides: dict[str, str] | None,
) -> dict[str, str]:
    """The kernel's constants for this input."""
    n = affinities.shape[1]
    holders = int(capacity.clamp(max=n).max()) if capacity.numel() else 1
    # The emulator's dynamic shared memory is 256 KiB; state_in_scratch puts the state in the
    # scratch buffer (global memory on a GPU) and keeps the graph and affinities out of shared
    # memory.
    room = 0 if state_in_scratch else 200 * 1024
    return global_cuda.kernel_defines(
        n, affinities.shape[2], k, holders, budget or GlobalBudget(), shared_bytes=room,
        overrides=overrides,
    )  # fmt: skip


class EmulatedRun(NamedTuple):
    """One emulated solve: the assignment and, from the debug build, what it reports."""

    index: torch.Tensor  # [G, n, k] long
    stats: torch.Tensor  # [G, DEBUG_STATS] int32 (zeros from the shipped build)
    # the graph check's mismatches, phase 3's relaxations, its rounds, the rounds stopped by
    # the relaxation cap while distances still changed (summed over the groups)
    counters: tuple[int, int, int, int]


def run_solver(
    affinities: torch.Tensor,
    k: int,
    capacity: torch.Tensor,
    budget: GlobalBudget | None = None,
    *,
    token_mask: torch.Tensor | None = None,
    state_in_scratch: bool = False,
    defines: dict[str, str] | None = None,
    cluster: int | None = None,
    first_bids: bool = True,
    debug: bool = True,
    check_graph: bool = False,
) -> EmulatedRun:
    """``global_cuda.solve_cuda`` on the CPU: the starting prices' kernel
    (:func:`start_prices_emulated`, ``cluster`` blocks per group), then the solver kernel, its
    debug build (``debug``; with ``check_graph`` its graph check) or the shipped one.
    ``defines`` overrides the solver's compile-time constants (e.g. ``GRAPH_IN_WORK``);
    ``first_bids=False``: none of the prices' kernel's first bids reaches the solver (every
    entry -1), so that the auction selects every token's first bids itself."""
    groups, n, e = affinities.shape
    cap = capacity.to(torch.int32).expand(groups, e)
    constants = _defines(affinities, k, cap, budget, state_in_scratch, defines)
    lib = _library((*constants.items(), DEBUG) if debug else tuple(constants.items()))
    a = np.ascontiguousarray(affinities.float().numpy())
    cap_np = np.ascontiguousarray(cap.numpy())
    out = np.zeros((groups, n, k), dtype=np.int64)
    stats = np.zeros((groups, global_cuda.DEBUG_STATS), dtype=np.int32)
    counters = np.zeros(4, dtype=np.int32)
    _, scratch_bytes = global_cuda.shared_and_scratch_bytes(constants, groups)
    scratch = np.zeros(max(1, scratch_bytes), dtype=np.uint8)
    mask = np.ones((groups, n), dtype=np.uint8)
    if token_mask is not None:
        mask = np.ascontiguousarray(token_mask.expand(groups, n).numpy().astype(np.uint8))
    prices = np.zeros((groups, e), dtype=np.float32)
    first_experts = np.full((groups, n, k), -1, dtype=np.int32)
    first_values = np.zeros((groups, n, k), dtype=np.float32)
    if (budget or GlobalBudget()).price_iterations > 0:
        start = start_prices_emulated(
            affinities, k, cap, budget, token_mask=token_mask, cluster=cluster
        )
        prices = np.ascontiguousarray(start.prices.numpy())
        if first_bids:
            first_experts = np.ascontiguousarray(start.first_experts.numpy())
            first_values = np.ascontiguousarray(start.first_values.numpy())
    ptr = ctypes.c_void_p
    lib.run_solver(
        ptr(a.ctypes.data), ptr(cap_np.ctypes.data), ptr(out.ctypes.data),
        ptr(scratch.ctypes.data), ptr(mask.ctypes.data),
        ctypes.c_int(0 if token_mask is None else 1), ptr(prices.ctypes.data),
        ptr(first_experts.ctypes.data), ptr(first_values.ctypes.data), ctypes.c_int(groups),
        ptr(stats.ctypes.data), ptr(counters.ctypes.data), ctypes.c_int(int(check_graph)),
    )  # fmt: skip
    found = (int(counters[0]), int(counters[1]), int(counters[2]), int(counters[3]))
    return EmulatedRun(torch.from_numpy(out), torch.from_numpy(stats), found)


def solve_emulated(
    affinities: torch.Tensor,
    k: int,
    capacity: torch.Tensor,
    budget: GlobalBudget | None = None,
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`run_solver`'s assignment and ``[G, DEBUG_STATS]`` statistics (the debug build's:
    the auction's rounds, the slots open after it, the augmenting and cancelling rounds, then
    the clocks, zeros here)."""
    run = run_solver(affinities, k, capacity, budget, **options)
    return run.index, run.stats


def graph_mismatches(
    affinities: torch.Tensor,
    k: int,
    capacity: torch.Tensor,
    budget: GlobalBudget | None = None,
    *,
    defines: dict[str, str] | None = None,
) -> tuple[torch.Tensor, int]:
    """:func:`run_solver` with the debug build's graph check: the assignment, and how many times
    an entry of the expert graph (or an expert's worst holder), as the kernel keeps it from
    round to round, differed from a computation from scratch (0: the kept graph is exact in
    every round of phases 2 and 3)."""
    run = run_solver(affinities, k, capacity, budget, defines=defines, check_graph=True)
    return run.index, run.counters[0]


def phase3_relaxations(
    affinities: torch.Tensor,
    k: int,
    capacity: torch.Tensor,
    budget: GlobalBudget | None = None,
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """:func:`run_solver`'s assignment, and phase 3's Bellman-Ford relaxations, rounds, and
    rounds stopped by the relaxation cap while distances still changed, summed over the
    groups (the debug build's counters)."""
    run = run_solver(affinities, k, capacity, budget)
    _, relaxations, rounds, capped = run.counters
    return run.index, (relaxations, rounds, capped)


# The emulated prices' kernel runs one block per group of at most 128 threads unless a test
# asks for a cluster: every emulated thread costs a fiber's switches at each barrier, and the
# kernel's logic does not depend on either (the tests that do pass `cluster`).
EMULATED_PRICE_THREADS = 128


def start_prices_emulated(
    affinities: torch.Tensor,
    k: int,
    capacity: torch.Tensor,
    budget: GlobalBudget | None = None,
    *,
    token_mask: torch.Tensor | None = None,
    cluster: int | None = None,
    defines: dict[str, str] | None = None,
) -> global_cuda.StartPrices:
    """``global_cuda.start_prices``' results from ``dual_prices.cu`` on the CPU, its clusters'
    blocks run together: the ``[G, e]`` starting prices, each token's dual ``u_t`` at them and
    the auction's first bids; ``cluster``: blocks per group (default 1); ``defines``:
    compile-time constants to override (e.g. ``IN_REGS``; ``THREADS`` is at most
    ``EMULATED_PRICE_THREADS`` unless given)."""
    budget = budget or GlobalBudget()
    groups, n, e = affinities.shape
    cluster = cluster or 1
    constants = global_cuda.price_defines(n, e, k, budget, cluster)
    threads = min(int(constants["THREADS"]), EMULATED_PRICE_THREADS)
    constants = {**constants, "THREADS": str(threads), **(defines or {})}
    lib = _library(tuple(constants.items()), "dual_prices.cu", _PRICES_RUNNER)
    a = np.ascontiguousarray(affinities.float().numpy())
    cap = np.ascontiguousarray(capacity.to(torch.int32).expand(groups, e).numpy())
    mask = np.ones((groups, n), dtype=np.uint8)
    if token_mask is not None:
        mask = np.ascontiguousarray(token_mask.expand(groups, n).numpy().astype(np.uint8))
    prices = np.zeros((groups, e), dtype=np.float32)
    duals = np.zeros((groups, n), dtype=np.float32)
    first_experts = np.full((groups, n, k), -1, dtype=np.int32)
    first_values = np.zeros((groups, n, k), dtype=np.float32)
    ptr = ctypes.c_void_p
    lib.run_prices(
        ptr(a.ctypes.data), ptr(cap.ctypes.data), ptr(mask.ctypes.data),
        ctypes.c_int(0 if token_mask is None else 1), ptr(prices.ctypes.data),
        ptr(duals.ctypes.data), ptr(first_experts.ctypes.data), ptr(first_values.ctypes.data),
        ctypes.c_int(groups),
    )  # fmt: skip
    return global_cuda.StartPrices(
        *(torch.from_numpy(x) for x in (prices, duals, first_experts, first_values))
    )


def radix_select(
    values: np.ndarray, is_item: np.ndarray, need: int, bits: int
) -> tuple[int, int, int]:
    """The kernel's ``warp_radix_select`` (one warp) on ``values`` (uint32, below ``2**bits``) at
    the positions where ``is_item``: (the largest value U with at least ``need`` items >= U, the
    items still needed at U, the items equal to U)."""
    lib = _library(tuple(global_cuda.kernel_defines(64, 8, 2, 16, GlobalBudget()).items()))
    v = np.ascontiguousarray(values, dtype=np.uint32)
    m = np.ascontiguousarray(is_item, dtype=np.uint8)
    out = np.zeros(3, dtype=np.int32)
    ptr = ctypes.c_void_p
    lib.radix_select(
        ptr(v.ctypes.data), ptr(m.ctypes.data), ctypes.c_int(len(v)), ctypes.c_int(need),
        ctypes.c_int(bits), ptr(out.ctypes.data),
    )  # fmt: skip
    return int(out[0]) & 0xFFFFFFFF, int(out[1]), int(out[2])
