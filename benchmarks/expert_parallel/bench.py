"""Expert-parallel training throughput: experts over several GPUs against one GPU, and MFU.

``bench.py run`` trains ``--runs`` (``preset:router`` pairs) one after the other through the real
``maxscore.training.train`` path (HF Trainer, fused AdamW, bf16 autocast over fp32 weights, the
embedded corpus, seq 512) and times the optimizer steps after ``--warmup`` (which include
compilation), CUDA-synchronised at both ends. One process is one GPU; under
``torchrun --nproc-per-node P`` with ``--expert-parallel P`` each MoE layer's experts are spread
over the P GPUs (all-to-all token exchange) and every GPU keeps the same micro-batch, so the
global batch is P times larger and perfect scaling is P times the tokens/s of one GPU.
``bench.py summarize`` joins the rows of several ``run`` calls into one JSON with the scaling
(P-GPU tokens/s over 1-GPU tokens/s of the same preset and router) and maxscore against gshard.

MFU = tokens/s x model FLOPs per token / (GPUs x 989 TFLOP/s), FLOPs per token as in
``benchmarks/common.py`` (``6 N_active + 12 L H Q T``), counted on the whole model (every expert)
built on the meta device. Validation is skipped (timing only). ``--precision fp8`` and
``--fused-loss`` (``run`` and ``sweep``) set the training options of the same names, so the
timed path is the trainer's own (``maxscore.training.model_build.apply_speed_options``); the MFU
stays counted against the bf16 peak. ``--grad-accum G`` times optimizer steps of G micro-batches
(the optimizer's pass over every parameter then comes once per G micro-batches, as in a training
at the paper's global batch of 688 sequences: ``--batch-size 86 --grad-accum 8``).

    CUDA_VISIBLE_DEVICES=0 python benchmarks/expert_parallel/bench.py run \\
        --runs base-2x64:gshard --compile --output DIR --tag one_gpu_gshard
    torchrun --nproc-per-node 2 benchmarks/expert_parallel/bench.py run --expert-parallel 2 \\
        --runs base-2x64:gshard,base-2x64:maxscore,xl:maxscore --compile --output DIR --tag ep2
    python benchmarks/expert_parallel/bench.py summarize DIR --output OUT/expert_parallel.json

``bench.py sweep`` runs a whole grid on one machine within a deadline: every ``preset:router``
of ``--runs`` on each GPU count of ``--gpu-counts``, one process group per (preset, router, GPU
count) on its own block of GPUs, as many side by side as the machine's GPUs allow (a 1-GPU run
on GPU 0 while another runs on GPU 1; the GPUs of a block are never shared, the host's CPU
cores are). The runs go in the order 1 GPU, the largest count, then the counts between; a run
whose expected length (``--expected-s``) no longer fits before ``--deadline`` is skipped and
listed as skipped. Each writes ``<tag>.json`` into ``--output`` as ``run`` does::

    python benchmarks/expert_parallel/bench.py sweep --gpus 4 --gpu-counts 1,2,4 \
        --runs base-2x64:gshard,base-2x64:maxscore --compile --output DIR --deadline 300
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "tests"))  # distributed_helpers
from common import H100_BF16_PEAK, flops_per_token, step_timer, timing_train_config

#: Micro-batch per GPU by preset where the default (``--batch-size``) would not fit an 80 GB GPU.
BATCH_BY_PRESET = {"xl": 32}


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _say(message: str) -> None:
    if _rank() == 0:
        print(f"[{datetime.now(UTC).strftime('%H:%M:%S')}] {message}", flush=True)


def _full_model_flops(model_config: Any, seq_len: int) -> tuple[float, int, int]:
    """FLOPs per token, activated matmul parameters and total parameters of the whole model."""
    from maxscore.models import LlamaMoEForCausalLM

    with torch.device("meta"):
        model = LlamaMoEForCausalLM(model_config)
    fpt, n_active = flops_per_token(model, seq_len)
    return fpt, n_active, model.parameter_counts()["total"]


def run_one(preset: str, router: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train ``preset`` with ``router`` for ``args.steps`` steps; the timed row."""
    from maxscore.training import prepare, train
    from maxscore.training.distributed import world_size

    batch = BATCH_BY_PRESET.get(preset, args.batch_size)
    config = timing_train_config(
        model=preset,
        router=router,
        seq_len=args.seq_len,
        batch_size=batch,
        grad_accum=args.grad_accum,
        compile=args.compile,
        fused_loss=args.fused_loss,
        max_steps=args.steps,
        expert_parallel=args.expert_parallel,
        logging_steps=args.steps,
        max_eval_blocks=1,
        output_dir=str(Path(args.runs_dir) / f"{preset}-{router}-ep{args.expert_parallel}"),
        **({} if args.gc_interval is None else {"gc_interval": args.gc_interval}),
        **({} if args.precision is None else {"precision": args.precision}),
    )
    prepared = prepare(config)
    # Timing only: no validation set, so no final evaluation (and no eval-mode compilation).
    prepared.data = dataclasses.replace(prepared.data, validation=[])
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    timer = step_timer(args.warmup, _say)
    started = time.perf_counter()
    result = train(config, callbacks=[timer], prepared=prepared)
    gpus = world_size()
    fpt, n_active, total = _full_model_flops(prepared.model_config, args.seq_len)
    seconds = timer.t1 - timer.t0
    step_ms = [1000 * (b - a) for a, b in zip([timer.t0, *timer.step_ends], timer.step_ends)]
    tokens = timer.steps * batch * args.grad_accum * args.seq_len * gpus
    tps = tokens / seconds
    rc = prepared.model_config.router_config.to_dict()
    return {
        "preset": preset,
        "router": router,
        "router_setup": {
            k: rc.get(k)
            for k in ("operator", "strategy", "capacity_factor", "group", "flow_method")
        },
        "gc_interval": config.gc_interval,
        "gpus": gpus,
        "expert_parallel": args.expert_parallel,
        "micro_batch_per_gpu": batch,
        "grad_accum": args.grad_accum,
        "global_batch": batch * args.grad_accum * gpus,
        "total_params": total,
        "activated_matmul_params": n_active,
        "flops_per_token": fpt,
        "timed_steps": timer.steps,
        "step_ms": 1000 * seconds / timer.steps,
        "tokens_per_s": tps,
        "tokens_per_s_per_gpu": tps / gpus,
        "mfu": tps * fpt / (gpus * H100_BF16_PEAK),
        "step_ms_each": [round(ms, 2) for ms in step_ms],
        "first_step_s": timer.first_step_s,
        "device_mallocs_timed": timer.device_mallocs,
        "gc_pauses_timed": timer.gc_pauses,
        "compilations_timed": timer.compilations,
        "wall_s": time.perf_counter() - started,
        "peak_memory_gib_rank0": result.peak_memory_gb,
        "final_train_loss": result.train_loss,
        "dropped": result.routing.get("dropped"),
        "load_imbalance": result.routing.get("load_imbalance"),
    }


def run(args: argparse.Namespace) -> None:
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "seq_len": args.seq_len,
        "compile": args.compile,
        "precision": args.precision or ("bf16" if torch.cuda.is_available() else "fp32"),
        "fused_loss": args.fused_loss,
        "steps": args.steps,
        "warmup_steps_excluded": args.warmup,
        "grad_accum": args.grad_accum,
        "dtype": "bf16 autocast, fp32 master weights (HF Trainer bf16=True)"
        + (", torchao float8 dense linears" if args.precision == "fp8" else ""),
        "peak_flops_per_gpu": H100_BF16_PEAK,
    }
    rows: list[dict[str, Any]] = []
    path = out / f"{args.tag}.json"
    for item in args.runs.split(","):
        preset, _, router = item.partition(":")
        _say(f"== {preset} / {router}, expert parallel {args.expert_parallel}")
        try:
            row = run_one(preset, router or "gshard", args)
        except Exception as err:  # a run that does not fit still leaves the others' rows
            if args.expert_parallel > 1:
                raise  # the other processes would wait in a collective
            row = {"preset": preset, "router": router, "error": f"{type(err).__name__}: {err}"}
        rows.append(row)
        _say(json.dumps(row))
        if _rank() == 0:  # after every run, so a cut-off call keeps what it measured
            path.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def summarize(args: argparse.Namespace) -> None:
    rows: list[dict[str, Any]] = []
    metas = {}
    skipped: list[str] = []
    for path in sorted(Path(args.folder).glob("*.json")):
        data = json.loads(path.read_text())
        if "results" not in data:  # the sweep's list of runs it had no time for
            skipped += data.get("skipped", [])
            continue
        metas[path.stem] = data["meta"]
        rows += [{**r, "file": path.stem} for r in data["results"]]
    ok = [r for r in rows if "error" not in r]

    def find(preset: str, router: str, gpus: int) -> dict[str, Any] | None:
        return next(
            (r for r in ok if (r["preset"], r["router"], r["gpus"]) == (preset, router, gpus)),
            None,
        )

    scaling = []
    for row in ok:
        if row["gpus"] == 1:
            continue
        one = find(row["preset"], row["router"], 1)
        gshard = find(row["preset"], "gshard", row["gpus"])
        scaling.append(
            {
                "preset": row["preset"],
                "router": row["router"],
                "gpus": row["gpus"],
                "tokens_per_s": row["tokens_per_s"],
                "one_gpu_tokens_per_s": one["tokens_per_s"] if one else None,
                "speedup": row["tokens_per_s"] / one["tokens_per_s"] if one else None,
                "scaling_efficiency": (
                    row["tokens_per_s"] / (row["gpus"] * one["tokens_per_s"]) if one else None
                ),
                "vs_gshard_same_gpus": (
                    row["tokens_per_s"] / gshard["tokens_per_s"] if gshard else None
                ),
                "mfu": row["mfu"],
            }
        )
    summary = {"meta": metas, "scaling": scaling, "runs": rows, "skipped": skipped}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        "| preset | router | GPUs | tokens/s | 1-GPU tokens/s | speedup | efficiency | "
        "vs gshard | MFU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for s in scaling:
        lines.append(
            f"| {s['preset']} | {s['router']} | {s['gpus']} | {s['tokens_per_s']:,.0f} | "
            f"{fmt(s['one_gpu_tokens_per_s'], ',.0f')} | {fmt(s['speedup'], '.2f')} | "
            f"{fmt(s['scaling_efficiency'], '.1%')} | {fmt(s['vs_gshard_same_gpus'], '.3f')} | "
            f"{s['mfu']:.1%} |"
        )
    for r in rows:
        if "error" in r:
            lines.append(f"\n{r['file']}: {r['preset']} / {r['router']} failed: {r['error']}")
    print("\n".join(lines), flush=True)


def _sweep_jobs(args: argparse.Namespace) -> list[tuple[int, str, list[str]]]:
    """``(gpus, preset, routers)`` in the sweep's order: 1 GPU, the most GPUs, the others.

    Where two runs of a count cannot run side by side (more than half the GPUs) the routers of
    a preset share one process group, one after the other: one start-up instead of two.
    """
    counts = sorted({int(c) for c in args.gpu_counts.split(",") if int(c) <= args.gpus})
    order = list(dict.fromkeys([c for c in counts if c == 1] + counts[::-1][:1] + counts[::-1]))
    runs: dict[str, list[str]] = {}
    for item in args.runs.split(","):
        preset, _, router = item.partition(":")
        runs.setdefault(preset, []).append(router or "gshard")
    jobs: list[tuple[int, str, list[str]]] = []
    for g in order:
        for preset, routers in runs.items():
            if 2 * g > args.gpus:
                jobs.append((g, preset, routers))
            else:
                jobs += [(g, preset, [router]) for router in routers]
    return jobs


def sweep(args: argparse.Namespace) -> None:
    """Run the grid of :func:`_sweep_jobs` on free GPU blocks until the deadline."""
    from distributed_helpers import free_port

    start = time.monotonic()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    pending = _sweep_jobs(args)
    free = list(range(args.gpus))
    running: list[tuple[subprocess.Popen, list[int], str, Any]] = []
    skipped: list[str] = []
    common = [
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--seq-len",
        str(args.seq_len), "--batch-size", str(args.batch_size),
        "--grad-accum", str(args.grad_accum), "--output", str(out),
        "--runs-dir", args.runs_dir, *(["--compile"] if args.compile else []),
        *(["--precision", args.precision] if args.precision else []),
        *(["--fused-loss"] if args.fused_loss else []),
    ]  # fmt: skip

    def left() -> float:
        return args.deadline - (time.monotonic() - start)

    while pending or running:
        for entry in list(running):
            proc, gpus, tag, log = entry
            if proc.poll() is not None:
                running.remove(entry)
                log.close()
                free.extend(gpus)
                print(f"[sweep +{time.monotonic() - start:.0f}s] {tag} exit {proc.returncode}",
                      flush=True)  # fmt: skip
        # Start jobs in order while a block fits; a job waiting for GPUs blocks later ones of
        # its count only, so a 1-GPU job may start beside a running larger one.
        for job in list(pending):
            g, preset, routers = job
            if left() < args.expected_s * len(routers):
                pending.remove(job)
                skipped += [f"{preset}:{router} on {g} GPUs" for router in routers]
                continue
            if len(free) < g:
                break
            free.sort()
            gpus, free[:] = free[:g], free[g:]
            pending.remove(job)
            tag = f"gpus{g}_{preset}_{'_'.join(routers)}"
            items = ",".join(f"{preset}:{router}" for router in routers)
            script = [str(Path(__file__).resolve()), "run", "--runs", items, "--tag", tag,
                      "--expert-parallel", str(g), *common]  # fmt: skip
            if g == 1:
                cmd = [sys.executable, *script]
            else:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                       str(g), "--master-port", str(free_port()), *script]  # fmt: skip
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}
            log = (out / f"{tag}.log").open("w")
            # The job's own time limit: what is left of the sweep (SIGINT first, so a run that
            # is cut keeps the rows it wrote).
            limit = ["timeout", "-s", "INT", "-k", "15", str(max(int(left()), 10))]
            proc = subprocess.Popen([*limit, *cmd], env=env, stdout=log, stderr=subprocess.STDOUT)
            running.append((proc, gpus, tag, log))
            print(f"[sweep +{time.monotonic() - start:.0f}s] {tag} on GPUs {gpus}", flush=True)
        time.sleep(1.0)
    (out / "skipped.json").write_text(json.dumps({"skipped": skipped}, indent=2) + "\n")
    if skipped:
        print("[sweep] skipped (no time left): " + "; ".join(skipped), flush=True)


def _training_option_arguments(parser: argparse.ArgumentParser) -> None:
    """``--grad-accum``, ``--precision`` and ``--fused-loss``: the training options of the same
    names."""
    parser.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="TrainConfig.grad_accum: micro-batches per optimizer step; a timed step is one "
        "optimizer step (e.g. --batch-size 86 --grad-accum 8: the paper's 688 sequences)",
    )
    parser.add_argument(
        "--precision",
        choices=("bf16", "fp8"),
        default=None,
        help="TrainConfig.precision: bf16 autocast, or fp8 (bf16 autocast + torchao float8 "
        "dense linears; sm89+ GPU, torchao); default bf16 on a GPU, fp32 on CPU",
    )
    parser.add_argument(
        "--fused-loss",
        action="store_true",
        help="TrainConfig.fused_loss: liger-kernel's fused LM head + cross-entropy",
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train and time --runs on this process's GPU(s)")
    r.add_argument("--runs", default="base-2x64:gshard,base-2x64:maxscore")
    r.add_argument("--expert-parallel", type=int, default=1)
    r.add_argument("--batch-size", type=int, default=64, help="micro-batch per GPU")
    r.add_argument("--seq-len", type=int, default=512)
    r.add_argument("--steps", type=int, default=30)
    r.add_argument("--warmup", type=int, default=15, help="steps excluded from timing")
    r.add_argument("--compile", action="store_true", help="TrainConfig.compile (compile_layers)")
    _training_option_arguments(r)
    r.add_argument("--output", default=os.environ.get("OUT", "."))
    r.add_argument("--tag", default="bench", help="the result file's name")
    r.add_argument("--runs-dir", default="/tmp/maxscore-ep-bench-runs")
    r.add_argument(
        "--gc-interval",
        type=int,
        help="TrainConfig.gc_interval (default: its default; 0: Python's automatic collection)",
    )
    w = sub.add_parser("sweep", help="run a grid of runs side by side within a deadline")
    w.add_argument("--gpus", type=int, required=True, help="GPUs of the machine to use")
    w.add_argument("--gpu-counts", default="1,2,4", help="expert-parallel sizes to time")
    w.add_argument("--runs", default="base-2x64:gshard,base-2x64:maxscore")
    w.add_argument("--batch-size", type=int, default=64, help="micro-batch per GPU")
    w.add_argument("--seq-len", type=int, default=512)
    w.add_argument("--steps", type=int, default=30)
    w.add_argument("--warmup", type=int, default=15)
    w.add_argument("--compile", action="store_true")
    _training_option_arguments(w)
    w.add_argument("--output", required=True)
    w.add_argument("--runs-dir", default="/tmp/maxscore-ep-bench-runs")
    w.add_argument("--deadline", type=float, default=600, help="seconds for the whole sweep")
    w.add_argument(
        "--expected-s", type=float, default=90, help="a job is started only if this much is left"
    )
    s = sub.add_parser("summarize", help="join the rows of several run calls")
    s.add_argument("folder")
    s.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args)
    elif args.command == "sweep":
        sweep(args)
    else:
        summarize(args)


if __name__ == "__main__":
    main()
