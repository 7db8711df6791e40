"""One process owns a run directory at a time (``run_lock.lock_run_dir``).

The lock is ``.NAME.lock`` beside the run directory, flocked by its owner and naming it (host,
pid, since). A second ``maxscore train`` (new, ``--resume`` or ``--overwrite``) or
``maxscore compare`` on a directory in use gets one line naming the owner, exit status 2, and
changes nothing; a lock left by a process that died is taken over with a note; the lock is
released when the run ends, whether it finished or failed. Every training is a few steps of
``test_training.small_config``'s one-layer, 32-wide model.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from maxscore.checkpoints.layout import list_checkpoints, previous_run_path
from maxscore.cli import main
from maxscore.training import ConfigError, prepare, train
from maxscore.training.run_lock import RunDirInUseError, lock_file_path
from test_faults import SMALL_FLAGS, FailAtStep
from test_training import small_config

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="flock")

# Another process that takes a run directory's lock as maxscore does (flock on the lock file,
# its name in it), says so, and holds it until its stdin closes. No maxscore import: it starts
# in a fraction of a second.
_HOLDER = textwrap.dedent(
    """
    import datetime, fcntl, json, os, socket, sys
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "since": since}
    os.write(fd, json.dumps(owner).encode())
    print("locked", flush=True)
    sys.stdin.read()
    """
)


@contextmanager
def other_process_holding(run: Path) -> Iterator[subprocess.Popen[str]]:
    """``run``'s lock held by another process (its pid is the owner's) while in the block."""
    path = lock_file_path(run)
    path.parent.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
    try:
        yield holder
    finally:
        if holder.poll() is None:
            holder.communicate(input="", timeout=30)


def snapshot(root: Path) -> dict[str, str]:
    """Every file and folder under ``root``, with a hash of each file's bytes."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "/"
        for p in sorted(root.rglob("*"))
    }


def names(run: Path) -> list[str]:
    return [p.name for p in list_checkpoints(run)]


def test_a_run_directory_in_use_is_refused_and_left_as_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The owner is in the middle of an --overwrite (the previous run aside, the new run
    without a checkpoint yet): nobody else may touch it, not even to "undo" that overwrite."""
    train(small_config(tmp_path, max_steps=2, save_steps=2))
    run = tmp_path / "run"
    os.rename(run, previous_run_path(run))
    run.mkdir()
    (run / "config.json").write_text("{}")
    capsys.readouterr()
    with other_process_holding(run) as owner:
        before = snapshot(tmp_path)
        owner_named = f"pid {owner.pid} on host {socket.gethostname()}, since "
        for extra in ([], ["--resume"], ["--overwrite"]):
            argv = ["train", *SMALL_FLAGS, "--max-steps", "2", "--output-dir", str(run), *extra]
            assert main([*argv]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1, err
            assert err[0].startswith("maxscore: error: output dir") and owner_named in err[0]
            assert "in use by another maxscore run" in err[0] and "choose another" in err[0]
        # a run inside it (a compare's folder), and a compare on it
        assert main(["train", *SMALL_FLAGS, "--output-dir", str(run / "inner")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is inside" in err[0] and owner_named in err[0], err
        argv = ["compare", *SMALL_FLAGS, "--routers", "gshard", "--output-dir", str(run)]
        assert main([*argv, "--overwrite"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and owner_named in err[0], err
        assert snapshot(tmp_path) == before  # nothing written, moved or removed
    # the owner gone (it died mid-overwrite): the next start puts the previous run back
    with pytest.raises(ConfigError, match="already holds this run"):
        prepare(small_config(tmp_path, max_steps=2, save_steps=2))
    assert names(run) == ["checkpoint-2"] and not previous_run_path(run).exists()


def test_a_lock_left_by_a_process_that_died_is_taken_over(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    with other_process_holding(run) as owner:
        owner.kill()  # SIGKILL: no clean-up, the lock file stays with its name in it
        owner.wait()
    path = lock_file_path(run)
    assert json.loads(path.read_text())["pid"] == owner.pid
    assert train(small_config(tmp_path, max_steps=2)).steps == 2
    err = capsys.readouterr().err
    assert f"took over the lock of {run} left by pid {owner.pid} on host" in err
    assert "no longer running" in err
    assert not path.exists()


def test_a_lock_of_another_host_is_never_taken_over(tmp_path: Path) -> None:
    """This host cannot see that process (the filesystem may not share flocks between hosts):
    refused, with the lock file to delete if that run is over."""
    path = lock_file_path(tmp_path / "run")
    path.write_text(json.dumps({"host": "node-elsewhere", "pid": 4242, "since": "yesterday"}))
    with pytest.raises(RunDirInUseError, match=r"pid 4242 on host node-elsewhere.*delete"):
        prepare(small_config(tmp_path, max_steps=2))
    assert not (tmp_path / "run").exists()


def test_the_lock_is_released_after_a_failed_a_refused_and_a_finished_run(
    tmp_path: Path,
) -> None:
    run = tmp_path / "nested" / "run"
    cfg = small_config(tmp_path, "nested/run", max_steps=2, save_steps=0)
    with pytest.raises(RuntimeError, match="injected"):
        train(cfg, callbacks=[FailAtStep(1)])
    assert not (tmp_path / "nested").exists()  # neither the run nor its lock file
    bad = tmp_path / "bad.jsonl"  # refused after the lock was taken (data is read after it)
    bad.write_bytes(b'{"text": "ok"}\n[1, 2]\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2"):
        prepare(replace(cfg, dataset=str(bad)))
    assert not (tmp_path / "nested").exists()
    assert train(cfg).steps == 2
    assert not lock_file_path(run).exists()
    with other_process_holding(run):  # another process takes it at once
        pass


def test_compare_holds_its_output_folder_over_the_runs_inside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from maxscore.training import run as run_module
    from maxscore.training.compare import compare

    out = tmp_path / "cmp"
    seen: list[tuple[int, list[str]]] = []
    real = run_module.write_resolved_config

    def look(prepared: object) -> None:  # at the start of each router's training
        seen.append(
            (
                json.loads(lock_file_path(out).read_text())["pid"],
                [p.name for p in out.rglob("*.lock")],
            )
        )
        real(prepared)  # type: ignore[arg-type]

    monkeypatch.setattr(run_module, "write_resolved_config", look)
    compare(["gshard", "maxscore"], small_config(tmp_path, max_steps=2), out)
    assert seen == [(os.getpid(), []), (os.getpid(), [])]  # one lock, beside the folder
    assert not lock_file_path(out).exists()


def test_two_maxscore_train_at_once_on_one_directory(tmp_path: Path) -> None:
    """Two real ``maxscore train`` processes, same command: one trains, the other exits 2 with
    one line naming it; the one training is then stopped with SIGTERM (a checkpoint, 143)."""
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "maxscore.cli", "train", *SMALL_FLAGS, "--output-dir", str(run)]
    argv += ["--max-steps", "2000", "--save-steps", "0", "--eval-steps", "0"]
    argv += ["--logging-steps", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    procs = [
        subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        deadline = time.monotonic() + 300
        while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        refused = next(p for p in procs if p.poll() is not None)
        winner = next(p for p in procs if p is not refused)
        _, err = refused.communicate()
        lines = [line for line in err.splitlines() if line.startswith("maxscore")]
        assert refused.returncode == 2, err[-3000:]
        assert len(lines) == 1 and "in use by another maxscore run" in lines[0], lines
        assert f"pid {winner.pid} on host {socket.gethostname()}" in lines[0]

        metrics = run / "metrics.jsonl"
        while winner.poll() is None and time.monotonic() < deadline:
            if metrics.is_file() and '"type": "train"' in metrics.read_text():
                break  # training (the signal handlers are in place)
            time.sleep(0.1)
        winner.send_signal(signal.SIGTERM)
        _, err = winner.communicate(timeout=300)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert winner.returncode == 128 + signal.SIGTERM, err[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r["step"] for r in records if r["type"] == "train"]
    assert steps == list(range(1, len(steps) + 1))  # one run's log, no step twice
    assert names(run) == [f"checkpoint-{records[-1]['step']}"]
    assert not lock_file_path(run).exists()
