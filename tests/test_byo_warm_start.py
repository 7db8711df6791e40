"""A router swap on a pretrained model leaves it unchanged at step 0 (warm_start.py's rule).

Converted and upcycled weights were trained under softmax weights, so a SoftTopk preset starts
its ``t`` schedule at 0: in evaluation the converted model's logits equal the family routing's,
in training too wherever MaxScore's assignment agrees with the family's top-k (here: every
token, capacity large enough), and it exports at step 0. An explicit start wins; a model built
from scratch keeps the preset's 3 -> 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from byo_helpers import batch, family_model, save_family_checkpoint, save_text, save_tiny_tokenizer
from maxscore.models import LlamaMoEConfig
from maxscore.models.convert import convert_model, load_pretrained, to_family_model
from maxscore.models.upcycle import upcycle_model
from maxscore.training.config import TrainConfig

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SOFTTOPK = ["maxscore", "maxscore-i", "gshard-s"]


def _start(model: torch.nn.Module) -> float:
    return model.config.router_config.temperature.start


def _logits(model: torch.nn.Module, ids: torch.Tensor, training: bool) -> torch.Tensor:
    model.train(training)
    torch.manual_seed(0)
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("router", SOFTTOPK)
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe"])
def test_a_softtopk_router_leaves_a_converted_model_unchanged(family: str, router: str) -> None:
    original = family_model(family)
    native = convert_model(original, router="native")
    # Capacity for every token's top-k: the assignment agrees with the family's for all tokens.
    e, k = native.config.num_experts, native.config.num_experts_per_tok
    swapped = convert_model(original, router=router, router_config={"capacity_factor": e / k})
    assert _start(swapped) == 0.0
    ids = batch(length=12)
    for training in (False, True):
        diff = (_logits(swapped, ids, training) - _logits(native, ids, training)).abs().max()
        assert diff.item() <= 1e-6, (family, router, training)
    to_family_model(swapped.eval())  # exports at step 0 (t is already 0)


def test_an_explicit_start_wins_and_changes_the_model() -> None:
    """The rule matters: with the paper's t = 3 the same swap moves the eval logits."""
    original = family_model("mixtral")
    native = convert_model(original, router="native")
    boosted = convert_model(
        original, router="maxscore", router_config={"temperature": {"start": 3.0}}
    )
    assert _start(boosted) == 3.0
    ids = batch(length=12)
    assert (_logits(boosted, ids, False) - _logits(native, ids, False)).abs().max() > 1e-3


def test_upcycled_and_swapped_checkpoints_start_at_zero(tmp_path: Path) -> None:
    upcycled = upcycle_model(family_model("llama"), num_experts=4, top_k=2, router="maxscore")
    assert _start(upcycled) == 0.0
    # A converted checkpoint trained with gshard, given maxscore: a swap, so t starts at 0.
    convert_model(family_model("qwen3_moe"), router="gshard").save_pretrained(tmp_path / "ft")
    assert _start(load_pretrained(str(tmp_path / "ft"), router="maxscore")) == 0.0
    # A model built from scratch keeps the preset's schedule.
    scratch = LlamaMoEConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4
    )
    assert scratch.router_config.temperature.start == 3.0


def test_a_fine_tuning_run_resolves_its_schedule_from_zero(tmp_path: Path) -> None:
    from maxscore.training.run import prepare

    checkpoint = save_tiny_tokenizer(save_family_checkpoint("qwen3_moe", tmp_path / "qwen"))
    common = {
        "model": str(checkpoint),
        "router": "maxscore",
        "dataset": str(save_text(tmp_path / "data.txt")),
        "seq_len": 16,
        "batch_size": 2,
        "max_steps": 12,
    }
    run = prepare(TrainConfig(**common, output_dir=str(tmp_path / "a")))
    run.run_dir_plan.release_lock()
    assert (run.temperature.start, run.temperature.end) == (0.0, 0.0)
    explicit = TrainConfig(
        **common,
        router_overrides={"temperature": {"start": 3.0}},
        output_dir=str(tmp_path / "b"),
    )
    run = prepare(explicit)
    run.run_dir_plan.release_lock()
    assert run.temperature.start == 3.0
