"""The slot-position kernel's chunk loop: as a loop (shipped) against unrolled (tl.static_range,
the kernel before it), compile time and run time.

Evaluation batches (lm-eval) are sorted by length, so their rows (one routing group per batch,
``batch x length x k`` slots) shrink through the powers of two of the kernel's chunk count, and
each new count compiles a variant. Unrolled, a 16-chunk variant compiled for about 30 s and
lm-eval stalled that long. Each (kernel, shape) starts from an empty Triton cache, so its first
call includes its compile; then the mean of ``--reps`` calls (CUDA events, launches included).

``PYTHONPATH=src python3 benchmarks/dispatch_kernels/position_kernel_compile.py --out DIR``
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # an empty cache: every compile counted

import torch
import triton

from maxscore.moe import dispatch


def unrolled_kernel() -> Any:
    """The shipped kernel with its chunk loop unrolled (``tl.static_range``), as it was before:
    its source with that one line changed, imported from a file (Triton reads a kernel's
    source)."""
    source = textwrap.dedent(inspect.getsource(dispatch._key_positions_kernel.fn))
    loop = "for chunk in range(chunks):"
    if loop not in source:
        raise SystemExit(f"the shipped kernel has no line {loop!r}: update this benchmark")
    source = source.replace(loop, "for chunk in tl.static_range(chunks):")
    path = Path(tempfile.mkdtemp()) / "unrolled_position_kernel.py"
    path.write_text("import triton\nimport triton.language as tl\n\n\n" + source)
    spec = importlib.util.spec_from_file_location("unrolled_position_kernel", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._key_positions_kernel


# (groups, slots per group, experts): MaxScore's Base and base-2x64 training rows, then single
# rows of evaluation batches (16, 8 and 4 chunks at e = 16).
SHAPES = [(128, 1024, 16), (128, 1024, 64), (1, 8192, 16), (1, 4000, 16), (1, 2000, 16)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    shipped, unrolled = dispatch._key_positions_kernel, unrolled_kernel()
    rows = []
    for groups, m, e in SHAPES:
        key = torch.randint(0, e + 1, (groups, m), device="cuda")
        for name, kernel in (("unrolled", unrolled), ("loop", shipped)):
            dispatch._key_positions_kernel = kernel
            try:
                torch.cuda.synchronize()
                start = time.perf_counter()
                dispatch._key_positions_triton(key, e + 1)
                torch.cuda.synchronize()
                first = time.perf_counter() - start
                begin, end = torch.cuda.Event(True), torch.cuda.Event(True)
                begin.record()
                for _ in range(args.reps):
                    dispatch._key_positions_triton(key, e + 1)
                end.record()
                torch.cuda.synchronize()
            finally:
                dispatch._key_positions_kernel = shipped
            rows.append(
                {
                    "kernel": name, "groups": groups, "m": m, "e": e,
                    "first_call_s": round(first, 3),
                    "us_per_call": round(begin.elapsed_time(end) / args.reps * 1000, 2),
                }
            )  # fmt: skip
            print(rows[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": rows}
    (args.out / "position_kernel_compile.json").write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
