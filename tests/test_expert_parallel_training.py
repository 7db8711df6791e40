"""``maxscore train --expert-parallel 2`` on two CPU processes (gloo) against one process.

Two processes with the experts spread over both and micro-batches of 2 sequences train on the
same global batch as one process with micro-batches of 4: the first step's loss must be equal
to rounding (the later ones close), and the logged aux loss and routing statistics must be those
of the whole batch (aggregated over both processes). The expert-parallel run's checkpoints hold
the whole experts and load on one process; they resume on two processes exactly and on one
process (the optimizer state resharded by torch.distributed.checkpoint).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from distributed_helpers import free_port, spawn_launched
from maxscore.checkpoints.layout import list_checkpoints

# One xdist worker runs this module, so its module-scoped fixtures are set up once.
pytestmark = pytest.mark.xdist_group("test_expert_parallel_training")

SMALL_MODEL = {
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_experts": 4,
}

RUN = {
    "model": "tiny",
    "model_overrides": SMALL_MODEL,
    "router": "maxscore",
    "seq_len": 16,
    "max_steps": 4,
    "eval_steps": 0,
    "save_steps": 2,
    "logging_steps": 1,
    "max_eval_blocks": 2,
    "report_to": "none",
    "quiet": True,
    "lr": 1e-2,
}


def _config(run_dir: Path, **overrides: Any):
    from maxscore.training import TrainConfig

    return TrainConfig(**{**RUN, **overrides, "output_dir": str(run_dir)})


def _train_on_rank(rank: int, world: int, run_dir: str, overrides: dict[str, Any]) -> None:
    from maxscore.training import train

    train(_config(Path(run_dir), **overrides))


def _train_two(run_dir: Path, **overrides: Any) -> None:
    spawn_launched(
        _train_on_rank, 2, str(run_dir), {"batch_size": 2, "expert_parallel": 2, **overrides}
    )


def _train_one(run_dir: Path, **overrides: Any) -> None:
    from maxscore.training import train

    train(_config(run_dir, batch_size=4, **overrides))


def _train_logs(run_dir: Path) -> dict[int, dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["type"] == "train"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(2 processes with --expert-parallel 2 and activation checkpointing, 1 process): 4 steps
    each, checkpoints at 2 and 4."""
    root = tmp_path_factory.mktemp("ep")
    _train_two(root / "ep2", gradient_checkpointing=True)
    _train_one(root / "one")
    return root / "ep2", root / "one"


def test_expert_parallel_training_matches_one_process(runs: tuple[Path, Path]) -> None:
    """Step 1 equal to rounding, steps 2-4 within 1e-4; aux loss and dropped / rerouted shares
    logged over both processes equal the one-process values (the fixture: about 25 s)."""
    ep, one = (_train_logs(run) for run in runs)
    assert sorted(ep) == sorted(one) == [1, 2, 3, 4]
    assert ep[1]["loss"] == pytest.approx(one[1]["loss"], rel=1e-6)
    for step in (2, 3, 4):
        assert ep[step]["loss"] == pytest.approx(one[step]["loss"], rel=1e-4), step
    for key in ("aux_loss", "dropped_rank1", "dropped_rank2", "rerouted_rank1", "rerouted_rank2"):
        assert ep[1][key] == pytest.approx(one[1][key], rel=1e-5, abs=1e-7), key


def test_expert_parallel_checkpoint_loads_on_one_process(runs: tuple[Path, Path]) -> None:
    """model.safetensors holds the whole experts; `maxscore eval`'s loader and `generate` use
    it on one process."""
    from maxscore.checkpoints.integrity import verify_checkpoint
    from maxscore.evaluation.runner import load_model, resolve_model_path

    ep, one = runs
    checkpoint = ep / "checkpoint-4"
    assert verify_checkpoint(checkpoint) == []
    assert (checkpoint / "optimizer.dcp" / ".metadata").is_file()
    assert not (checkpoint / "optimizer.pt").exists()
    weights = load_file(str(checkpoint / "model.safetensors"))
    reference = load_file(str(one / "checkpoint-4" / "model.safetensors"))
    assert weights.keys() == reference.keys()
    for name, tensor in weights.items():
        assert tensor.shape == reference[name].shape, name
        torch.testing.assert_close(tensor, reference[name], atol=1e-4, rtol=0, msg=name)
    resolved = resolve_model_path(ep)  # the run directory, as `maxscore eval RUN` takes it
    assert resolved.checkpoint.name == "checkpoint-4"
    model, _ = load_model(resolved.checkpoint, "cpu")
    assert model.model.layers[0].mlp.experts.gate_up.shape[0] == 4
    out = model.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 6)


def _stopped_copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    shutil.rmtree(to / "checkpoint-4")
    return to


def test_expert_parallel_resumes_exactly_on_two_processes(
    runs: tuple[Path, Path], tmp_path: Path
) -> None:
    """Killed after checkpoint-2, resumed with --expert-parallel 2: bit-identical final weights."""
    ep, _ = runs
    stopped = _stopped_copy(ep, tmp_path / "stopped")
    _train_two(stopped, gradient_checkpointing=True, resume=True)
    assert [p.name for p in list_checkpoints(stopped)] == ["checkpoint-2", "checkpoint-4"]
    a = load_file(str(ep / "checkpoint-4" / "model.safetensors"))
    b = load_file(str(stopped / "checkpoint-4" / "model.safetensors"))
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert sorted(_train_logs(stopped)) == [1, 2, 3, 4]


def test_expert_parallel_checkpoint_resumes_on_one_process(
    runs: tuple[Path, Path], tmp_path: Path
) -> None:
    """checkpoint-2 of the 2-process run resumed by one process (same global batch of 4): the
    optimizer state is resharded from optimizer.dcp and steps 3-4 continue the 2-process run."""
    ep, _ = runs
    stopped = _stopped_copy(ep, tmp_path / "stopped")
    _train_one(stopped, gradient_checkpointing=True, resume=True)
    resumed, original = _train_logs(stopped), _train_logs(ep)
    for step in (3, 4):
        assert resumed[step]["loss"] == pytest.approx(original[step]["loss"], rel=1e-4), step
    a = load_file(str(ep / "checkpoint-4" / "model.safetensors"))
    b = load_file(str(stopped / "checkpoint-4" / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-4, rtol=0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("router", ["gshard", "dropless"])
def test_expert_parallel_capacity_and_dropless_training_match_one_process(
    router: str, tmp_path: Path
) -> None:
    """GShard (padded buffers) and dropless (grouped, count exchange) trained on 2 processes with
    --expert-parallel 2 against 1 process, with the same routing groups (one per process's
    micro-batch of 2 x 16 tokens): step 1 to rounding, steps 2-4 within 1e-4 (about 18 s each)."""
    groups = {"group": "tokens", "group_size": 32}
    run = {"router": router, "router_overrides": groups, "save_steps": 0, "save_final": False}
    _train_two(tmp_path / "ep2", **run)
    _train_one(tmp_path / "one", **run)
    ep, one = _train_logs(tmp_path / "ep2"), _train_logs(tmp_path / "one")
    assert ep[1]["loss"] == pytest.approx(one[1]["loss"], rel=1e-6)
    assert ep[1]["aux_loss"] == pytest.approx(one[1]["aux_loss"], rel=1e-5)
    for step in (2, 3, 4):
        assert ep[step]["loss"] == pytest.approx(one[step]["loss"], rel=1e-4), step


_CLI_ARGS = [
    "--model-option", "hidden_size=32", "--model-option", "num_hidden_layers=1",
    "--model-option", "num_attention_heads=2", "--model-option", "num_experts=4",
    "--seq-len", "16", "--batch-size", "2", "--max-steps", "2", "--save-steps", "2",
    "--logging-steps", "1", "--eval-steps", "0", "--max-eval-blocks", "2",
    "--report-to", "none", "--quiet", "--expert-parallel", "2",
]  # fmt: skip


def _torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    src = str(Path(__file__).resolve().parent.parent / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(free_port()), "-m", "maxscore.cli", *args,
    ]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_torchrun_compare_with_expert_parallel(tmp_path: Path) -> None:
    """``torchrun --nproc_per_node 2 -m maxscore.cli compare --expert-parallel 2`` (about 16 s):
    both routers train with their experts over the two processes and the comparison is written
    once."""
    out = tmp_path / "cmp"
    done = _torchrun(
        "compare", "--routers", "gshard,maxscore", *_CLI_ARGS, "--output-dir", str(out)
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert (out / "comparison.md").is_file()
    for router in ("gshard", "maxscore"):
        assert (out / router / "checkpoint-2" / "optimizer.dcp" / ".metadata").is_file()
        config = json.loads((out / router / "config.json").read_text())
        assert config["train"]["expert_parallel"] == 2


@pytest.mark.slow
def test_torchrun_train_refuses_an_expert_parallel_size_that_does_not_divide(
    tmp_path: Path,
) -> None:
    done = _torchrun(
        "train", *_CLI_ARGS, "--expert-parallel", "3", "--output-dir", str(tmp_path / "r")
    )
    assert done.returncode != 0
    assert "--expert-parallel 3 must divide the number of processes (2)" in done.stderr
    assert not (tmp_path / "r").exists()


def test_one_process_checkpoint_resumes_with_expert_parallel(
    runs: tuple[Path, Path], tmp_path: Path
) -> None:
    """checkpoint-2 of the one-process run (optimizer.pt, whole experts) resumed on 2 processes
    with --expert-parallel 2: each cuts its experts out of the weights and the optimizer state,
    and steps 3-4 continue the one-process run."""
    _, one = runs
    stopped = _stopped_copy(one, tmp_path / "stopped")
    _train_two(stopped, resume=True)
    resumed, original = _train_logs(stopped), _train_logs(one)
    for step in (3, 4):
        assert resumed[step]["loss"] == pytest.approx(original[step]["loss"], rel=1e-4), step
    assert (stopped / "checkpoint-4" / "optimizer.dcp").is_dir()


def _train_four(rank: int, world: int, run_dir: str) -> None:
    from maxscore.training import train

    train(_config(Path(run_dir), batch_size=1, expert_parallel=2, save_steps=0, save_final=False))


@pytest.mark.slow
def test_four_processes_two_expert_replicas_match_one_process(
    runs: tuple[Path, Path], tmp_path: Path
) -> None:
    """4 processes, experts over 2 (each expert on 2 replicas, gradients reduced over the dp
    groups), micro-batches of 1: the one-process run's losses (about 40 s)."""
    spawn_launched(_train_four, 4, str(tmp_path / "ep2x2"))
    ep, one = _train_logs(tmp_path / "ep2x2"), _train_logs(runs[1])
    assert ep[1]["loss"] == pytest.approx(one[1]["loss"], rel=1e-6)
    for step in (2, 3, 4):
        assert ep[step]["loss"] == pytest.approx(one[step]["loss"], rel=1e-4), step


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"fsdp": True}, "--fsdp shards the dense parameters around expert-parallel experts"),
        (
            {"fsdp": True, "expert_parallel": 2, "compile": True},
            "--fsdp does not combine with --compile",
        ),
    ],
)
def test_fsdp_needs_expert_parallelism_and_no_compile(options: dict, message: str) -> None:
    """--fsdp without --expert-parallel, or with --compile, is refused before anything runs."""
    from maxscore.training.config import ConfigError
    from maxscore.training.option_checks import check_parallel_options

    with pytest.raises(ConfigError, match=message):
        check_parallel_options(_config(Path("unused"), **options), 2, None)
