"""Freed host memory is kept for reuse (glibc): a loop that allocates and frees a large tensor
stops faulting in fresh pages every time."""

from __future__ import annotations

import subprocess
import sys

import pytest

from maxscore.host_memory import reuse_freed_host_memory

CODE = """
import resource, sys, torch
from maxscore.host_memory import reuse_freed_host_memory
if sys.argv[1] == "reuse":
    assert reuse_freed_host_memory()
torch.ones(16 * 2**20)  # torch's own first-use allocations out of the count
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    torch.ones(16 * 2**20)  # 64 MiB, freed at once
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _minor_faults(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", CODE, mode], capture_output=True, text=True, timeout=120, check=True
    )
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not reuse_freed_host_memory(), reason="glibc's mallopt is not available")
def test_freed_memory_is_reused_instead_of_faulted_in_again() -> None:
    plain, reused = _minor_faults("plain"), _minor_faults("reuse")
    # 50 x 64 MiB = 819,200 pages of 4 KiB faulted in without; with reuse only the first
    # allocations in each of malloc's arenas fault
    assert plain > 500_000
    assert reused < plain / 4
