"""How far two one-GPU trainings of the layout tests' model part by rounding alone.

The layout tests (``tests/test_expert_parallel_layouts.py``) hold each run to the run it must
equal over a window of steps; the window's bound must sit above what rounding alone gives and
below what a bug gives. This trains the tests' model (tiny preset, fp32, seq 128, global batch
16, maxscore, 30 steps) five times side by side on one GPU and writes the relative loss gap per
step of four pairs: TF32 off twice (run-to-run), TF32 off with one micro-batch of 16 against two
of 8 (another matrix shape and summation order, as another layout gives), TF32 on twice, TF32
off against on. TF32 off is ``NVIDIA_TF32_OVERRIDE=0`` (what the layout tests set on GPUs).

    PYTHONPATH=src python3 benchmarks/expert_parallel/rounding.py --output rounding_1gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

TRAIN = [
    "-m", "maxscore.cli", "train", "--model", "tiny", "--seq-len", "128", "--precision", "fp32",
    "--router", "maxscore", "--max-steps", "30", "--save-steps", "0", "--logging-steps", "1",
    "--eval-steps", "0", "--max-eval-blocks", "4", "--report-to", "none", "--quiet",
]  # fmt: skip
#: name: (TF32 off, micro-batch, gradient accumulation)
RUNS = {
    "off_a": (True, 16, 1),
    "off_b": (True, 16, 1),
    "off_2x8": (True, 8, 2),
    "on_a": (False, 16, 1),
    "on_b": (False, 16, 1),
}
PAIRS = {
    "tf32_off_run_to_run": ("off_a", "off_b"),
    "tf32_off_batch16_vs_2x8": ("off_a", "off_2x8"),
    "tf32_on_run_to_run": ("on_a", "on_b"),
    "tf32_off_vs_on": ("off_a", "on_a"),
}


def losses(run_dir: Path) -> dict[int, float]:
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in rows if r.get("type") == "train"}


def gaps(a: dict[int, float], b: dict[int, float]) -> dict[int, float]:
    return {s: abs(b[s] - a[s]) / abs(a[s]) for s in sorted(a) if s in b}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    import torch

    with tempfile.TemporaryDirectory() as scratch:
        procs = {}
        for name, (tf32_off, batch, accum) in RUNS.items():
            env = {**os.environ, **({"NVIDIA_TF32_OVERRIDE": "0"} if tf32_off else {})}
            command = [sys.executable, *TRAIN, "--batch-size", str(batch), "--grad-accum",
                       str(accum), "--output-dir", str(Path(scratch) / name)]  # fmt: skip
            procs[name] = subprocess.Popen(command, env=env)
        failed = [name for name, proc in procs.items() if proc.wait() != 0]
        if failed:
            raise SystemExit(f"runs failed: {failed} (their output is above)")
        runs = {name: losses(Path(scratch) / name) for name in RUNS}
    doc = {
        "what": __doc__.split("\n\n")[1].replace("\n", " "),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "date": datetime.now(UTC).isoformat(timespec="minutes"),
        "gaps": {pair: gaps(runs[a], runs[b]) for pair, (a, b) in PAIRS.items()},
    }
    args.output.write_text(json.dumps(doc, indent=1) + "\n")
    for pair, row in doc["gaps"].items():
        print(pair, " ".join(f"{s}:{g:.1e}" for s, g in row.items()))


if __name__ == "__main__":
    main()
