"""The SoftTopk t schedule follows the run: 1/6 of its optimizer steps by default, the paper's
30k with ``--recipe paper``, an explicit length when given, the stored length on resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from maxscore.cli import build_parser, config_from_args
from maxscore.routing.config import TemperatureScheduleConfig
from maxscore.routing.resolve import resolve_router
from maxscore.training import TrainConfig, apply_recipe, prepare, train
from maxscore.training.config import ConfigError
from maxscore.training.temperature import PAPER_TEMPERATURE_FRACTION, resolve_temperature
from test_training import small_config


def resolved(config: TrainConfig, total: int) -> tuple[int, str]:
    r = resolve_temperature(config, resolve_router(config.router), total, None)
    return r.steps, r.source


def test_length_follows_the_run_unless_given() -> None:
    assert pytest.approx(1 / 6) == PAPER_TEMPERATURE_FRACTION
    assert resolved(TrainConfig(), 400) == (67, "fraction")  # round(400 / 6)
    assert resolved(TrainConfig(temperature_fraction=0.5), 400) == (200, "fraction")
    assert resolved(TrainConfig(temperature_steps=123), 400) == (123, "explicit")
    overridden = TrainConfig(router_overrides={"temperature": {"start": 4.0, "steps": 9}})
    router = resolve_router("maxscore", {"temperature": {"start": 4.0, "steps": 9}})
    r = resolve_temperature(overridden, router, 400, None)
    assert (r.steps, r.source, r.start) == (9, "explicit", 4.0)
    # The layer used alone keeps the documented default.
    assert TemperatureScheduleConfig().steps == 30_000
    with pytest.raises(ConfigError, match="temperature_steps"):
        TrainConfig(temperature_steps=-1)
    with pytest.raises(ConfigError, match="temperature_fraction"):
        TrainConfig(temperature_fraction=1.5)


def test_recipes_paper_and_paper_shape() -> None:
    paper = apply_recipe(TrainConfig(recipe="paper"))
    assert resolved(paper, paper.total_steps()) == (30_000, "explicit")
    shape = apply_recipe(TrainConfig(recipe="paper-shape", max_steps=360, lr=6e-4), {"lr"})
    assert shape.lr == 6e-4 and shape.model == "tiny"  # the user's model and lr stay
    assert (shape.adam_beta1, shape.adam_beta2, shape.adam_eps) == (0.9, 0.95, 1e-6)
    assert shape.weight_decay == 0.1 and shape.lr_schedule == "wsd"
    assert shape.warmup_and_decay() == (4, 12)  # 2k and 6k of 180k, scaled to 360 steps
    assert resolved(shape, 360) == (60, "fraction")


def test_cli_flags_reach_the_config() -> None:
    parser = build_parser()
    args = parser.parse_args(["train", "--temperature-steps", "50", "--recipe", "paper-shape"])
    cfg = config_from_args(args)
    assert cfg.temperature_steps == 50 and cfg.recipe == "paper-shape"
    args = parser.parse_args(["train", "--temperature-fraction", "0.25"])
    assert config_from_args(args).temperature_fraction == 0.25


def test_resume_keeps_the_stored_length(tmp_path: Path) -> None:
    """A run of 12 steps anneals over 2; resumed with a budget of 24 it still anneals over 2."""
    cfg = small_config(tmp_path, max_steps=12, save_steps=6)
    train(cfg)
    stored = json.loads((tmp_path / "run" / "config.json").read_text())
    assert stored["resolved"]["temperature_schedule"]["steps"] == 2
    longer = TrainConfig(**{**cfg.to_dict(), "max_steps": 24, "resume": True})
    run = prepare(longer)
    assert run.resume_from is not None
    assert (run.temperature.steps, run.temperature.source) == (2, "stored")
    assert run.model_config.router_config.temperature.steps == 2
    # A fresh run of 24 steps would anneal over 4.
    fresh = prepare(
        TrainConfig(**{**cfg.to_dict(), "max_steps": 24, "output_dir": str(tmp_path / "b")})
    )
    assert (fresh.temperature.steps, fresh.temperature.source) == (4, "fraction")
