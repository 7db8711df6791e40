"""The miniature reproduction of the paper's claims: one command, in resumable chunks.

    python benchmarks/paper_reproduction/study.py plan                 # what is done / pending
    python benchmarks/paper_reproduction/study.py run --deadline-s 540 # train + evaluate what fits
    python benchmarks/paper_reproduction/study.py run --only gshard:42,maxscore:42
    python benchmarks/paper_reproduction/study.py report               # results.json + README.md

``run`` works through the plan (:mod:`study_plan`) in order. For each (router, seed) it

1. trains into ``<runs-dir>/<router>/seed-<seed>`` (resuming from the last checkpoint when the
   run directory exists; a run is stopped cleanly, with a checkpoint, when the deadline comes);
2. runs the offline lm-eval tasks on the final checkpoint with the causal evaluation routing,
   and, for capacity / flow routers, also with the training routing;
3. copies the small result files (``config.json``, ``summary.json``, ``metrics.jsonl``,
   ``validation.json``, ``eval_<routing>.json``) to ``<results-dir>/raw/<router>/seed-<seed>/``.

A stage whose result file is already in ``<results-dir>`` is skipped, so a call made with a
10-minute limit does what it can and the next call continues (copy ``<results-dir>`` back
between calls; run directories only help while the machine that holds them is kept).
``report`` needs only ``<results-dir>``: it writes ``results.json`` (every number) and
``README.md`` (generated from it; a claim without its runs says "pending").
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from study_plan import BOTH_ROUTINGS, StudyConfig  # noqa: E402

RESULT_FILES = ("config.json", "summary.json", "metrics.jsonl", "validation.json")


def raw_dir(results: Path, router: str, seed: int) -> Path:
    return results / "raw" / router / f"seed-{seed}"


def routings_for(router: str) -> list[str]:
    """lm-eval routings of a router: causal always, train where it differs (capacity / flow)."""
    return ["causal", "train"] if router in BOTH_ROUTINGS else ["causal"]


def _trained(results: Path, router: str, seed: int) -> bool:
    """Whether the run's summary in ``results`` is that of a complete run."""
    path = raw_dir(results, router, seed)
    if not (path / "summary.json").is_file() or not (path / "config.json").is_file():
        return False
    summary = json.loads((path / "summary.json").read_text())
    total = json.loads((path / "config.json").read_text())["resolved"]["total_steps"]
    return not summary.get("interrupted") and summary.get("steps", 0) >= total


def status(config: StudyConfig, results: Path) -> list[dict[str, Any]]:
    """Per run: trained, and which evaluation routings are done."""
    rows = []
    for router, seed in config.runs():
        folder = raw_dir(results, router, seed)
        rows.append(
            {
                "router": router,
                "seed": seed,
                "trained": _trained(results, router, seed),
                "evaluated": [
                    r for r in routings_for(router) if (folder / f"eval_{r}.json").is_file()
                ],
                "routings": routings_for(router),
            }
        )
    return rows


class _Deadline:
    """A Trainer callback that saves a checkpoint and stops when the deadline passes."""

    def __init__(self, deadline: float) -> None:
        from transformers import TrainerCallback

        class Callback(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
                if time.monotonic() > deadline:
                    control.should_save = True
                    control.should_training_stop = True
                return control

        self.callback = Callback()


def train_run(
    config: StudyConfig, router: str, seed: int, runs: Path, results: Path, deadline: float
) -> bool:
    """Train (or resume) one run; copy its small files to ``results``. Returns completeness."""
    from maxscore.training import train

    run_dir = runs / router / f"seed-{seed}"
    cfg = config.train_config(router, seed, str(run_dir))
    if (run_dir / "config.json").is_file():
        cfg = type(cfg)(**{**cfg.to_dict(), "resume": True})
    print(f"study: training {router} seed {seed} -> {run_dir}", flush=True)
    train(cfg, callbacks=[_Deadline(deadline).callback])
    out = raw_dir(results, router, seed)
    out.mkdir(parents=True, exist_ok=True)
    for name in RESULT_FILES:
        if (run_dir / name).is_file():
            shutil.copyfile(run_dir / name, out / name)
    return _trained(results, router, seed)


def evaluate_run(config: StudyConfig, router: str, seed: int, runs: Path, results: Path) -> None:
    """lm-eval on the run's final checkpoint, each routing of :func:`routings_for` not done yet."""
    from maxscore.evaluation.runner import evaluate_model

    run_dir = runs / router / f"seed-{seed}"
    out = raw_dir(results, router, seed)
    for routing in routings_for(router):
        target = out / f"eval_{routing}.json"
        if target.is_file():
            continue
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
) -> list[dict[str, Any]]:
    """Train and evaluate pending runs until the deadline; return the status afterwards.

    A stage starts only while time is left; training stops at the deadline with a checkpoint.
    """
    deadline = time.monotonic() + deadline_s
    for row in status(config, results):
        key = (row["router"], row["seed"])
        if only is not None and key not in only:
            continue
        if time.monotonic() >= deadline:
            break
        if not row["trained"] and not train_run(config, *key, runs, results, deadline):
            break  # cut by the deadline: the next call resumes it
        if evaluate and time.monotonic() < deadline:
            evaluate_run(config, *key, runs, results)
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


def study_config(args: argparse.Namespace) -> StudyConfig:
    """The plan's defaults, with what the command line overrides (tests use tiny values)."""
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
    return StudyConfig(**overrides)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("plan", "run", "report"))
    parser.add_argument("--results-dir", type=Path, default=HERE / "results")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/paper_reproduction"))
    parser.add_argument("--readme", type=Path, default=HERE / "README.md")
    parser.add_argument("--deadline-s", type=float, default=540.0, help="time for this call")
    parser.add_argument("--only", help="ROUTER:SEED,... (default: the whole plan, in order)")
    parser.add_argument("--no-eval", action="store_true", help="train only")
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
    if args.command == "run":
        rows = run_study(
            config,
            args.runs_dir,
            args.results_dir,
            args.deadline_s,
            only=_parse_only(args.only),
            evaluate=not args.no_eval,
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
            f"{'/'.join(row['routings'])}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
