"""The paper-reproduction study's tooling (benchmarks/paper_reproduction): the plan, the report
from raw results (verdicts, pending claims), and, slow, a tiny study trained and evaluated on
the CPU, resumed without retraining."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest

STUDY_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "paper_reproduction"
sys.path.insert(0, str(STUDY_DIR))

import study  # noqa: E402
import study_report  # noqa: E402
from study_plan import ROUTERS, StudyConfig  # noqa: E402


def test_plan_covers_the_papers_routers_with_three_seeds_for_the_ablation() -> None:
    config = StudyConfig()
    names = {p.router for p in ROUTERS}
    assert names == set(study_report.PAPER_AVG)  # every Table 2 / 3 router, dense included
    seeds = {p.router: len(p.seeds) for p in config.plans()}
    for router in ("gshard", "gshard-i", "gshard-s", "gshard-m", "maxscore-i", "maxscore"):
        assert seeds[router] >= 3
    assert min(seeds.values()) >= 1
    cfg = config.train_config("maxscore", 42, "/tmp/x")
    assert cfg.total_steps() * cfg.tokens_per_step() >= 25_000_000
    assert (cfg.adam_beta1, cfg.adam_beta2, cfg.adam_eps, cfg.weight_decay) == (
        0.9,
        0.95,
        1e-6,
        0.1,
    )
    assert cfg.lr_schedule == "wsd" and cfg.temperature_fraction == pytest.approx(1 / 6)
    assert cfg.warmup_ratio == pytest.approx(2 / 180) and cfg.decay_ratio == pytest.approx(6 / 180)
    assert config.train_config("deepseek", 42, "/tmp/x").model == "deepseek-base"


def _write_run(
    results: Path,
    router: str,
    seed: int,
    doc_losses: list[float],
    device: str = "cpu",
    tokens_per_s: float = 1000.0,
) -> None:
    folder = results / "raw" / router / f"seed-{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    tokens = [10.0] * len(doc_losses)
    sums = [loss * t for loss, t in zip(doc_losses, tokens, strict=True)]
    loss = sum(sums) / sum(tokens)
    config = {
        "train": {"seq_len": 16},
        "resolved": {"total_steps": 10, "train_blocks": 100, "device": device},
    }
    summary = {"steps": 10, "tokens": 3200, "eval_loss": loss, "eval_loss_se": 0.01}
    summary["tokens_per_s"] = tokens_per_s
    validation = {"loss": loss, "se": 0.01, "loss_sum": sums, "tokens": tokens}
    routing = {
        "dropped_by_rank": [[0.0, 0.3], [0.0, 0.1]],
        "rerouted_by_rank": [[0.1, 0.0], [0.1, 0.0]],
        "mean_affinity_by_rank": [[0.5, 0.2], [0.5, 0.2]],
        "load_over_capacity": [[0.8, 0.9], [1.0, 1.0]],
        "moe_layers": [0, 1],
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "validation.json").write_text(json.dumps(validation))
    (folder / "metrics.jsonl").write_text(
        json.dumps({"type": "train", "step": 10, "loss": 3.5, "routing": routing}) + "\n"
    )
    scores = {
        "piqa": {"acc": 0.51, "acc_stderr": 0.02},
        "arc_easy": {"acc": 0.40, "acc_stderr": 0.01},
        "sciq": {"acc": 0.20, "acc_stderr": 0.01},  # below chance (25): no better than it
    }
    payload = {"eval_routing": "causal", "metrics": scores, "n_samples": {"piqa": 100}}
    (folder / "eval_causal.json").write_text(json.dumps(payload))


def test_report_verdicts_from_raw_results_and_pending_claims(tmp_path: Path) -> None:
    results = tmp_path / "results"
    config = StudyConfig(routers=("gshard", "gshard-s", "gshard-m", "maxscore", "dense"))
    base = [3.0, 3.2, 2.8, 3.1]
    for seed, shift in zip((42, 43, 44), (0.0, 0.01, -0.01), strict=True):
        _write_run(results, "gshard", seed, [x + shift for x in base])
        # MaxScore: 0.02 lower on every document and seed; GShard-S 0.01; GShard-M the same
        _write_run(results, "maxscore", seed, [x + shift - 0.02 for x in base])
        _write_run(
            results, "gshard-s", seed, [x + shift - 0.01 + 0.001 * (seed - 43) for x in base]
        )
        _write_run(
            results, "gshard-m", seed, [x + shift + (0.002 if seed == 43 else -0.001) for x in base]
        )
    readme = tmp_path / "README.md"
    rows = study.status(config, results)
    data = study_report.write_report(config, results, readme, rows)
    claims = data["claims"]
    gain = claims["maxscore_beats_gshard"]["gain"]
    assert gain["mean"] == pytest.approx(0.02) and gain["n"] == 3
    assert claims["maxscore_beats_gshard"]["verdict"] == "reproduces"
    assert claims["s_and_m_superadditive"]["superadditive"] is True
    assert claims["s_and_m_superadditive"]["verdict"] == "reproduces"
    assert claims["s_and_m_superadditive"]["excess"]["mean"] == pytest.approx(0.01)
    # GShard-M's gains +0.001 / -0.002 / +0.001: the t interval lies within ±0.01
    assert claims["flow_alone_negligible"]["verdict"] == "reproduces (within ±0.01)"
    assert claims["rerouting_alone_negligible"]["verdict"] == "pending"  # no GShard-I run
    assert data["passes_over_corpus"] == pytest.approx(3200 / 1600)
    assert data["routers"]["dense"]["eval_loss"] is None  # no run: pending
    maxscore = data["routers"]["maxscore"]
    assert maxscore["dropped_by_rank"] == pytest.approx([0.0, 0.2])
    assert maxscore["load_over_capacity_middle_layer"]["mean"] == pytest.approx(1.0)
    piqa = maxscore["lm_eval"]["causal"]["piqa"]
    assert (
        piqa["score"] == pytest.approx(51.0) and piqa["no_better_than_chance"]
    )  # 51 ± 2, chance 50
    assert not maxscore["lm_eval"]["causal"]["arc_easy"]["no_better_than_chance"]
    assert maxscore["lm_eval"]["causal"]["sciq"]["no_better_than_chance"]
    text = readme.read_text()
    assert "- MaxScore beats GShard (Table 2): **reproduces**" in text
    assert "- S and M superadditive: **reproduces**" in text
    assert "| dense | Dense | 1 | 0 | pending |" in text
    assert "Above chance: arc_easy (4 router(s))." in text
    assert json.loads((results / "results.json").read_text())["claims"]["ranking"]["routers"]


def test_speeds_are_reported_per_card(tmp_path: Path) -> None:
    # Runs spread over device calls may land on different cards: their tokens/s are never
    # averaged together, and the figures name each run's card.
    results = tmp_path / "results"
    config = StudyConfig(routers=("gshard", "maxscore"))
    h200, h100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
    _write_run(results, "gshard", 42, [3.0, 3.1], device=h200, tokens_per_s=400.0)
    _write_run(results, "gshard", 43, [3.0, 3.1], device=h200, tokens_per_s=420.0)
    _write_run(results, "gshard", 44, [3.0, 3.1], device=h100, tokens_per_s=300.0)
    _write_run(results, "maxscore", 42, [3.0, 3.1], device=h100, tokens_per_s=290.0)
    readme = tmp_path / "README.md"
    data = study_report.write_report(config, results, readme, study.status(config, results))
    speeds = data["routers"]["gshard"]["tokens_per_s"]
    assert speeds[h200]["mean"] == pytest.approx(410.0) and speeds[h200]["n"] == 2
    assert speeds[h100]["mean"] == pytest.approx(300.0) and speeds[h100]["n"] == 1
    text = readme.read_text()
    assert "| 300 (H100, n=1); 410 (H200, n=2) |" in text
    assert "| 290 (H100) |" in text


def test_a_run_trained_twice_reports_its_run_to_run_variation(tmp_path: Path) -> None:
    """A run trained again (same seed, for its lm-eval) keeps the first run's files in
    before-retraining/: the report gives how far the two losses are apart, and on which cards."""
    results = tmp_path / "results"
    config = StudyConfig(routers=("gshard", "maxscore"))
    _write_run(results, "gshard", 42, [3.0, 3.2], device="NVIDIA H200")  # loss 3.1
    folder = results / "raw" / "gshard" / "seed-42"
    (folder / study.SUPERSEDED).mkdir()
    for path in list(folder.glob("*.*")):
        path.rename(folder / study.SUPERSEDED / path.name)
    _write_run(results, "gshard", 42, [3.0, 3.0], device="NVIDIA H100 80GB HBM3")  # loss 3.0
    _write_run(results, "maxscore", 42, [3.0, 3.1])  # trained once: not a pair
    readme = tmp_path / "README.md"
    data = study_report.write_report(config, results, readme, study.status(config, results))
    found = data["reruns"]
    assert [p["run"] for p in found["pairs"]] == ["gshard/42"]
    assert found["pairs"][0]["difference"] == pytest.approx(-0.1)
    assert found["pairs"][0]["cards"] == ["H200", "H100"]
    assert found["max_abs_difference"] == pytest.approx(0.1)
    assert "gshard/42 3.1000 -> 3.0000 (-0.1000, H200 -> H100)" in readme.read_text()


def test_runs_only_the_summary_records_report_as_with_their_raw_files(tmp_path: Path) -> None:
    """results.json keeps every run's numbers and analysis.json every plotted number: without
    the raw files the report (verdicts, README, figures) is the same, the runs count as trained,
    and a new run's raw files join them."""
    results = tmp_path / "results"
    config = StudyConfig(routers=("gshard", "maxscore"))
    for seed, shift in ((42, 0.0), (43, 0.01)):
        _write_run(results, "gshard", seed, [3.0 + shift, 3.2 + shift], device="NVIDIA H200")
        _write_run(results, "maxscore", seed, [2.98 + shift, 3.17 + shift], device="NVIDIA H200")
    readme = tmp_path / "README.md"
    first = study_report.write_report(config, results, readme, study.status(config, results))
    texts = {p: p.read_text() for p in (readme, results / "results.json")}
    analysis_md = (results / "analysis" / "analysis.md").read_text()
    shutil.rmtree(results / "raw")
    (results / "analysis" / "loss_curves.png").unlink()
    rows = study.status(config, results)
    assert [r["trained"] for r in rows] == [True, True, True, True, False, False]
    assert rows[0]["evaluated"] == ["causal"]
    again = study_report.write_report(config, results, readme, rows)
    assert {p: p.read_text() for p in texts} == texts
    assert (results / "analysis" / "analysis.md").read_text() == analysis_md
    assert (results / "analysis" / "loss_curves.png").is_file()  # drawn from analysis.json
    assert again["claims"] == first["claims"]
    # a run of a later call: its raw files join the runs the summary records
    _write_run(results, "gshard", 44, [3.1, 3.3], device="NVIDIA H100 80GB HBM3")
    _write_run(results, "maxscore", 44, [3.08, 3.27], device="NVIDIA H100 80GB HBM3")
    data = study_report.write_report(config, results, readme, study.status(config, results))
    assert data["claims"]["maxscore_beats_gshard"]["gain"]["n"] == 3
    assert sorted(data["runs"]) == [
        f"{r}/{s}" for r in ("gshard", "maxscore") for s in (42, 43, 44)
    ]
    assert "6 of 6 runs trained" in readme.read_text()


@pytest.mark.parametrize(
    ("results", "readme"),
    [("results", "README.md"), ("results_full", "results_full/README.md")],
)
def test_the_committed_readmes_regenerate_from_the_summaries(
    tmp_path: Path, results: str, readme: str
) -> None:
    """``study_report.py`` writes each committed README again, byte for byte, from its study's
    summary (results.json) and saved analysis alone."""
    for name in ("README.md", "results_full/README.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(STUDY_DIR / name, tmp_path / name)
    for folder in ("results", "results_full"):
        (tmp_path / folder / "analysis").mkdir(parents=True, exist_ok=True)
        for name in ("results.json", "analysis/analysis.json"):
            shutil.copyfile(STUDY_DIR / folder / name, tmp_path / folder / name)
    argv = ["--results-dir", str(tmp_path / results), "--readme", str(tmp_path / readme)]
    assert study_report.main([*argv, "--no-figures"]) == 0
    assert (tmp_path / readme).read_text() == (STUDY_DIR / readme).read_text()
    summary = json.loads((tmp_path / results / "results.json").read_text())
    assert summary == json.loads((STUDY_DIR / results / "results.json").read_text())


def test_empty_results_say_every_number_is_pending(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    config = StudyConfig()
    study_report.write_report(
        config, tmp_path / "results", readme, study.status(config, tmp_path / "results")
    )
    text = readme.read_text()
    assert "no run has been made yet" in text and "pending" in text
    assert "reproduces**" not in text


def _run_of_an_earlier_call(tmp_path: Path) -> tuple[Path, Path, Path, StudyConfig]:
    """A study of one run (gshard, seed 42) whose results came from an earlier device call:
    (results, runs, queue, config); no run directory (checkpoint) on this machine."""
    results, runs, queue = tmp_path / "results", tmp_path / "runs", tmp_path / "queue"
    queue.mkdir()
    _write_run(results, "gshard", 42, [3.0, 3.1])
    return results, runs, queue, StudyConfig(routers=("gshard",), seeds_override=(42,))


def test_worker_skips_lm_eval_of_runs_trained_on_another_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A run trained in an earlier device call has its result files but no checkpoint here: the
    # worker neither evaluates it (that raised, and marked the run failed) nor retrains it.
    results, runs, queue, config = _run_of_an_earlier_call(tmp_path)
    (results / "raw" / "gshard" / "seed-42" / "eval_causal.json").unlink()
    assert study.status(config, results)[0]["trained"]

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("must not be called")

    monkeypatch.setattr(study, "evaluate_run", forbidden)
    monkeypatch.setattr(study, "train_run", forbidden)
    assert study.work(config, runs, results, queue, time.time() + 60, "w0") == 0
    assert not list(queue.glob("*.failed")) and not list(queue.glob("*.claim"))
    # With its checkpoint on this machine the same run is evaluated.
    (runs / "gshard" / "seed-42").mkdir(parents=True)
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(study, "evaluate_run", lambda c, r, s, *a: calls.append((r, s)))
    assert study.work(config, runs, results, queue, time.time() + 60, "w0") == 0
    assert calls == [("gshard", 42)]


@pytest.mark.slow
def test_tiny_study_trains_evaluates_resumes_and_reports(tmp_path: Path) -> None:
    """Two routers, one seed each, tiny model and budget, one lm-eval task with 4 documents."""
    argv = [
        "--results-dir", str(tmp_path / "results"), "--runs-dir", str(tmp_path / "runs"),
        "--readme", str(tmp_path / "README.md"), "--routers", "gshard,maxscore", "--seeds", "7",
        "--model", "tiny", "--model-option", "hidden_size=32", "--model-option", "num_hidden_layers=1",
        "--model-option", "num_attention_heads=2", "--model-option", "num_experts=4",
        "--tokens", "1024", "--seq-len", "32", "--batch-size", "8", "--eval-steps", "2",
        "--save-steps", "2", "--max-eval-blocks", "4", "--eval-limit", "4", "--eval-tasks", "piqa",
        "--no-compile",
    ]  # fmt: skip
    assert study.main(["run", *argv]) == 0
    raw = tmp_path / "results" / "raw"
    for router in ("gshard", "maxscore"):
        for name in ("summary.json", "metrics.jsonl", "validation.json", "eval_causal.json"):
            assert (raw / router / "seed-7" / name).is_file(), (router, name)
    assert (raw / "maxscore" / "seed-7" / "eval_train.json").is_file()  # both routings
    stamp = (raw / "gshard" / "seed-7" / "summary.json").stat().st_mtime_ns
    assert study.main(["run", *argv]) == 0  # everything done: nothing retrained
    assert (raw / "gshard" / "seed-7" / "summary.json").stat().st_mtime_ns == stamp
    assert study.main(["report", *argv]) == 0
    data = json.loads((tmp_path / "results" / "results.json").read_text())
    assert data["routers"]["maxscore"]["delta_vs_gshard"]["n"] == 1
    assert "piqa" in data["routers"]["gshard"]["lm_eval"]["causal"]
    assert "2 of 2 runs trained" in (tmp_path / "README.md").read_text()


def test_retraining_for_lm_eval_replaces_a_run_only_once_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A run trained in an earlier call has its causal lm-eval but not the training-routing one,
    # and no checkpoint here. --retrain-for-eval trains it again and evaluates the new weights;
    # the old files (their lm-eval included) move aside, and a retraining cut by the deadline
    # leaves the old complete results as they were.
    import maxscore.training

    results, runs, queue, config = _run_of_an_earlier_call(tmp_path)
    raw = results / "raw" / "gshard" / "seed-42"
    old_summary = json.loads((raw / "summary.json").read_text())
    finish = {"steps": 10}

    def fake_train(cfg: object, callbacks: object = None) -> None:
        out = Path(cfg.output_dir)  # type: ignore[attr-defined]
        out.mkdir(parents=True, exist_ok=True)
        resolved = {"total_steps": 10, "train_blocks": 100, "device": "cpu"}
        (out / "config.json").write_text(
            json.dumps({"train": {"seq_len": 16}, "resolved": resolved})
        )
        summary = {**old_summary, "eval_loss": 2.5, **finish}
        (out / "summary.json").write_text(json.dumps(summary))
        for name in ("metrics.jsonl", "validation.json"):
            shutil.copyfile(raw / name, out / name)

    evaluated: list[tuple[str, int]] = []

    def fake_eval(
        c: object, router: str, seed: int, runs_: Path, results_: Path, *a: object
    ) -> None:
        evaluated.append((router, seed))
        for routing in study.routings_for(router):
            target = study.raw_dir(results_, router, seed) / f"eval_{routing}.json"
            if not target.is_file():
                target.write_text(json.dumps({"eval_routing": routing, "metrics": {}}))

    monkeypatch.setattr(maxscore.training, "train", fake_train)
    monkeypatch.setattr(study, "evaluate_run", fake_eval)
    # Cut by the deadline (fewer steps than planned): nothing in the results changes.
    finish["steps"] = 4
    study.work(config, runs, results, queue, time.time() + 60, "w0", retrain_for_eval=True)
    assert json.loads((raw / "summary.json").read_text()) == old_summary
    assert not (raw / study.SUPERSEDED).exists() and not evaluated
    # Complete: the new run's files replace the old ones, which move aside with their lm-eval.
    finish["steps"] = 10
    shutil.rmtree(runs)
    shutil.rmtree(queue)
    queue.mkdir()
    study.work(config, runs, results, queue, time.time() + 60, "w0", retrain_for_eval=True)
    assert json.loads((raw / "summary.json").read_text())["eval_loss"] == 2.5
    assert json.loads((raw / study.SUPERSEDED / "summary.json").read_text()) == old_summary
    assert (raw / study.SUPERSEDED / "eval_causal.json").is_file()
    assert evaluated == [("gshard", 42)]
    assert {p.name for p in raw.glob("eval_*.json")} == {"eval_causal.json", "eval_train.json"}
    row = study.status(config, results)[0]
    assert row["trained"] and row["evaluated"] == ["causal", "train"]


def test_runs_never_trained_come_before_retraining() -> None:
    both = ["causal", "train"]
    rows = [
        {"router": "gshard", "seed": 42, "trained": True, "routings": both, "evaluated": []},
        {
            "router": "deepseek",
            "seed": 42,
            "trained": False,
            "routings": ["causal"],
            "evaluated": [],
        },
        {"router": "maxscore", "seed": 42, "trained": True, "routings": both, "evaluated": []},
    ]
    order = [row["router"] for row in study._work_order(rows)]
    assert order == ["deepseek", "gshard", "maxscore"]


def test_retraining_gives_every_router_its_lm_eval_before_a_second_seed() -> None:
    both = ["causal", "train"]

    def row(router: str, seed: int, evaluated: list[str]) -> dict[str, object]:
        return dict(router=router, seed=seed, trained=True, routings=both, evaluated=evaluated)

    rows = [
        row("gshard", 42, []),
        row("gshard", 43, []),
        row("gshard-i", 42, []),
        row("gshard-i", 44, both),  # complete: gshard-i needs no retraining first
        row("maxscore-i", 42, []),
        row("maxscore-i", 43, ["causal"]),  # incomplete: maxscore-i is not covered yet
        row("sbase", 42, []),
    ]
    order = [(r["router"], r["seed"]) for r in study._work_order(rows)]
    assert order[:3] == [("gshard", 42), ("maxscore-i", 42), ("sbase", 42)]
    assert order[3:] == [("gshard", 43), ("gshard-i", 42), ("gshard-i", 44), ("maxscore-i", 43)]


def test_lm_eval_starts_only_when_its_shortest_recorded_time_fits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import maxscore.evaluation.runner

    results = tmp_path / "results"
    _write_run(results, "gshard", 42, [3.0, 3.1])  # its causal lm-eval took 80 s
    _write_run(results, "maxscore", 42, [3.0, 3.1])  # its causal lm-eval took 50 s
    for router, seconds in (("gshard", 80.0), ("maxscore", 50.0)):
        path = results / "raw" / router / "seed-42" / "eval_causal.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "seconds": seconds}))
    _write_run(results, "gshard", 43, [3.0, 3.1])
    (results / "raw" / "gshard" / "seed-43" / "eval_causal.json").unlink()
    assert study.shortest_eval_s(results, "gshard", "causal") == 80.0  # its own router's
    assert study.shortest_eval_s(results, "gshard-s", "causal") == 50.0  # any router's
    assert study.shortest_eval_s(results, "gshard", "train") == 0.0  # none recorded
    calls: list[str] = []

    def fake_evaluate_model(*args: object, routing: str, **kwargs: object) -> object:
        calls.append(routing)
        raise RuntimeError("stop here")

    monkeypatch.setattr(maxscore.evaluation.runner, "evaluate_model", fake_evaluate_model)
    config = StudyConfig(routers=("gshard",))
    # 60 s left: less than gshard's 80 s, so its causal lm-eval does not start
    study.evaluate_run(config, "gshard", 43, tmp_path / "runs", results, time.time() + 60)
    assert calls == []
    with pytest.raises(RuntimeError, match="stop here"):
        study.evaluate_run(config, "gshard", 43, tmp_path / "runs", results, time.time() + 100)
    assert calls == ["causal"]


def test_negligible_gain_verdicts() -> None:
    """Negligible-gain claims need the whole t interval inside ±0.01 (or on the losing side):
    non-significance alone is not equivalence."""

    def gains(*values: float) -> dict[str, object]:
        return {"mean": sum(values) / len(values), "per_seed": dict(enumerate(values))}

    verdict = study_report.negligible_verdict
    assert verdict(gains(0.001, 0.002, 0.0, 0.001)) == "reproduces (within ±0.01)"
    assert verdict(gains(0.02, 0.021, 0.019)).startswith("does not reproduce")
    assert "worse than GShard" in verdict(gains(-0.02, -0.021, -0.019))
    # a tiny mean with a wide interval (2 seeds far apart) is inconclusive, not "negligible"
    assert verdict(gains(0.03, -0.028)) == "inconclusive"
    assert verdict(gains(0.001)).startswith("inconclusive")  # one seed
    assert verdict(None) == "pending"
