"""The starting prices' kernel alone (``kernels/dual_prices.cu``) with each cluster size.

For each shape (random softmax groups, capacity ``ceil(k n / e)``) and each number of blocks
per group (a thread-block cluster), the median time of the kernel replayed in a CUDA graph, the
clusters of that size the driver says the GPU holds at once (``cuOccupancyMaxActiveClusters``:
fewer than the groups means a second wave), and the plan ``global_cuda.price_cluster`` makes.

    PYTHONPATH=src:tests python benchmarks/flow_solver/price_clusters.py --out OUT
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from functools import partial
from pathlib import Path

import torch

from maxscore.routing.flow import global_cuda
from maxscore.routing.flow.global_reference import GlobalBudget

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/common.py
from common import load_script  # noqa: E402

# (n, e, k, groups): the timing table's 32 groups of 512, 8 of 4,096, and a training call's 64
SHAPES = [
    (512, 16, 2, 32),
    (512, 64, 2, 32),
    (512, 64, 6, 32),
    (512, 256, 8, 32),
    (4096, 64, 6, 8),
    (512, 128, 8, 64),
]
CLUSTERS = (1, 2, 3, 4, 6, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    bench = load_script(HERE / "bench.py", "flow_bench")
    planner = global_cuda.price_cluster
    budget = GlobalBudget()
    rows = []
    try:
        for n, e, k, groups in SHAPES:
            a = bench.synthetic("random", groups, n, e, seed=7).cuda().float().contiguous()
            cap = torch.full((groups, e), math.ceil(k * n / e), dtype=torch.int32, device="cuda")
            global_cuda.price_cluster = planner
            global_cuda._price_launch.cache_clear()
            planned = global_cuda._price_launch(0, n, e, k, budget, groups).cluster
            for cluster in CLUSTERS:
                global_cuda.price_cluster = lambda *_, c=cluster: c
                global_cuda._price_launch.cache_clear()
                launch = global_cuda._price_launch(0, n, e, k, budget, groups)
                defines = dict(launch.defines)
                resident = global_cuda.price_resident_clusters(defines, launch.kernel, groups)
                call = partial(global_cuda.start_prices, a, k, cap, budget, None, 0)
                row = {
                    "n": n,
                    "e": e,
                    "k": k,
                    "groups": groups,
                    "cluster": cluster,
                    "threads": int(defines["THREADS"]),
                    "seg": int(defines["SEG"]),
                    "resident_clusters": resident,
                    "planned_cluster": int(planned),
                    "ms": bench.graph_time_ms(call, args.reps),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        global_cuda.price_cluster = planner
        global_cuda._price_launch.cache_clear()
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "iterations": budget.price_iterations,
        "rows": rows,
    }
    (args.out / "price_clusters.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
