"""SIGTERM and SIGUSR1 save a checkpoint and stop like Ctrl-C; the run resumes bit for bit.

Slurm's preemption and time limit, ``docker stop``, ``timeout`` and ``kill`` send SIGTERM, many
clusters send SIGUSR1 as a preemption warning. The first stop signal asks for a checkpoint at
the end of the current step; ``maxscore train`` then exits with 128 + the signal's number (143,
138; Ctrl-C keeps 130); a second signal aborts without saving. Every training is a few steps of
``test_training.small_config``'s one-layer, 32-wide model.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from maxscore.checkpoints.layout import list_checkpoints, previous_run_path
from maxscore.training import train
from maxscore.training.callbacks import STOP_SIGNALS
from maxscore.training.run_lock import lock_file_path
from test_faults import SMALL_FLAGS, leftovers
from test_training import small_config

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

SIGUSR1 = getattr(signal, "SIGUSR1", None)


class SignalAt(TrainerCallback):
    """Send this process ``signals[step]`` at the end of optimizer step ``step`` (it runs after
    the trainer's own stop check of that step, so the stop comes one step later)."""

    def __init__(self, signals: dict[int, list[int]]) -> None:
        self.signals = signals

    def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        for signum in self.signals.get(state.global_step, []):
            os.kill(os.getpid(), signum)
        return control


def handlers() -> dict[int, object]:
    return {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}


def names(run: Path) -> list[str]:
    return [p.name for p in list_checkpoints(run)]


# ------------------------------------------------------------------------------------------------
# in one process: the stop, the first checkpoint, a second signal, the handlers
# ------------------------------------------------------------------------------------------------
def test_sigterm_before_the_first_checkpoint_saves_the_runs_first_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An --overwrite stopped before its first scheduled checkpoint: the stop's checkpoint makes
    the new run resumable but does not replace the previous run (kept aside); continued, the
    new run replaces it at its end. Handlers restored after."""
    cfg = small_config(tmp_path, max_steps=2, save_steps=2)
    train(cfg)
    run = tmp_path / "run"
    before = handlers()
    seen: list[object] = []

    class Look(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            seen.append(signal.getsignal(signal.SIGTERM))
            return control

    again = replace(cfg, overwrite=True, lr=0.5, max_steps=5, save_steps=0)
    result = train(again, callbacks=[Look(), SignalAt({2: [signal.SIGTERM]})])
    assert result.interrupted and result.stop_signal == signal.SIGTERM
    assert result.exit_status == 128 + signal.SIGTERM == 143
    assert result.steps == 3 and names(run) == ["checkpoint-3"]
    assert names(previous_run_path(run)) == ["checkpoint-2"]  # the previous run, kept
    assert json.loads((run / "config.json").read_text())["train"]["lr"] == 0.5
    err = capsys.readouterr().err
    assert "SIGTERM received; saving a checkpoint" in err and "replaced the previous run" not in err
    assert "does not replace the previous run" in err
    assert seen and seen[0] != before[signal.SIGTERM]  # ours while training
    assert handlers() == before
    assert not lock_file_path(run).exists()

    result = train(replace(again, overwrite=False, resume=True))
    assert (
        result.steps == 5
        and not result.interrupted
        and names(run) == ["checkpoint-3", "checkpoint-5"]
    )
    assert not leftovers(run) and "replaced the previous run" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("second", "window", "aborted"),
    [
        (signal.SIGINT, 2.0, True),  # Ctrl-C after SIGTERM: abort
        (signal.SIGTERM, 0.0, True),  # SIGTERM again, later: abort
        (signal.SIGTERM, 60.0, False),  # the same delivery twice (Slurm + torchrun): one stop
    ],
)
def test_a_second_signal_aborts_without_saving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, second: int, window: float, aborted: bool
) -> None:
    monkeypatch.setattr("maxscore.training.callbacks.REPEATED_SIGNAL_S", window)
    cfg = small_config(tmp_path, "nested/run", max_steps=50, save_steps=0)
    before = handlers()
    # the second signal comes during step 2's callbacks, after the stop was decided, before the
    # save
    signals = SignalAt({1: [signal.SIGTERM], 2: [second]})
    if aborted:
        with pytest.raises(KeyboardInterrupt):
            train(cfg, callbacks=[signals])
        # no checkpoint: the run failed before its first one and leaves nothing behind
        assert not (tmp_path / "nested").exists()
    else:
        result = train(cfg, callbacks=[signals])
        assert result.exit_status == 143 and names(tmp_path / "nested" / "run") == ["checkpoint-2"]
    assert handlers() == before
    assert not lock_file_path(tmp_path / "nested" / "run").exists()


def test_handlers_are_restored_after_a_finished_and_a_failed_run(tmp_path: Path) -> None:
    from test_faults import FailAtStep

    before = handlers()
    assert train(small_config(tmp_path, "a", max_steps=2)).exit_status == 0
    assert handlers() == before
    with pytest.raises(RuntimeError, match="injected"):
        train(small_config(tmp_path, "b", max_steps=4), callbacks=[FailAtStep(1)])
    assert handlers() == before


# ------------------------------------------------------------------------------------------------
# `maxscore train` in its own process: exit status, then --resume to the same weights
# ------------------------------------------------------------------------------------------------
_RUNNER = textwrap.dedent(
    """
    import contextlib, json, os, signal, sys
    from transformers import TrainerCallback
    import maxscore.training.run as run
    from maxscore.cli import main

    if sys.argv[1] == "serve":  # `maxscore train` once per argument list read from stdin
        for line in sys.stdin:
            with contextlib.redirect_stdout(sys.stderr):  # stdout: the exit statuses only
                status = main(json.loads(line))
            print(status, flush=True)
        sys.exit(0)

    # `maxscore train ARGS` that sends itself a signal at the end of a step
    signum, step = getattr(signal, sys.argv[1]), int(sys.argv[2])

    class SignalAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == step:
                os.kill(os.getpid(), signum)

    real_train = run.train
    run.train = lambda config, callbacks=None, prepared=None: real_train(
        config, [*(callbacks or []), SignalAt()], prepared
    )
    sys.exit(main(sys.argv[3:]))
    """
)

# One thread per process: bit-reproducible, and the runs go in parallel on two cores.
_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _argv(run: Path) -> list[str]:
    return [
        "train",
        *SMALL_FLAGS,
        *("--max-steps", "6", "--save-steps", "0", "--eval-steps", "0", "--logging-steps", "2"),
        *("--output-dir", str(run)),
    ]


def _popen(*args: str, stdin: int | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _RUNNER, *args],
        env=_ENV,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def same_weights(a: Path, b: Path) -> None:
    first = load_file(str(a / "model.safetensors"))
    second = load_file(str(b / "model.safetensors"))
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key


def train_steps(run: Path) -> list[int]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if r["type"] == "train"]


def test_sigterm_stops_maxscore_train_with_a_checkpoint_and_status_143_then_resumes_exactly(
    tmp_path: Path,
) -> None:
    """SIGTERM at step 2 of 6 (no periodic checkpoints): checkpoint-3, exit status 143;
    ``--resume`` then ends with the uninterrupted run's weights, bit for bit.

    One process serves the uninterrupted run and, after the stop, the resume (one start-up
    fewer); the signalled run is a process of its own, for its exit status.
    """
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    server = _popen("serve", stdin=subprocess.PIPE)
    assert server.stdin is not None and server.stdout is not None
    server.stdin.write(json.dumps(_argv(full)) + "\n")
    server.stdin.flush()
    proc = _popen("SIGTERM", "2", *_argv(stopped))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM == 143, err[-3000:]
    assert "SIGTERM received; saving a checkpoint" in err
    assert "stopped by SIGTERM at step 3" in out and "--resume" in out
    assert names(stopped) == ["checkpoint-3"]
    assert server.stdout.readline().strip() == "0"  # the uninterrupted run
    out, err = server.communicate(json.dumps([*_argv(stopped), "--resume"]) + "\n", timeout=300)
    assert out.strip() == "0", err[-3000:]
    same_weights(full / "checkpoint-6", stopped / "checkpoint-6")
    assert train_steps(stopped) == [2, 4, 6]  # no step logged twice


@pytest.mark.skipif(SIGUSR1 is None, reason="no SIGUSR1 on this platform")
def test_sigusr1_stops_with_a_checkpoint_and_resumes_exactly(tmp_path: Path) -> None:
    """SIGUSR1 (a preemption warning) does what SIGTERM does: checkpoint-3, exit status 138 on
    Linux, and ``--resume`` to the uninterrupted run's weights (here in one process)."""
    assert SIGUSR1 is not None
    full = train(small_config(tmp_path, "full", save_steps=0))
    cfg = small_config(tmp_path, save_steps=0)
    result = train(cfg, callbacks=[SignalAt({2: [SIGUSR1]})])
    assert result.stop_signal == SIGUSR1 and result.exit_status == 128 + SIGUSR1
    run = tmp_path / "run"
    assert result.steps == 3 and names(run) == ["checkpoint-3"]
    assert train(replace(cfg, resume=True)).steps == full.steps == 6
    same_weights(tmp_path / "full" / "checkpoint-6", run / "checkpoint-6")
    assert train_steps(run) == [2, 4, 6]


def test_a_signal_stops_compare_with_its_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGTERM during the first router's run of ``maxscore compare``: that run saves a
    checkpoint, the next router does not train, and compare exits with 143."""
    import maxscore.training.compare as compare_module
    from maxscore.cli import main

    real_train = compare_module.train

    def train_with_signal(config, callbacks=None, prepared=None):  # type: ignore[no-untyped-def]
        return real_train(config, [SignalAt({1: [signal.SIGTERM]})], prepared)

    monkeypatch.setattr(compare_module, "train", train_with_signal)
    out = tmp_path / "cmp"
    argv = ["compare", "--routers", "gshard,maxscore", "--output-dir", str(out),
            "--max-steps", "6", "--save-steps", "0", *SMALL_FLAGS]  # fmt: skip
    assert main(argv) == 143
    err = capsys.readouterr().err
    assert "compare stopped by a signal while training gshard" in err
    assert f"start it again with: maxscore {shlex.join(argv)} --overwrite" in err
    assert names(out / "gshard") == ["checkpoint-2"]
    assert not (out / "maxscore").exists() and not (out / "comparison.md").exists()
