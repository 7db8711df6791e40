"""Fault injection: nothing a user has is lost, and nothing goes wrong silently.

Kill during a save, truncated and overwritten checkpoint files, a full disk (a writer that fails
with ENOSPC after writing part of a file), bad values of every kind of option, bad data files,
``--overwrite`` whose new run fails, and the noise of a normal run. Every training here is a few
steps of a one-layer, 32-wide model (``small_config``), so the file runs in well under a minute.
The MoE layer's own faults (a NaN token, degenerate sizes and dtypes) are in
``test_moe_faults.py``.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from maxscore.checkpoints.integrity import INTEGRITY_FILE, verify_checkpoint
from maxscore.checkpoints.layout import list_checkpoints, previous_run_path
from maxscore.cli import main
from maxscore.training import ConfigError, prepare, train
from test_training import SMALL_MODEL, small_config

#: ``small_config``'s model and sizes as ``maxscore train`` flags.
SMALL_FLAGS = [
    *(flag for key, value in SMALL_MODEL.items() for flag in ("--model-option", f"{key}={value}")),
    *("--seq-len", "16", "--batch-size", "2", "--max-eval-blocks", "2"),
    *("--report-to", "none", "--quiet"),
]


class FailAtStep(TrainerCallback):
    """Raise at the end of optimizer step ``step`` (a crash in the middle of a run)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        if state.global_step == self.step:
            raise RuntimeError(f"injected failure at step {self.step}")
        return control


def checkpoint_names(run: Path) -> list[str]:
    return [p.name for p in list_checkpoints(run)]


def leftovers(run: Path) -> list[str]:
    """Hidden staging / trash / previous-run folders in or beside ``run``."""
    inside = [p.name for p in run.iterdir() if p.name.startswith(".")] if run.is_dir() else []
    return inside + ([previous_run_path(run).name] if previous_run_path(run).exists() else [])


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "model.safetensors"))


# ------------------------------------------------------------------------------------------------
# --overwrite: the old run survives until the new one has a checkpoint
# ------------------------------------------------------------------------------------------------
def test_overwrite_keeps_the_old_run_until_the_new_one_has_a_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = small_config(tmp_path, max_steps=2, save_steps=2)
    train(cfg)
    run = tmp_path / "run"
    old = weights(run / "checkpoint-2")
    again = replace(cfg, overwrite=True, lr=0.5)

    # bad data: refused before anything is touched
    with pytest.raises(ConfigError, match="does not exist"):
        train(replace(again, dataset=str(tmp_path / "missing.jsonl")))
    # a crash before the new run's first checkpoint: the old run is put back
    with pytest.raises(RuntimeError, match="injected"):
        train(replace(again, save_steps=0), callbacks=[FailAtStep(1)])
    assert checkpoint_names(run) == ["checkpoint-2"] and not leftovers(run)
    assert json.loads((run / "config.json").read_text())["train"]["lr"] == cfg.lr
    assert all(torch.equal(old[k], v) for k, v in weights(run / "checkpoint-2").items())
    assert "previous run" in capsys.readouterr().err

    # a run that gets to its first checkpoint replaces the old one, and says so
    train(again)
    assert json.loads((run / "config.json").read_text())["train"]["lr"] == 0.5
    assert not leftovers(run)
    assert "replaced the previous run" in capsys.readouterr().err


def test_an_overwrite_killed_before_its_first_checkpoint_is_undone(tmp_path: Path) -> None:
    """The process died with the old run aside: the next start puts it back."""
    cfg = small_config(tmp_path, max_steps=2, save_steps=2)
    train(cfg)
    run = tmp_path / "run"
    os.rename(run, previous_run_path(run))  # what --overwrite had done when it was killed
    run.mkdir()
    (run / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="already holds this run"):
        prepare(cfg)  # the check restored the old run first, then refused to clobber it
    assert checkpoint_names(run) == ["checkpoint-2"] and not leftovers(run)


def test_a_failed_run_leaves_no_folder_and_does_not_block_the_rerun(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, "nested/run", max_steps=2, save_steps=0)
    with pytest.raises(RuntimeError, match="injected"):
        train(cfg, callbacks=[FailAtStep(1)])
    assert not (tmp_path / "nested").exists()
    with pytest.raises(ConfigError):
        train(replace(cfg, router_overrides={"flow_method": "foo"}))
    assert not (tmp_path / "nested").exists()
    assert train(cfg).steps == 2  # no --overwrite needed


# ------------------------------------------------------------------------------------------------
# damaged checkpoints: --resume and eval fall back, NaN weights are refused
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pristine_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 4-step run with checkpoints at steps 2 and 4, trained once for this file."""
    cfg = small_config(tmp_path_factory.mktemp("pristine"), max_steps=4, save_steps=2)
    train(replace(cfg, save_total_limit=0))
    run = Path(cfg.output_dir or "")
    assert checkpoint_names(run) == ["checkpoint-2", "checkpoint-4"]
    for checkpoint in list_checkpoints(run):
        assert (checkpoint / INTEGRITY_FILE).is_file() and not verify_checkpoint(checkpoint)
    return run


@pytest.fixture
def two_checkpoints(pristine_run: Path, tmp_path: Path) -> Path:
    """A copy of ``pristine_run`` at ``tmp_path / "run"``, free to damage."""
    return Path(shutil.copytree(pristine_run, tmp_path / "run"))


def truncate(path: Path) -> None:
    with path.open("r+b") as handle:
        handle.truncate(path.stat().st_size // 2)


def scribble(path: Path, nbytes: int) -> None:
    """Overwrite ``nbytes`` in the middle of ``path`` with random bytes (same size)."""
    size = path.stat().st_size
    with path.open("r+b") as handle:
        handle.seek(size // 4)
        handle.write(os.urandom(min(nbytes, size // 2)))


def test_resume_skips_a_truncated_checkpoint(
    two_checkpoints: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = two_checkpoints
    truncate(run / "checkpoint-4" / "model.safetensors")
    cfg = small_config(run.parent, max_steps=4, save_steps=2, save_total_limit=0, resume=True)
    result = train(cfg)
    err = capsys.readouterr().err
    assert "checkpoint-4 is damaged (model.safetensors" in err
    assert re.search(r"resuming from \S*checkpoint-2", err)
    assert err.count("is damaged") == 1  # said once, with what was done about it
    assert result.steps == 4
    assert checkpoint_names(run) == ["checkpoint-2", "checkpoint-4"]
    assert not verify_checkpoint(run / "checkpoint-4")  # written again, intact
    assert (run / "damaged-checkpoint-4").is_dir()  # the damaged one is kept aside


def test_resume_with_every_checkpoint_damaged_is_refused(two_checkpoints: Path) -> None:
    for checkpoint in list_checkpoints(two_checkpoints):
        truncate(checkpoint / "optimizer.pt")
    cfg = small_config(two_checkpoints.parent, max_steps=4, save_steps=2, resume=True)
    with pytest.raises(ConfigError, match="no intact checkpoint"):
        prepare(cfg)


@pytest.mark.parametrize("damage", ["truncate", "scribble"])
def test_eval_falls_back_to_the_newest_intact_checkpoint(
    two_checkpoints: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from maxscore.evaluation.runner import EvaluationError, load_model, resolve_model_path

    model_file = two_checkpoints / "checkpoint-4" / "model.safetensors"
    truncate(model_file) if damage == "truncate" else scribble(model_file, 4 << 20)
    resolved = resolve_model_path(two_checkpoints)
    assert resolved.checkpoint.name == "checkpoint-2"
    assert "evaluating checkpoint-2 instead" in capsys.readouterr().err
    with pytest.raises(EvaluationError, match="checkpoint-4 is damaged"):
        load_model(two_checkpoints / "checkpoint-4", "cpu")


def test_eval_refuses_non_finite_weights(two_checkpoints: Path) -> None:
    """A checkpoint without an integrity record (older, or edited) whose weights hold NaN."""
    from safetensors.torch import save_file

    from maxscore.evaluation.runner import EvaluationError, load_model

    checkpoint = two_checkpoints / "checkpoint-4"
    state = weights(checkpoint)
    name = next(k for k, v in state.items() if v.is_floating_point())
    state[name][0] = float("nan")
    save_file(state, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    (checkpoint / INTEGRITY_FILE).unlink()
    with pytest.raises(EvaluationError, match=r"non-finite \(NaN/inf\) weights"):
        load_model(checkpoint, "cpu")


def test_a_checkpoint_without_record_is_checked_for_truncation(two_checkpoints: Path) -> None:
    checkpoint = two_checkpoints / "checkpoint-4"
    (checkpoint / INTEGRITY_FILE).unlink()
    assert not verify_checkpoint(checkpoint)
    truncate(checkpoint / "model.safetensors")
    assert "truncated" in " ".join(verify_checkpoint(checkpoint))


# ------------------------------------------------------------------------------------------------
# a full disk or a kill during a save
# ------------------------------------------------------------------------------------------------
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The optimizer state of checkpoint-4 hits ENOSPC half-way: one line, nothing lost."""
    real_save = torch.save

    def save_until_the_disk_is_full(obj: object, f: object, *args: object, **kw: object) -> None:
        if isinstance(f, str) and f.endswith("optimizer.pt") and "checkpoint-4" in f:
            Path(f).write_bytes(b"\0" * 1000)  # part of the file made it to disk
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, f, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "save", save_until_the_disk_is_full)
    run = tmp_path / "run"
    argv = ["train", *SMALL_FLAGS, "--output-dir", str(run), "--max-steps", "4"]
    assert main([*argv, "--save-steps", "2", "--eval-steps", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("maxscore: error: could not save checkpoint-4")
    assert "the disk is full" in err[-1] and "checkpoint-2" in err[-1] and "--resume" in err[-1]
    assert checkpoint_names(run) == ["checkpoint-2"] and not leftovers(run)
    assert not verify_checkpoint(run / "checkpoint-2")

    monkeypatch.setattr(torch, "save", real_save)  # space freed: continue
    assert main([*argv, "--save-steps", "2", "--eval-steps", "0", "--resume"]) == 0
    assert checkpoint_names(run) == ["checkpoint-2", "checkpoint-4"]


_KILL_DURING_SAVE = textwrap.dedent(
    """
    import json, os, signal, sys
    import torch
    from maxscore.training import TrainConfig, train

    real_save = torch.save

    def save_then_die(obj, f, *args, **kw):
        real_save(obj, f, *args, **kw)
        if isinstance(f, str) and f.endswith("optimizer.pt") and "checkpoint-4" in f:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-save: model and optimizer written

    torch.save = save_then_die
    train(TrainConfig(**json.loads(sys.argv[1])))
    """
)


def test_kill_during_a_save_then_resume(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, max_steps=4, save_steps=2)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-c", _KILL_DURING_SAVE, json.dumps(cfg.to_dict())],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    run = tmp_path / "run"
    assert checkpoint_names(run) == ["checkpoint-2"]
    assert [p.name for p in run.iterdir() if p.name.startswith(".staging")]  # half-written
    result = train(replace(cfg, resume=True))
    assert result.steps == 4 and checkpoint_names(run) == ["checkpoint-2", "checkpoint-4"]
    assert not leftovers(run)


# ------------------------------------------------------------------------------------------------
# bad values of every kind of option, bad data: one line, nothing written
# ------------------------------------------------------------------------------------------------
BAD_OPTIONS = [
    (["--model-option", "num_hiden_layers=2"], "unknown model option 'num_hiden_layers'"),
    (["--model-option", "rope_theta=abc"], "rope_theta must be a number"),
    (["--model-option", "router=gshard"], "is set with --router"),
    (["--router-option", "flow_method=foo"], "unknown flow_method 'foo'"),
    (["--router-option", "temperature=abc"], "temperature must be an object"),
    (["--router-option", 'temperature={"start": 2, "stop": 1}'], "unknown temperature"),
    (["--router-option", "capacity_factor=abc"], "capacity_factor must be a number"),
    (["--router-option", "min_capacity=null"], "min_capacity must be an integer"),
    (["--router-option", "capacity_facter=2"], "unknown router option 'capacity_facter'"),
    (["--router-option", "drop_policy=random"], "drop_policy must be one of"),
    (["--router-option", 'temperature={"steps": -5}'], "steps must be >= 0"),
    (["--temperature-steps", "-1"], "temperature_steps must be >= 0"),
    (["--temperature-fraction", "1.5"], "temperature_fraction must be in [0, 1]"),
    (["--seed", "-1"], "seed must be in [0, 2^32 - 1]"),
]


@pytest.mark.parametrize(("flags", "message"), BAD_OPTIONS)
def test_bad_option_values_fail_before_the_run_directory_exists(
    tmp_path: Path, flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert main(["train", *SMALL_FLAGS, *flags, "--output-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not run.exists()


@pytest.mark.parametrize(
    ("seeds", "message"),
    [
        ("42,x", "--seeds expects comma-separated integers"),
        (",", "--seeds is empty"),
        ("42,42", "--seeds lists a seed twice"),
        ("42,-1", "seed must be in [0, 2^32 - 1]"),
    ],
)
def test_bad_compare_seeds_fail_before_the_output_dir_exists(
    tmp_path: Path, seeds: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cmp"
    argv = ["compare", *SMALL_FLAGS, "--routers", "gshard", "--seeds", seeds]
    assert main([*argv, "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_unknown_model_option_lists_the_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--model-option", "num_hiden_layers=2", "--output-dir", "x"]) == 2
    err = capsys.readouterr().err
    assert "num_hidden_layers" in err and "valid options" in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lr: abc\n", "lr must be a number"),
        ("max_steps: 2.5\n", "max_steps must be an integer"),
        ("precision: fp4\n", "precision must be one of"),
        ("model_overrides: [1]\n", "model_overrides must be an object"),
        ("no_such_field: 1\n", "unknown training config field"),
        ("temperature_steps: 1.5\n", "temperature_steps must be an integer"),
        ("temperature_fraction: abc\n", "temperature_fraction must be a number"),
        ("recipe: papr\n", "unknown recipe 'papr'"),
    ],
)
def test_bad_config_file_values(
    tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    assert main(["train", "--config", str(path), "--output-dir", str(tmp_path / "run")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("latin1.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', r"latin1.jsonl:2: not UTF-8"),
        ("list.jsonl", b'{"text": "ok"}\n[1, 2]\n', r"list.jsonl:2: expected a JSON object"),
        ("number.jsonl", b'{"text": 7}\n', r"number.jsonl:1: field 'text' holds int"),
        ("broken.jsonl", b'{"text": "ok"}\n{"text": \n', r"broken.jsonl:2: not valid JSON"),
        ("binary.txt", bytes(range(256)) * 64, r"binary.txt does not look like text"),
    ],
)
def test_bad_data_files_name_the_file_and_line(
    tmp_path: Path, name: str, content: bytes, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    run = tmp_path / "run"
    assert main(["train", *SMALL_FLAGS, "--dataset", str(path), "--output-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert re.search(message, err[0]), err[0]
    assert not run.exists()


def test_a_mostly_text_file_with_a_few_bad_bytes_is_warned_about(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from maxscore.data.sources import _read_local

    path = tmp_path / "notes.txt"
    path.write_bytes(b"plain English text here. " * 200 + b"\n\ncaf\xe9 au lait\n")
    docs = _read_local(path, "text")
    assert len(docs) == 2
    err = capsys.readouterr().err
    assert "notes.txt" in err and "first at line 3" in err


# ------------------------------------------------------------------------------------------------
# noise: one final evaluation, a summary on every run, no stray warnings, a fast --help
# ------------------------------------------------------------------------------------------------
def test_a_short_run_is_quiet_and_complete(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    argv = ["train", *SMALL_FLAGS, "--output-dir", str(run), "--max-steps", "2"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main([*argv, "--eval-steps", "2", "--logging-steps", "10"]) == 0
    future = [w for w in caught if issubclass(w.category, FutureWarning)]
    assert not future, [str(w.message) for w in future]
    printed = capsys.readouterr().out
    needles = ("validation loss:", "dropped slots:", "rerouted slots:", "load imbalance:")
    for needle in (*needles, "throughput:"):
        assert needle in printed, needle  # 2 steps < --logging-steps 10: still summarised
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["type"] == "eval"] == [2]  # evaluated once


@pytest.mark.parametrize(("save_steps", "kept"), [("100", []), ("3", ["checkpoint-3"])])
def test_no_save_final_writes_no_checkpoint_at_the_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], save_steps: str, kept: list[str]
) -> None:
    """``--no-save-final`` is honoured whatever ``--save-steps`` is (the Trainer's own flow
    saves at the last step under a steps strategy); a step the schedule names still saves."""
    run = tmp_path / "run"
    argv = ["train", *SMALL_FLAGS, "--output-dir", str(run), "--max-steps", "3"]
    assert main([*argv, "--eval-steps", "0", "--save-steps", save_steps, "--no-save-final"]) == 0
    assert checkpoint_names(run) == kept
    printed = capsys.readouterr().out
    if not kept:
        assert "final checkpoint:  none (--no-save-final)" in printed
        assert json.loads((run / "summary.json").read_text())["final_checkpoint"] is None


def test_help_imports_neither_torch_nor_transformers() -> None:
    code = (
        "import sys, contextlib, io\n"
        "from maxscore.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try: main(['--help'])\n"
        "    except SystemExit: pass\n"
        "print(sorted(m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_report_accepts_a_run_beside_its_compare_directory(tmp_path: Path) -> None:
    from maxscore.analysis.report import ReportError, classify

    cmp = tmp_path / "cmp"
    (cmp / "maxscore" / "eval").mkdir(parents=True)
    (cmp / "gshard").mkdir()
    (cmp / "comparison.md").write_text("# comparison\n")
    (cmp / "maxscore" / "eval" / "eval_results.json").write_text("{}")
    (cmp / "gshard" / "metrics.jsonl").write_text("")
    found = classify([cmp, cmp / "maxscore", cmp / "gshard"])
    assert found.compare == [cmp] and len(found.eval) == 1
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "metrics.jsonl").write_text("")
    with pytest.raises(ReportError, match="maxscore eval"):
        classify([lone])


def test_compare_overwrite_keeps_the_old_comparison_until_a_router_has_trained(
    tmp_path: Path,
) -> None:
    from maxscore.training.compare import compare

    out = tmp_path / "cmp"
    (out / "gshard").mkdir(parents=True)
    (out / "comparison.md").write_text("old\n")
    cfg = small_config(tmp_path, max_steps=2, save_steps=2)
    with pytest.raises(ConfigError, match="capacity_factor must be a number"):
        compare(["gshard"], replace(cfg, router_overrides={"capacity_factor": "x"}), out, True)
    assert (out / "comparison.md").read_text() == "old\n"  # bad input: nothing touched
    with pytest.raises(RuntimeError, match="injected"), pytest.MonkeyPatch.context() as patch:
        patch.setattr("maxscore.training.run.write_resolved_config", _fail)
        compare(["gshard"], cfg, out, overwrite=True)
    assert (out / "comparison.md").read_text() == "old\n"  # failed before a checkpoint
    assert not leftovers(out)
    compare(["gshard"], cfg, out, overwrite=True)
    assert (out / "comparison.md").read_text() != "old\n" and not leftovers(out)
    assert checkpoint_names(out / "gshard") == ["checkpoint-2"]


def _fail(*args: object) -> None:
    raise RuntimeError("injected failure before the first step")


def test_compare_overwrite_stopped_in_its_first_router_keeps_the_old_comparison(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stop signal during the first router (its run saved a stop checkpoint) must not delete
    # the previous comparison; the next --overwrite replaces the stopped one.
    from types import SimpleNamespace

    import maxscore.training.compare as compare_module
    from maxscore.training.compare import ComparisonStopped, compare
    from maxscore.training.run_dir import previous_run_path

    out = tmp_path / "cmp"
    (out / "gshard").mkdir(parents=True)
    (out / "comparison.md").write_text("old\n")

    def stopped(cfg: Any, prepared: object = None) -> SimpleNamespace:
        (Path(cfg.output_dir) / "checkpoint-1").mkdir(parents=True)
        return SimpleNamespace(interrupted=True, exit_status=143)

    monkeypatch.setattr(compare_module, "train", stopped)
    cfg = small_config(tmp_path, max_steps=2, save_steps=2)
    with pytest.raises(ComparisonStopped) as stop:
        compare(["gshard", "maxscore"], cfg, out, overwrite=True)
    assert stop.value.exit_status == 143
    kept = previous_run_path(out)
    assert (kept / "comparison.md").read_text() == "old\n"  # the old comparison is kept aside
    monkeypatch.undo()
    compare(["gshard"], cfg, out, overwrite=True)  # finishes: now it replaces the old one
    assert not kept.exists()
    assert (out / "comparison.md").read_text() != "old\n" and not leftovers(out)
