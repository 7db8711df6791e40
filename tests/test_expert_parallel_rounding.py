"""``benchmarks/expert_parallel/rounding.py``: the five trainings it starts (TF32 off through the
environment, the micro-batch split) and the gaps of its four pairs, with a stand-in for
``maxscore train`` that writes losses from its arguments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from script_helpers import load_benchmark_script

rounding = load_benchmark_script("expert_parallel", "rounding")

#: Writes metrics.jsonl as maxscore train does: loss 2.0 at every step, plus 1e-3 with TF32 on
#: and 1e-6 * step with two micro-batches.
STAND_IN = """
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
out = Path(args[args.index("--output-dir") + 1]); out.mkdir(parents=True)
split = args[args.index("--grad-accum") + 1] == "2"
tf32 = os.environ.get("NVIDIA_TF32_OVERRIDE") != "0"
rows = [{"type": "train", "step": s, "loss": 2.0 + 1e-3 * tf32 + 1e-6 * s * split}
        for s in (1, 2, 3)]
(out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
"""


def test_the_pairs_gaps_from_the_five_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    monkeypatch.setattr(rounding, "TRAIN", [str(script)])
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE", raising=False)
    rounding.main(["--output", str(tmp_path / "out.json")])
    gaps = json.loads((tmp_path / "out.json").read_text())["gaps"]
    assert gaps["tf32_off_run_to_run"] == {"1": 0.0, "2": 0.0, "3": 0.0}
    assert gaps["tf32_on_run_to_run"] == {"1": 0.0, "2": 0.0, "3": 0.0}
    assert gaps["tf32_off_batch16_vs_2x8"]["3"] == pytest.approx(3e-6 / 2.0)
    assert gaps["tf32_off_vs_on"]["1"] == pytest.approx(1e-3 / 2.0)


def test_a_failed_run_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "fails.py"
    script.write_text("import sys; sys.exit(3)\n")
    monkeypatch.setattr(rounding, "TRAIN", [str(script)])
    with pytest.raises(SystemExit, match=r"runs failed: \['off_a', 'off_b'"):
        rounding.main(["--output", str(tmp_path / "out.json")])
    assert not (tmp_path / "out.json").exists()
