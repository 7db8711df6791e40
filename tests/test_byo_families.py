"""Bring your own MoE: Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE checkpoints as Llama-MoE models.

Every family: with its own routing the converted model's logits equal the original's (fp32,
1e-5), from memory and from a saved checkpoint; with other router presets it trains; and it
exports back to the family's format (round trip: same logits with the family's class).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config

from byo_helpers import VOCAB, batch, family_model, save_family_checkpoint
from maxscore.models import LlamaMoEConfig, LlamaMoEForCausalLM
from maxscore.models.convert import (
    FAMILIES,
    ConversionError,
    convert_model,
    export_pretrained,
    load_pretrained,
    to_family_model,
)
from maxscore.routing.router import Router

FAMILY_NAMES = sorted(FAMILIES)
TOLERANCE = 1e-5

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _routers(model: torch.nn.Module) -> list[Router]:
    return [m for m in model.modules() if isinstance(m, Router)]


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_native_routing_reproduces_the_original_logits(family: str, training: bool) -> None:
    original = family_model(family)
    ours = convert_model(original)
    ours.train(training)
    ids = batch()
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0  # right padding: both models see the same real tokens
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": mask}):
            want = original(ids, **kwargs).logits
            got = ours(ids, **kwargs).logits
            real = kwargs.get("attention_mask", torch.ones_like(ids)).bool()
            diff = (want - got)[real].abs().max().item()
            assert diff <= TOLERANCE, f"{family}: max |logit diff| {diff:.3g}"


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_checkpoint_directory_loads_with_native_routing(family: str, tmp_path: Path) -> None:
    save_family_checkpoint(family, tmp_path / family)
    original = AutoModelForCausalLM.from_pretrained(tmp_path / family).eval()
    ours = load_pretrained(str(tmp_path / family), router="native").eval()
    assert ours.config.source_family == family
    ids = batch()
    with torch.no_grad():
        diff = (original(ids).logits - ours(ids).logits).abs().max().item()
    assert diff <= TOLERANCE


@pytest.mark.parametrize(
    ("family", "router"),
    [
        ("mixtral", "maxscore"),
        ("qwen2_moe", "maxscore"),
        ("qwen3_moe", "gshard"),
        ("olmoe", "sbase"),
    ],
)
def test_converted_model_trains_with_any_router(family: str, router: str) -> None:
    router_config = {"flow_method": "exact"} if router == "maxscore" else None
    original = family_model(family)
    model = convert_model(original, router=router, router_config=router_config)
    cfg = model.config.router_config
    assert model.config.router == router
    assert all(r.config.strategy == cfg.strategy for r in _routers(model))
    # The family's weighting of expert outputs (norm_topk_prob) is kept under any router.
    family_weighting = FAMILIES[family].router_fields(original.config)["normalize_weights"]
    assert cfg.normalize_weights == family_weighting
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = batch(length=16, size=4)
    losses = []
    for _ in range(4):
        out = model(ids, labels=ids)
        assert out.aux_loss is not None and torch.isfinite(out.loss)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model.advance_router_schedule()
        losses.append(out.loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_export_round_trip_gives_the_same_logits(family: str, tmp_path: Path) -> None:
    """Fine-tune one step with gshard, export, load with the family's own class: same logits."""
    model = convert_model(family_model(family), router="gshard")
    model.train()
    ids = batch(length=12, size=2)
    model(ids, labels=ids).loss.backward()
    with torch.no_grad():
        for param in model.parameters():
            if param.grad is not None:
                param.sub_(0.05 * param.grad)
    model.eval()
    export_pretrained(model, tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(reloaded).__name__ == FAMILIES[family].model_class
    with torch.no_grad():
        diff = (reloaded(ids).logits - model(ids).logits).abs().max().item()
    assert diff <= TOLERANCE


def test_export_from_a_saved_checkpoint(tmp_path: Path) -> None:
    model = convert_model(family_model("qwen2_moe"), router="gshard-i").eval()
    model.save_pretrained(tmp_path / "ckpt")
    export_pretrained(tmp_path / "ckpt", tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = batch()
    with torch.no_grad():
        assert (reloaded(ids).logits - model(ids).logits).abs().max().item() <= TOLERANCE


def test_export_refuses_routing_the_family_cannot_express() -> None:
    # A SoftTopk schedule started above 0 on purpose (the default starts a converted model at 0).
    boosted = convert_model(
        family_model("mixtral"), router="maxscore", router_config={"temperature": {"start": 3.0}}
    )
    with pytest.raises(ConversionError, match="SoftTopk scale t"):
        to_family_model(boosted)
    sigmoid = convert_model(family_model("olmoe"), router="deepseek-v3")
    with pytest.raises(ConversionError, match="affinity operator is 'sigmoid'"):
        to_family_model(sigmoid)
    assert to_family_model(sigmoid, allow_routing_change=True).config.model_type == "olmoe"
    # Once the SoftTopk schedule has ended (t = 0) maxscore routes like the softmax in eval.
    boosted.advance_router_schedule(10**6)
    assert to_family_model(boosted).config.model_type == "mixtral"
    native = LlamaMoEForCausalLM(
        LlamaMoEConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
    )
    with pytest.raises(ConversionError, match="not converted"):
        to_family_model(native)


def test_unsupported_families_are_refused_with_the_reason(tmp_path: Path) -> None:
    config = DeepseekV3Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1)
    config.save_pretrained(tmp_path / "dsv3")
    with pytest.raises(ConversionError, match="multi-head latent attention"):
        load_pretrained(str(tmp_path / "dsv3"))
    save_family_checkpoint("llama", tmp_path / "llama")
    with pytest.raises(ConversionError, match="maxscore upcycle"):
        load_pretrained(str(tmp_path / "llama"))
    with pytest.raises(ConversionError, match="cannot read a model config"):
        load_pretrained(str(tmp_path / "missing"))


# --------------------------------------------------------------------------------------------------
# from_pretrained(..., router=..., router_config=...) changes the routing
# --------------------------------------------------------------------------------------------------


def _tiny(router: str) -> LlamaMoEForCausalLM:
    torch.manual_seed(0)
    return LlamaMoEForCausalLM(
        LlamaMoEConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
            router=router,
            # The exact solver for the flow routers (fast on a CPU); the others have no solver.
            router_config={"capacity_factor": 1.5}
            | ({"flow_method": "exact"} if router == "maxscore" else {}),
        )
    )


def test_from_pretrained_router_really_changes_the_routing(tmp_path: Path) -> None:
    _tiny("maxscore").save_pretrained(tmp_path / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", router="gshard")
    assert model.config.router == "gshard"
    for router in _routers(model):
        assert (router.config.operator, router.config.strategy) == ("softmax", "topk")
        assert router.config.group == "batch"  # the new preset's routing group
        assert router.config.capacity_factor == 1.5  # the checkpoint's own override is kept
    # Saved again, it reloads as gshard.
    model.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    assert {r.config.strategy for r in _routers(again)} == {"topk"}


def test_from_pretrained_router_config_really_changes_the_routing(tmp_path: Path) -> None:
    _tiny("gshard").save_pretrained(tmp_path / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt", router_config={"capacity_factor": 2.0, "aux_loss_coef": 0.5}
    )
    for router in _routers(model):
        assert router.config.capacity_factor == 2.0
        assert router.config.aux_loss_coef == 0.5
        assert router.config.strategy == "topk"
    assert model.config.router_aux_loss_coef == 0.5


def test_converted_checkpoint_keeps_family_weighting_under_a_new_router(tmp_path: Path) -> None:
    convert_model(family_model("mixtral")).save_pretrained(tmp_path / "mix")
    model = load_pretrained(str(tmp_path / "mix"), router="gshard")
    cfg = model.config.router_config
    assert (cfg.strategy, cfg.normalize_weights) == ("topk", True)
    assert model.config.source_family == "mixtral"
