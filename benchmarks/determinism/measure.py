"""Same-seed reruns with and without ``--deterministic``, and the flow solver on one input twice.

For each router (gshard, maxscore): the Base preset narrowed to hidden 512, 8 layers, 8 heads,
expert width 1024 (seq 512, batch 64, 60 optimizer steps, eager, bf16 on a GPU) trained four
times with the same seed, alternating without / with ``--deterministic``. The JSON (``--output``)
holds each run's validation loss, mean training loss and tokens/s, per mode the |difference|
between its two runs, and the deterministic / non-deterministic tokens/s ratio; then the GPU
flow solver (``flow_method="global"``, :func:`maxscore.routing.flow.global_solver.solve_global`)
timed on one random input of maxscore's routing shape twice, and whether both assignments are
the same index for index. ``--smoke``: a one-layer model of width 32 for 4 steps (any device)::

    PYTHONPATH=src python benchmarks/determinism/measure.py --output determinism.json
    PYTHONPATH=src python benchmarks/determinism/measure.py --smoke --output /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from maxscore.training import TrainConfig, train

ROUTERS = ("gshard", "maxscore")
MODES = {"nondeterministic": False, "deterministic": True}
MODEL = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "intermediate_size": 2048,  # dense layers' width (the Base preset has none)
    "moe_intermediate_size": 1024,
}
SIZES: dict[bool, dict[str, Any]] = {  # by --smoke
    False: {"model": "base", "model_overrides": MODEL, "seq_len": 512, "batch_size": 64,
            "max_steps": 60, "logging_steps": 10, "max_eval_blocks": 256},
    True: {"model": "tiny", "seq_len": 16, "batch_size": 2, "max_steps": 4, "logging_steps": 2,
           "max_eval_blocks": 2, "model_overrides": {"hidden_size": 32, "num_hidden_layers": 1,
                                                     "num_attention_heads": 2}},
}  # fmt: skip


def run_config(router: str, deterministic: bool, out: Path, smoke: bool) -> TrainConfig:
    """One run's settings (the same seed and data for every run)."""
    return TrainConfig(
        router=router,
        deterministic=deterministic,
        seed=42,
        compile=False,
        eval_steps=0,
        save_steps=0,
        save_final=False,
        report_to="none",
        quiet=True,
        overwrite=True,
        output_dir=str(out),
        **SIZES[smoke],
    )


def train_runs(router: str, workdir: Path, smoke: bool) -> dict[str, Any]:
    """Four runs of ``router`` (each mode twice, alternating) and their differences."""
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for rerun in range(2):
        for mode, deterministic in MODES.items():
            cfg = run_config(router, deterministic, workdir / f"{router}-{mode}-{rerun}", smoke)
            result = train(cfg)
            keys = ("eval_loss", "train_loss", "tokens_per_s", "runtime_s")
            runs[mode].append({key: getattr(result, key) for key in keys})
            print(f"{router} {mode} {rerun}: {runs[mode][-1]}", flush=True)

    def gap(mode: str, key: str) -> float:
        first, second = (run[key] for run in runs[mode])
        return abs(first - second)

    def speed(mode: str) -> float:
        return sum(run["tokens_per_s"] or 0.0 for run in runs[mode]) / 2

    return {
        "runs": runs,
        "eval_loss_abs_difference": {mode: gap(mode, "eval_loss") for mode in MODES},
        "train_loss_abs_difference": {mode: gap(mode, "train_loss") for mode in MODES},
        "tokens_per_s_ratio_deterministic": speed("deterministic") / speed("nondeterministic"),
    }


def flow_solver_twice(smoke: bool) -> dict[str, Any]:
    """The global solver on one random input of maxscore's shape (a group per sequence), twice."""
    from maxscore.routing.flow.choice import choose_flow_solver
    from maxscore.routing.flow.global_solver import solve_global
    from maxscore.routing.groups import expert_capacity

    device = "cuda" if torch.cuda.is_available() else "cpu"
    groups, n, e, k = (2, 16, 4, 2) if smoke else (64, 512, 16, 2)
    capacity = expert_capacity(n, e, k, 1.0, 1)
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(groups, n, e, generator=generator).softmax(-1).to(device)
    cap = torch.full((e,), capacity, dtype=torch.long, device=device)

    def solve() -> tuple[torch.Tensor, float]:
        if device == "cuda":
            torch.cuda.synchronize()
        begin = time.perf_counter()
        out = solve_global(scores, k, cap, capacity_bound=capacity)
        if device == "cuda":
            torch.cuda.synchronize()
        return out, 1e3 * (time.perf_counter() - begin)

    solve()  # compiles the kernels (NVRTC) on a GPU
    (first, ms_first), (second, ms_second) = solve(), solve()
    return {
        "shape": {"groups": groups, "tokens": n, "experts": e, "k": k, "capacity": capacity},
        "backend": choose_flow_solver("global", scores, k).backend,
        "ms": [ms_first, ms_second],
        "identical": bool(torch.equal(first, second)),
        "differing_slots": int((first != second).sum()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="the JSON file to write")
    parser.add_argument("--workdir", default="runs/determinism", help="the runs' directories")
    parser.add_argument("--smoke", action="store_true", help="tiny settings (CPU check)")
    parser.add_argument("--routers", default=",".join(ROUTERS))
    args = parser.parse_args()
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "smoke": args.smoke,
        "settings": run_config(ROUTERS[0], False, Path(args.workdir), args.smoke).to_dict(),
        "flow_solver": flow_solver_twice(args.smoke),
        "routers": {},
    }
    for router in args.routers.split(","):
        report["routers"][router] = train_runs(router, Path(args.workdir), args.smoke)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2, default=str) + "\n")
    for router, row in report["routers"].items():
        diff = row["eval_loss_abs_difference"]
        ratio = row["tokens_per_s_ratio_deterministic"]
        print(f"{router}: |eval loss difference| {diff}; tokens/s ratio {ratio:.3f}")
    print(f"flow solver: {report['flow_solver']}")


if __name__ == "__main__":
    main()
