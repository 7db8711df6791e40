"""Does ``--precision fp8`` train as well as bf16? The Base faithful short run, paired over seeds.

``fp8_loss.py run`` trains the Base preset with MaxScore under the paper's optimizer and schedule
shape (``--recipe paper-shape``: AdamW (0.9, 0.95), WSD warm-up and decay, SoftTopk ``t``
annealed over the first sixth), 400 steps of 64 x 512 tokens at peak lr 6e-4, compiled, once per
seed and precision, through the ``maxscore train`` command; ``--parallel`` trainings share the
GPU at once (the loss does not depend on the speed); a run whose ``summary.json`` is in ``--out``
already is skipped. Each run ends with the whole validation split (about 195k tokens of the
embedded corpus); no checkpoint is kept.

``fp8_loss.py report`` reads each run's ``summary.json`` and writes the losses and the verdict
(:func:`fp8_verdict`): a run with seed ``s`` starts from the same initialisation and sees the
same data in both precisions, so the difference is paired by seed; fp8 is **within the bf16
seed spread** when its mean validation loss differs from bf16's mean by at most bf16's
seed-to-seed standard deviation, and **outside** it otherwise. Beside that target the report
states how sure the difference is: the paired fp8 - bf16 differences' Student-t interval and the
verdict of :mod:`maxscore.training.evidence` (better / worse / equivalent within 0.01 nats /
inconclusive), as ``maxscore compare`` judges two routers. ``report`` also takes a JSON file it
wrote before and judges its runs again.

    python benchmarks/train_throughput/fp8_loss.py run --seeds 0 1 --out /tmp/fp8loss
    python benchmarks/train_throughput/fp8_loss.py report /tmp/fp8loss --output fp8_loss_h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

from maxscore.training.evidence import describe, format_interval

#: The Base faithful short run (``--precision`` and ``--seed`` are added per run).
TRAIN_ARGS: tuple[str, ...] = (
    "--model", "base", "--router", "maxscore", "--recipe", "paper-shape", "--max-steps", "400",
    "--lr", "6e-4", "--batch-size", "64", "--seq-len", "512", "--compile", "--quiet",
    # only the final validation is wanted: no 9 GB checkpoints of a 757M-parameter model
    "--save-steps", "100000", "--no-save-final",
)  # fmt: skip
PRECISIONS: tuple[str, ...] = ("bf16", "fp8")
#: The evidence module's verdict on fp8 - bf16, in words.
PAIRED_VERDICTS = {
    "better": "fp8 reaches a lower loss than bf16",
    "worse": "fp8 reaches a higher loss than bf16",
    "equivalent": "fp8 and bf16 equivalent (within 0.01 nats)",
    "inconclusive": "inconclusive",
    "too few seeds": "too few seeds for an interval",
}


def run_name(precision: str, seed: int) -> str:
    return f"{precision}-seed{seed}"


def fp8_verdict(bf16: Mapping[int, float], fp8: Mapping[int, float]) -> dict[str, Any]:
    """Compare fp8's validation losses with bf16's, both keyed by seed.

    Needs at least two seeds in each precision (a spread needs two) and the same seeds in both
    (the comparison is paired). ``within`` is ``|mean(fp8) - mean(bf16)| <= sd(bf16)``, ``sd``
    the sample standard deviation of bf16's losses over seeds; ``paired`` is
    :func:`maxscore.training.evidence.describe` of the per-seed fp8 - bf16 differences (their
    t interval and verdict), ``paired_verdict`` the same in words.
    """
    if set(bf16) != set(fp8):
        raise ValueError(
            f"fp8 and bf16 runs must share their seeds (bf16: {sorted(bf16)}, fp8: {sorted(fp8)})"
        )
    if len(bf16) < 2:
        raise ValueError(f"need >= 2 seeds per precision for a seed spread, got {len(bf16)}")
    values = [*bf16.values(), *fp8.values()]
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"a validation loss is not finite: bf16 {dict(bf16)}, fp8 {dict(fp8)}")
    seeds = sorted(bf16)
    mean_bf16 = statistics.fmean(bf16[s] for s in seeds)
    mean_fp8 = statistics.fmean(fp8[s] for s in seeds)
    spread = statistics.stdev(bf16[s] for s in seeds)
    difference = mean_fp8 - mean_bf16
    within = abs(difference) <= spread
    paired = describe([fp8[s] - bf16[s] for s in seeds])
    return {
        "seeds": seeds,
        "bf16": {str(s): bf16[s] for s in seeds},
        "fp8": {str(s): fp8[s] for s in seeds},
        "paired_difference": {str(s): fp8[s] - bf16[s] for s in seeds},
        "mean_bf16": mean_bf16,
        "mean_fp8": mean_fp8,
        "mean_difference": difference,
        "bf16_seed_sd": spread,
        "within": within,
        "verdict": "within the bf16 seed spread" if within else "outside the bf16 seed spread",
        "fp8_seed_sd": statistics.stdev(fp8[s] for s in seeds),
        "paired": paired,
        "paired_verdict": f"{PAIRED_VERDICTS[paired['verdict']]}: fp8 - bf16 = "
        f"{format_interval(paired)}",
    }


def _run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # a (precision, seed) whose summary is there already is not trained again
    jobs = [
        (p, s)
        for s in args.seeds
        for p in args.precisions
        if not (out / run_name(p, s) / "summary.json").is_file()
    ]
    running: list[tuple[str, subprocess.Popen[bytes], BinaryIO]] = []
    failed = 0
    for i, (precision, seed) in enumerate(jobs):
        name = run_name(precision, seed)
        cmd = [sys.executable, "-m", "maxscore", "train", *TRAIN_ARGS, "--precision", precision]
        cmd += ["--seed", str(seed), "--output-dir", str(out / name)]
        log = (out / f"{name}.log").open("wb")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        running.append((name, proc, log))
        if len(running) >= args.parallel or i == len(jobs) - 1:
            for done, waited, done_log in running:
                rc = waited.wait()
                done_log.close()
                print(f"{done}: exit {rc} (log: {out / done}.log)", flush=True)
                failed += rc != 0
            running = []
    return 1 if failed else 0


def _report(args: argparse.Namespace) -> int:
    root = Path(args.root)
    if root.is_file():  # a report written before: its runs judged again
        summaries = json.loads(root.read_text())["runs"]
    else:
        summaries = {
            path.parent.name: json.loads(path.read_text())
            for path in sorted(root.glob("*-seed*/summary.json"))
        }
    if not summaries:
        raise SystemExit(f"{root}: no <precision>-seed<n>/summary.json runs and not a report file")
    losses: dict[str, dict[int, float]] = {p: {} for p in PRECISIONS}
    for name, summary in summaries.items():
        precision, seed = name.split("-seed")
        losses[precision][int(seed)] = float(summary["eval_loss"])
    result = fp8_verdict(losses["bf16"], losses["fp8"])
    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "command": TRAIN_ARGS}
    if root.is_file():
        meta = {**json.loads(root.read_text())["meta"], "judged": meta["date"]}
    payload = {
        "meta": meta,
        "result": result,
        "runs": {
            name: {k: s.get(k) for k in ("eval_loss", "eval_loss_se", "tokens_per_s", "steps")}
            for name, s in summaries.items()
        },
    }
    Path(args.output).write_text(json.dumps(payload, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train every (precision, seed)")
    run.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    run.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    run.add_argument("--parallel", type=int, default=4, help="trainings at once on the GPU")
    run.add_argument("--out", required=True, help="one folder per run is made here")
    report = sub.add_parser("report", help="losses and verdict from a `run` folder")
    report.add_argument("root", help="a `run` folder, or a JSON file `report` wrote")
    report.add_argument("--output", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    return _run(args) if args.command == "run" else _report(args)


if __name__ == "__main__":
    raise SystemExit(main())
