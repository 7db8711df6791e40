"""``--overwrite`` after a fault: the printed command continues the *new* run, the previous run
stays visible to ``maxscore eval`` until it is really replaced, and a stop signal does not
replace it (a checkpoint saved at a stop is not one the user chose to keep).

Every training is a few steps of ``test_training.small_config``'s one-layer, 32-wide model.
"""

from __future__ import annotations

import errno
import json
import re
import shlex
import signal
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

import maxscore.training.run as run_module
from maxscore.checkpoints.layout import REPLACING_MARKER, pending_previous_run, previous_run_path
from maxscore.cli import main
from maxscore.evaluation.runner import resolve_model_path
from maxscore.training import train
from maxscore.training.continue_command import continue_command, overwrite_command
from test_faults import SMALL_FLAGS, checkpoint_names, leftovers
from test_training import small_config


def stored_lr(run: Path) -> float:
    return json.loads((run / "config.json").read_text())["train"]["lr"]


def argv(run: Path, *flags: str) -> list[str]:
    return ["train", *SMALL_FLAGS, "--eval-steps", "0", "--output-dir", str(run), *flags]


def printed_command(text: str, lead: str) -> list[str]:
    """The arguments (without ``maxscore``) of the command after ``lead`` in ``text``."""
    match = re.search(re.escape(lead) + r": (maxscore .*?)(?:\n|$)", text)
    assert match, text[-3000:]
    words = shlex.split(match.group(1))
    assert words[0] == "maxscore"
    return words[1:]


def full_disk_at(monkeypatch: pytest.MonkeyPatch, checkpoint: str) -> None:
    real_save = torch.save

    def save(obj: object, f: object, *args: object, **kw: object) -> None:
        if isinstance(f, str) and f.endswith("optimizer.pt") and checkpoint in f:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, f, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "save", save)


# ------------------------------------------------------------------------------------------------
# the command every "how to go on" message prints
# ------------------------------------------------------------------------------------------------
def test_continue_command_drops_overwrite_and_adds_resume() -> None:
    line = ["maxscore", "train", "--overwrite", "--lr", "0.5", "--output-dir", "runs/a b"]
    assert (
        continue_command(True, line) == "maxscore train --lr 0.5 --output-dir 'runs/a b' --resume"
    )
    assert continue_command(False, line) == shlex.join(line)  # the same command again
    assert continue_command(True, ["maxscore", "train", "--overw", "--resume"]) == (
        "maxscore train --resume"
    )
    assert overwrite_command(["maxscore", "compare", "--resume", "--seeds", "1,2"]) == (
        "maxscore compare --seeds 1,2 --overwrite"
    )


def test_a_failed_save_after_the_first_checkpoint_prints_the_command_that_continues_the_new_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert main(argv(run, "--lr", "0.01", "--max-steps", "2", "--save-steps", "2")) == 0
    capsys.readouterr()
    new = argv(run, "--overwrite", "--lr", "0.02", "--max-steps", "4", "--save-steps", "2")
    real_save = torch.save
    full_disk_at(monkeypatch, "checkpoint-4")
    assert main(new) == 2
    err = capsys.readouterr().err
    assert "same command plus --resume" not in err
    command = printed_command(err, "continue with")
    assert "--overwrite" not in command and command[-1] == "--resume"
    # checkpoint-2 was scheduled: the new run replaced the previous one there
    assert checkpoint_names(run) == ["checkpoint-2"] and not leftovers(run)

    monkeypatch.setattr(torch, "save", real_save)  # space freed: the printed command works
    assert main(command) == 0
    assert checkpoint_names(run) == ["checkpoint-2", "checkpoint-4"]
    assert stored_lr(run) == 0.02  # the new run's settings, not the old run's
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4


def test_a_failed_first_save_prints_the_same_command_which_starts_the_new_run_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before its first checkpoint the new run is gone and the previous one back: ``--resume``
    would continue the previous run under the new settings, so the advice is the same
    command (with ``--overwrite``) again."""
    run = tmp_path / "run"
    assert main(argv(run, "--lr", "0.01", "--max-steps", "2", "--save-steps", "2")) == 0
    capsys.readouterr()
    new = argv(run, "--overwrite", "--lr", "0.02", "--max-steps", "2", "--save-steps", "2")
    real_save = torch.save
    full_disk_at(monkeypatch, "checkpoint-2")
    assert main(new) == 2
    err = capsys.readouterr().err
    command = printed_command(err, "start it again with")
    assert command == new and "--resume" not in command
    assert stored_lr(run) == 0.01 and not leftovers(run)  # the previous run, back

    monkeypatch.setattr(torch, "save", real_save)
    assert main(command) == 0
    assert stored_lr(run) == 0.02 and checkpoint_names(run) == ["checkpoint-2"]
    assert not leftovers(run)


# ------------------------------------------------------------------------------------------------
# a stop signal during --overwrite: the previous run stays until a scheduled checkpoint
# ------------------------------------------------------------------------------------------------
class SignalAt(TrainerCallback):
    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        if state.global_step == self.step:
            signal.raise_signal(self.signum)
        return control


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_during_overwrite_keeps_the_previous_run_until_the_resumed_run_replaces_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    signum: int,
) -> None:
    run = tmp_path / "run"
    assert main(argv(run, "--lr", "0.01", "--max-steps", "2", "--save-steps", "2")) == 0
    capsys.readouterr()
    real_train = run_module.train

    def train_with_signal(config, callbacks=None, prepared=None):  # type: ignore[no-untyped-def]
        return real_train(config, [*(callbacks or []), SignalAt(1, signum)], prepared)

    monkeypatch.setattr(run_module, "train", train_with_signal)
    new = argv(run, "--overwrite", "--lr", "0.02", "--max-steps", "6", "--save-steps", "4")
    assert main(new) == 128 + signum
    out = capsys.readouterr().out
    assert checkpoint_names(run) == ["checkpoint-2"]  # saved at the stop (step 2)
    previous = previous_run_path(run)
    assert checkpoint_names(previous) == ["checkpoint-2"] and stored_lr(previous) == 0.01
    assert (run / REPLACING_MARKER).exists() and pending_previous_run(run) == previous
    assert f"the previous run stays as {previous.name}" in out

    # meanwhile `maxscore eval run` evaluates the previous run, with a note
    resolved = resolve_model_path(run)
    assert resolved.checkpoint == (previous / "checkpoint-2").resolve()
    assert resolved.name == "run"
    assert "evaluating the previous run" in capsys.readouterr().err
    # the stopped run's own checkpoint, by name
    assert resolve_model_path(run / "checkpoint-2").checkpoint == (run / "checkpoint-2").resolve()

    monkeypatch.setattr(run_module, "train", real_train)
    command = printed_command(out, "continue with")
    assert "--overwrite" not in command and command[-1] == "--resume"
    assert main(command) == 0
    err = capsys.readouterr().err
    assert "replaced the previous run" in err
    assert not previous.exists() and not leftovers(run)
    assert checkpoint_names(run)[-1] == "checkpoint-6" and stored_lr(run) == 0.02
    assert resolve_model_path(run).checkpoint == (run / "checkpoint-6").resolve()


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_overwrite_again_after_a_stopped_overwrite_keeps_the_previous_run(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, max_steps=2, save_steps=2)
    train(cfg)
    run = tmp_path / "run"
    stopped = replace(cfg, overwrite=True, lr=0.5, max_steps=6, save_steps=0)
    assert train(stopped, callbacks=[SignalAt(1, signal.SIGTERM)]).interrupted
    previous = previous_run_path(run)
    assert stored_lr(previous) == cfg.lr and stored_lr(run) == 0.5
    # a new --overwrite replaces the stopped run; the previous run stays aside until it has a
    # scheduled checkpoint, and comes back if it fails first
    from test_faults import FailAtStep

    with pytest.raises(RuntimeError, match="injected"):
        train(replace(stopped, lr=0.25), callbacks=[FailAtStep(1)])
    assert stored_lr(run) == cfg.lr and checkpoint_names(run) == ["checkpoint-2"]
    assert not leftovers(run)


def test_eval_of_an_overwrite_killed_before_its_first_checkpoint_finds_the_previous_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = small_config(tmp_path, max_steps=2, save_steps=2)
    train(cfg)
    run = tmp_path / "run"
    previous = previous_run_path(run)
    run.rename(previous)  # what --overwrite had done when it was killed
    run.mkdir()
    (run / "config.json").write_text("{}")
    capsys.readouterr()
    resolved = resolve_model_path(run)
    assert resolved.checkpoint == (previous / "checkpoint-2").resolve() and resolved.name == "run"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "evaluating the previous run" in err[0]
