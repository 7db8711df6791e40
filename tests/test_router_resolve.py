"""Resolving a router: one path for every entry point, and options without effect refused."""

from __future__ import annotations

from dataclasses import FrozenInstanceError

import pytest

from maxscore.cli import main
from maxscore.models import LlamaMoEConfig
from maxscore.moe import MoE
from maxscore.routing import ROUTER_PRESETS, RouterConfig, build_router
from maxscore.routing.resolve import (
    RouterSizes,
    ineffective_options,
    resolve_router,
    strategy_options,
)
from maxscore.routing.strategies import ASSIGNMENT_STRATEGIES

SIZES = RouterSizes(hidden_size=16, num_experts=8, top_k=2)

# (preset, option, value): an option the preset's strategy never reads.
WITHOUT_EFFECT = [
    ("dropless", "capacity_factor", 2.0),
    ("dropless", "min_capacity", 4),
    ("deepseek", "drop_policy", "score"),
    ("gshard", "flow_method", "exact"),
    ("gshard", "sinkhorn_iterations", 20),
    ("sbase", "drop_policy", "score"),
    ("maxscore", "num_expert_groups", 2),
    ("expert-choice", "topk_groups", 1),
    ("gshard", "group_size", 64),  # group="batch"
]


@pytest.mark.parametrize(("preset", "option", "value"), WITHOUT_EFFECT)
def test_an_option_without_effect_is_refused_with_what_to_do(
    preset: str, option: str, value: object
) -> None:
    if option == "topk_groups":  # needs a matching num_expert_groups to be a valid value
        overrides = {"num_expert_groups": 2, option: value}
    else:
        overrides = {option: value}
    with pytest.raises(ValueError, match="has no effect") as err:
        resolve_router(preset, overrides)
    message = str(err.value)
    assert any(f"{name}=" in message for name in overrides) and "remove it" in message
    # every entry point refuses it the same way
    with pytest.raises(ValueError, match="has no effect"):
        build_router(preset, 16, 8, 2, **overrides)
    with pytest.raises(ValueError, match="has no effect"):
        MoE(16, 8, 2, router=preset, **overrides)
    with pytest.raises(ValueError, match="has no effect"):
        LlamaMoEConfig(
            vocab_size=64,
            hidden_size=16,
            num_attention_heads=2,
            router=preset,
            router_config=overrides,
        )


def test_the_refusal_names_the_strategies_that_use_the_option() -> None:
    with pytest.raises(ValueError) as err:
        resolve_router("dropless", {"capacity_factor": 1.25})
    assert "'dropless' strategy does not use it" in str(err.value)
    assert "min-cost-flow" in str(err.value) and "topk" in str(err.value)
    with pytest.raises(ValueError, match="only group='tokens'"):
        resolve_router("maxscore", {"group_size": 128})


@pytest.mark.parametrize(("preset", "option", "value"), WITHOUT_EFFECT)
def test_an_option_that_changes_nothing_or_has_an_effect_is_accepted(
    preset: str, option: str, value: object
) -> None:
    base = ROUTER_PRESETS[preset].config
    assert resolve_router(preset, {option: getattr(base, option)}) == base  # no change
    users = [name for name, spec in ASSIGNMENT_STRATEGIES.items() if option in spec.options]
    strategy = users[0] if users else "topk"
    overrides = {"strategy": strategy, option: value}
    if option == "group_size":
        overrides["group"] = "tokens"
    if option == "topk_groups":
        overrides["num_expert_groups"] = 2
    config = resolve_router(preset, overrides, SIZES)
    assert getattr(config, option) == value


def test_every_preset_resolves_and_uses_the_options_it_sets() -> None:
    for name, preset in ROUTER_PRESETS.items():
        assert resolve_router(name) is preset.config
        unused = ineffective_options(preset.config)
        defaults = RouterConfig()
        for option in unused:  # a preset never sets an option its router ignores
            assert getattr(preset.config, option) == getattr(defaults, option), (name, option)
    assert strategy_options() == {
        "capacity_factor",
        "min_capacity",
        "drop_policy",
        "sinkhorn_iterations",
        "flow_method",
        "num_expert_groups",
        "topk_groups",
    }


def test_resolved_configs_are_frozen_and_checked_when_made() -> None:
    config = resolve_router("gshard")
    with pytest.raises(FrozenInstanceError):
        config.capacity_factor = 2.0  # type: ignore[misc]
    with pytest.raises(ValueError, match="drop_policy must be one of 'position', 'score'"):
        RouterConfig(drop_policy="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        RouterConfig(capacity_factor=0.0)
    with pytest.raises(TypeError, match="preset name"):
        resolve_router(3)  # type: ignore[arg-type]
    # saved fields (a mapping) resolve as they are
    saved = resolve_router("deepseek", {"aux_loss_coef": 0.5}).to_dict()
    assert resolve_router(saved) == resolve_router("deepseek", {"aux_loss_coef": 0.5})


def test_sizes_are_checked_with_the_strategy_setup() -> None:
    with pytest.raises(ValueError, match="top_k=9 exceeds num_experts=8"):
        RouterSizes(16, 8, 9)
    with pytest.raises(ValueError, match="not divisible by num_expert_groups"):
        resolve_router("deepseek", sizes=RouterSizes(16, 12, 2))
    assert resolve_router("dense", sizes=SIZES).is_dense  # no router, nothing to fit


def test_cli_refuses_an_option_without_effect_before_the_run_directory(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    argv = ["train", "--router", "dropless", "--router-option", "capacity_factor=2"]
    assert main([*argv, "--output-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "capacity_factor=2 has no effect" in err[0], err
    assert not run.exists()
    out = tmp_path / "cmp"
    argv = ["compare", "--routers", "gshard,dropless", "--router-option", "drop_policy=score"]
    assert main([*argv, "--output-dir", str(out)]) == 2
    assert "drop_policy='score' has no effect" in capsys.readouterr().err
    assert not out.exists()
