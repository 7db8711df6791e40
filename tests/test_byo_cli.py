"""The bring-your-own-MoE commands end to end on tiny local checkpoints (CPU).

``maxscore train --model <Mixtral checkpoint> --router maxscore``, then ``eval``, ``analyze`` and
``export`` on the result; ``compare`` with the family's own routing; ``upcycle`` of a dense
Llama checkpoint, then training it.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from byo_helpers import batch, save_family_checkpoint, save_text, save_tiny_tokenizer
from maxscore.cli import main
from maxscore.models import LlamaMoEForCausalLM

# One xdist worker runs this module, so its module-scoped fixtures are set up once.
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.xdist_group("test_byo_cli"),
]

SMALL = [
    "--seq-len", "16", "--batch-size", "2", "--max-steps", "3", "--logging-steps", "1",
    "--eval-steps", "0", "--save-steps", "0", "--max-eval-blocks", "2", "--quiet",
    "--report-to", "none",
]  # fmt: skip


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("byo")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_tiny_tokenizer(save_family_checkpoint("mixtral", root / "mixtral"))
        save_tiny_tokenizer(save_family_checkpoint("llama", root / "llama"))
    save_text(root / "data.txt")
    return root


@pytest.fixture(scope="module")
def finetuned(workspace: Path) -> Path:
    run = workspace / "run"
    argv = [
        "train", "--model", str(workspace / "mixtral"), "--router", "gshard",
        "--dataset", str(workspace / "data.txt"), "--output-dir", str(run), *SMALL,
    ]  # fmt: skip
    assert main(argv) == 0
    return run


def test_train_fine_tunes_a_family_checkpoint(finetuned: Path) -> None:
    checkpoint = finetuned / "checkpoint-3"
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["model_type"] == "maxscore_llama_moe"
    assert (config["router"], config["source_family"]) == ("gshard", "mixtral")
    assert (checkpoint / "tokenizer.json").is_file()  # the checkpoint's own tokenizer
    # The SoftTopk t schedule follows the run (1/6 of 3 steps), in the trained model too.
    resolved = json.loads((finetuned / "config.json").read_text())["resolved"]
    steps = resolved["temperature_schedule"]["steps"]
    assert steps == round(3 / 6) and config["router_config"]["temperature"]["steps"] == steps
    summary = json.loads((finetuned / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["eval_loss"] > 0
    # The fine-tuned weights moved away from the original ones.
    tuned = LlamaMoEForCausalLM.from_pretrained(checkpoint)
    original = AutoModelForCausalLM.from_pretrained(finetuned.parent / "mixtral")
    assert not torch.equal(tuned.lm_head.weight, original.lm_head.weight)


def test_maxscore_router_trains_a_family_checkpoint(workspace: Path) -> None:
    argv = [
        "train", "--model", str(workspace / "mixtral"), "--router", "maxscore",
        "--router-option", 'flow_method="exact"', "--dataset", str(workspace / "data.txt"),
        "--output-dir", str(workspace / "run-maxscore"), "--no-save-final", *SMALL,
    ]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads((workspace / "run-maxscore" / "summary.json").read_text())
    assert summary["steps"] == 3


def test_analyze_and_eval_work_on_the_result(finetuned: Path, tmp_path: Path) -> None:
    out = tmp_path / "analysis"
    argv = ["analyze", str(finetuned), "--checkpoint", "--max-blocks", "2", "--output", str(out)]
    assert main(argv) == 0
    assert (out / "analysis.json").is_file()
    pytest.importorskip("lm_eval")
    ev = tmp_path / "eval"
    argv = [
        "eval", str(finetuned / "checkpoint-3"), "--tasks", "piqa", "--limit", "2",
        "--batch-size", "2", "--device", "cpu", "--output", str(ev),
    ]  # fmt: skip
    assert main(argv) == 0
    assert (ev / "eval_results.json").is_file()


def test_export_writes_the_family_format(finetuned: Path, tmp_path: Path) -> None:
    out = tmp_path / "exported"
    assert main(["export", str(finetuned / "checkpoint-3"), str(out)]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(exported).__name__ == "MixtralForCausalLM"
    tuned = LlamaMoEForCausalLM.from_pretrained(finetuned / "checkpoint-3").eval()
    ids = batch()
    with torch.no_grad():
        assert (exported(ids).logits - tuned(ids).logits).abs().max().item() <= 1e-5
    assert (out / "tokenizer.json").is_file()


def test_export_refusal_is_a_clear_error(finetuned: Path, tmp_path: Path, capsys) -> None:
    # sigmoid routing: Mixtral cannot express it
    model = LlamaMoEForCausalLM.from_pretrained(finetuned / "checkpoint-3", router="deepseek-v3")
    model.save_pretrained(tmp_path / "ckpt")
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2
    assert "sigmoid" in capsys.readouterr().err


def test_compare_with_the_family_routing(workspace: Path) -> None:
    out = workspace / "cmp"
    argv = [
        "compare", "--model", str(workspace / "mixtral"), "--routers", "native,gshard",
        "--dataset", str(workspace / "data.txt"), "--output-dir", str(out),
        "--no-save-final", *SMALL,
    ]  # fmt: skip
    assert main(argv) == 0
    assert "| native |" in (out / "comparison.md").read_text()


def test_upcycle_then_train(workspace: Path) -> None:
    moe = workspace / "llama-moe"
    argv = [
        "upcycle", str(workspace / "llama"), str(moe), "--num-experts", "4", "--top-k", "2",
        "--router", "dropless",
    ]  # fmt: skip
    assert main(argv) == 0
    dense = AutoModelForCausalLM.from_pretrained(workspace / "llama").eval()
    upcycled = LlamaMoEForCausalLM.from_pretrained(moe).eval()
    ids = batch()
    with torch.no_grad():  # experts are copies and weights renormalised: the dense function
        assert (dense(ids).logits - upcycled(ids).logits).abs().max().item() <= 1e-5
    argv = [
        "train", "--model", str(moe), "--router", "maxscore", "--router-option",
        'flow_method="exact"', "--dataset", str(workspace / "data.txt"),
        "--output-dir", str(workspace / "run-upcycled"), "--no-save-final", *SMALL,
    ]  # fmt: skip
    assert main(argv) == 0


def test_bad_model_is_a_clear_error(tmp_path: Path, capsys) -> None:
    assert main(["train", "--model", str(tmp_path / "nothing"), "--output-dir", str(tmp_path)]) == 2
    assert "unknown model preset" in capsys.readouterr().err
    code = main(["upcycle", str(tmp_path / "nothing"), str(tmp_path / "o"), "--num-experts", "4"])
    assert code == 2
