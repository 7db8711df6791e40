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

import numpy as np
import torch

from maxscore.routing.flow import global_cuda
from maxscore.routing.flow.global_reference import GlobalBudget

HERE = Path(__file__).resolve().parent
# Added to the runner where the kernel file has the radix select (earlier kernels, built to
# compare assignments with, do not).
_RADIX_RUNNER = """
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
_RUNNER = """
#include "cuda_block_emulator.h"
#include "{kernel}"
extern "C" void run_solver(const float* a, const int* cap, long long* out, int* stats,
                           unsigned char* scratch, int use_scratch, const unsigned char* mask,
                           int has_mask, const float* prices, const int* first_experts,
                           const float* first_values, int groups) {{
  launch_blocks(groups, THREADS, [&] {{
    global_auction_kernel(a, cap, out, stats, scratch, use_scratch, 1, mask, has_mask, prices,
                          first_experts, first_values);
  }});
}}
extern "C" int block_struct_bytes() {{ return (int)sizeof(Block); }}
#ifdef CHECK_GRAPH
extern "C" int graph_mismatches() {{ return graph_check_mismatches; }}
#endif
#ifdef COUNT_RELAXATIONS
extern "C" int relaxation_count(int i) {{ return relaxation_counts[i]; }}
#endif
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


# Built libraries by the hash of their defines, kernel text and emulator: a kernel file that
# changes, or another kernel file (an earlier version, compared against), gets its own build.
# (The same text at another path builds the same library.)
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
    defines: tuple[tuple[str, str], ...], kernel: Path | None = None, runner: str = _RUNNER
) -> ctypes.CDLL:
    kernel = (kernel or _kernel_path()).resolve()
    emulator = (HERE / "cuda_block_emulator.h").read_text()
    text = repr(defines) + kernel.read_text() + emulator + runner
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    if key in _LOADED:
        return _LOADED[key]
    build = _build_dir()
    lib = build / f"auction_{key}.so"
    if not lib.exists():
        src = build / f"runner_{key}.{os.getpid()}.cpp"
        if runner == _RUNNER and "warp_radix_select" in kernel.read_text():
            runner += _RADIX_RUNNER
        src.write_text(runner.format(kernel=kernel))
        flags = [f"-D{name}={value}" for name, value in defines]
        header = _precompiled_header_dir()
        includes = [f"-I{header}"] if header is not None else []
        command = ["g++", *_FLAGS, "-shared", *includes, f"-I{HERE}", *flags, str(src)]
        done = _compile(command, lib)
        src.unlink()
        if done.returncode != 0:
            raise RuntimeError(f"g++ could not build the emulated kernel:\n{done.stderr[-3000:]}")
    _LOADED[key] = ctypes.CDLL(str(lib))
    return _LOADED[key]


def block_struct_bytes(defines: dict[str, str]) -> int:
    """``sizeof(Block)``, the kernel's static shared memory, as g++ lays it out (the same rules
    as NVCC's for its int, float and 64-bit members)."""
    return int(_library(tuple(defines.items())).block_struct_bytes())


def _defines(
    affinities: torch.Tensor,
    k: int,
    capacity: torch.Tensor,
    budget: GlobalBudget | None,
    use_scratch: bool,
    overrides: dict[str, str] | None,
) -> tuple[tuple[str, str], ...]:
    """The kernel's constants for this input, as :func:`_library` takes them."""
    n = affinities.shape[1]
    holders = int(capacity.clamp(max=n).max()) if capacity.numel() else 1
    # The emulator's dynamic shared memory is 256 KiB; use_scratch puts the state in the scratch
    # buffer (global memory on a GPU) and keeps the graph and affinities out of shared memory.
    room = 0 if use_scratch else 200 * 1024
    defines = global_cuda.kernel_defines(
        n, affinities.shape[2], k, holders, budget or GlobalBudget(), shared_bytes=room,
        overrides=overrides,
    )  # fmt: skip
    return tuple(defines.items())


def library(
    affinities: torch.Tensor,
    k: int,
    capacity: torch.Tensor,
    budget: GlobalBudget | None = None,
    *,
    defines: dict[str, str] | None = None,
    kernel: Path | None = None,
) -> ctypes.CDLL:
    """The built library that :func:`solve_emulated` runs for these arguments (state in shared
    memory): for reading a kernel's test hooks, e.g. counters, before and after a solve."""
    return _library(_defines(affinities, k, capacity, budget, False, defines), kernel)


def graph_mismatches(
    affinities: torch.Tensor,
    k: int,
    capacity: torch.Tensor,
    budget: GlobalBudget | None = None,
    *,
    defines: dict[str, str] | None = None,
    kernel: Path | None = None,
) -> tuple[torch.Tensor, int]:
    """:func:`solve_emulated` with the kernel's ``CHECK_GRAPH`` hook: the assignment, and how
    many times an entry of the expert graph (or an expert's worst holder), as the kernel keeps
    it from round to round, differed from a computation from scratch (0: the kept graph is
    exact in every round of phases 2 and 3). ``kernel``: as in :func:`solve_emulated`."""
    checked = {**(defines or {}), "CHECK_GRAPH": "1"}
    lib = library(affinities, k, capacity, budget, defines=checked, kernel=kernel)
    before = int(lib.graph_mismatches())  # a library's counter lives as long as the process
    index, _ = solve_emulated(affinities, k, capacity, budget, defines=checked, kernel=kernel)
    return index, int(lib.graph_mismatches()) - before


def phase3_relaxations(
    affinities: torch.Tensor,
    k: int,
    capacity: torch.Tensor,
    budget: GlobalBudget | None = None,
    *,
    kernel: Path | None = None,
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """:func:`solve_emulated` with the kernel's ``COUNT_RELAXATIONS`` hook: the assignment, and
    phase 3's Bellman-Ford relaxations, rounds, and rounds stopped by the relaxation cap while
    distances still changed, summed over the groups. ``kernel``: as in :func:`solve_emulated`."""
    counted = {"COUNT_RELAXATIONS": "1"}
    lib = library(affinities, k, capacity, budget, defines=counted, kernel=kernel)
    before = [int(lib.relaxation_count(i)) for i in range(3)]  # counters outlive a solve
    index, _ = solve_emulated(affinities, k, capacity, budget, defines=counted, kernel=kernel)
    after = [int(lib.relaxation_count(i)) for i in range(3)]
    passes, rounds, capped = (b - a for a, b in zip(before, after, strict=True))
    return index, (passes, rounds, capped)


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
    lib = _library(tuple(constants.items()), _kernel_path("dual_prices.cu"), _PRICES_RUNNER)
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


def solve_emulated(
    affinities: torch.Tensor,
    k: int,
    capacity: torch.Tensor,
    budget: GlobalBudget | None = None,
    *,
    token_mask: torch.Tensor | None = None,
    use_scratch: bool = False,
    defines: dict[str, str] | None = None,
    kernel: Path | None = None,
    cluster: int | None = None,
    first_bids: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``global_cuda.solve_cuda``'s result on the CPU, and its ``[G, 20]`` statistics: the
    starting prices' kernel (:func:`start_prices_emulated`, ``cluster`` blocks per group), then
    the solver kernel. ``defines`` overrides the solver's compile-time constants (e.g.
    ``GRAPH_IN_WORK``); ``kernel``: another solver kernel file than the shipped one (an earlier
    version, to compare assignments with); ``first_bids=False``: none of the prices' kernel's
    first bids reaches the solver (every entry -1), so that the auction selects every token's
    first bids itself."""
    groups, n, e = affinities.shape
    cap = capacity.to(torch.int32).expand(groups, e)
    items = _defines(affinities, k, cap, budget, use_scratch, defines)
    lib = _library(items, kernel)
    defines = dict(items)
    a = np.ascontiguousarray(affinities.float().numpy())
    cap_np = np.ascontiguousarray(cap.numpy())
    out = np.zeros((groups, n, k), dtype=np.int64)
    stats = np.zeros((groups, 20), dtype=np.int32)
    _, scratch_bytes = global_cuda.shared_and_scratch_bytes(defines, groups)
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
        ptr(a.ctypes.data),
        ptr(cap_np.ctypes.data),
        ptr(out.ctypes.data),
        ptr(stats.ctypes.data),
        ptr(scratch.ctypes.data),
        ctypes.c_int(0 if defines["STATE_SMEM"] == "1" else 1),
        ptr(mask.ctypes.data),
        ctypes.c_int(0 if token_mask is None else 1),
        ptr(prices.ctypes.data),
        ptr(first_experts.ctypes.data),
        ptr(first_values.ctypes.data),
        ctypes.c_int(groups),
    )
    return torch.from_numpy(out), torch.from_numpy(stats)


def radix_select(
    values: np.ndarray, is_item: np.ndarray, need: int, bits: int
) -> tuple[int, int, int]:
    """The kernel's ``warp_radix_select`` (one warp) on ``values`` (uint32, below ``2**bits``) at
    the positions where ``is_item``: (the largest value U with at least ``need`` items >= U, the
    items still needed at U, the items equal to U)."""
    defines = global_cuda.kernel_defines(64, 8, 2, 16, GlobalBudget())
    lib = _library(tuple(defines.items()))
    v = np.ascontiguousarray(values, dtype=np.uint32)
    m = np.ascontiguousarray(is_item, dtype=np.uint8)
    out = np.zeros(3, dtype=np.int32)
    ptr = ctypes.c_void_p
    lib.radix_select(
        ptr(v.ctypes.data), ptr(m.ctypes.data), ctypes.c_int(len(v)), ctypes.c_int(need),
        ctypes.c_int(bits), ptr(out.ctypes.data),
    )  # fmt: skip
    return int(out[0]) & 0xFFFFFFFF, int(out[1]), int(out[2])
