"""Routing analysis and reports: plotted numbers equal the run's statistics."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import matplotlib.image
import pytest
import torch
from PIL import Image

from maxscore.analysis import plots
from maxscore.analysis.analyze import analyze
from maxscore.analysis.commands import add_analyze_parser, add_report_parser
from maxscore.analysis.report import ReportError, combined_report
from maxscore.analysis.runs import RunError, load_run
from maxscore.evaluation.results import write_results

LAYERS = [1, 2]  # MoE decoder layers (layer 0 dense, as with first_k_dense=1)
EXPERTS = 4
K = 2


def routing_block(rng: random.Random) -> dict[str, Any]:
    """One ``routing`` object as the trainer logs it (per MoE layer lists)."""

    def row(n: int, lo: float, hi: float) -> list[float]:
        return [rng.uniform(lo, hi) for _ in range(n)]

    return {
        "dropped_by_rank": [row(K, 0.0, 0.3) for _ in LAYERS],
        "rerouted_by_rank": [row(K, 0.0, 0.1) for _ in LAYERS],
        "mean_affinity_by_rank": [sorted(row(K, 0.1, 0.6), reverse=True) for _ in LAYERS],
        "load_over_capacity": [row(EXPERTS, 0.5, 1.5) for _ in LAYERS],
        "tokens_per_expert": [row(EXPERTS, 10, 60) for _ in LAYERS],
        "load_imbalance": row(len(LAYERS), 1.0, 2.0),
        "unused_experts": [0.0 for _ in LAYERS],
        "aux_loss": row(len(LAYERS), 0.0, 0.1),
        "z_loss": [0.0 for _ in LAYERS],
        "moe_layers": list(LAYERS),
    }


def make_run(path: Path, router: str, seed: int) -> Path:
    """A run directory with a hand-written metrics.jsonl in the trainer's format."""
    rng = random.Random(seed)
    path.mkdir(parents=True)
    (path / "config.json").write_text(
        json.dumps({"train": {"router": router, "model": "tiny"}, "model": {"router": router}})
    )
    records: list[dict[str, Any]] = []
    for step in (10, 20, 30):
        records.append(
            {
                "type": "train",
                "step": step,
                "loss": 10.0 - step / 10 + rng.random(),
                "tokens_per_s": rng.uniform(1000, 2000),
                "peak_memory_gb": rng.uniform(1, 3),
                "routing": routing_block(rng),
            }
        )
        records.append({"type": "eval", "step": step, "eval_loss": 9.5 - step / 10})
    records.append({"type": "end", "step": 30, "train_loss": 8.0})
    records.append({"type": "final", "step": 30, "tokens_per_s": 1500.0, "peak_memory_gb": 2.5})
    lines = [json.dumps(r) for r in records]
    lines.insert(2, '{"type": "train", "step": 15, "loss": 9.')  # a line cut short by a crash
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def runs(tmp_path: Path) -> list[Path]:
    return [
        make_run(tmp_path / "gshard", "gshard", 0),
        make_run(tmp_path / "maxscore", "maxscore", 1),
    ]


def last_routing(run: Path) -> dict[str, Any]:
    """The ``routing`` object of the last training log (the end-of-run summary has its own)."""
    lines = run.joinpath("metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.endswith("}")]
    return [r for r in records if r.get("type") == "train" and r.get("routing")][-1]["routing"]


def flat(values: Any) -> list[float]:
    """Nested lists flattened (pytest.approx compares flat sequences only)."""
    if isinstance(values, list):
        return [x for v in values for x in flat(v)]
    return [float(values)]


def assert_png(path: Path) -> None:
    assert path.is_file() and path.suffix == ".png"
    with Image.open(path) as image:
        image.verify()
        assert image.format == "PNG"
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert pixels.std() > 0  # not a blank canvas


# ------------------------------------------------------------------------------------------------
# analyze
# ------------------------------------------------------------------------------------------------
def test_analyze_writes_valid_pngs_and_the_metrics_numbers(
    runs: list[Path], tmp_path: Path
) -> None:
    out = tmp_path / "analysis"
    result = analyze(runs, out, layer=2)
    assert set(result.figures) == {
        "dropped",
        "rerouted",
        "mean_affinity",
        "expert_load",
        "loss_curves",
        "throughput",
    }
    for path in result.figures.values():
        assert_png(path)
    data = json.loads((out / "analysis.json").read_text())
    for run in runs:
        name = run.name  # labels default to the router preset, here equal to the dir name
        expected = last_routing(run)
        got = data["runs"][name]["routing"]
        assert got["layers"] == LAYERS
        for key in (
            "dropped_by_rank",
            "rerouted_by_rank",
            "mean_affinity_by_rank",
            "load_over_capacity",
        ):
            assert flat(got["stats"][key]) == pytest.approx(flat(expected[key]))
        load = data["expert_load"]["runs"][name]
        layer_values = expected["load_over_capacity"][LAYERS.index(2)]
        assert load["sorted"] == pytest.approx(sorted(layer_values, reverse=True))
        assert load["mean"] == pytest.approx(sum(layer_values) / EXPERTS)
        assert (load["min"], load["max"]) == pytest.approx((min(layer_values), max(layer_values)))
        assert data["runs"][name]["throughput"]["tokens_per_s"] == 1500.0
    md = (out / "analysis.md").read_text()
    for figure in result.figures.values():
        assert f"]({figure.name})" in md
    for key in ("dropped_by_rank", "rerouted_by_rank"):
        drop = last_routing(runs[0])[key]
        assert f"| gshard | 1st | {drop[0][0] * 100:.2f} | {drop[1][0] * 100:.2f} |" in md


def test_plotted_bars_and_lines_equal_the_metrics(runs: list[Path]) -> None:
    """Read the numbers back from the matplotlib artists."""
    loaded = [load_run(r) for r in runs]
    snapshots = {run.name: run.routing_snapshot() for run in loaded}
    expected = {run.name: last_routing(path) for run, path in zip(loaded, runs, strict=True)}

    for figure_fn, key in (
        (plots.dropped_figure, "dropped_by_rank"),
        (plots.rerouted_figure, "rerouted_by_rank"),
        (plots.mean_affinity_figure, "mean_affinity_by_rank"),
    ):
        fig = figure_fn(snapshots)
        axes = fig.axes
        assert len(axes) == K
        for rank, ax in enumerate(axes):
            bars = {c.get_label(): [p.get_height() for p in c.patches] for c in ax.containers}
            assert set(bars) == set(expected)
            for name, values in expected.items():
                assert bars[name] == pytest.approx([layer[rank] for layer in values[key]])
            assert [t.get_text() for t in ax.get_xticklabels()] == [str(x) for x in LAYERS]
        plots.plt.close(fig)

    fig = plots.expert_load_figure(snapshots, layer=1)
    lines = {line.get_gid(): list(line.get_ydata()) for line in fig.axes[0].lines if line.get_gid()}
    for name, values in expected.items():
        assert lines[name] == pytest.approx(sorted(values["load_over_capacity"][0], reverse=True))
    plots.plt.close(fig)

    train = {run.name: run.train_loss() for run in loaded}
    val = {run.name: run.eval_loss() for run in loaded}
    fig = plots.loss_curves_figure(train, val)
    lines = {
        line.get_gid(): (list(line.get_xdata()), list(line.get_ydata()))
        for line in fig.axes[0].lines
    }
    for run, path in zip(loaded, runs, strict=True):
        records = [
            json.loads(x)
            for x in path.joinpath("metrics.jsonl").read_text().splitlines()
            if x.endswith("}")
        ]
        steps = [r["step"] for r in records if r["type"] == "train"]
        assert lines[f"{run.name}/train"] == (
            steps,
            pytest.approx([r["loss"] for r in records if r["type"] == "train"]),
        )
        assert lines[f"{run.name}/validation"][1] == pytest.approx(
            [r["eval_loss"] for r in records if r["type"] == "eval"]
        )
    plots.plt.close(fig)

    rows = {run.name: run.throughput() for run in loaded}
    fig = plots.throughput_figure(rows)
    speed, memory = ([p.get_height() for p in ax.patches] for ax in fig.axes)
    assert speed == [1500.0, 1500.0]  # the trainer's end-of-run mean ("final" record)
    for run, path in zip(loaded, runs, strict=True):
        records = [
            json.loads(x)
            for x in path.joinpath("metrics.jsonl").read_text().splitlines()
            if x.endswith("}")
        ]
        assert rows[run.name]["peak_memory_gb"] == max(
            r["peak_memory_gb"] for r in records if "peak_memory_gb" in r
        )
    assert memory == [rows[run.name]["peak_memory_gb"] for run in loaded]
    plots.plt.close(fig)


def test_a_compare_directory_stands_for_its_runs(runs: list[Path], tmp_path: Path) -> None:
    result = analyze([tmp_path], tmp_path / "out")  # the fixture's runs live in tmp_path
    assert set(result.data["runs"]) == {"gshard", "maxscore"}


def test_window_averages_the_last_logs(runs: list[Path]) -> None:
    run = load_run(runs[0])
    records = [r for r in run.records if r.get("routing")]
    snap = run.routing_snapshot(window=2)
    assert snap is not None and snap.step == 30 and snap.source == "metrics.jsonl steps 20-30"
    a, b = (r["routing"]["dropped_by_rank"] for r in records[-2:])
    assert flat(snap.stats["dropped_by_rank"]) == pytest.approx(
        [(x + y) / 2 for x, y in zip(flat(a), flat(b), strict=True)]
    )


def test_bad_input_errors(
    runs: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(RunError, match="run directory not found"):
        analyze([tmp_path / "missing"], tmp_path / "out")
    (tmp_path / "not-a-run").mkdir()
    with pytest.raises(RunError, match="not a run directory"):
        analyze([tmp_path / "not-a-run"], tmp_path / "out")
    with pytest.raises(RunError, match="layer 0 is not an MoE layer"):
        analyze(runs, tmp_path / "out", layer=0)
    parser = argparse.ArgumentParser(prog="maxscore")
    sub = parser.add_subparsers()
    add_analyze_parser(sub)
    add_report_parser(sub)
    args = parser.parse_args(
        ["analyze", str(tmp_path / "missing"), "--output", str(tmp_path / "o")]
    )
    assert args.func(args) == 2
    assert "run directory not found" in capsys.readouterr().err
    args = parser.parse_args(
        ["report", str(tmp_path / "not-a-run"), "--output", str(tmp_path / "r.md")]
    )
    assert args.func(args) == 2
    assert "no compare" in capsys.readouterr().err


def test_dense_run_without_routing_still_gets_loss_and_throughput(tmp_path: Path) -> None:
    run = tmp_path / "dense"
    run.mkdir()
    run.joinpath("metrics.jsonl").write_text(
        json.dumps(
            {"type": "train", "step": 1, "loss": 5.0, "tokens_per_s": 10.0, "peak_memory_gb": 1.0}
        )
        + "\n"
    )
    result = analyze([run], tmp_path / "out")
    assert set(result.figures) == {"loss_curves", "throughput"}
    assert any("no routing statistics" in note for note in result.notes)


# ------------------------------------------------------------------------------------------------
# checkpoint statistics
# ------------------------------------------------------------------------------------------------
def test_checkpoint_statistics_equal_the_models_own(tmp_path: Path) -> None:
    from maxscore.analysis.checkpoint_stats import checkpoint_snapshot
    from maxscore.data import load_default_tokenizer
    from maxscore.models import LlamaMoEForCausalLM, get_model_config

    torch.manual_seed(0)
    model = LlamaMoEForCausalLM(get_model_config("tiny", router="gshard", num_hidden_layers=2))
    run = tmp_path / "run"
    model.save_pretrained(run / "checkpoint-1")
    load_default_tokenizer().save_pretrained(run / "checkpoint-1")
    run.joinpath("config.json").write_text(json.dumps({"train": {"router": "gshard"}}))
    blocks = torch.randint(3, 32000, (3, 64), generator=torch.Generator().manual_seed(0))
    snap = checkpoint_snapshot(
        load_run(run), run / "checkpoint-1", blocks=blocks, batch_size=3, routing="train"
    )
    model.eval()
    for router_module in (m for m in model.modules() if hasattr(m, "strategy_for_mode")):
        router_module.config = replace(router_module.config, eval_routing="train")
    with torch.no_grad():
        model(input_ids=blocks)
    reference = [s for s in model.routing_statistics() if s]
    assert snap.layers == [0, 1]
    for key in (
        "dropped_by_rank",
        "rerouted_by_rank",
        "load_over_capacity",
        "mean_affinity_by_rank",
    ):
        assert flat(snap.stats[key]) == pytest.approx(
            flat([s[key].tolist() for s in reference]), rel=1e-5, abs=1e-6
        )
    assert max(snap.stats["dropped_by_rank"][0]) > 0  # capacity routing really dropped tokens


# ------------------------------------------------------------------------------------------------
# combined report
# ------------------------------------------------------------------------------------------------
def test_report_combines_compare_eval_and_analysis(runs: list[Path], tmp_path: Path) -> None:
    compare = tmp_path / "compare"
    compare.mkdir()
    plots.save_figure(
        plots.loss_curves_figure({"a": [(1, 2.0), (2, 1.5)]}, {}), compare / "loss_curves.png"
    )
    compare.joinpath("comparison.md").write_text(
        "# Router comparison\n\n| router | val loss |\n|---|---|\n| gshard | 9.1 |\n\n![loss curves](loss_curves.png)\n"
    )
    analysis_dir = runs[0] / "analysis"
    analyze(runs, analysis_dir)
    eval_dir = runs[0] / "eval"
    models = [
        {
            "name": "gshard",
            "metrics": {"piqa": {"acc": 0.61}, "arc_easy": {"acc": 0.40}},
            "routing": {"eval_routing": "causal"},
        },
        {
            "name": "maxscore",
            "metrics": {"piqa": {"acc": 0.63}, "arc_easy": {"acc": 0.42}},
            "routing": {"eval_routing": "causal"},
        },
    ]
    write_results(eval_dir, models, {"limit": None})
    out = tmp_path / "site" / "report.md"
    # A run directory brings its eval/ and analysis/ sub-directories.
    path = combined_report([compare, runs[0]], out)
    text = path.read_text()
    assert "## Router comparison" in text and "| gshard | 9.1 |" in text
    assert "| Model | ARC-e | PIQA | Avg. |" in text
    assert "| maxscore | 42.00 | 63.00 | 52.50 |" in text
    assert "## Routing analysis" in text and "### Dropped choices by rank" in text
    assert "### Rerouted choices by rank" in text
    images = [
        line.split("](")[1].rstrip(")") for line in text.splitlines() if line.startswith("![")
    ]
    assert len(images) == 7  # compare: 1; analysis: dropped, rerouted, affinity, load, loss, speed
    for image in images:
        assert_png((out.parent / image).resolve())
    with pytest.raises(ReportError, match="not found"):
        combined_report([tmp_path / "missing"], out)


# ------------------------------------------------------------------------------------------------
# end to end (slow: trains two routers for a few steps on the CPU)
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_train_analyze_eval_report_end_to_end(tmp_path: Path) -> None:
    from maxscore.evaluation.data import EvalDataUnavailableError, ensure_task_data
    from maxscore.evaluation.runner import evaluate_model
    from maxscore.training import TrainConfig, train

    run_dirs = []
    for router in ("gshard", "maxscore"):
        config = TrainConfig(
            model="tiny",
            model_overrides={"num_hidden_layers": 2},
            router=router,
            max_steps=4,
            logging_steps=2,
            eval_steps=2,
            save_steps=4,
            seq_len=64,
            batch_size=4,
            max_eval_blocks=4,
            report_to="none",
            quiet=True,
            output_dir=str(tmp_path / router),
        )
        train(config)
        run_dirs.append(tmp_path / router)
    result = analyze(run_dirs, tmp_path / "analysis", checkpoint=None)
    for path in result.figures.values():
        assert_png(path)
    for run in run_dirs:
        name = run.name
        got = result.data["runs"][name]["routing"]["stats"]["dropped_by_rank"]
        assert flat(got) == pytest.approx(flat(last_routing(run)["dropped_by_rank"]))
    measured = analyze(run_dirs[:1], tmp_path / "analysis-ckpt", checkpoint="latest", max_blocks=2)
    assert "checkpoint" in measured.data["runs"]["gshard"]["routing"]["source"]
    try:
        ensure_task_data(["piqa"])
    except EvalDataUnavailableError:
        pytest.skip("evaluation data unavailable")
    from maxscore.evaluation.results import write_results

    evals = [evaluate_model(run, "piqa", limit=2, device="cpu") for run in run_dirs]
    write_results(tmp_path / "eval", evals, {"limit": 2})
    report = combined_report([tmp_path / "eval", tmp_path / "analysis"], tmp_path / "report.md")
    text = report.read_text()
    assert "| gshard |" in text and "| maxscore |" in text and "PIQA" in text
