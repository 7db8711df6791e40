"""The paper-claims study: train the plan's arms x seeds on the GPUs at hand, then report.

    python benchmarks/paper_claims/claims_study.py plan                       # done / pending
    python benchmarks/paper_claims/claims_study.py run --devices cuda:0,cuda:1 --per-device 3 \\
        --deadline-s 500                                               # what fits the deadline
    python benchmarks/paper_claims/claims_study.py report                     # README.md + results.json

``run`` starts ``per-device`` worker processes on each device (``cpu`` entries run on the CPU).
Each worker takes the next pending ``(arm, seed)`` of the queue (:meth:`claims_plan.StudyConfig.queue`)
that no other worker has claimed, trains it in-process, and writes the run's result file
``raw/<arm>/seed-<seed>.json`` (written whole or not at all). A run starts only while the time
its shape took before (10% more) is left before the deadline, so a call of fixed length does what
it can and the next call continues. ``report`` needs only the ``raw/`` files.

Besides the plan, the first seed of the headline arms (``gshard``, ``maxscore``) is trained a
second time (``seed-1-rerun.json``): same-seed noise, which the deterministic mode should bring
to zero.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from claims_plan import ARMS_BY_NAME, PROFILES, StudyConfig, arm_slug  # noqa: E402

#: Arms whose first seed is trained twice (same-seed noise).
RERUN_ARMS: tuple[str, ...] = ("gshard", "maxscore")


def result_path(results: Path, arm: str, seed: int, rerun: bool = False) -> Path:
    name = f"seed-{seed}" + ("-rerun" if rerun else "")
    return results / "raw" / arm_slug(arm) / f"{name}.json"


def jobs(config: StudyConfig) -> list[tuple[str, int, bool]]:
    """The queue with the reruns placed after the headline's second seeds."""
    queue = [(arm, seed, False) for arm, seed in config.queue()]
    reruns = [(a, 1, True) for a in RERUN_ARMS if a in {x.name for x in config.plan()}]
    cut = next((i for i, (a, s, _) in enumerate(queue) if s > 2), len(queue))
    return queue[:cut] + reruns + queue[cut:]


def pending(config: StudyConfig, results: Path) -> list[tuple[str, int, bool]]:
    return [job for job in jobs(config) if not result_path(results, *job).is_file()]


# ------------------------------------------------------------------------------------------------
# One run
# ------------------------------------------------------------------------------------------------
def _last(records: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return next((r for r in reversed(records) if r.get("type") == kind and "routing" in r), {})


def run_record(run_dir: Path, result: Any) -> dict[str, Any]:
    """The run's result file: losses, the validation per document (for paired errors), the
    last logged routing of the first MoE layer and the mean over layers, speed, device."""
    import torch

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    routing = _last(records, "train").get("routing", {})
    validation = json.loads((run_dir / "validation.json").read_text())
    first: dict[str, Any] = {}
    for key in ("load_over_capacity", "tokens_per_expert", "dropped_by_rank", "rerouted_by_rank"):
        if routing.get(key):
            first[key] = routing[key][0]
    return {
        "eval_loss": result.eval_loss,
        "eval_loss_se": result.eval_loss_se,
        "train_loss": result.train_loss,
        "steps": result.steps,
        "tokens": result.tokens,
        "tokens_per_s": result.tokens_per_s,
        "runtime_s": result.runtime_s,
        "peak_memory_gb": result.peak_memory_gb,
        "routing_mean": result.routing,
        "first_layer": first,
        "load_imbalance_by_layer": routing.get("load_imbalance"),
        "eval_curve": [[r["step"], r["eval_loss"]] for r in records if r.get("type") == "eval"],
        "validation": {"loss_sum": validation["loss_sum"], "tokens": validation["tokens"]},
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
    }


def train_one(
    config: StudyConfig, arm: str, seed: int, rerun: bool, runs: Path, results: Path
) -> None:
    """Train one run in this process and write its result file (atomically)."""
    from maxscore.training import train

    run_dir = runs / arm_slug(arm) / (f"seed-{seed}" + ("-rerun" if rerun else ""))
    shutil.rmtree(run_dir, ignore_errors=True)  # a run cut short in an earlier call restarts
    cfg = config.train_config(arm, seed, str(run_dir))
    result = train(cfg)
    if result.interrupted:
        raise RuntimeError(f"{arm} seed {seed} was interrupted")
    record = {"arm": arm, "seed": seed, "rerun": rerun, **run_record(run_dir, result)}
    target = result_path(results, arm, seed, rerun)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(record) + "\n")
    tmp.replace(target)
    shutil.rmtree(run_dir, ignore_errors=True)


# ------------------------------------------------------------------------------------------------
# Workers
# ------------------------------------------------------------------------------------------------
def _tag(job: tuple[str, int, bool]) -> str:
    return f"{arm_slug(job[0])}.{job[1]}{'r' if job[2] else ''}"


def _claim(queue: Path, job: tuple[str, int, bool], worker: str) -> bool:
    name = f"{_tag(job)}.claim"
    try:
        fd = os.open(queue / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as handle:
        handle.write(f"{worker} {time.time():.0f}\n")
    return True


def _expected_s(queue: Path, shape: str) -> float:
    """The slowest run of this shape so far (of any shape before the first of it)."""
    took = [json.loads(p.read_text()) for p in queue.glob("*.took")]
    same = [t["s"] for t in took if t["shape"] == shape]
    return max(same or [t["s"] for t in took] or [0.0])


def work(config: StudyConfig, runs: Path, results: Path, deadline: float, worker: str) -> int:
    """Take the next unclaimed pending job, train it, repeat while time is left."""
    queue = runs / "queue"
    for job in pending(config, results):
        shape = ARMS_BY_NAME[job[0]].shape
        left = deadline - time.time()
        if left < 1.1 * _expected_s(queue, shape) + 5:
            continue  # a shorter shape may still fit
        if not _claim(queue, job, worker):
            continue
        start = time.time()
        print(f"study[{worker}]: {job} with {left:.0f} s left", flush=True)
        try:
            train_one(config, *job, runs, results)
            ok = True
        except Exception:  # one failing run must not end the others
            traceback.print_exc()
            (queue / f"{_tag(job)}.failed").write_text(traceback.format_exc())
            ok = False
        took = time.time() - start
        (queue / f"{_tag(job)}.took").write_text(json.dumps({"shape": shape, "s": took}))
        print(f"study[{worker}]: {job} {'done' if ok else 'FAILED'} in {took:.0f} s", flush=True)
        gc.collect()
    return 0


def run_parallel(
    config: StudyConfig,
    devices: list[str],
    per_device: int,
    runs: Path,
    results: Path,
    deadline_s: float,
) -> None:
    """``per_device`` worker processes on each device until the queue is done or the deadline."""
    deadline = time.time() + deadline_s
    queue = runs / "queue"
    shutil.rmtree(queue, ignore_errors=True)
    queue.mkdir(parents=True)
    settings = queue / "study.json"
    settings.write_text(json.dumps(config.to_dict()))
    procs = []
    for d, device in enumerate(devices):
        for w in range(per_device):
            env = dict(os.environ)
            env["CUDA_VISIBLE_DEVICES"] = device.partition(":")[2] if device != "cpu" else ""
            log = open(runs / f"worker-{d}-{w}.log", "ab")  # noqa: SIM115 (closed by the process)
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "worker",
                "--study-config",
                str(settings),
                "--results-dir",
                str(results),
                "--runs-dir",
                str(runs),
                "--deadline-at",
                f"{deadline:.3f}",
                "--worker-name",
                f"{d}.{w}",
            ]
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
            time.sleep(2.0)  # staggered starts: the workers' first tokenisations overlap less
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.time() + 60))
        except subprocess.TimeoutExpired:
            proc.kill()
    for failed in sorted(queue.glob("*.failed")):
        print(f"study: FAILED {failed.stem}: {failed.read_text().strip().splitlines()[-1]}")


def study_config(args: argparse.Namespace) -> StudyConfig:
    if args.study_config:
        return StudyConfig.from_dict(json.loads(Path(args.study_config).read_text()))
    recorded = args.results_dir / "study.json"
    if args.profile is None and recorded.is_file():
        return StudyConfig.from_dict(json.loads(recorded.read_text()))
    return PROFILES[args.profile or "gpu"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("plan", "run", "report", "worker"))
    parser.add_argument(
        "--profile", choices=sorted(PROFILES), help="default: as recorded, else gpu"
    )
    parser.add_argument("--results-dir", type=Path, default=HERE / "results")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/paper_claims"))
    parser.add_argument("--readme", type=Path, default=HERE / "README.md")
    parser.add_argument(
        "--summary-in",
        type=Path,
        nargs="*",
        help="READMEs whose generated paper-claims summary block `report` refreshes (default: "
        "the repository's and benchmarks/ README when reporting the study's own results)",
    )
    parser.add_argument("--devices", default="cpu", help="cuda:0,cuda:1 or cpu")
    parser.add_argument("--per-device", type=int, default=1, help="workers per device")
    parser.add_argument("--deadline-s", type=float, default=500.0)
    parser.add_argument("--arms", help="comma-separated arms (default: the whole plan)")
    parser.add_argument("--seeds", type=int, help="at most this many seeds per arm")
    parser.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="train with (or without) --deterministic (default: as recorded / the profile); "
        "keep one mode per results folder",
    )
    parser.add_argument("--worker-name", default="0", help=argparse.SUPPRESS)
    parser.add_argument("--deadline-at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--study-config", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    config = study_config(args)
    if args.arms or args.seeds or args.deterministic is not None:
        values = config.to_dict()
        if args.deterministic is not None:
            values["deterministic"] = args.deterministic
        if args.arms:
            values["arms"] = [a.strip() for a in args.arms.split(",")]
        if args.seeds:
            values["seeds"] = args.seeds
        config = StudyConfig.from_dict(values)
    if args.command == "worker":
        return work(config, args.runs_dir, args.results_dir, args.deadline_at, args.worker_name)
    if args.command == "run":
        args.results_dir.mkdir(parents=True, exist_ok=True)
        args.runs_dir.mkdir(parents=True, exist_ok=True)
        (args.results_dir / "study.json").write_text(json.dumps(config.to_dict(), indent=1) + "\n")
        devices = [d.strip() for d in args.devices.split(",")]
        run_parallel(
            config, devices, args.per_device, args.runs_dir, args.results_dir, args.deadline_s
        )
    if args.command == "report":
        from claims_report import update_summary_block, write_report

        payload = write_report(config, args.results_dir, args.readme)
        print(f"wrote {args.results_dir / 'results.json'} and {args.readme}")
        summaries = args.summary_in
        if summaries is None:  # only the study's own results may speak for it in the READMEs
            own = args.results_dir.resolve() == (HERE / "results").resolve()
            summaries = [HERE.parents[1] / "README.md", HERE.parent / "README.md"] if own else []
        for other in summaries:
            if other.is_file() and update_summary_block(other, payload):
                print(f"refreshed the summary in {other}")
        return 0
    left = pending(config, args.results_dir)
    total = len(jobs(config))
    print(f"{total - len(left)} of {total} runs done; next: {left[:6]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
