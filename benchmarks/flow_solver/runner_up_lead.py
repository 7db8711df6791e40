"""A lead for phase 2's Dijkstra search, on the kernel's CPU emulation: the runner-up's row.

Each step of the warp Dijkstra settles the node of smallest distance and then reads that node's
row of the expert graph; with the graph in global memory (e = 256) that read is the step's
latency, and the next node is unknown until the step's distances are updated. If the next node
settled is usually the current step's runner-up (the second smallest distance before the
update), its row can be loaded a step ahead. The candidate kernel does that (the shipped one
with the runner-up's row loaded a step ahead; it assigns as the shipped one does). This script
counts how often the loaded row is the one needed: the candidate with counters, run through
the block emulator on random and near-tied inputs and a real router's scores; and writes the
candidate kernel file into ``--out``, for ``compare_kernels.py --baseline`` on a GPU. The
shipped kernel does not change.

``PYTHONPATH=src:tests python benchmarks/flow_solver/runner_up_lead.py --out DIR`` (~2 minutes)
"""

from __future__ import annotations

import ctypes
import sys
import tempfile
from pathlib import Path

import torch

from maxscore.routing.flow import global_cuda

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "tests"))  # the emulator and its input helpers
from reference_leads import lead_arguments, record, write_rows  # noqa: E402

import cuda_emulated  # noqa: E402
import flow_helpers  # noqa: E402

# (text in the shipped kernel, replacement): the candidate, each step loading the runner-up's
# row a step ahead (kept in registers: the next step copies it where the runner-up is settled).
CANDIDATE = [
    (
        "  float reached_max = 0.0f;\n  for (int step = 0; step < V; ++step) {\n",
        "  float reached_max = 0.0f;\n  float spec[R];  // the runner-up's row\n"
        "  int spec_node = -1;\n  for (int step = 0; step < V; ++step) {\n",
    ),
    (
        """    float row[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int v = lane + 32 * r;
      row[r] = v < E ? gain[GAIN(bu, v)] : NEG;
    }
""",
        """    float row[R];
    if (bu == spec_node) {
#pragma unroll
      for (int r = 0; r < R; ++r) row[r] = spec[r];
    } else {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int v = lane + 32 * r;
        row[r] = v < E ? gain[GAIN(bu, v)] : NEG;
      }
    }
    {  // the runner-up (bu is done now), its row's loads issued before this step's work
      float second = INF;
      int b2 = 0x7fffffff;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int v = lane + 32 * r;
        if (v < V && !done[r] && dist[r] < second) {
          second = dist[r];
          b2 = v;
        }
      }
      const u32 key = __float_as_uint(second);
      const u32 low = __reduce_min_sync(FULL_MASK, key);
      b2 = __reduce_min_sync(FULL_MASK, key == low ? b2 : 0x7fffffff);
      spec_node = low < __float_as_uint(INF) && b2 < E ? b2 : -1;
      if (spec_node >= 0) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int v = lane + 32 * r;
          spec[r] = v < E ? gain[GAIN(spec_node, v)] : NEG;
        }
      }
    }
""",
    ),
]
# (text in the candidate, replacement): counters of settled steps and of steps whose node was
# the previous step's runner-up (the row the candidate loaded ahead), kept by lane 0 of the
# searching warp; the counted kernel assigns as the candidate does.
COUNTERS = [
    (
        "typedef unsigned int u32;\n",
        "typedef unsigned int u32;\n#include <atomic>\n"
        "inline std::atomic<long long> lead_steps{0}, lead_hits{0};\n",
    ),
    (
        "    if (!(best < INF)) break;\n    reached_max = best;\n",
        "    if (!(best < INF)) break;\n"
        "    if (lane == 0) {\n      lead_steps++;\n      if (bu == spec_node) lead_hits++;\n    }\n"
        "    reached_max = best;\n",
    ),
]
GETTER = """
extern "C" long long lead_count(int which) { return which == 0 ? lead_steps : lead_hits; }
"""


def patched(replacements: list[tuple[str, str]], text: str | None = None) -> str:
    """``text`` (the shipped kernel's, by default) with ``replacements`` made (each must occur
    exactly once)."""
    text = global_cuda.kernel_source() if text is None else text
    for old, new in replacements:
        if text.count(old) != 1:
            raise ValueError(f"{old!r} occurs {text.count(old)} times in the kernel file")
        text = text.replace(old, new)
    return text


def instrumented_kernel(folder: Path) -> Path:
    """The candidate kernel file with the counters, written into ``folder``."""
    path = folder / "global_auction_runner_up.cu"
    path.write_text(patched(COUNTERS, patched(CANDIDATE)) + GETTER)
    return path


def count(kernel: Path, a: torch.Tensor, k: int) -> dict:
    """Settled steps and runner-up hits of phase 2's searches on the groups of ``a``."""
    e = a.shape[2]
    cap = torch.full((e,), -(-k * a.shape[1] // e))
    lib = cuda_emulated.library(a, k, cap, kernel=kernel)
    lib.lead_count.restype = ctypes.c_longlong
    before = [lib.lead_count(0), lib.lead_count(1)]
    index, stats = cuda_emulated.solve_emulated(a, k, cap, kernel=kernel)
    flow_helpers.check_constraints(index, k, cap, e)
    steps, hits = lib.lead_count(0) - before[0], lib.lead_count(1) - before[1]
    return {
        "phase2_rounds": [int(x) for x in stats[:, 2]],
        "settled_steps": steps,
        "runner_up_next": hits,
        "share": round(hits / max(steps, 1), 3),
    }


def main() -> None:
    args = lead_arguments(__doc__)
    candidate = args.out / "global_auction_runner_up_candidate.cu"
    candidate.write_text(patched(CANDIDATE))  # to time: compare_kernels.py --baseline FILE
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        kernel = instrumented_kernel(Path(tmp))
        for n, e, k in [(256, 16, 2), (256, 64, 2), (128, 64, 6), (256, 128, 8), (256, 256, 8)]:
            for family in ["random", "near-tied-0.03"]:
                if family == "random":
                    a = flow_helpers.instances(3, args.groups, n, e, 0.0)
                else:
                    a = flow_helpers.near_tied(3, args.groups, n, e, 0.03)
                record(rows, {"n": n, "e": e, "k": k, "family": family, **count(kernel, a, k)})
        router = flow_helpers.real_router_scores("e64_k2")[:, :256].contiguous()
        record(
            rows, {"n": 256, "e": 64, "k": 2, "family": "router-e64_k2", **count(kernel, router, 2)}
        )
    write_rows(args.out, "runner_up_lead.json", rows)


if __name__ == "__main__":
    main()
