"""Compare the loss curves of a 1-GPU run and a 2-GPU (DDP) run of the same training.

``python benchmarks/ddp/ddp_report.py --single RUN1 --ddp RUN2 --output DIR``

Reads the ``metrics.jsonl`` of two run directories (same global batch: 1 GPU x B against
2 GPUs x B/2) and writes ``ddp_loss_curves.png``, ``ddp_loss.md`` and ``ddp_loss.json`` (loss per
logged step, largest absolute and relative difference) to ``--output`` (default ``$OUT`` or
``.``). ``run_gpu.sh`` runs both trainings and this report in one go.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path


def _losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("type") == "train" and "loss" in record:
            out[int(record["step"])] = float(record["loss"])
    return out


def ddp_report(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    single, ddp = _losses(Path(args.single)), _losses(Path(args.ddp))
    steps = sorted(set(single) & set(ddp))
    diffs = [abs(single[s] - ddp[s]) for s in steps]
    rel = [abs(single[s] - ddp[s]) / single[s] for s in steps]
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    summary = {
        "single_gpu_run": str(args.single),
        "ddp_run": str(args.ddp),
        "note": args.note,
        "steps": steps,
        "loss_single": [single[s] for s in steps],
        "loss_ddp": [ddp[s] for s in steps],
        "max_abs_diff": max(diffs) if diffs else math.nan,
        "max_rel_diff": max(rel) if rel else math.nan,
        "mean_abs_diff": sum(diffs) / len(diffs) if diffs else math.nan,
    }
    (out / "ddp_loss.json").write_text(json.dumps(summary, indent=2) + "\n")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(steps, summary["loss_single"], label="1 GPU")
    ax.plot(steps, summary["loss_ddp"], "--", label="2 GPUs (DDP)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title("Same global batch: 1 GPU vs 2-GPU DDP")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ddp_loss_curves.png", dpi=120)
    lines = [
        "# 1-GPU vs 2-GPU DDP loss curves",
        "",
        args.note,
        "",
        f"Max |loss difference| over {len(steps)} logged steps: {summary['max_abs_diff']:.4f} "
        f"(max relative {summary['max_rel_diff']:.2%}, mean {summary['mean_abs_diff']:.4f}).",
        "",
        "| step | 1 GPU | 2 GPUs | diff |",
        "|---|---|---|---|",
    ]
    stride = max(1, len(steps) // 15)
    for s in steps[::stride] + ([steps[-1]] if steps and steps[-1] not in steps[::stride] else []):
        lines.append(f"| {s} | {single[s]:.4f} | {ddp[s]:.4f} | {single[s] - ddp[s]:+.4f} |")
    lines += ["", "![loss curves](ddp_loss_curves.png)", ""]
    (out / "ddp_loss.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--single", required=True, help="run directory of the 1-GPU run")
    parser.add_argument("--ddp", required=True, help="run directory of the 2-GPU run")
    parser.add_argument("--note", default="", help="setup line written above the table")
    parser.add_argument("--output", default=os.environ.get("OUT", "."))
    ddp_report(parser.parse_args(argv))


if __name__ == "__main__":
    main()
