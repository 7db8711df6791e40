"""Compiling, loading and launching the package's CUDA kernels (``kernels/``): NVRTC and the driver.

The kernels' sources ship with the package and are compiled at first use for each set of
compile-time constants with NVRTC, loaded through PyTorch's runtime-compilation helpers
(``torch.cuda._utils``, private; present since PyTorch 2.8) and launched on the current stream
through the driver's ``cuLaunchKernel`` directly (:func:`launch`): the router launches two
kernels per MoE layer and step, and PyTorch's own kernel wrapper opens the driver library afresh
at every launch, which made the solver's Python path the larger part of its time inside a
compiled training step (``benchmarks/flow_solver/README.md``, host time per call). What the
kernels compute, and how their launches are planned, is :mod:`.global_cuda`'s.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.resources
from collections.abc import Callable
from importlib.resources.abc import Traversable

import torch
from torch import Tensor

__all__ = [
    "KERNEL_NAME",
    "KernelCompileError",
    "available",
    "compiled_kernel",
    "kernel_headers",
    "kernel_source",
    "launch",
    "nvrtc_cubin",
    "resident_clusters",
    "with_defines",
]

KERNEL_NAME = "global_auction_kernel"  # the solver's kernel, the default of the helpers below
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class KernelCompileError(RuntimeError):
    """NVRTC could not compile or load the kernel on this machine."""


def kernel_source(name: str = "global_auction.cu") -> str:
    """The CUDA C++ source of a kernel file (shipped with the package): the solver's, or
    ``dual_prices.cu``."""
    return _kernels_folder().joinpath(name).read_text()


def kernel_headers() -> tuple[tuple[str, str], ...]:
    """The headers the kernel files include (``kernels/*.cuh``), as (name, text) pairs: the
    solver's phases and state, which NVRTC gets by name."""
    folder = _kernels_folder()
    names = sorted(entry.name for entry in folder.iterdir() if entry.name.endswith(".cuh"))
    return tuple((name, folder.joinpath(name).read_text()) for name in names)


def _kernels_folder() -> Traversable:
    return importlib.resources.files(__package__).joinpath("kernels")


class _LaunchConfig(ctypes.Structure):
    """The driver's CUlaunchConfig (for its occupancy query)."""

    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attributes", ctypes.c_void_p),
        ("attribute_count", ctypes.c_uint),
    ]


def resident_clusters(kernel, blocks: int, threads: int, shared_bytes: int) -> int | None:
    """The clusters of a kernel compiled with its cluster size that the GPU holds at once
    (``cuOccupancyMaxActiveClusters``), or ``None`` where the driver does not say."""
    from torch.cuda import _utils

    try:
        query = _utils._get_gpu_runtime_library().cuOccupancyMaxActiveClusters
    except AttributeError:
        return None
    config = _LaunchConfig((blocks, 1, 1), (threads, 1, 1), shared_bytes, None, None, 0)
    count = ctypes.c_int(0)
    if query(ctypes.byref(count), kernel.func, ctypes.byref(config)) != 0:
        return None
    return count.value


def with_defines(defines: dict[str, str], file: str = "global_auction.cu") -> str:
    """A kernel file's source with ``defines`` (its compile-time constants) as ``#define``s."""
    head = "".join(f"#define {key} {value}\n" for key, value in defines.items())
    return head + kernel_source(file)


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


def nvrtc_cubin(source: str, arch: str, kernel_name: str = KERNEL_NAME) -> bytes:
    """Compile ``source`` to a cubin for ``sm_<arch>`` with NVRTC, the kernels' headers
    (:func:`kernel_headers`) given to it by name (no file system needed)."""
    lib = _rtc_library()
    prog = ctypes.c_void_p()
    name = f"{kernel_name}.cu".encode()
    headers = kernel_headers()
    texts = (ctypes.c_char_p * len(headers))(*(text.encode() for _, text in headers))
    names = (ctypes.c_char_p * len(headers))(*(header.encode() for header, _ in headers))

    def check(result: int, what: str) -> None:
        if result != 0:
            lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            text = lib.nvrtcGetErrorString(result)
            message = text.decode() if text else result
            raise KernelCompileError(f"NVRTC {what} failed: {message}")

    check(
        lib.nvrtcCreateProgram(
            ctypes.byref(prog), source.encode(), name, len(headers), texts, names
        ),
        "create",
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
        raise KernelCompileError(f"NVRTC could not compile {kernel_name}:\n{log.value.decode()}")
    size = ctypes.c_size_t()
    check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
    cubin = ctypes.create_string_buffer(size.value)
    check(lib.nvrtcGetCUBIN(prog, cubin), "cubin")
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return cubin.raw


@functools.cache
def compiled_kernel(
    device_index: int,
    defines: tuple[tuple[str, str], ...],
    dynamic_bytes: int,
    file: str = "global_auction.cu",
    kernel_name: str = KERNEL_NAME,
):
    """A loaded kernel for one device, shape and budget (compiled once per process)."""
    from torch.cuda import _utils

    with torch.cuda.device(device_index):
        props = torch.cuda.get_device_properties(device_index)
        source = with_defines(dict(defines), file)
        cubin = nvrtc_cubin(source, f"{props.major}{props.minor}", kernel_name)
        try:
            kernel = _utils._cuda_load_module(cubin, [kernel_name])[kernel_name]
        except RuntimeError as exc:
            raise KernelCompileError(f"could not load {kernel_name}: {exc}") from exc
        # Dynamic shared memory above 48 KiB must be allowed explicitly (set always: torch's own
        # helper skips it when the dynamic part alone is below 48 KiB).
        libcuda = _utils._get_gpu_runtime_library()
        _utils._check_cuda(
            libcuda.cuFuncSetAttribute(
                kernel.func, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic_bytes
            )
        )
        if hasattr(kernel, "_max_shared_mem_bytes"):  # torch's launcher checks its own record
            kernel._max_shared_mem_bytes = dynamic_bytes
    return kernel


@functools.cache
def _driver() -> tuple[Callable[..., int], Callable[..., int] | None]:
    """The CUDA driver's ``cuLaunchKernel`` with its argument types, and PyTorch's raw current
    stream getter (``None`` where this build lacks it), looked up once. PyTorch's own kernel
    wrapper opens the driver library afresh at every launch (``ctypes.CDLL`` per call)."""
    from torch.cuda import _utils

    driver = _utils._get_gpu_runtime_library()
    launch_kernel = driver.cuLaunchKernel
    launch_kernel.restype = ctypes.c_int
    launch_kernel.argtypes = [
        ctypes.c_void_p,  # CUfunction
        *(ctypes.c_uint,) * 6,  # grid, block
        ctypes.c_uint,  # shared memory bytes
        ctypes.c_void_p,  # CUstream
        ctypes.POINTER(ctypes.c_void_p),  # kernel parameters
        ctypes.c_void_p,  # extra
    ]
    raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return launch_kernel, raw_stream


def launch(
    kernel,
    device_index: int,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    args: list[Tensor | int],
    shared_mem: int,
) -> None:
    """Launch a loaded kernel on the current stream of GPU ``device_index``: tensors go as their
    data pointers, ints as C ints (the kernels' signatures). No host synchronisation."""
    launch_kernel, raw_stream = _driver()
    keep = [
        ctypes.c_void_p(arg.data_ptr()) if isinstance(arg, Tensor) else ctypes.c_int(arg)
        for arg in args
    ]
    params = (ctypes.c_void_p * len(keep))(*(ctypes.addressof(value) for value in keep))
    stream = (
        raw_stream(device_index)
        if raw_stream is not None
        else torch.cuda.current_stream(device_index).cuda_stream
    )
    # The device guard only where the call is not on its device already (it costs a device
    # switch and back).
    same = torch.cuda.current_device() == device_index
    with contextlib.nullcontext() if same else torch.cuda.device(device_index):
        result = launch_kernel(kernel.func, *grid, *block, shared_mem, stream, params, None)
    if result != 0:
        from torch.cuda import _utils

        _utils._check_cuda(result)
