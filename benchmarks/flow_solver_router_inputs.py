"""The global flow solver on the affinities a real router produces (issue 3 / issue 5).

``flow_solver_gpu.py`` times synthetic softmax affinities. Training feeds the solver the Base
model's SoftTopk affinities, whose spread and ties differ, and the rounds a group needs depend on
that. This script captures the solver's inputs in a forward pass of the Base preset with the
maxscore router (random init and after ``--train-steps`` optimizer steps on random ids, micro-batch
64 x 512: 64 groups of 512 tokens, e = 16, k = 2) and, per layer, reports the rounds used, the
phase split of the slowest group and the CUDA-graph time of the CUDA and Triton kernels, with the
gap to the exact optimum (CPU) for the first groups.

``PYTHONPATH=src:benchmarks python3 benchmarks/flow_solver_router_inputs.py --out DIR``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from flow_solver_cuda import phase_split
from flow_solver_gpu import graph_timer
from maxscore.routing.flow import FLOW_SOLVERS, flow_objective, global_cuda, global_triton
from maxscore.routing.flow.global_solver import (
    cuda_budget,
    default_budget,
    fused_budget,
    solve_global,
)

MOVE_VARIANTS = {"m4": {"moves": 4}, "m4 c16": {"moves": 4, "cycle_rounds": 16}}


def capture(model: torch.nn.Module, batch: torch.Tensor) -> list[tuple]:
    """(affinities, k, capacity) of every solver call in one forward pass."""
    spec = FLOW_SOLVERS["global"]
    calls: list[tuple] = []
    original = spec.solve

    def recording(affinities, k, capacity, *, iterations=None):
        calls.append((affinities.detach().clone(), k, capacity.detach().clone()))
        return original(affinities, k, capacity, iterations=iterations)

    object.__setattr__(spec, "solve", recording)
    try:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            model(input_ids=batch)
    finally:
        object.__setattr__(spec, "solve", original)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--train-steps", type=int, default=30)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    from maxscore.training import TrainConfig
    from maxscore.training.trainer import build_model, build_model_config

    cfg = TrainConfig(model="base", router="maxscore")
    model = build_model(build_model_config(cfg, vocab_size=32000), seed=0, on_gpu=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    batch = torch.randint(0, 32000, (64, 512), device="cuda", generator=gen)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    rows = []
    exact = FLOW_SOLVERS["exact"].solve
    for stage in ("init", f"after {args.train_steps} steps"):
        if stage != "init":
            for _ in range(args.train_steps):
                ids = torch.randint(0, 32000, (64, 512), device="cuda", generator=gen)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        for layer, (x, k, cap) in enumerate(capture(model, batch)):
            groups, _, e = x.shape
            x = x.float().contiguous()
            capg = cap.to(x.device).expand(groups, e).contiguous()
            budget = default_budget(e)
            stats = torch.zeros(groups, 4, dtype=torch.int32, device="cuda")
            clocks = torch.zeros(groups, 8, dtype=torch.int64, device="cuda")
            out = global_cuda.solve_cuda(
                x, k, capg, **cuda_budget(budget), stats=stats, clocks=clocks
            )
            torch.cuda.synchronize()
            split = phase_split(clocks, stats.cpu())
            ms_cuda, _ = graph_timer(
                lambda a, c=capg, k=k, b=budget: global_cuda.solve_cuda(a, k, c, **cuda_budget(b)),
                [x],
                args.reps,
            )
            tstats = torch.zeros(groups, 4, dtype=torch.int32, device="cuda")
            tout = global_triton.solve_triton(x, k, capg, **fused_budget(budget), stats=tstats)
            torch_out = solve_global(x[:8], k, cap, backend="torch")
            ms_triton, _ = graph_timer(
                lambda a, c=capg, k=k, b=budget: global_triton.solve_triton(
                    a, k, c, **fused_budget(b)
                ),
                [x],
                args.reps,
            )
            sub = x[:8].cpu()
            opt = flow_objective(sub, exact(sub, k, cap.cpu()))
            gap = ((opt - flow_objective(sub, out[:8].cpu())) / opt).numpy()
            tgap = ((opt - flow_objective(sub, tout[:8].cpu())) / opt).numpy()
            pgap = ((opt - flow_objective(sub, torch_out.cpu())) / opt).numpy()
            # Parallel cycle copies (moves > 1, flow_solver_notes.md round 4): time and gaps.
            variants = {}
            for label, extra in MOVE_VARIANTS.items():
                opts = {**cuda_budget(budget), **extra}
                vout = global_cuda.solve_cuda(x, k, capg, **opts)
                vms, _ = graph_timer(
                    lambda a, c=capg, k=k, o=opts: global_cuda.solve_cuda(a, k, c, **o),
                    [x],
                    args.reps,
                )
                vgap = ((opt - flow_objective(sub, vout[:8].cpu())) / opt).numpy()
                variants[label] = {"graph_ms": round(vms, 4), "gap_max_first8": float(vgap.max())}
            spread = (x.amax(dim=(1, 2)) - x.amin(dim=(1, 2))).median().item()
            row = {
                "stage": stage,
                "layer": layer,
                "shape": list(x.shape),
                "k": k,
                "capacity": int(cap.reshape(-1)[0]),
                "spread_median": spread,
                "cuda_graph_ms": round(ms_cuda, 4),
                "triton_graph_ms": round(ms_triton, 4),
                "cuda_rounds_max": stats[:, :2].amax(0).tolist(),
                "cuda_cycle_rounds_mean": float(stats[:, 1].float().mean()),
                "triton_rounds_max": tstats[:, :2].amax(0).tolist(),
                "gap_max_first8": float(np.max(gap)),
                "triton_gap_max_first8": float(np.max(tgap)),
                "torch_gap_max_first8": float(np.max(pgap)),
                "cuda_variants": variants,
                **split,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"card": torch.cuda.get_device_name(), "torch": torch.__version__}
    (args.out / "flow_solver_router_inputs.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
