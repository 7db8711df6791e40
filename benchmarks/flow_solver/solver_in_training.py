"""The flow solver's time inside training: every solver call of the timed steps, on the GPU.

Trains ``--runs`` (``preset:router`` pairs) one after the other through
``benchmarks/expert_parallel/bench.py run``'s path (compiled, bf16, micro-batch 64 x 512) and
wraps the solver call that the compiled model makes (``compiled_call.solve_with``, which the
``maxscore::flow_solve`` operator looks up at every call) with two CUDA events, for the calls of
steps ``--warmup + 1 .. --steps`` (``--calls-per-step`` calls a step: one per MoE layer). The
events are read after training, so the timing adds no host synchronisation. Per run: the step
time, the solver's milliseconds a call (mean, median, 90th percentile, largest) and a step, the
caching allocator's cudaMallocs and retries during the timed steps, and for the slowest and
the median call the kernel's statistics and its time replayed alone in a CUDA graph (the
scores are kept for that, and written to ``OUT/run<i>_<slowest|median>.npz`` as float16, the
form ``bench.py --timing --scores`` reads).

An event pair spans the prices' kernel and the solver's kernel, so a call whose second launch
the host issues late (the GPU having caught up with the host) reads longer than its replay: the
difference between the two is time the GPU waited for the host inside the call. Keeping every
call's scores allocates device memory during the timed steps, so ``step_ms`` here is not the
clean throughput: ``bench.py run`` measures that.

    PYTHONPATH=src:tests python benchmarks/flow_solver/solver_in_training.py \\
        --runs base-2x64:gshard,base-2x64:maxscore --out OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from maxscore.routing.flow import compiled_call

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/common.py
from common import load_script  # noqa: E402


class SolverCallTimer:
    """Wraps ``compiled_call.solve_with``: the calls numbered ``first .. last - 1`` (counted from
    the run's start) get a CUDA event before and after, and their inputs are kept."""

    def __init__(self) -> None:
        self.solve_with = compiled_call.solve_with
        self.first = self.last = 0
        self.calls = 0
        self.records: list[tuple[torch.cuda.Event, torch.cuda.Event, torch.Tensor, int, Any]] = []

    def start_run(self, first: int, last: int) -> None:
        self.first, self.last, self.calls, self.records = first, last, 0, []

    def __call__(self, spec: Any, affinities: torch.Tensor, k: int, capacity: Any, **kw: Any):
        index, self.calls = self.calls, self.calls + 1
        if not self.first <= index < self.last:
            return self.solve_with(spec, affinities, k, capacity, **kw)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        result = self.solve_with(spec, affinities, k, capacity, **kw)
        end.record()
        self.records.append((start, end, affinities.detach().clone(), k, capacity.clone()))
        return result


def call_summary(
    flow_bench: Any, record: tuple[Any, ...], ms_in_training: float, index: int, path: Path
) -> dict[str, Any]:
    """One kept call: its kernel statistics and its time replayed alone; its scores saved."""
    _, _, scores, k, capacity = record
    a, cap = scores.float(), capacity.to(torch.int32)
    flow_bench.save_scores(path, a, k, cap)
    replayed = flow_bench.time_and_stats(a, k, cap, 10)
    return {
        "call": index,
        "ms_in_training": ms_in_training,
        "ms_replayed": replayed.pop("ms"),
        "shape": list(a.shape),
        **replayed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="base-2x64:gshard,base-2x64:maxscore")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=260, help="steps excluded from timing")
    parser.add_argument(
        "--calls-per-step", type=int, default=12, help="solver calls a step: the MoE layers"
    )
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("solver_in_training.py times CUDA kernels: it needs a GPU")
    train_bench = load_script(HERE.parent / "expert_parallel" / "bench.py", "ep_bench")
    flow_bench = load_script(HERE / "bench.py", "flow_bench")
    timer = SolverCallTimer()
    compiled_call.solve_with = timer
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for index, item in enumerate(args.runs.split(",")):
        timer.start_run(args.warmup * args.calls_per_step, args.steps * args.calls_per_step)
        train_bench.main([
            "run", "--runs", item, "--compile", "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--output", str(args.out / f"run{index}"),
            "--tag", "train", "--runs-dir", f"/tmp/solver-in-training-{index}",
        ])  # fmt: skip
        torch.cuda.synchronize()
        trained = json.loads((args.out / f"run{index}" / "train.json").read_text())["results"][0]
        ms = np.array([start.elapsed_time(end) for start, end, *_ in timer.records])
        row: dict[str, Any] = {
            "run": item,
            "step_ms": trained.get("step_ms"),
            "first_step_s": trained.get("first_step_s"),
            "final_train_loss": trained.get("final_train_loss"),
            "device_mallocs_timed": trained.get("device_mallocs_timed"),
            "solver_calls_timed": len(ms),
            "solver_calls_total": timer.calls,
        }
        if len(ms):
            order = np.argsort(ms)
            row |= {
                "solver_ms_mean": float(ms.mean()),
                "solver_ms_median": float(np.median(ms)),
                "solver_ms_p90": float(np.percentile(ms, 90)),
                "solver_ms_max": float(ms.max()),
                "solver_ms_per_step": float(ms.sum()) / (args.steps - args.warmup),
            }
            for label, call in (("slowest", order[-1]), ("median", order[len(order) // 2])):
                path = args.out / f"run{index}_{label}.npz"
                row[label] = call_summary(
                    flow_bench, timer.records[call], float(ms[call]), int(call), path
                )
        print("solver in training", json.dumps(row), flush=True)
        rows.append(row)
        (args.out / "solver_in_training.json").write_text(json.dumps(rows, indent=1) + "\n")
        timer.records = []
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
