"""DeepSpeed ZeRO-2 / ZeRO-3 smoke run: train, checkpoint, resume, compare with an uninterrupted run.

``PYTHONPATH=src python benchmarks/deepspeed/deepspeed_smoke.py --out DIR [--steps 30] [--stages plain,zero2,zero3]``

For each stage (``plain`` = the stock Trainer without DeepSpeed, as the reference), through the
real CLI launched with ``torchrun --nproc_per_node N -m maxscore.cli train``:

1. train the ``tiny`` preset for ``--steps`` optimizer steps, checkpointing every ``--save-steps``;
2. copy the run directory, delete its last checkpoint (the state a kill after the previous
   checkpoint leaves) and resume it with ``--resume`` to the same step;
3. compare the final weights of both runs (bitwise equality and max abs difference).

Writes ``DIR/deepspeed_smoke.json`` (versions, device, per stage: return codes, steps, final
train loss, validation loss, tokens/s, peak memory, resume comparison) and every run's console
log plus ``metrics.jsonl`` under ``DIR/logs/``. A failing run is recorded with the tail of its log
and does not stop the other stages.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _versions() -> dict[str, Any]:
    import accelerate
    import transformers

    out: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    for name in ("deepspeed", "pydantic"):
        try:
            module = __import__(name)
            out[name] = getattr(module, "__version__", "?")
        except Exception as err:  # reported, not raised
            out[name] = f"import failed: {type(err).__name__}: {err}"
    return out


def _train(
    run_dir: Path, stage: str, args: argparse.Namespace, log: Path, resume: bool = False
) -> tuple[int, float]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
        "--master_port", str(_free_port()), "-m", "maxscore.cli", "train",
        "--model", args.model, "--max-steps", str(args.steps),
        "--save-steps", str(args.save_steps), "--logging-steps", str(args.logging_steps),
        "--eval-steps", "0", "--max-eval-blocks", "16", "--report-to", "none", "--quiet",
        "--output-dir", str(run_dir),
    ]  # fmt: skip
    if stage != "plain":
        cmd += ["--deepspeed", stage]
    if resume:
        cmd.append("--resume")
    begin = time.perf_counter()
    with log.open("w") as handle:
        try:
            code = subprocess.run(
                cmd, stdout=handle, stderr=subprocess.STDOUT, check=False, timeout=args.run_timeout
            ).returncode
        except subprocess.TimeoutExpired:
            handle.write(f"\nkilled after --run-timeout {args.run_timeout} s\n")
            code = 124
    return code, time.perf_counter() - begin


def _tail(path: Path, lines: int = 40) -> str:
    return (
        "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else ""
    )


def _summary(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "summary.json"
    if not path.is_file():
        return {}
    summary = json.loads(path.read_text())
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in records if r["type"] == "train" and "loss" in r]
    keys = ("steps", "eval_loss", "tokens_per_s", "peak_memory_gb", "runtime_s", "routing")
    return {
        **{k: summary.get(k) for k in keys},
        "train_loss_by_step": losses,
        "checkpoints": sorted(p.name for p in run_dir.glob("checkpoint-*")),
    }


def _compare(a: Path, b: Path) -> dict[str, Any]:
    x, y = load_file(str(a)), load_file(str(b))
    if x.keys() != y.keys():
        return {"same_keys": False}
    diff = max((x[k].float() - y[k].float()).abs().max().item() for k in x)
    return {
        "same_keys": True,
        "bitwise_equal": all(torch.equal(x[k], y[k]) for k in x),
        "max_abs_diff": diff,
        "dtypes": sorted({str(v.dtype) for v in x.values()}),
    }


def run_stage(stage: str, args: argparse.Namespace, work: Path, logs: Path) -> dict[str, Any]:
    full, resumed = work / f"{stage}-full", work / f"{stage}-resumed"
    result: dict[str, Any] = {}
    code, seconds = _train(full, stage, args, logs / f"{stage}-full.log")
    result["full"] = {"returncode": code, "wall_s": round(seconds, 1), **_summary(full)}
    if code != 0:
        result["full"]["log_tail"] = _tail(logs / f"{stage}-full.log")
        return result
    shutil.copy(full / "metrics.jsonl", logs / f"{stage}-full-metrics.jsonl")
    last = full / f"checkpoint-{args.steps}"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / last.name)
    code, seconds = _train(resumed, stage, args, logs / f"{stage}-resume.log", resume=True)
    result["resumed"] = {"returncode": code, "wall_s": round(seconds, 1), **_summary(resumed)}
    if code != 0:
        result["resumed"]["log_tail"] = _tail(logs / f"{stage}-resume.log")
        return result
    shutil.copy(resumed / "metrics.jsonl", logs / f"{stage}-resume-metrics.jsonl")
    result["resumed_vs_full"] = _compare(
        last / "model.safetensors", resumed / last.name / "model.safetensors"
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--work", type=Path, default=Path("/tmp/deepspeed-smoke"))
    parser.add_argument("--stages", default="plain,zero2,zero3")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save-steps", type=int, default=10)
    parser.add_argument("--logging-steps", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--run-timeout", type=float, default=240.0, help="seconds per launch")
    args = parser.parse_args()
    if args.steps % args.save_steps or args.steps < 2 * args.save_steps:
        parser.error("--steps must be a multiple of --save-steps and at least twice it")
    stages = [s for s in args.stages.split(",") if s]
    unknown = set(stages) - {"plain", "zero2", "zero3"}
    if unknown:
        parser.error(f"unknown stages {sorted(unknown)}; choose from plain, zero2, zero3")
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.work, ignore_errors=True)
    report: dict[str, Any] = {"versions": _versions(), "args": {**vars(args)}, "stages": {}}
    report["args"] = {k: str(v) for k, v in report["args"].items()}
    for stage in stages:
        report["stages"][stage] = run_stage(stage, args, args.work, logs)
        (args.out / "deepspeed_smoke.json").write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps({stage: report["stages"][stage]}, indent=1)[:3000], flush=True)
    ok = all(
        s.get("resumed", {}).get("returncode") == 0 and s["full"]["returncode"] == 0
        for s in report["stages"].values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
