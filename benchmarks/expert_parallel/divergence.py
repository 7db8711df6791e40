"""Why an expert-parallel loss curve leaves the one-process curve: a controlled experiment.

Four trainings of the same model on the same global batches (``tests/gpu_training_runs.py``:
the 16-sequence global batch, routing groups of 4 sequences, every step's routing decisions
recorded by ``tests/routing_trace.py``):

* ``one``: one process, micro-batch 16 (the reference);
* ``ep``: 4 processes, ``--expert-parallel 4``, micro-batch 4 each;
* ``ddp``: 4 processes, plain DDP (every process holds every expert), micro-batch 4 each;
* ``perturbed``: one process, the initial embeddings multiplied by ``1 + 1e-7 * noise``.

``ddp`` and ``perturbed`` differ from ``one`` only by rounding (another order of the sums, a
change of the start the size of one fp32 rounding), so the way they leave ``one`` is the
chaos of training itself; ``ep`` must leave it the same way, and route identically until the
first near-tie flips. For each run the JSON has the loss gaps to ``one`` (largest, mean, per
step), the first step whose routing differs, that step's flips (tokens whose top-k experts by
logit differ) and their largest top-k margin in ``one`` (how close to a tie they were), and the
tokens routed differently at later steps.

On the CPU (gloo; ``MAXSCORE_GPU_RUNS_SMALL=1`` is set: a 1-layer model of width 32)::

    python benchmarks/expert_parallel/divergence.py run OUT --steps 100 --seq-len 32
    python benchmarks/expert_parallel/divergence.py summarize OUT --output OUT/divergence.json

On GPUs add ``--gpus``: the tiny preset (4 layers, width 128), seq 128, one GPU per process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
sys.path.insert(0, str(TESTS))  # routing_trace, distributed_helpers

#: name -> (processes, extra arguments of gpu_training_runs.py)
RUNS: dict[str, tuple[int, tuple[str, ...]]] = {
    "one": (1, ("--batch-size", "16")),
    "ep": (4, ("--batch-size", "4", "--expert-parallel", "4")),
    "ddp": (4, ("--batch-size", "4")),
    "perturbed": (1, ("--batch-size", "16", "--perturb", "1e-7")),
}


def run(args: argparse.Namespace) -> None:
    from distributed_helpers import free_port

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TOKENIZERS_PARALLELISM": "false"}
    if not args.gpus:
        env.update(MAXSCORE_GPU_RUNS_SMALL="1", OMP_NUM_THREADS="1")
    common = (
        "--routers", args.router, "--group-batch", "4", "--steps", str(args.steps),
        "--seq-len", str(args.seq_len), "--trace-steps", str(args.steps), "--trace-logits",
        str(args.steps), "--save-steps", "0",
    )  # fmt: skip
    for name in args.runs.split(","):
        procs, extra = RUNS[name]
        out = Path(args.out) / name
        script = [str(TESTS / "gpu_training_runs.py"), str(out), *common, *extra]
        if procs == 1:
            cmd = [sys.executable, *script]
        else:
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs),
                "--master-port", str(free_port()), *script,
            ]  # fmt: skip
        print(f"[divergence] {name}: {' '.join(cmd)}", flush=True)
        log = Path(args.out) / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as handle:
            subprocess.run(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT, check=True)


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r.get("type") == "train"}


def _sci(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def summarize(args: argparse.Namespace) -> None:
    from routing_trace import compare, load_global

    out = Path(args.out)
    router = args.router
    ref_losses = _losses(out / "one" / router)
    ref_routing = load_global(out / "one" / router / "routing")
    rows: dict[str, Any] = {}
    for name in ("ep", "ddp", "perturbed"):
        if not (out / name / router / "metrics.jsonl").is_file():
            continue
        losses = _losses(out / name / router)
        gaps = {s: abs(losses[s] - ref_losses[s]) / ref_losses[s] for s in ref_losses}
        routing = compare(ref_routing, load_global(out / name / router / "routing"))
        first = next((s for s in sorted(routing) if routing[s]["differing"]), None)
        rows[name] = {
            "max_rel": max(gaps.values()),
            "max_rel_step": max(gaps, key=gaps.__getitem__),
            "mean_rel": sum(gaps.values()) / len(gaps),
            "step1_rel": gaps[1],
            "first10_max_rel": max(gaps[s] for s in sorted(gaps)[:10]),
            "same_inputs_every_step": all(r["same_inputs"] for r in routing.values()),
            "first_differing_step": first,
            "at_first_difference": routing.get(first) if first else None,
            "differing_tokens": {
                s: routing[s]["differing"] for s in (25, 50, 75, 100) if s in routing
            },
            "token_layer_pairs": routing[1]["tokens"],
            "gaps": {str(s): g for s, g in gaps.items()},
        }
    result = {"router": router, "runs": rows}
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print("| run | first routing difference | its flips (near-ties) | largest margin | "
          "tokens differing at 50 / 100 | step 1 gap | max gap (step) | mean gap |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        first = row["at_first_difference"] or {}
        diff = row["differing_tokens"]
        print(
            f"| {name} | step {row['first_differing_step']} | {first.get('choice_flips')} "
            f"({first.get('near_ties')}) | {_sci(first.get('max_margin_flipped'))} | "
            f"{diff.get(50)} / {diff.get(100)} of {row['token_layer_pairs']} | "
            f"{row['step1_rel']:.1e} | {row['max_rel']:.2%} ({row['max_rel_step']}) | "
            f"{row['mean_rel']:.3%} |"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train the four runs into OUT")
    r.add_argument("out")
    r.add_argument("--router", default="gshard")
    r.add_argument("--runs", default="one,ep,ddp,perturbed")
    r.add_argument("--steps", type=int, default=100)
    r.add_argument("--seq-len", type=int, default=32)
    r.add_argument("--gpus", action="store_true", help="one GPU per process (the tiny preset)")
    s = sub.add_parser("summarize", help="compare the runs in OUT with the one-process run")
    s.add_argument("out")
    s.add_argument("--router", default="gshard")
    s.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    (run if args.command == "run" else summarize)(args)


if __name__ == "__main__":
    main()
