"""``--deterministic``: torch's deterministic settings during a run and restored after it, the
flag on the command line and in ``config.json``, identical same-seed reruns (CPU; GPU below),
a loud error for an operation without a deterministic implementation, and with ``--compile``.

Every run here is a few steps of a one-layer, 32-wide model on 16-token sequences.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from maxscore.cli import build_parser, config_from_args
from maxscore.training import ConfigError, TrainConfig, prepare, train
from maxscore.training import callbacks as callbacks_mod
from maxscore.training.callbacks import DeterministicAlgorithms, NondeterministicOperationError
from test_training import small_config as training_config


def small_config(tmp_path: Path, name: str = "run", **overrides: Any) -> TrainConfig:
    """``test_training.small_config`` in deterministic mode, 4 steps, no checkpoints."""
    base: dict[str, Any] = {"max_steps": 4, "save_steps": 0, "deterministic": True}
    return training_config(tmp_path, name, **{**base, **overrides})


def global_settings() -> dict[str, Any]:
    """The process-wide settings ``--deterministic`` changes."""
    import torch._inductor.config as inductor

    return {
        "algorithms": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "inductor": inductor.deterministic,
    }


DETERMINISTIC = {
    "algorithms": True,
    "warn_only": False,
    "cudnn_deterministic": True,
    "cudnn_benchmark": False,
    "cublas": ":4096:8",
}


@pytest.fixture
def previous_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Settings unlike deterministic mode's before the test, and torch's defaults after it."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.backends.cudnn.benchmark = True
    before = global_settings()
    try:
        yield before
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
        torch.backends.cudnn.benchmark = False
        import torch._inductor.config as inductor

        inductor.deterministic = False


class _SettingsLog(TrainerCallback):
    """The global settings at every step; raises at step ``fail_at`` (its own error, or
    ``operation()``'s)."""

    def __init__(self, fail_at: int = 0, operation: Any = None) -> None:
        self.seen: list[dict[str, Any]] = []
        self.fail_at = fail_at
        self.operation = operation

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.seen.append(global_settings())
        if state.global_step + 1 == self.fail_at:
            if self.operation is not None:
                self.operation()
            raise RuntimeError("a failing step")


# ------------------------------------------------------------------------------------------------
# the flag: config, command line, config.json
# ------------------------------------------------------------------------------------------------
def test_flag_on_the_command_line_and_in_the_config() -> None:
    assert TrainConfig().deterministic is False
    with pytest.raises(ConfigError, match="deterministic must be true or false"):
        TrainConfig(deterministic="yes")  # type: ignore[arg-type]
    parser = build_parser()
    for command in ("train", "compare"):
        assert config_from_args(parser.parse_args([command, "--deterministic"])).deterministic
        assert not config_from_args(
            parser.parse_args([command, "--no-deterministic"])
        ).deterministic
        assert not config_from_args(parser.parse_args([command])).deterministic
    assert TrainConfig.from_dict(TrainConfig(deterministic=True).to_dict()).deterministic


def test_settings_hold_during_training_and_are_restored(
    tmp_path: Path, previous_settings: dict[str, Any]
) -> None:
    log = _SettingsLog()
    result = train(small_config(tmp_path), [log])
    assert len(log.seen) == 4
    for seen in log.seen:
        assert {key: seen[key] for key in DETERMINISTIC} == DETERMINISTIC
    assert global_settings() == previous_settings
    stored = json.loads((result.run_dir / "config.json").read_text())
    assert stored["train"]["deterministic"] is True


def test_without_the_flag_nothing_changes(
    tmp_path: Path, previous_settings: dict[str, Any]
) -> None:
    log = _SettingsLog()
    train(small_config(tmp_path, deterministic=False), [log])
    assert all(seen == previous_settings for seen in log.seen)
    assert global_settings() == previous_settings


def test_settings_restored_when_training_fails(
    tmp_path: Path, previous_settings: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A user's deterministic-workspace value is kept, and a warn-only mode comes back after.
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    before = global_settings()
    log = _SettingsLog(fail_at=2)
    with pytest.raises(RuntimeError, match="a failing step"):
        train(small_config(tmp_path), [log])
    assert [seen["cublas"] for seen in log.seen] == [":16:8", ":16:8"]
    assert all(seen["algorithms"] and not seen["warn_only"] for seen in log.seen)
    assert global_settings() == before


def test_a_resumed_run_keeps_it(tmp_path: Path, previous_settings: dict[str, Any]) -> None:
    cfg = small_config(tmp_path, save_steps=2)
    with pytest.raises(RuntimeError, match="a failing step"):
        train(cfg, [_SettingsLog(fail_at=3)])  # after checkpoint-2
    log = _SettingsLog()
    result = train(replace(cfg, resume=True), [log])
    assert result.steps == 4 and len(log.seen) == 2
    assert all(seen["algorithms"] for seen in log.seen)
    assert json.loads((result.run_dir / "config.json").read_text())["train"]["deterministic"]
    assert global_settings() == previous_settings


# ------------------------------------------------------------------------------------------------
# reruns and failures
# ------------------------------------------------------------------------------------------------
def test_same_seed_reruns_are_identical(tmp_path: Path, previous_settings: dict[str, Any]) -> None:
    results = [train(small_config(tmp_path, f"run{i}", seed=7)) for i in range(2)]
    assert results[0].eval_loss is not None
    assert results[0].eval_loss == results[1].eval_loss
    assert results[0].train_loss == results[1].train_loss
    losses = [
        [
            json.loads(line)["loss"]
            for line in (r.run_dir / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["type"] == "train"
        ]
        for r in results
    ]
    assert len(losses[0]) == 2 and losses[0] == losses[1]
    weights = [load_file(str(r.final_checkpoint / "model.safetensors")) for r in results]
    for name, value in weights[0].items():
        assert torch.equal(value, weights[1][name]), name


def test_an_operation_without_a_deterministic_implementation_fails_loudly(
    tmp_path: Path, previous_settings: dict[str, Any]
) -> None:
    def put() -> None:  # put_ without accumulation has none, on any device
        torch.zeros(4).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))

    with pytest.raises(NondeterministicOperationError, match="drop --deterministic") as caught:
        train(small_config(tmp_path), [_SettingsLog(fail_at=2, operation=put)])
    assert "put_" in str(caught.value)
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert global_settings() == previous_settings
    # Without the flag the same operation runs.
    with pytest.raises(RuntimeError, match="a failing step"):
        train(small_config(tmp_path, "plain", deterministic=False), [_SettingsLog(2, put)])


def test_a_workspace_setting_that_is_not_deterministic_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(ConfigError, match="CUBLAS_WORKSPACE_CONFIG"):
        prepare(small_config(tmp_path))
    assert not (tmp_path / "run").exists()
    prepare(small_config(tmp_path, deterministic=False))  # only deterministic mode cares


# ------------------------------------------------------------------------------------------------
# with --compile
# ------------------------------------------------------------------------------------------------
def test_compile_sets_inductors_deterministic_mode_and_restores_it(
    previous_settings: dict[str, Any],
) -> None:
    """torch 2.13 (and 2.11, on the GPU machines) has ``torch._inductor.config.deterministic``:
    set while the run is installed, its previous value back after."""
    import torch._inductor.config as inductor

    assert hasattr(inductor, "deterministic")
    DeterministicAlgorithms.check(compile=True)
    mode = DeterministicAlgorithms(True, compile=True)
    mode.install()
    try:
        assert mode.active and inductor.deterministic
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        mode.uninstall()
    assert not mode.active
    assert global_settings() == previous_settings


def test_compile_without_inductors_deterministic_mode_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torch whose inductor has no deterministic mode: --deterministic --compile is refused
    before the run directory is touched; either flag alone is fine."""
    monkeypatch.setattr(callbacks_mod, "_inductor_config", lambda: SimpleNamespace())
    with pytest.raises(ConfigError, match="--deterministic with --compile"):
        prepare(small_config(tmp_path, compile=True))
    assert not (tmp_path / "run").exists()
    prepare(small_config(tmp_path, compile=False))
    prepare(small_config(tmp_path, compile=True, deterministic=False))


# ------------------------------------------------------------------------------------------------
# on a GPU
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("router", ["gshard", "maxscore"])
def test_gpu_reruns_have_the_same_validation_loss(
    tmp_path: Path, router: str, previous_settings: dict[str, Any]
) -> None:
    """Two same-seed runs on CUDA (bf16, maxscore through the CUDA flow-solver kernel) end with
    the same validation loss."""
    results = [
        train(
            small_config(
                tmp_path,
                f"{router}-{i}",
                router=router,
                model_overrides={"num_hidden_layers": 2},
                seq_len=64,
                batch_size=8,
                max_steps=8,
                max_eval_blocks=16,
                seed=3,
            )
        )
        for i in range(2)
    ]
    losses = [r.eval_loss for r in results]
    assert losses[0] is not None and losses[1] is not None
    assert abs(losses[0] - losses[1]) <= 1e-6, losses
    assert results[0].train_loss == results[1].train_loss
    assert global_settings() == previous_settings
