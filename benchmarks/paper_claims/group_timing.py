"""How long the GPU flow solver takes for one micro-batch at each routing-group size.

The authors route the flow routers per 512-token sequence and the baselines per micro-batch; a
common group for both needs the flow solver to route larger groups. This times one call of the
global solver on one micro-batch of 64 x 512 tokens (e = 16, k = 2, capacity factor 1) split
into groups of 512, 4,096 (8 sequences) and 32,768 tokens (the whole micro-batch), on softmax
affinities of random logits, and writes ``group_timing.json``.

    python benchmarks/paper_claims/group_timing.py --output benchmarks/paper_claims/results
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from maxscore.routing.flow import min_cost_flow_assignment


def time_group(tokens: int, group: int, e: int, k: int, repeats: int) -> dict[str, float]:
    groups = tokens // group
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(groups, group, e, device="cuda", generator=gen) * 2.0
    affinities = logits.softmax(-1)
    capacity = math.ceil(k * group / e)
    solve = lambda: min_cost_flow_assignment(affinities, k, capacity, method="global")  # noqa: E731
    first = solve()  # compiles the kernels for this shape
    torch.cuda.synchronize()
    start = time.perf_counter()
    solve()
    torch.cuda.synchronize()
    if time.perf_counter() - start > 1.0:
        repeats = 1  # a whole micro-batch in one group can take seconds a call
    start = time.perf_counter()
    for _ in range(repeats):
        again = solve()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / repeats * 1e3
    return {
        "group_tokens": group,
        "groups": groups,
        "ms_per_micro_batch": ms,
        "same_assignment_twice": bool(torch.equal(first, again)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = [time_group(64 * 512, g, 16, 2, args.repeats) for g in (512, 4096, 32768)]
    payload = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "group_timing.json").write_text(json.dumps(payload, indent=1) + "\n")
    print(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
