"""Packaging conventions: ``python -m maxscore``, optional extras, light imports, and clear lines
(not tracebacks) when a tracker fails to start or ``--deepspeed`` lacks its package."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from transformers import TrainerCallback

from byo_helpers import save_text
from maxscore.cli import main

ROOT = Path(__file__).resolve().parent.parent
SRC = str(ROOT / "src")


def _python(*args: str) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=300, check=False
    )


def test_python_dash_m_maxscore_is_the_command_line() -> None:
    result = _python("-m", "maxscore", "presets", "router")
    assert result.returncode == 0, result.stderr
    assert "maxscore" in result.stdout and "gshard" in result.stdout


def test_importing_the_moe_layer_loads_neither_matplotlib_nor_tensorboard() -> None:
    code = (
        "import sys, maxscore.moe, maxscore.models; "
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'tensorboard') "
        "or m.startswith('torch.utils.tensorboard')]; print(heavy)"
    )
    result = _python("-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_optional_packages_are_extras() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = " ".join(project["dependencies"])
    for package in ("matplotlib", "tensorboard", "deepspeed", "wandb", "mlflow", "peft"):
        assert package not in required
    extras = project["optional-dependencies"]
    assert any(dep.startswith("deepspeed") for dep in extras["deepspeed"])
    assert any(dep.startswith("matplotlib") for dep in extras["plots"])
    assert {"tensorboard", "wandb", "mlflow"} <= {d.split(">")[0] for d in extras["trackers"]}
    assert any(dep.startswith("peft") for dep in extras["lora"])


def _train_args(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--model-option",
        "hidden_size=32",
        "--model-option",
        "num_hidden_layers=1",
        "--model-option",
        "num_attention_heads=2",
        "--dataset",
        str(save_text(tmp_path / "data.txt")),
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--max-steps",
        "2",
        "--quiet",
        "--output-dir",
        str(tmp_path / "run"),
        *extra,
    ]


class _FailingTracker(TrainerCallback):
    """A tracker whose service cannot be reached, as mlflow with a store it cannot use."""

    def on_train_begin(self, args, state, control, **kwargs):
        raise RuntimeError("file:///nowhere/mlruns: the tracking store cannot be created")


def test_a_tracker_that_fails_to_start_is_one_line_and_keeps_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers.integrations import integration_utils

    from maxscore.training import reporting

    monkeypatch.setitem(integration_utils.INTEGRATION_TO_CALLBACK, "failing", _FailingTracker)
    monkeypatch.setattr(reporting, "tracker_installed", lambda name: True)
    status = main(_train_args(tmp_path, "--report-to", "failing"))
    err = capsys.readouterr().err
    assert status == 2
    lines = [line for line in err.splitlines() if line.startswith("maxscore: error:")]
    assert len(lines) == 1, err
    assert "--report-to failing: the tracker failed to start (RuntimeError:" in lines[0]
    assert "--report-to none" in lines[0] and "--resume" in lines[0]
    assert "Traceback" not in err
    assert (tmp_path / "run" / "config.json").is_file()  # the run directory is kept


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="deepspeed installed")
def test_deepspeed_without_the_package_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(_train_args(tmp_path, "--deepspeed", "zero2"))
    err = capsys.readouterr().err
    assert status == 2
    assert "--deepspeed needs the deepspeed package" in err
    assert "pip install 'maxscore[deepspeed]'" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_figures_without_matplotlib_say_what_to_install(tmp_path: Path) -> None:
    """compare writes its tables and notes the missing figures; analyze stops with one line."""
    block = "import sys; sys.modules['matplotlib'] = None; "
    compare = _python(
        "-c",
        block + "from pathlib import Path; from maxscore.training.compare import plot_comparison; "
        f"plot_comparison([], Path({str(tmp_path)!r}))",
    )
    assert compare.returncode == 0, compare.stderr
    assert "no loss_curves.png" in compare.stderr and "maxscore[plots]" in compare.stderr
    analyze = _python(
        "-c", block + f"from maxscore.cli import main; main(['analyze', {str(tmp_path)!r}])"
    )
    assert "maxscore analyze: error: the figures need matplotlib" in analyze.stderr
    assert "Traceback" not in analyze.stderr
