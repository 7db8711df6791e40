"""The paper-claims study's tooling (benchmarks/paper_claims): the plan, the verdicts from raw
result files (a known effect is found, a null effect is not called a gain, composite claims per
seed), and a tiny study trained on the CPU and reported."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

STUDY_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "paper_claims"
sys.path.insert(0, str(STUDY_DIR))

import claims_report as report  # noqa: E402
import claims_study as study  # noqa: E402
from claims_plan import ARMS, ARMS_BY_NAME, PROFILES, SHAPES, StudyConfig, arm_slug  # noqa: E402


def test_plan_is_consistent() -> None:
    assert len({arm_slug(a.name) for a in ARMS}) == len(ARMS)  # one folder per arm
    assert all(a.shape in SHAPES for a in ARMS)
    for claim in report.CLAIMS:
        assert set(claim.terms) <= set(ARMS_BY_NAME), claim.key
        # a claim is a contrast: the coefficients sum to 0, so a seed-level shift cancels
        assert sum(claim.terms.values()) == 0, claim.key
    cfg = StudyConfig().train_config("gshard@seq", 3, "/tmp/x")
    assert cfg.router == "gshard" and cfg.router_overrides == {"group": "sequence"}
    assert cfg.seed == 3 and not cfg.deterministic  # the recorded study's mode
    assert StudyConfig(deterministic=True).train_config("gshard", 1, "/tmp/x").deterministic
    assert (cfg.adam_beta1, cfg.adam_beta2, cfg.adam_eps, cfg.weight_decay) == (
        0.9,
        0.95,
        1e-6,
        0.1,
    )
    assert cfg.warmup_ratio == pytest.approx(2 / 180) and cfg.decay_ratio == pytest.approx(6 / 180)
    wide = StudyConfig().train_config("maxscore/8:128", 1, "/tmp/x")
    assert wide.model_overrides["num_experts"] == 128 and wide.model_overrides["hidden_size"] == 512


def test_queue_completes_pairs_first() -> None:
    queue = StudyConfig().queue()
    assert queue[:3] == [("gshard", 1), ("maxscore", 1), ("gshard@seq", 1)]
    # the headline's first 8 seeds come before any other tier
    first_other = next(i for i, (arm, _) in enumerate(queue) if ARMS_BY_NAME[arm].tier > 0)
    assert first_other == 3 * 8
    jobs = study.jobs(StudyConfig())
    assert ("gshard", 1, True) in jobs and jobs.index(("gshard", 1, True)) < 10


def _write(results: Path, arm: str, seed: int, loss: float, rerun: bool = False) -> None:
    path = study.result_path(results, arm, seed, rerun)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "arm": arm,
        "seed": seed,
        "rerun": rerun,
        "eval_loss": loss,
        "tokens_per_s": 1000.0,
        "routing_mean": {"dropped_by_rank": [0.0, 0.2], "rerouted_by_rank": [0.0, 0.0]},
        "first_layer": {"load_over_capacity": [0.5, 1.0, 1.5], "tokens_per_expert": [1, 2, 3]},
        "device": "constructed",
    }
    path.write_text(json.dumps(record))


def _constructed(results: Path, effects: dict[str, float], seeds: int, sd: float) -> None:
    """Every arm's loss = a seed-level value shared by all arms + the arm's effect + noise."""
    rng = random.Random(0)
    for seed in range(1, seeds + 1):
        shared = rng.gauss(5.0, 0.05)  # seed-to-seed spread far above the effects
        for arm, effect in effects.items():
            _write(results, arm, seed, shared + effect + rng.gauss(0.0, sd))


def _outcomes(results: Path) -> dict[str, str]:
    runs, _ = report.load_runs(results)
    return {row["key"]: row["outcome"] for row in report.evaluate_claims(runs)}


def test_a_known_effect_is_found(tmp_path: Path) -> None:
    _constructed(
        tmp_path,
        {
            "gshard": 0.0,
            "gshard@seq": 0.0,
            "maxscore": -0.02,
            "gshard-m": 0.001,
            "gshard-s": 0.0,
            "dropless": 0.02,
        },
        seeds=10,
        sd=0.003,
    )
    found = _outcomes(tmp_path)
    assert found["maxscore>gshard"] == "reproduces"
    assert found["maxscore>gshard@seq"] == "reproduces"
    assert found["maxscore>dropless"] == "reproduces"
    assert found["M~gshard"] == "reproduces"  # a negligible gain within ±0.01
    # superadditivity: gain(SM) = 0.02 > gain(S) + gain(M) = 0 - 0.001
    assert found["S+M superadditive"] == "reproduces"
    assert found["maxscore>gshard-i"].startswith("pending")


def test_a_null_effect_is_not_called_a_gain(tmp_path: Path) -> None:
    _constructed(tmp_path, {"gshard": 0.0, "maxscore": 0.0}, seeds=3, sd=0.01)
    assert _outcomes(tmp_path)["maxscore>gshard"] == "inconclusive"
    # with many seeds and little noise the same null effect is "not reproduced", never a gain
    _constructed(tmp_path, {"gshard": 0.0, "maxscore": 0.0}, seeds=16, sd=0.002)
    assert _outcomes(tmp_path)["maxscore>gshard"].startswith("not reproduced")


def test_an_opposite_effect_contradicts(tmp_path: Path) -> None:
    _constructed(tmp_path, {"gshard": 0.0, "maxscore": 0.02, "gshard-i": 0.02}, 8, 0.003)
    found = _outcomes(tmp_path)
    assert found["maxscore>gshard"] == "contradicted"
    assert found["I~gshard"] == "reproduces (no gain; worse)"


@pytest.mark.parametrize(
    ("verdict", "expected", "outcome"),
    [
        ("better", "below 0", "reproduces"),
        ("equivalent", "below 0", "not reproduced (no difference beyond the margin)"),
        ("worse", "below 0", "contradicted"),
        ("better", "within margin", "contradicted (a gain)"),
        ("inconclusive", "within margin", "inconclusive"),
        ("too few seeds", "below 0", "pending (fewer than 2 paired seeds)"),
        ("worse", "none", "above 0"),
    ],
)
def test_outcome_table(verdict: str, expected: str, outcome: str) -> None:
    assert report.outcome(verdict, expected) == outcome  # type: ignore[arg-type]


def test_report_from_constructed_results(tmp_path: Path) -> None:
    results = tmp_path / "results"
    _constructed(
        results,
        {
            "gshard": 0.0,
            "maxscore": -0.01,
            "dropless": 0.0,
            "dropless/2:64": 0.0,
            "maxscore/2:64": -0.02,
        },
        4,
        0.002,
    )
    _write(
        results,
        "gshard",
        1,
        json.loads(study.result_path(results, "gshard", 1).read_text())["eval_loss"],
        rerun=True,
    )
    payload = report.write_report(PROFILES["gpu"], results, tmp_path / "README.md")
    text = (tmp_path / "README.md").read_text()
    assert "| MaxScore beats GShard | Table 2 | authors'" in text
    assert "largest |difference| 0.00e+00 nats over 1 pair(s)" in text
    assert payload["same_seed_noise"]["pairs"] == 1
    assert (results / "results.json").is_file()


def test_tiny_study_trains_and_reports_on_cpu(tmp_path: Path) -> None:
    results, runs = tmp_path / "results", tmp_path / "runs"
    argv = [
        "--profile",
        "cpu-smoke",
        "--results-dir",
        str(results),
        "--runs-dir",
        str(runs),
        "--arms",
        "gshard,maxscore",
        "--seeds",
        "1",
    ]
    assert study.main(["run", *argv, "--deadline-s", "300"]) == 0
    assert (
        study.pending(
            StudyConfig.from_dict(json.loads((results / "study.json").read_text())), results
        )
        == []
    )
    record = json.loads(study.result_path(results, "maxscore", 1).read_text())
    assert record["eval_loss"] > 0 and len(record["validation"]["loss_sum"]) > 0
    assert record["first_layer"]["load_over_capacity"]
    assert study.main(["report", *argv, "--readme", str(tmp_path / "README.md")]) == 0
    assert "MaxScore beats GShard" in (tmp_path / "README.md").read_text()


def test_summary_block_in_another_readme_is_regenerated_and_nothing_else_changes(
    tmp_path: Path,
) -> None:
    payload = json.loads((STUDY_DIR / "results" / "results.json").read_text())
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n\n{report.BLOCK_BEGIN}\nstale numbers\n{report.BLOCK_END}\n\nrest\n")
    assert report.update_summary_block(readme, payload)
    text = readme.read_text()
    assert "stale numbers" not in text
    assert text.startswith("intro\n\n") and text.endswith(f"{report.BLOCK_END}\n\nrest\n")
    assert "\n".join(report.headline_lines(payload)) in text
    plain = tmp_path / "other.md"
    plain.write_text("no block\n")
    assert not report.update_summary_block(plain, payload)
    assert plain.read_text() == "no block\n"


@pytest.mark.parametrize("readme", ["README.md", "benchmarks/README.md"])
def test_readme_summaries_match_the_committed_results(readme: str) -> None:
    payload = json.loads((STUDY_DIR / "results" / "results.json").read_text())
    text = (STUDY_DIR.parents[1] / readme).read_text()
    assert "\n".join(report.headline_lines(payload)) in text
