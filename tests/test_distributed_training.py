"""Training with two CPU processes (gloo): global routing statistics, multi-process resume.

The fast tests spawn two processes that train the smallest model through :func:`train` (the
Trainer forms the gloo DDP group from the launcher variables, as under torchrun); the slow one
launches ``torchrun --nproc_per_node 2 -m maxscore.cli train`` twice.
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

from distributed_helpers import free_port
from maxscore.checkpoints.layout import list_checkpoints

# One xdist worker runs this module, so its module-scoped fixtures are set up once.
pytestmark = pytest.mark.xdist_group("test_distributed_training")

#: The smallest useful model: one MoE layer, 4 experts, 32 wide (as in test_training.py).
SMALL_MODEL = {
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_experts": 4,
}

#: Routing statistics that are means over tokens / groups (so a global mean is well defined).
MEAN_KEYS = (
    "dropped_by_rank",
    "rerouted_by_rank",
    "load_imbalance",
    "unused_experts",
    "mean_affinity_by_rank",
    "tokens_per_expert",
    "load_over_capacity",
)


def _train_on_rank(rank: int, port: int, run_dir: str, out_dir: str, resume: bool) -> None:
    """One of two DDP processes: train 4 steps (log and save every 2), record local and logged
    statistics to ``out_dir/rank{rank}.json``."""
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    torch.set_num_threads(1)
    from transformers import TrainerCallback

    from maxscore.training import TrainConfig, train
    from maxscore.training.distributed import unwrap

    local: list[list[dict[str, list[float]]]] = []
    logged: list[dict[str, float]] = []

    class Record(TrainerCallback):
        """This process's own routing statistics of every step (public model API) and its logs."""

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any):
            stats = unwrap(model).routing_statistics()
            local.append([{k: v.float().tolist() for k, v in s.items()} for s in stats if s])
            return control

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any):
            if logs and "loss" in logs:
                logged.append({k: v for k, v in logs.items() if isinstance(v, float)})
            return control

    cfg = TrainConfig(
        model="tiny",
        model_overrides=dict(SMALL_MODEL),
        router="maxscore",
        seq_len=16,
        batch_size=2,
        max_steps=4,
        eval_steps=0,
        save_steps=2,
        logging_steps=2,
        max_eval_blocks=2,
        report_to="none",
        quiet=True,
        output_dir=run_dir,
        lr=1e-2,
        resume=resume,
    )
    train(cfg, callbacks=[Record()])
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"local": local, "logged": logged}))


def _mean(values: list[Any]) -> Any:
    if isinstance(values[0], list):
        return [_mean([v[i] for v in values]) for i in range(len(values[0]))]
    return sum(values) / len(values)


def _spawn_training(run_dir: Path, out_dir: Path, resume: bool = False) -> None:
    import torch.multiprocessing as mp

    out_dir.mkdir(parents=True, exist_ok=True)
    args = (free_port(), str(run_dir), str(out_dir), resume)
    mp.spawn(_train_on_rank, args=args, nprocs=2, join=True)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A finished 4-step run of two gloo DDP processes: (run directory, per-process reports)."""
    root = tmp_path_factory.mktemp("ddp")
    _spawn_training(root / "run", root / "reports")
    return root / "run", root / "reports"


def test_routing_statistics_are_averaged_over_ddp_processes(ddp_run: tuple[Path, Path]) -> None:
    """Two gloo processes see different data; both log the mean of both processes' statistics."""
    run_dir, tmp_path = ddp_run
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    local = [report["local"] for report in reports]
    # every process logs the same (global) values
    assert len(reports[0]["logged"]) == 2
    for key in ("aux_loss", "dropped_rank1", "dropped_rank2", "load_imbalance"):
        for mine, theirs in zip(reports[0]["logged"], reports[1]["logged"]):
            assert mine[key] == theirs[key], key
    assert len(local[0]) == len(local[1]) == 4  # steps
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_logs = [r for r in records if r["type"] == "train"]
    assert [r["step"] for r in train_logs] == [2, 4]
    for log, steps in zip(train_logs, ([0, 1], [2, 3])):
        # the processes' own statistics differ (different batches) ...
        first = [local[0][s][0]["dropped_by_rank"] for s in steps]
        second = [local[1][s][0]["dropped_by_rank"] for s in steps]
        affinity = [[local[r][s][0]["mean_affinity_by_rank"] for s in steps] for r in range(2)]
        assert first != second or affinity[0] != affinity[1]
        # ... and the logged value is the mean over both processes and the logged steps
        routing = log["routing"]
        for key in (*MEAN_KEYS, "aux_loss", "z_loss"):
            expected = _mean([local[r][s][0][key] for r in range(2) for s in steps])
            assert routing[key][0] == pytest.approx(expected, rel=1e-5, abs=1e-7), key
        assert log["dropped_rank1"] == pytest.approx(routing["dropped_by_rank"][0][0])


@pytest.mark.slow  # 24 s; a bit-equal resume of two gloo processes (the optimizer state loaded on
# each) stays in the default run: test_expert_parallel_training.py's resume tests
def test_ddp_run_on_cpu_resumes_with_identical_weights(
    ddp_run: tuple[Path, Path], tmp_path: Path
) -> None:
    """Two gloo processes resume from checkpoint-2 and end with the uninterrupted run's weights.

    The interrupted run is the finished one without its last checkpoint (the state a kill between
    steps 2 and 4 leaves). Before the fix the resume failed in
    ``Trainer._load_optimizer_and_scheduler`` (``torch.load(map_location=cpu:0)``).
    """
    full, _ = ddp_run
    assert [p.name for p in list_checkpoints(full)] == ["checkpoint-2", "checkpoint-4"]
    stopped = tmp_path / "stopped"
    shutil.copytree(full, stopped)
    shutil.rmtree(stopped / "checkpoint-4")
    _spawn_training(stopped, tmp_path / "reports", resume=True)
    _assert_same_final_weights(full, stopped)
    reports = [json.loads((tmp_path / "reports" / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(len(report["local"]) == 2 for report in reports)  # only steps 3 and 4 were run


def _assert_same_final_weights(full: Path, resumed: Path) -> None:
    assert [p.name for p in list_checkpoints(resumed)] == ["checkpoint-2", "checkpoint-4"]
    a = load_file(str(full / "checkpoint-4" / "model.safetensors"))
    b = load_file(str(resumed / "checkpoint-4" / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    steps = [
        json.loads(line)["step"]
        for line in (resumed / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["type"] == "train"
    ]
    assert steps == [2, 4]
    assert json.loads((resumed / "summary.json").read_text())["steps"] == 4


# ------------------------------------------------------------------------------------------------
# torchrun: two CPU processes, stopped and resumed
# ------------------------------------------------------------------------------------------------
_TRAIN_ARGS = [
    "--model-option", "hidden_size=32",
    "--model-option", "num_hidden_layers=1",
    "--model-option", "num_attention_heads=2",
    "--model-option", "num_experts=4",
    "--seq-len", "16", "--batch-size", "2", "--max-steps", "4",
    "--save-steps", "2", "--logging-steps", "2", "--eval-steps", "0",
    "--max-eval-blocks", "2", "--report-to", "none", "--quiet", "--lr", "1e-2",
]  # fmt: skip


def _torchrun_train(run_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    src = str(Path(__file__).resolve().parent.parent / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(free_port()),
        "-m", "maxscore.cli", "train", *_TRAIN_ARGS, "--output-dir", str(run_dir), *extra,
    ]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_torchrun_two_cpu_processes_resume_and_finish(tmp_path: Path) -> None:
    """``torchrun --nproc_per_node 2 -m maxscore.cli train ... --resume`` on the CPU (20-50 s).

    The same check as the spawned test above, through the launcher and the CLI.
    """
    full = tmp_path / "full"
    done = _torchrun_train(full)
    assert done.returncode == 0, done.stderr[-4000:]
    assert [p.name for p in list_checkpoints(full)] == ["checkpoint-2", "checkpoint-4"]
    stopped = tmp_path / "stopped"
    shutil.copytree(full, stopped)
    shutil.rmtree(stopped / "checkpoint-4")
    resumed = _torchrun_train(stopped, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resuming from" in resumed.stderr and "checkpoint-2" in resumed.stderr
    _assert_same_final_weights(full, stopped)


# ------------------------------------------------------------------------------------------------
# DeepSpeed
# ------------------------------------------------------------------------------------------------
def test_deepspeed_without_a_launcher_gets_one_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from maxscore.training.distributed import single_process_launcher_env

    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    for name in names:  # recorded by monkeypatch, so whatever the function sets is undone
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    single_process_launcher_env()
    env = {name: os.environ[name] for name in names}
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("0", "0", "1")
    assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
    # a launcher's variables are left alone
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("MASTER_PORT", "29999")
    single_process_launcher_env()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"]) == (
        "3",
        "8",
        "29999",
    )
    # a preset MASTER_ADDR / MASTER_PORT (e.g. a cluster's) is kept
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29400")
    single_process_launcher_env()
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], os.environ["RANK"]) == (
        "10.0.0.1",
        "29400",
        "0",
    )


def _cli_train(run_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``python -m maxscore.cli train`` without a launcher (one process)."""
    launcher = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    )
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    src = str(Path(__file__).resolve().parent.parent / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    cmd = [
        sys.executable,
        "-m",
        "maxscore.cli",
        "train",
        *_TRAIN_ARGS,
        "--output-dir",
        str(run_dir),
    ]
    return subprocess.run([*cmd, *extra], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_deepspeed_stage_trains_and_resumes_exactly(tmp_path: Path, stage: str) -> None:
    """``maxscore train --deepspeed zero2/zero3`` (no launcher) trains, saves and resumes.

    Runs wherever deepspeed is installed (on the CPU it uses DeepSpeed's CPU accelerator and
    gloo; benchmarks/deepspeed/README.md has the GPU run).
    """
    pytest.importorskip("deepspeed")
    full = tmp_path / "full"
    done = _cli_train(full, "--deepspeed", stage)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (full / "checkpoint-4" / "latest").is_file()  # DeepSpeed's own checkpoint
    stopped = tmp_path / "stopped"
    shutil.copytree(full, stopped)
    shutil.rmtree(stopped / "checkpoint-4")
    resumed = _cli_train(stopped, "--deepspeed", stage, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    _assert_same_final_weights(full, stopped)
