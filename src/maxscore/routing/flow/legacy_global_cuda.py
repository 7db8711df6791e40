"""The global solver of Eq. (8) as one CUDA kernel per call for small groups (NVRTC-compiled).

Same phases as :mod:`.global_solver` (Jacobi prices of Eq. 8's dual, rounding, repair, cycle
cancelling on the expert graph, Eq. 7 enforced exactly), written in CUDA C++
(``global_fused.cu``) with one thread block per routing group and one thread per token: a
block-wide count is a warp vote plus one barrier, the token lists and the assignment live in
shared memory, and the graph phase (``e + 1`` nodes) runs in one warp with shuffles. The Triton
kernel of :mod:`.global_triton` keeps the state in register tiles and global scratch, so each of
its dependent steps costs several barriers and L2 round trips (``benchmarks/flow_solver_notes.md``).

The source is compiled at first use for each shape and budget with NVRTC through PyTorch's
runtime-compilation helpers (``torch.cuda._utils``, private; present since PyTorch 2.8) and
launched on the current stream, so calls are capturable in CUDA graphs and need no host sync.
Where NVRTC or those helpers are missing, :func:`available` is false and the Triton kernel runs.

Applies to CUDA tensors on GPUs of compute capability 8.0 or newer with ``n <= 1024`` tokens per
group (one thread each), ``2 <= e <= 31`` experts (the graph's ``e + 1`` nodes on one warp's
lanes) and ``1 <= k < e``; any ``n``, not only powers of two.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.resources
import math

import torch
from torch import Tensor

__all__ = [
    "KernelCompileError",
    "available",
    "disable",
    "kernel_defines",
    "kernel_source",
    "shared_bytes",
    "solve_cuda",
    "supported",
]

MAX_TOKENS = 1024  # one thread per token
MAX_EXPERTS = 31  # e + 1 graph nodes on the 32 lanes of a warp; expert sets as 32-bit masks
MAX_MOVES = 4  # the largest ``moves`` budget that supported() makes room for
MIN_CAPABILITY = (8, 0)  # __reduce_add_sync (warp reductions) needs sm_80
KERNEL_NAME = "global_fused_kernel"
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


_disabled_reason: str | None = None


class KernelCompileError(RuntimeError):
    """NVRTC could not compile or load the kernel on this machine."""


def disable(reason: str) -> None:
    """Stop offering the kernel in this process (:func:`supported` is false from now on)."""
    global _disabled_reason
    _disabled_reason = reason


def kernel_source() -> str:
    """The CUDA C++ source of the kernel (``global_fused.cu``, shipped with the package)."""
    return importlib.resources.files(__package__).joinpath("legacy_global_fused.cu").read_text()


def shared_bytes(n: int, e: int, moves: int = 1) -> int:
    """Dynamic shared memory of one block: affinities and price thresholds ``[n, e + 1]`` fp32
    (rows padded by one word against bank conflicts), assignment masks ``[n]`` u32; with
    ``moves > 1`` the 2nd..``moves``-th best moves per expert pair and the tokens leaving each
    expert on a cycle."""
    extra = (moves - 1) * 32 * 32 * 8 + 32 * moves * 4 if moves > 1 else 0
    return 8 * n * (e + 1) + 4 * n + extra


def kernel_defines(
    n: int,
    e: int,
    k: int,
    *,
    price_iterations: int,
    repair_rounds: int,
    cycle_rounds: int,
    bf_iterations: int,
    bisect0: int = 16,
    bisect: int = 8,
    window: float = 0.0625,
    early_exit: bool = True,
    moves: int = 1,
) -> dict[str, str]:
    """The compile-time constants of ``global_fused.cu`` for one shape and budget.

    ``moves``: parallel copies of each cycle applied per round in phase 4 (each with the next
    best token of every edge, while the copy's gain stays positive); 1 = one token per edge.
    """
    return {
        "N": str(n),
        "E": str(e),
        "K": str(k),
        "THREADS": str(32 * math.ceil(n / 32)),
        "PRICE_IT": str(max(1, price_iterations)),
        "BISECT0": str(bisect0),
        "BISECT": str(bisect),
        "WINDOW": f"{float(window)!r}f",
        "REPAIR": str(max(0, repair_rounds)),
        "CYCLES": str(max(0, cycle_rounds)),
        "BF": str(max(0, bf_iterations)),
        "JUMPS": str(max(1, math.ceil(math.log2(e + 1)))),
        "EARLY_EXIT": "1" if early_exit else "0",
        "MOVES": str(max(1, moves)),
    }


def _with_defines(defines: dict[str, str]) -> str:
    head = "".join(f"#define {key} {value}\n" for key, value in defines.items())
    return head + kernel_source()


def _rtc_library() -> ctypes.CDLL:
    from torch.cuda import _utils

    getter = getattr(_utils, "_get_gpu_rtc_library", None) or _utils._get_nvrtc_library
    return getter()


@functools.cache
def available() -> bool:
    """Whether CUDA, NVRTC and PyTorch's module loader are usable here (checked once)."""
    if not torch.cuda.is_available() or torch.version.hip is not None:
        return False
    try:
        from torch.cuda import _utils

        _rtc_library()
        return hasattr(_utils, "_cuda_load_module")
    except (ImportError, OSError, AttributeError, RuntimeError):
        return False


def supported(affinities: Tensor, k: int) -> bool:
    """Whether the CUDA kernel handles this shape and device."""
    if affinities.dim() != 3 or not affinities.is_cuda or _disabled_reason or not available():
        return False
    _, n, e = affinities.shape
    if not (1 <= n <= MAX_TOKENS and 2 <= e <= MAX_EXPERTS and 1 <= k < e):
        return False
    props = torch.cuda.get_device_properties(affinities.device)
    if (props.major, props.minor) < MIN_CAPABILITY:
        return False
    # the static part (the Shared struct, ~14 KB) comes on top of the dynamic part
    return shared_bytes(n, e, MAX_MOVES) + 16 * 1024 <= props.shared_memory_per_block_optin


def _nvrtc_cubin(source: str, arch: str) -> bytes:
    """Compile ``source`` to a cubin for ``sm_<arch>`` with NVRTC (no headers needed)."""
    lib = _rtc_library()
    prog = ctypes.c_void_p()
    name = f"{KERNEL_NAME}.cu".encode()

    def check(result: int, what: str) -> None:
        if result != 0:
            lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            text = lib.nvrtcGetErrorString(result)
            message = text.decode() if text else result
            raise KernelCompileError(f"NVRTC {what} failed: {message}")

    check(
        lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name, 0, None, None), "create"
    )
    options = [f"--gpu-architecture=sm_{arch}".encode(), b"-std=c++17"]
    array = (ctypes.c_char_p * len(options))(*options)
    result = lib.nvrtcCompileProgram(prog, len(options), array)
    if result != 0:
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        raise KernelCompileError(f"NVRTC could not compile {KERNEL_NAME}:\n{log.value.decode()}")
    size = ctypes.c_size_t()
    check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
    cubin = ctypes.create_string_buffer(size.value)
    check(lib.nvrtcGetCUBIN(prog, cubin), "cubin")
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return cubin.raw


@functools.cache
def _compiled(device_index: int, defines: tuple[tuple[str, str], ...], dynamic_bytes: int):
    """The loaded kernel for one device, shape and budget (compiled once per process)."""
    from torch.cuda import _utils

    with torch.cuda.device(device_index):
        props = torch.cuda.get_device_properties(device_index)
        cubin = _nvrtc_cubin(_with_defines(dict(defines)), f"{props.major}{props.minor}")
        try:
            kernel = _utils._cuda_load_module(cubin, [KERNEL_NAME])[KERNEL_NAME]
        except RuntimeError as exc:
            raise KernelCompileError(f"could not load {KERNEL_NAME}: {exc}") from exc
        # Static plus dynamic shared memory above 48 KiB must be allowed explicitly (set always:
        # torch's own helper skips it when the dynamic part alone is below 48 KiB).
        libcuda = _utils._get_gpu_runtime_library()
        _utils._check_cuda(
            libcuda.cuFuncSetAttribute(
                kernel.func, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic_bytes
            )
        )
        if hasattr(kernel, "_max_shared_mem_bytes"):  # torch's launcher checks its own record
            kernel._max_shared_mem_bytes = dynamic_bytes
    return kernel


def solve_cuda(
    affinities: Tensor,
    k: int,
    capacity: Tensor,
    *,
    stats: Tensor | None = None,
    clocks: Tensor | None = None,
    **budget: int | float | bool,
) -> Tensor:
    """Run the kernel; ``capacity`` is the ``[G, e]`` effective capacity (clamped to ``[0, n]``).

    ``budget``: the step counts of :func:`kernel_defines` (``price_iterations``,
    ``repair_rounds``, ``cycle_rounds``, ``bf_iterations``; optionally ``bisect0``, ``bisect``,
    ``window``, ``early_exit``). Returns ``[G, n, k]`` long expert indices, each token's experts
    by decreasing affinity (ties: lower expert), ``-1`` last. ``stats`` (``[G, 4]`` int32), if
    given, receives the repair and cycle rounds each group used; ``clocks`` (``[G, 8]`` int64),
    for profiling, the SM clock at the phase boundaries in slots 0-5 (start, then the ends of
    load, prices, repair, cycles, finalize) and in slots 6 and 7 the SM cycles of the cycle
    phase's two parts summed over its rounds: the edge scans (with their barrier) and warp 0's
    graph work (Bellman-Ford, cycle search, moves).
    """
    if not supported(affinities, k):
        raise ValueError(
            "the CUDA global-solver kernel does not apply: it needs CUDA tensors [G, n, e] with "
            f"n <= {MAX_TOKENS}, 2 <= e <= {MAX_EXPERTS}, 1 <= k < e, and NVRTC"
        )
    groups, n, e = affinities.shape
    a = affinities.float().contiguous()
    cap = capacity.to(device=a.device, dtype=torch.int32).expand(groups, e).contiguous()
    out = torch.empty(groups, n, k, dtype=torch.long, device=a.device)
    defines = kernel_defines(n, e, k, **budget)  # type: ignore[arg-type]
    dynamic = shared_bytes(n, e, int(defines["MOVES"]))
    device_index = a.device.index if a.device.index is not None else torch.cuda.current_device()
    kernel = _compiled(device_index, tuple(defines.items()), dynamic)
    flags = (1 if stats is not None else 0) | (2 if clocks is not None else 0)
    if groups == 0:
        return out
    with torch.cuda.device(device_index):
        kernel(
            grid=(groups, 1, 1),
            block=(int(defines["THREADS"]), 1, 1),
            args=[
                a,
                cap,
                out,
                stats if stats is not None else cap,
                clocks if clocks is not None else out,
                flags,
            ],
            shared_mem=dynamic,
        )
    return out
