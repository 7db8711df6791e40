"""The host's time per flow-solver call: the Python path from the router's call to the last launch.

A compiled training step at micro-batch 64 is close to bound by the host issuing its kernels,
so every microsecond the solver's Python path takes between its launches is a microsecond the
GPU can wait (``solver_in_training.py``: early in training a Base call takes 0.54 ms inside the
step against 0.11 ms replayed alone). This measures that path alone: the GPU is kept busy by a
long ``torch.cuda._sleep`` queued first, so no call waits for the GPU, and each call's wall time
is host time only. Entry points: ``solve_flow`` as the eager router calls it, and the
``maxscore::flow_solve`` operator as the compiled router calls it. Shapes: the routing calls of
Base (64 groups of 512 tokens, e = 16, k = 2) and base-8x128 (e = 128, k = 8). With
``--profile``, the functions that take the host's time (cProfile, cumulative).

    PYTHONPATH=src python benchmarks/flow_solver/host_time.py --out OUT
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import pstats
import statistics
import time
from pathlib import Path

import torch

from maxscore.routing.flow import compiled_call

SHAPES = ((64, 512, 16, 2), (64, 512, 128, 8))


def _entries(a: torch.Tensor, k: int, cap: torch.Tensor, bound: int):
    eager = lambda: compiled_call.solve_flow("global", a, k, cap, None, bound)  # noqa: E731
    operator = lambda: torch.ops.maxscore.flow_solve(a, k, cap, "global", -1, bound, None)  # noqa: E731
    return {"solve_flow": eager, "operator": operator}


def host_us(call, calls: int) -> list[float]:
    """Each of ``calls`` calls' host time in us, with the GPU busy for the whole loop."""
    call()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # about a second of GPU time at ~2 GHz: no call waits for it
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        times.append(1e6 * (time.perf_counter() - t0))
    torch.cuda.synchronize()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    rows = []
    for groups, n, e, k in SHAPES:
        a = torch.randn(groups, n, e, device="cuda").softmax(-1)
        bound = math.ceil(k * n / e)
        cap = torch.full((e,), bound, dtype=torch.long, device="cuda")
        for name, call in _entries(a, k, cap, bound).items():
            times = host_us(call, args.calls)
            row = {
                "shape": [groups, n, e, k],
                "entry": name,
                "host_us_median": statistics.median(times),
                "host_us_p90": sorted(times)[int(0.9 * len(times))],
            }
            if args.profile:
                profiler = cProfile.Profile()
                profiler.enable()
                host_us(call, args.calls)
                profiler.disable()
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(18)
                row["profile"] = text.getvalue()
            rows.append(row)
            print(json.dumps({key: v for key, v in row.items() if key != "profile"}), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "calls": args.calls,
        "rows": rows,
    }
    (args.out / "host_time.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
