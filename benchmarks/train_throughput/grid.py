"""Every preset's training throughput in bf16 and fp8, on the GPUs of one machine, and its table.

``run`` spreads the presets over the machine's GPUs (one list of trainings per GPU, one training
per GPU at a time) and trains each preset's baseline router and MaxScore in bf16, then in fp8,
on one GPU in one process per precision, so that every ratio in the table (MaxScore over its
baseline, fp8 over bf16) compares runs of one GPU in one call. Each training is
``benchmarks/expert_parallel/bench.py run`` (the trainer with ``--compile``, micro-batch 64 x
512, 240 steps, the last 40 timed)::

    PYTHONPATH=src python3 benchmarks/train_throughput/grid.py run --output OUT
    python3 benchmarks/train_throughput/grid.py report OUT --write \
        --output benchmarks/train_throughput/presets_h200.json

``run`` called again with other ``--presets`` and the same ``--output`` adds to the folder (the
grid split over calls). ``report`` merges the runs into one JSON file (the GPU and time of each
preset) and writes the table into ``README.md`` between ``<!-- grid -->`` and ``<!-- /grid -->``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent / "expert_parallel" / "bench.py"

#: Each preset's baseline router (None: a dense model, one run a precision).
BASELINES: dict[str, str | None] = {
    "base": "gshard",
    "deepseek-base": "deepseek",
    "base-2x32": "gshard",
    "base-2x64": "gshard",
    "base-8x128": "gshard",
    "dense-base": None,
}
PRECISIONS = ("bf16", "fp8")
#: Seconds one precision of a preset takes on an H200 (both routers, process start and
#: compilation included), to balance the GPUs' lists; measured with the defaults below.
EXPECTED_S: dict[str, float] = {
    "base": 120,
    "deepseek-base": 140,
    "base-2x32": 120,
    "base-2x64": 135,
    "base-8x128": 200,
    "dense-base": 60,
}
START, END = "<!-- grid -->", "<!-- /grid -->"


def routers_of(preset: str) -> list[str]:
    baseline = BASELINES[preset]
    return [baseline, "maxscore"] if baseline else ["dense"]


def assign(presets: list[str], gpus: int) -> list[list[str]]:
    """Presets spread over ``gpus`` lists: the longest first, each onto the least loaded GPU."""
    if gpus < 1:
        raise ValueError(f"needs at least one GPU, got {gpus}")
    lanes: list[list[str]] = [[] for _ in range(gpus)]
    load = [0.0] * gpus
    for preset in sorted(presets, key=lambda p: -EXPECTED_S[p]):
        lane = min(range(gpus), key=lambda g: (load[g], g))
        lanes[lane].append(preset)
        load[lane] += EXPECTED_S[preset] * len(PRECISIONS)
    return lanes


def bench_command(args: argparse.Namespace, preset: str, precision: str, out: Path) -> list[str]:
    runs = ",".join(f"{preset}:{router}" for router in routers_of(preset))
    return [
        sys.executable, str(BENCH), "run", "--compile", "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
        "--precision", precision, "--output", str(out), "--tag", f"{preset}_{precision}",
        "--runs-dir", str(out / "runs"), "--runs", runs,
    ]  # fmt: skip


@dataclass
class Lane:
    gpu: int
    presets: list[str]
    log: list[dict[str, Any]]


def _run_lane(args: argparse.Namespace, lane: Lane, start: float) -> None:
    out = Path(args.output) / f"gpu{lane.gpu}"
    out.mkdir(parents=True, exist_ok=True)
    # GPU numbers count the visible GPUs (CUDA_VISIBLE_DEVICES set by the caller is honoured).
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible else []
    device = devices[lane.gpu] if devices else str(lane.gpu)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": device}
    for preset in lane.presets:
        for precision in PRECISIONS:
            left = args.deadline - (time.monotonic() - start)
            entry: dict[str, Any] = {"preset": preset, "precision": precision}
            if left < EXPECTED_S[preset]:
                lane.log.append({**entry, "skipped": "no time left"})
                continue
            began = time.time()
            with (out / f"{preset}_{precision}.log").open("w") as handle:
                # SIGINT first: a run that is cut keeps the rows it wrote.
                code = subprocess.call(
                    ["timeout", "-s", "INT", "-k", "15", str(int(left)),
                     *bench_command(args, preset, precision, out)],
                    env=env, stdout=handle, stderr=subprocess.STDOUT,
                )  # fmt: skip
            lane.log.append(
                {**entry, "exit": code, "device": device, "start": began, "end": time.time()}
            )
            print(f"[grid] GPU {lane.gpu} {preset} {precision}: exit {code}", flush=True)


def run(args: argparse.Namespace) -> None:
    presets = args.presets.split(",")
    unknown = [p for p in presets if p not in BASELINES]
    if unknown:
        raise SystemExit(f"unknown preset(s) {unknown}; known: {', '.join(BASELINES)}")
    if not args.gpus:
        import torch

        args.gpus = torch.cuda.device_count()
    gpus = args.gpus
    if gpus < 1:
        raise SystemExit("grid.py run needs a CUDA GPU (none is visible)")
    lanes = [Lane(g, p, []) for g, p in enumerate(assign(presets, gpus)) if p]
    start = time.monotonic()
    threads = [threading.Thread(target=_run_lane, args=(args, lane, start)) for lane in lanes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # A folder filled by several calls (e.g. a grid split over two calls of a 2-GPU machine)
    # keeps every call's lists.
    path = Path(args.output) / "grid.json"
    layout = json.loads(path.read_text()) if path.is_file() else {"gpus": gpus, "lanes": []}
    layout["gpus"] = max(layout["gpus"], gpus)
    layout["lanes"] += [{"gpu": lane.gpu, "runs": lane.log} for lane in lanes]
    path.write_text(json.dumps(layout, indent=1) + "\n")


def collect(folder: Path) -> dict[str, Any]:
    """The runs of ``grid.py run``'s output folder as one document: per preset its GPU, the time
    its runs took, and the bench result files of both precisions."""
    layout = json.loads((folder / "grid.json").read_text())
    presets: dict[str, Any] = {}
    for lane in layout["lanes"]:
        # A preset run again in a later call replaces its earlier runs, both precisions, so
        # that its ratios stay within one GPU and one call.
        fresh: dict[str, Any] = {}
        for entry in lane["runs"]:
            result = folder / f"gpu{lane['gpu']}" / f"{entry['preset']}_{entry['precision']}.json"
            # The GPU as CUDA numbered it in that call (the lane's index where not recorded).
            gpu = entry.get("device", lane["gpu"])
            slot = fresh.setdefault(entry["preset"], {"gpu": gpu, "runs": {}})
            slot["runs"][entry["precision"]] = {
                **{k: v for k, v in entry.items() if k not in ("preset", "precision")},
                **(json.loads(result.read_text()) if result.is_file() else {"missing": True}),
            }
        presets.update(fresh)
    return {"gpus": layout["gpus"], "presets": presets}


def _result(doc: dict[str, Any], preset: str, precision: str, router: str) -> dict | None:
    """A run's result row (``{"error": ...}`` for a run that failed), or None if not run."""
    run = doc["presets"].get(preset, {}).get("runs", {}).get(precision, {})
    return next((r for r in run.get("results", []) if r.get("router") == router), None)


def _measured(row: dict | None) -> dict | None:
    return None if row is None or "error" in row else row


def _cell(row: dict | None, key: str, spec: str) -> str:
    if row is not None and "error" in row:
        return "failed"
    return "-" if row is None or row.get(key) is None else format(row[key], spec)


def _ratio(a: dict | None, b: dict | None) -> str:
    """Tokens/s of ``a`` over ``b`` ("-" when either run is missing or failed)."""
    a, b = _measured(a), _measured(b)
    return "-" if a is None or b is None else f"{a['tokens_per_s'] / b['tokens_per_s']:.3f}"


def table(doc: dict[str, Any]) -> list[str]:
    """The README table: per preset and router bf16 and fp8 side by side, fp8 / bf16 and MaxScore
    / baseline in tokens/s (each ratio within one GPU and one call); a failed run's cells say
    "failed" and its error follows the table."""
    lines = [
        "| preset | router | GPU | bf16 step ms | tokens/s | MFU | peak GiB | fp8 step ms | MFU "
        "| peak GiB | fp8 / bf16 | dropped | maxscore / baseline, bf16 | fp8 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    failures = []
    for preset in BASELINES:
        if preset not in doc["presets"]:
            continue
        baseline = routers_of(preset)[0]
        for router in routers_of(preset):
            bf16, fp8 = (_result(doc, preset, p, router) for p in PRECISIONS)
            base = {p: _result(doc, preset, p, baseline) for p in PRECISIONS}
            failures += [
                f"{preset} / {router} / {precision} failed: {row['error']}"
                for precision, row in zip(PRECISIONS, (bf16, fp8), strict=True)
                if row is not None and "error" in row
            ]
            measured = _measured(bf16)
            dropped = "-" if BASELINES[preset] is None or measured is None else (
                f"{measured['dropped'] * 100:.1f}%" if measured.get("dropped") else "0"
            )  # fmt: skip
            mine = router == "maxscore"
            versus_bf16 = f"**{_ratio(bf16, base['bf16'])}**" if mine else ""
            versus_fp8 = _ratio(fp8, base["fp8"]) if mine else ""
            lines.append(
                f"| {preset} | {router} | {doc['presets'][preset]['gpu']} "
                f"| {_cell(bf16, 'step_ms', '.1f')} | {_cell(bf16, 'tokens_per_s', ',.0f')} "
                f"| {_cell(bf16, 'mfu', '.1%')} | {_cell(bf16, 'peak_memory_gib_rank0', '.1f')} "
                f"| {_cell(fp8, 'step_ms', '.1f')} | {_cell(fp8, 'mfu', '.1%')} "
                f"| {_cell(fp8, 'peak_memory_gib_rank0', '.1f')} | {_ratio(fp8, bf16)} | {dropped} "
                f"| {versus_bf16} | {versus_fp8} |"
            )
    if failures:
        lines += ["", *failures]
    return lines


def write_readme(readme: Path, lines: list[str]) -> None:
    text = readme.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{readme} has no {START} ... {END} block to replace")
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    readme.write_text(head + START + "\n" + "\n".join(lines) + "\n" + END + tail)


def report(args: argparse.Namespace) -> None:
    doc = collect(Path(args.folder))
    if args.note:
        doc = {"note": args.note, **doc}
    lines = table(doc)
    print("\n".join(lines))
    if args.output:
        Path(args.output).write_text(json.dumps(doc, indent=1) + "\n")
    if args.write:
        write_readme(HERE / "README.md", lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="train the grid on this machine's GPUs")
    p.add_argument("--output", required=True)
    p.add_argument("--presets", default=",".join(BASELINES))
    p.add_argument("--gpus", type=int, default=0, help="GPUs to use (default: all visible)")
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--warmup", type=int, default=200, help="steps excluded from timing")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--deadline", type=float, default=3600.0, help="seconds for the whole grid")
    p.set_defaults(func=run)
    p = sub.add_parser("report", help="merge a run's files; print (and write) the table")
    p.add_argument("folder")
    p.add_argument("--output", help="the merged JSON file")
    p.add_argument("--note", help="a line about the machine and the calls, kept in the JSON")
    p.add_argument("--write", action="store_true", help="replace the README's grid table")
    p.set_defaults(func=report)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
