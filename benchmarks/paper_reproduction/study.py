"""The miniature reproduction of the paper's claims: one command, in resumable chunks.

    python benchmarks/paper_reproduction/study.py plan                 # what is done / pending
    python benchmarks/paper_reproduction/study.py run --deadline-s 540 # train + evaluate what fits
    python benchmarks/paper_reproduction/study.py run --only gshard:42,maxscore:42
    python benchmarks/paper_reproduction/study.py report               # results.json + README.md
    python benchmarks/paper_reproduction/study.py --profile one-call run --devices cuda:0,cuda:1

``run`` works through the plan (:mod:`study_plan`) in queue order (:func:`study_plan.priority`:
the claims first). With ``--devices`` it starts one worker process per device (``cpu`` entries
simulate devices on the CPU); each worker takes the next pending (router, seed) that no other
worker has claimed, runs it in-process, and starts a run only while the time it expects the run
to take (its slowest run so far) is left before the deadline. For each (router, seed) it

1. trains into ``<runs-dir>/<router>/seed-<seed>`` (resuming from the last checkpoint when the
   run directory exists; a run is stopped cleanly, with a checkpoint, when the deadline comes);
2. runs the offline lm-eval tasks on the final checkpoint with the causal evaluation routing,
   and, for capacity / flow routers, also with the training routing;
3. copies the small result files (``config.json``, ``summary.json``, ``metrics.jsonl``,
   ``validation.json``, ``eval_<routing>.json``) to ``<results-dir>/raw/<router>/seed-<seed>/``.

A stage whose result file is already in ``<results-dir>`` is skipped, so a call made with a
10-minute limit does what it can and the next call continues (copy ``<results-dir>`` back
between calls; run directories only help while the machine that holds them is kept).
lm-eval needs the run's final checkpoint, which only the machine that trained it holds:
``run --retrain-for-eval`` trains such runs again (after the runs never trained; one run of each
router without a complete lm-eval before the others) and evaluates them (:func:`work`).
``report`` needs only ``<results-dir>``: it adds the runs in ``raw/`` to the study's summary
``results.json`` (every run's numbers and every number of the report) and writes the figures
and ``README.md`` from it (:mod:`study_report`; a claim without its runs says "pending"). A run
the summary records counts as trained (and evaluated) without its raw files, which the
repository does not keep.

``--profile`` picks the study's settings (:data:`study_plan.PROFILES`); ``run`` records them in
``<results-dir>/study.json``, which ``plan`` and ``report`` use when no profile is given (else
the settings in ``results.json``).
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
from dataclasses import replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from study_plan import BOTH_ROUTINGS, PROFILES, SUPERSEDED, StudyConfig  # noqa: E402

RESULT_FILES = ("config.json", "summary.json", "metrics.jsonl", "validation.json")


def raw_dir(results: Path, router: str, seed: int) -> Path:
    return results / "raw" / router / f"seed-{seed}"


def routings_for(router: str) -> list[str]:
    """lm-eval routings of a router: causal always, train where it differs (capacity / flow)."""
    return ["causal", "train"] if router in BOTH_ROUTINGS else ["causal"]


def _recorded(results: Path, router: str, seed: int) -> dict[str, Any] | None:
    """The run's record in the study's summary (``results.json``) when it has no raw files."""
    if (raw_dir(results, router, seed) / "summary.json").is_file():
        return None
    from study_report import stored_runs

    return stored_runs(results).get(f"{router}/{seed}")


def _trained(results: Path, router: str, seed: int) -> bool:
    """Whether the run's summary in ``results`` (its raw copy, else its record in
    ``results.json``) is that of a complete run."""
    record = _recorded(results, router, seed)
    if record is not None:
        return bool(record.get("complete"))
    return _complete(raw_dir(results, router, seed))


def _complete(path: Path) -> bool:
    """Whether ``path`` (a run directory or its copy in the results) holds a complete run."""
    if not (path / "summary.json").is_file() or not (path / "config.json").is_file():
        return False
    summary = json.loads((path / "summary.json").read_text())
    total = json.loads((path / "config.json").read_text())["resolved"]["total_steps"]
    return not summary.get("interrupted") and summary.get("steps", 0) >= total


def status(config: StudyConfig, results: Path) -> list[dict[str, Any]]:
    """Per run, in queue order: trained, and which evaluation routings are done."""
    rows = []
    for router, seed in config.queue():
        folder = raw_dir(results, router, seed)
        recorded = (_recorded(results, router, seed) or {}).get("lm_eval", {})
        rows.append(
            {
                "router": router,
                "seed": seed,
                "trained": _trained(results, router, seed),
                "evaluated": [
                    r
                    for r in routings_for(router)
                    if (folder / f"eval_{r}.json").is_file() or r in recorded
                ],
                "routings": routings_for(router) if config.lm_eval else [],
            }
        )
    return rows


class _Deadline:
    """A Trainer callback that stops when the deadline (``time.time()``) passes, saving a
    checkpoint to resume from when the study keeps checkpoints."""

    def __init__(self, deadline: float, save: bool = True) -> None:
        from transformers import TrainerCallback

        class Callback(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
                if time.time() > deadline:
                    control.should_save = save
                    control.should_training_stop = True
                return control

        self.callback = Callback()


def train_run(
    config: StudyConfig, router: str, seed: int, runs: Path, results: Path, deadline: float
) -> bool:
    """Train (or resume) one run; copy its small files to ``results``. Returns completeness.

    A run whose complete results are already in ``results`` (trained again because its lm-eval
    needs the checkpoint) replaces them only once it is complete itself: the files it replaces,
    with the lm-eval of the weights they describe, move to ``SUPERSEDED/`` beside them. A run cut
    by the deadline never overwrites complete results.
    """
    from maxscore.training import train

    run_dir = runs / router / f"seed-{seed}"
    cfg = config.train_config(router, seed, str(run_dir))
    if (run_dir / "config.json").is_file():
        cfg = type(cfg)(**{**cfg.to_dict(), "resume": True})
    print(f"study: training {router} seed {seed} -> {run_dir}", flush=True)
    train(cfg, callbacks=[_Deadline(deadline, save=config.save_steps > 0).callback])
    out = raw_dir(results, router, seed)
    replacing = _trained(results, router, seed)
    if replacing and not _complete(run_dir):
        return False
    if replacing:
        old = out / SUPERSEDED
        shutil.rmtree(old, ignore_errors=True)
        old.mkdir(parents=True)  # a run only the summary records has no files to move
        for path in out.iterdir():
            if path.is_file():
                path.rename(old / path.name)
    out.mkdir(parents=True, exist_ok=True)
    for name in RESULT_FILES:
        if (run_dir / name).is_file():
            shutil.copyfile(run_dir / name, out / name)
    return _trained(results, router, seed)


def checkpoint_here(runs: Path, router: str, seed: int) -> bool:
    """Whether the run's directory (its final checkpoint) is on this machine: a run trained in an
    earlier device call keeps only its small result files, so its lm-eval needs it trained again."""
    return (runs / router / f"seed-{seed}").is_dir()


def shortest_eval_s(results: Path, router: str, routing: str) -> float:
    """The shortest lm-eval of ``routing`` recorded in ``results`` for ``router`` (else for any
    router; 0 before the first): less time than that left, it cannot finish."""
    mine: list[float] = []
    anyone: list[float] = []
    for path in (results / "raw").glob(f"*/seed-*/eval_{routing}.json"):
        try:
            seconds = float(json.loads(path.read_text()).get("seconds") or 0.0)
        except (ValueError, OSError):
            continue
        anyone.append(seconds)
        if path.parent.parent.name == router:
            mine.append(seconds)
    return min(mine or anyone or [0.0])


def evaluate_run(
    config: StudyConfig,
    router: str,
    seed: int,
    runs: Path,
    results: Path,
    deadline: float = float("inf"),
) -> None:
    """lm-eval on the run's final checkpoint, each routing of :func:`routings_for` not done yet.

    A routing starts only while its shortest recorded duration fits before ``deadline``: one
    cut by the deadline gives nothing and keeps the device call running for nothing."""
    from maxscore.evaluation.runner import evaluate_model

    run_dir = runs / router / f"seed-{seed}"
    out = raw_dir(results, router, seed)
    for routing in routings_for(router):
        target = out / f"eval_{routing}.json"
        if target.is_file():
            continue
        if deadline - time.time() < shortest_eval_s(results, router, routing):
            print(f"study: no time left for lm-eval of {router} seed {seed}, {routing}", flush=True)
            return
        print(f"study: lm-eval {router} seed {seed}, {routing} routing", flush=True)
        result = evaluate_model(
            run_dir,
            config.eval_tasks,
            name=f"{router}/{seed}",
            limit=config.eval_limit,
            batch_size=config.eval_batch_size,
            routing=routing,
        )
        # to_dict's "routing" describes the routers; "eval_routing" names the mode asked for.
        payload = {**result.to_dict(), "eval_routing": routing, "limit": config.eval_limit}
        target.write_text(json.dumps(payload, indent=1) + "\n")


def run_study(
    config: StudyConfig,
    runs: Path,
    results: Path,
    deadline_s: float,
    only: set[tuple[str, int]] | None = None,
    evaluate: bool = True,
    retrain_for_eval: bool = False,
) -> list[dict[str, Any]]:
    """Train and evaluate pending runs until the deadline; return the status afterwards.

    A stage starts only while time is left; training stops at the deadline with a checkpoint.
    ``retrain_for_eval``: see :func:`work`.
    """
    deadline = time.time() + deadline_s
    evaluate = evaluate and config.lm_eval
    for row in _work_order(status(config, results)):
        key = (row["router"], row["seed"])
        if only is not None and key not in only:
            continue
        if time.time() >= deadline:
            break
        step = _next_step(row, runs, evaluate, retrain_for_eval)
        if step == "train" and not train_run(config, *key, runs, results, deadline):
            break  # cut by the deadline: the next call resumes it
        if step is not None and evaluate and time.time() < deadline:
            evaluate_run(config, *key, runs, results, deadline)
    return status(config, results)


def _next_step(
    row: dict[str, Any], runs: Path, evaluate: bool, retrain_for_eval: bool
) -> str | None:
    """What a run needs on this machine: ``"train"`` (never trained, or trained in an earlier
    call whose lm-eval is missing and ``retrain_for_eval``: its checkpoint is not here),
    ``"evaluate"`` (its checkpoint is here and lm-eval is missing), or ``None``."""
    if not row["trained"]:
        return "train"
    if not (evaluate and set(row["routings"]) - set(row["evaluated"])):
        return None
    if checkpoint_here(runs, row["router"], row["seed"]):
        return "evaluate"
    return "train" if retrain_for_eval else None


def _work_order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs never trained first; then, of each router with no run whose lm-eval is
    complete, its first run (so every router gets its lm-eval before any router gets a second
    seed's); then the others. Queue order within each."""
    complete = {row["router"] for row in rows if set(row["routings"]) <= set(row["evaluated"])}
    first: dict[str, int] = {}
    for i, row in enumerate(rows):
        if row["trained"] and row["router"] not in complete:
            first.setdefault(row["router"], i)

    def rank(item: tuple[int, dict[str, Any]]) -> int:
        i, row = item
        return 0 if not row["trained"] else 1 if first.get(row["router"]) == i else 2

    return [row for _, row in sorted(enumerate(rows), key=rank)]


# ------------------------------------------------------------------------------------------------
# Several devices: one worker process per device, a queue of claim files
# ------------------------------------------------------------------------------------------------
def _claim(queue: Path, router: str, seed: int, worker: str) -> bool:
    """Claim a run for ``worker`` (atomic: exactly one worker gets each run)."""
    try:
        fd = os.open(queue / f"{router}@{seed}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as handle:
        handle.write(f"{worker} {time.time():.0f}\n")
    return True


def _free_memory() -> float:
    """Collect what the last run left; the GiB still allocated on the GPU (0 on a CPU)."""
    gc.collect()
    import torch

    if not torch.cuda.is_available():
        return 0.0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated() / 2**30


def work(
    config: StudyConfig,
    runs: Path,
    results: Path,
    queue: Path,
    deadline: float,
    worker: str,
    only: set[tuple[str, int]] | None = None,
    evaluate: bool = True,
    retrain_for_eval: bool = False,
) -> int:
    """One worker: take the next unclaimed pending run, train (and evaluate) it, repeat.

    A run starts only while its expected duration (the slowest run of any worker so far, 10%
    more; each finished run leaves ``<queue>/<router>@<seed>.took``) is left before
    ``deadline``. Runs never trained come first. A run trained in an earlier call whose lm-eval
    is missing has no checkpoint here: it is skipped, or with ``retrain_for_eval`` trained again
    (same seed and settings) and evaluated, its new results replacing the old ones only once
    complete (:func:`train_run`). Returns 0, or 3 when the GPU memory of finished runs was not
    freed (the caller starts a fresh worker).
    """
    evaluate = evaluate and config.lm_eval
    for row in _work_order(status(config, results)):
        key = (row["router"], row["seed"])
        if only is not None and key not in only:
            continue
        step = _next_step(row, runs, evaluate, retrain_for_eval)
        if step is None:
            continue
        left = deadline - time.time()
        slowest = max([float(p.read_text()) for p in queue.glob("*.took")] or [0.0])
        if left < 1.1 * slowest or left <= 0:
            print(f"study[{worker}]: {left:.0f} s left, a run takes ~{slowest:.0f} s: stopping")
            break
        if not _claim(queue, *key, worker):
            continue
        start = time.time()
        print(
            f"study[{worker}]: {key[0]} seed {key[1]}, {left:.0f} s before the deadline", flush=True
        )
        try:
            done = step == "evaluate" or train_run(config, *key, runs, results, deadline)
            if done and evaluate and time.time() < deadline:
                evaluate_run(config, *key, runs, results, deadline)
        except Exception:  # one failing run must not end the others
            traceback.print_exc()
            (queue / f"{key[0]}@{key[1]}.failed").write_text(traceback.format_exc())
            done = False
        took = time.time() - start
        (queue / f"{key[0]}@{key[1]}.took").write_text(f"{took:.1f}\n")
        print(
            f"study[{worker}]: {key[0]} seed {key[1]} {'done' if done else 'NOT done'} "
            f"in {took:.0f} s",
            flush=True,
        )
        if not config.save_steps and not config.save_final and (runs / key[0]).is_dir():
            shutil.rmtree(runs / key[0] / f"seed-{key[1]}", ignore_errors=True)
        leftover = _free_memory()
        if leftover > 1.0:
            print(f"study[{worker}]: {leftover:.1f} GiB still allocated: a fresh worker follows")
            return 3
    return 0


def run_parallel(
    config: StudyConfig,
    devices: list[str],
    runs: Path,
    results: Path,
    deadline_s: float,
    only: str | None = None,
    evaluate: bool = True,
    retrain_for_eval: bool = False,
) -> list[dict[str, Any]]:
    """One worker process per device (``cuda:N`` or ``cpu``) until the queue is empty or the
    deadline passes; a worker that dies is replaced while time is left (its run is not retried).
    Worker logs: ``<runs>/worker-<i>.log``. ``retrain_for_eval``: see :func:`work`."""
    deadline = time.time() + deadline_s
    queue = runs / "queue"
    shutil.rmtree(queue, ignore_errors=True)
    queue.mkdir(parents=True)
    (queue / "study.json").write_text(json.dumps(config.to_dict()))
    base = [sys.executable, str(Path(__file__).resolve()), "worker", "--results-dir", str(results)]
    base += ["--runs-dir", str(runs), "--deadline-at", f"{deadline:.3f}"]
    base += ["--study-config", str(queue / "study.json")] + (["--no-eval"] if not evaluate else [])
    base += ["--only", only] if only else []
    base += ["--retrain-for-eval"] if retrain_for_eval else []

    def start(i: int, generation: int) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        device = devices[i]
        env["CUDA_VISIBLE_DEVICES"] = device.partition(":")[2] if device.startswith("cuda") else ""
        log = open(runs / f"worker-{i}.log", "ab")  # noqa: SIM115 (closed with the process)
        cmd = [*base, "--worker-name", f"{i}.{generation}"]
        print(f"study: worker {i}.{generation} on {device}", flush=True)
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)

    workers = {i: start(i, 0) for i in range(len(devices))}
    generations = dict.fromkeys(workers, 0)
    crashes = dict.fromkeys(workers, 0)
    while workers:
        time.sleep(1.0)
        for i, proc in list(workers.items()):
            rc = proc.poll()
            if rc is None:
                late = time.time() - deadline
                if 30 < late < 31.5:
                    print(f"study: worker {i} past the deadline: terminating it", flush=True)
                    proc.terminate()
                elif late > 40:
                    proc.kill()
                continue
            del workers[i]
            # rc 3: the worker left GPU memory behind and asks for a fresh process; any other
            # non-zero rc is a crash (at most three restarts per device).
            crashes[i] += rc not in (0, 3)
            pending = [
                r
                for r in status(config, results)
                if _next_step(r, runs, evaluate, retrain_for_eval) == "train"
            ]
            if rc != 0 and crashes[i] <= 3 and pending and deadline - time.time() > 30:
                print(f"study: worker {i} exited with {rc}; starting a fresh one", flush=True)
                generations[i] += 1
                workers[i] = start(i, generations[i])
    for failed in sorted(queue.glob("*.failed")):
        print(f"study: FAILED {failed.stem}: {failed.read_text().strip().splitlines()[-1]}")
    return status(config, results)


def _parse_only(text: str | None) -> set[tuple[str, int]] | None:
    if not text:
        return None
    out = set()
    for item in text.split(","):
        router, _, seed = item.partition(":")
        if not seed:
            raise SystemExit(f"--only expects ROUTER:SEED items, got {item!r}")
        out.add((router.strip(), int(seed)))
    return out


def _base_config(args: argparse.Namespace) -> StudyConfig:
    """The named profile; else the settings ``run`` recorded in the results (``study.json``,
    else the summary's); else ``full``."""
    if getattr(args, "study_config", None):
        return StudyConfig.from_dict(json.loads(Path(args.study_config).read_text()))
    if args.profile:
        return PROFILES[args.profile]
    recorded = args.results_dir / "study.json"
    if recorded.is_file():
        return StudyConfig.from_dict(json.loads(recorded.read_text()))
    summary = args.results_dir / "results.json"
    if summary.is_file():
        return StudyConfig.from_dict(json.loads(summary.read_text())["settings"])
    return PROFILES["full"]


def study_config(args: argparse.Namespace) -> StudyConfig:
    """The profile's settings, with what the command line overrides (tests use tiny values)."""
    overrides: dict[str, Any] = {}
    names = ("model", "tokens", "seq_len", "batch_size", "lr", "eval_steps", "save_steps")
    for name in (*names, "max_eval_blocks"):
        if getattr(args, name, None) is not None:
            overrides[name] = getattr(args, name)
    if args.eval_limit is not None:
        overrides["eval_limit"] = args.eval_limit
    if args.eval_tasks:
        overrides["eval_tasks"] = args.eval_tasks
    if args.no_compile:
        overrides["compile"] = False
    if args.routers:
        overrides["routers"] = tuple(r.strip() for r in args.routers.split(","))
    if args.seeds:
        overrides["seeds_override"] = tuple(int(s) for s in args.seeds.split(","))
    if args.model_option:
        overrides["model_overrides"] = {
            k: json.loads(v) for k, v in (item.split("=", 1) for item in args.model_option)
        }
    return replace(_base_config(args), **overrides)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("plan", "run", "report", "worker"))
    parser.add_argument("--profile", choices=sorted(PROFILES), help="default: as recorded")
    parser.add_argument("--results-dir", type=Path, default=HERE / "results")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/paper_reproduction"))
    parser.add_argument("--readme", type=Path, default=HERE / "README.md")
    parser.add_argument("--deadline-s", type=float, default=540.0, help="time for this call")
    parser.add_argument("--only", help="ROUTER:SEED,... (default: the whole plan, in order)")
    parser.add_argument("--no-eval", action="store_true", help="train only")
    parser.add_argument(
        "--retrain-for-eval",
        action="store_true",
        help="train again (after the runs never trained; first one run of each router without a "
        "complete lm-eval) the runs whose lm-eval is missing and "
        "whose checkpoint is not on this machine, then evaluate them; their new results replace "
        f"the old ones, which move to raw/<router>/seed-<seed>/{SUPERSEDED}/",
    )
    parser.add_argument("--devices", help="cuda:0,cuda:1 (or cpu,cpu): one worker per device")
    # Set by run --devices for its workers.
    parser.add_argument("--worker-name", default="0", help=argparse.SUPPRESS)
    parser.add_argument("--deadline-at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--study-config", help=argparse.SUPPRESS)
    # Overrides of the plan (for tests on a CPU; the study itself uses the defaults).
    parser.add_argument("--routers")
    parser.add_argument("--seeds")
    parser.add_argument("--model")
    parser.add_argument("--model-option", action="append")
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--eval-steps", type=int)
    parser.add_argument("--save-steps", type=int)
    parser.add_argument("--eval-limit", type=int)
    parser.add_argument("--eval-tasks", help="lm-eval tasks (default: the eight bundled ones)")
    parser.add_argument("--max-eval-blocks", type=int)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args(argv)
    config = study_config(args)
    if args.command == "worker":
        return work(
            config,
            args.runs_dir,
            args.results_dir,
            args.runs_dir / "queue",
            args.deadline_at,
            args.worker_name,
            only=_parse_only(args.only),
            evaluate=not args.no_eval,
            retrain_for_eval=args.retrain_for_eval,
        )
    if args.command == "run":
        args.results_dir.mkdir(parents=True, exist_ok=True)
        (args.results_dir / "study.json").write_text(json.dumps(config.to_dict(), indent=1) + "\n")
        if args.devices:
            args.runs_dir.mkdir(parents=True, exist_ok=True)
            rows = run_parallel(
                config,
                [d.strip() for d in args.devices.split(",")],
                args.runs_dir,
                args.results_dir,
                args.deadline_s,
                only=args.only,
                evaluate=not args.no_eval,
                retrain_for_eval=args.retrain_for_eval,
            )
        else:
            rows = run_study(
                config,
                args.runs_dir,
                args.results_dir,
                args.deadline_s,
                only=_parse_only(args.only),
                evaluate=not args.no_eval,
                retrain_for_eval=args.retrain_for_eval,
            )
    elif args.command == "report":
        from study_report import write_report

        write_report(config, args.results_dir, args.readme, status(config, args.results_dir))
        print(f"wrote {args.results_dir / 'results.json'} and {args.readme}")
        return 0
    else:
        rows = status(config, args.results_dir)
    for row in rows:
        evals = "/".join(row["evaluated"]) or "-"
        print(
            f"{row['router']:<14} seed {row['seed']}: "
            f"{'trained' if row['trained'] else 'pending'}, lm-eval {evals} of "
            f"{'/'.join(row['routings']) or 'none (not in this profile)'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
