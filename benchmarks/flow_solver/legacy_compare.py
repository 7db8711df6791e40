"""Times the previous global solver's backends against the new CUDA kernel on their shapes
(one-off, to decide which backends to keep)."""

import math
import sys

import torch

sys.path.insert(0, "benchmarks/flow_solver")
from bench import graph_time_ms, synthetic

from maxscore.routing.flow import legacy_global_solver as old
from maxscore.routing.flow.global_solver import solve_global

for groups, n, e, k in [(32, 512, 16, 2), (1, 16384, 16, 2), (32, 512, 64, 2)]:
    c = math.ceil(k * n / e)
    cap = torch.full((e,), c, device="cuda")
    for fam in ["random", "near-tied-0.03"]:
        a = synthetic(fam, groups, n, e, seed=3).cuda()
        row = {}
        for name, fn in [
            ("new-cuda", lambda: solve_global(a, k, cap, capacity_bound=c, backend="cuda")),
            ("old-auto", lambda: old.solve_global(a, k, cap)),
        ]:
            try:
                row[name] = graph_time_ms(fn, 30)
            except Exception as exc:
                row[name] = f"failed: {type(exc).__name__}: {str(exc)[:80]}"
        print(f"legacy {groups}x{n} e={e} k={k} {fam}: {row}", flush=True)
