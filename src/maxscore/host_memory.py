"""Keep freed host memory in the process for reuse (glibc), instead of unmapping it.

glibc's ``malloc`` serves every block above its mmap threshold (at most 32 MiB) with a fresh
``mmap`` and unmaps it on ``free``, so a CPU training step that allocates the ``[tokens, vocab]``
logits, their gradients and the optimizer's temporaries (tens to hundreds of MiB each) faults in
new zeroed pages every time: the tiny preset's default CPU run would spend a third of its time
in the kernel (55 million minor page faults in 5.5 minutes on 2 cores). With ``mmap`` off for
``malloc`` and heap trimming off, freed blocks stay in the heap and the next step reuses them
(2 s of system time over 60 steps of that run, against 88 s without). The cost: the process keeps its peak heap until it exits,
which a training process does anyway. The command line turns this on for ``train`` and
``compare``; a library user sets ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647`` or
calls :func:`reuse_freed_host_memory`.
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["reuse_freed_host_memory"]

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_NO_TRIM = 2**31 - 1  # mallopt takes an int


def reuse_freed_host_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse; whether it took (False elsewhere)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # another C library (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _NO_TRIM))
