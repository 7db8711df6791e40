"""Training: config, packing, bad input, run directory, resume after SIGKILL, atomic saves, Ctrl-C.

Every training here is a few steps of a one-layer, 32-wide model on 16-token sequences so the
whole file runs in well under a minute on two CPU cores.
"""

from __future__ import annotations

import json
import os
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

from maxscore.checkpoints.layout import list_checkpoints
from maxscore.data.packing import PackedDataset, pack_documents, pack_token_stream
from maxscore.training import ConfigError, DataError, TrainConfig, apply_recipe, prepare, train
from maxscore.training.checkpoint import CheckpointSaveError

#: The smallest useful model: one MoE layer, 4 experts, 32 wide.
SMALL_MODEL = {
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_experts": 4,
}


def small_config(tmp_path: Path, name: str = "run", **overrides: object) -> TrainConfig:
    """A TrainConfig of a few seconds (on the embedded corpus and tokenizer)."""
    base = {
        "model": "tiny",
        "model_overrides": dict(SMALL_MODEL),
        "router": "maxscore",
        "seq_len": 16,
        "batch_size": 2,
        "max_steps": 6,
        "eval_steps": 0,
        "save_steps": 2,
        "logging_steps": 2,
        "max_eval_blocks": 2,
        "report_to": "none",
        "quiet": True,
        "output_dir": str(tmp_path / name),
        "lr": 1e-2,
    }
    base.update(overrides)
    return TrainConfig(**base)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# config
# ------------------------------------------------------------------------------------------------
def test_config_rejects_bad_values() -> None:
    with pytest.raises(ConfigError, match="seq_len"):
        TrainConfig(seq_len=0)
    with pytest.raises(ConfigError, match="precision"):
        TrainConfig(precision="int3")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="contradict"):
        TrainConfig(resume=True, overwrite=True)
    with pytest.raises(ConfigError, match="unknown training config"):
        TrainConfig.from_dict({"no_such_field": 1})
    with pytest.raises(ConfigError, match="compile_mode"):
        TrainConfig(compile=True, compile_mode="reduce-overhead")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="gc_interval must be >= 0"):
        TrainConfig(gc_interval=-1)


def test_compile_with_zero3_is_refused_before_training(tmp_path: Path) -> None:
    cfg = TrainConfig(compile=True, deepspeed="zero3", output_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="ZeRO-3"):
        prepare(cfg)


def test_collate_blocks_stacks_without_padding_machinery() -> None:
    """The Trainer's collator: a plain stack of the packed blocks (no tokenizer.pad walk)."""
    from maxscore.data.packing import collate_blocks

    blocks = torch.arange(24).view(4, 6)
    batch = collate_blocks([PackedDataset(blocks)[i] for i in (2, 0)])
    assert set(batch) == {"input_ids", "labels"}
    assert torch.equal(batch["input_ids"], blocks[[2, 0]])
    assert torch.equal(batch["labels"], blocks[[2, 0]])


def test_mixed_precision_outputs_stay_half_precision() -> None:
    """accelerate casts a bf16-autocast model's outputs to fp32 (an fp32 copy of the logits per
    micro-batch); the trainer removes that conversion and keeps autocast: same loss, bf16 logits."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from maxscore.models import LlamaMoEForCausalLM, get_model_config
    from maxscore.training.precision import keep_half_precision_outputs

    torch.manual_seed(0)
    model = LlamaMoEForCausalLM(get_model_config("tiny", router="gshard", vocab_size=128))
    # accelerate's process-wide state may hold another precision from earlier tests' Trainers.
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator = Accelerator(mixed_precision="bf16", cpu=True)
        prepared = accelerator.prepare_model(model)
        x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            before = prepared(input_ids=x, labels=x)
            assert before.logits.dtype == torch.float32  # accelerate's conversion
            assert keep_half_precision_outputs(prepared)
            assert not keep_half_precision_outputs(prepared)  # already removed
            after = prepared(input_ids=x, labels=x)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert after.logits.dtype == torch.bfloat16  # still under autocast
    assert after.loss.dtype == torch.float32
    torch.testing.assert_close(after.loss, before.loss)
    torch.testing.assert_close(after.logits.float(), before.logits)
    assert not keep_half_precision_outputs(LlamaMoEForCausalLM(model.config))  # never wrapped


def test_training_batches_are_full_and_evaluation_keeps_every_block(tmp_path: Path) -> None:
    """An epoch's partial last batch is dropped in training only (a constant batch shape for the
    compiled layers); the evaluation loader still yields every block."""
    from transformers import TrainingArguments

    from maxscore.data.packing import collate_blocks
    from maxscore.models import LlamaMoEForCausalLM, get_model_config
    from maxscore.training.trainer import MaxScoreTrainer

    blocks = [{"input_ids": torch.arange(8), "labels": torch.arange(8)} for _ in range(5)]
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, per_device_eval_batch_size=2,
        report_to="none", use_cpu=True, remove_unused_columns=False,
    )  # fmt: skip
    model = LlamaMoEForCausalLM(get_model_config("tiny", router="gshard", vocab_size=128))
    trainer = MaxScoreTrainer(
        model=model, args=args, train_dataset=blocks, eval_dataset=blocks,
        data_collator=collate_blocks, tokens_per_step=16, save_total_limit=1,
    )  # fmt: skip
    assert [len(b["input_ids"]) for b in trainer.get_train_dataloader()] == [2, 2]
    assert [len(b["input_ids"]) for b in trainer.get_eval_dataloader()] == [2, 2, 1]
    assert trainer.args.dataloader_drop_last is False


def test_paper_recipe_fills_the_papers_setup_and_explicit_flags_win() -> None:
    cfg = apply_recipe(TrainConfig(recipe="paper", router="gshard", max_steps=10), {"max_steps"})
    assert (cfg.seq_len, cfg.lr, cfg.weight_decay) == (512, 3e-5, 0.1)
    assert (cfg.adam_beta1, cfg.adam_beta2, cfg.adam_eps) == (0.9, 0.95, 1e-6)
    assert (cfg.warmup_steps, cfg.decay_steps, cfg.lr_schedule) == (2000, 6000, "wsd")
    assert cfg.precision == "bf16" and cfg.gradient_checkpointing
    assert cfg.dataset == "c4" and cfg.model == "base"
    assert cfg.batch_size * cfg.grad_accum * 8 == 688
    assert cfg.max_steps == 10 and cfg.router == "gshard"  # explicit values kept
    assert apply_recipe(TrainConfig(recipe="paper")).max_steps == 180_000


def test_token_budget_and_schedule_lengths() -> None:
    cfg = TrainConfig(seq_len=100, batch_size=2, grad_accum=3, max_tokens=6000, warmup_ratio=0.1)
    assert cfg.tokens_per_step() == 600 and cfg.total_steps() == 10
    assert cfg.total_steps(world_size=2) == 5
    assert cfg.warmup_and_decay() == (1, 2)


# ------------------------------------------------------------------------------------------------
# packing
# ------------------------------------------------------------------------------------------------
def test_packing_concatenates_with_eos_and_drops_the_remainder() -> None:
    blocks = list(pack_token_stream([[1, 2, 3], [4], [5, 6, 7, 8]], seq_len=3, eos_id=0))
    # stream: 1 2 3 0 4 0 5 6 7 8 0 -> [1 2 3] [0 4 0] [5 6 7], remainder [8 0] dropped
    assert blocks == [[1, 2, 3], [0, 4, 0], [5, 6, 7]]


def test_pack_documents_is_deterministic_and_uses_the_tokenizer_eos() -> None:
    from maxscore.training.data import load_tokenizer

    tok = load_tokenizer("default")
    docs = ["The quick brown fox jumps over the lazy dog."] * 5
    a = pack_documents(docs, tok, seq_len=8)
    b = pack_documents(docs, tok, seq_len=8)
    assert torch.equal(a, b) and a.shape[1] == 8
    assert (a == tok.eos_token_id).sum() >= 3
    item = PackedDataset(a)[0]
    assert torch.equal(item["input_ids"], item["labels"])


def test_local_jsonl_and_txt_sources(tmp_path: Path) -> None:
    from maxscore.data.sources import load_text_splits

    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"body": f"document {i}"}) + "\n" for i in range(50)))
    splits = load_text_splits(TrainConfig(dataset=str(jsonl), text_field="body"))
    assert len(splits.train or []) + len(splits.validation) == 50 and splits.validation
    with pytest.raises(DataError, match="no field 'text'"):
        load_text_splits(TrainConfig(dataset=str(jsonl)))
    txt = tmp_path / "book.txt"
    txt.write_text("\n\n".join(f"paragraph {i}" for i in range(20)))
    splits = load_text_splits(TrainConfig(dataset=str(txt)))
    assert len(splits.train or []) + len(splits.validation) == 20


# ------------------------------------------------------------------------------------------------
# bad input: a clear error before training
# ------------------------------------------------------------------------------------------------
def test_bad_input_fails_before_training(tmp_path: Path) -> None:
    def fails(match: str, **overrides: object) -> None:
        with pytest.raises(ConfigError, match=match):
            prepare(small_config(tmp_path, "bad", **overrides))
        assert not (tmp_path / "bad" / "checkpoint-2").exists()

    fails("unknown model preset", model="gigantic")
    fails("unknown router preset", router="nope")
    fails("above the model's maximum", seq_len=4096)
    fails("does not exist", dataset=str(tmp_path / "missing.jsonl"))
    fails("cannot load tokenizer", tokenizer=str(tmp_path / "no-tokenizer"))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    fails("no validation documents", dataset=str(empty))
    small = tmp_path / "small.txt"
    small.write_text("\n\n".join(f"tiny document number {i} " * 5 for i in range(40)))
    fails("too small", dataset=str(small), batch_size=64, validation_fraction=0.25)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    fails("not writable|not a directory", output_dir=str(blocker / "run"))
    fails("not a directory", output_dir=str(blocker))


def test_existing_run_dir_with_other_config_is_refused(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, max_steps=2, save_steps=0)
    train(cfg)
    with pytest.raises(ConfigError, match="different config"):
        prepare(replace(cfg, lr=0.5))
    with pytest.raises(ConfigError, match="already holds this run"):
        prepare(cfg)
    assert prepare(replace(cfg, lr=0.5, overwrite=True)).resume_from is None
    # prepare only checks: the run to be replaced is untouched until training starts
    assert (tmp_path / "run" / "checkpoint-2").is_dir()


# ------------------------------------------------------------------------------------------------
# a complete small run
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A 6-step run through the CLI (TensorBoard on, evaluation every 3 steps)."""
    from maxscore.cli import main

    out = tmp_path_factory.mktemp("cli") / "run"
    argv = [
        "train",
        "--output-dir", str(out),
        "--model-option", "hidden_size=32",
        "--model-option", "num_hidden_layers=2",
        "--model-option", "num_attention_heads=2",
        "--model-option", "num_experts=4",
        "--seq-len", "16", "--batch-size", "2", "--max-steps", "6",
        "--eval-steps", "3", "--save-steps", "3", "--logging-steps", "2",
        "--max-eval-blocks", "2", "--quiet",
    ]  # fmt: skip
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(argv) == 0
    return out, buffer.getvalue()


def test_main_command_prints_loss_perplexity_and_routing(finished_run: tuple[Path, str]) -> None:
    _, printed = finished_run
    for needle in (
        "validation loss:",
        "perplexity:",
        "dropped slots:",
        "rerouted slots:",
        "load imbalance:",
    ):
        assert needle in printed


def test_run_directory_contents(finished_run: tuple[Path, str]) -> None:
    run, _ = finished_run
    stored = json.loads((run / "config.json").read_text())
    assert stored["train"]["router"] == "maxscore" and stored["resolved"]["total_steps"] == 6
    schedule = stored["resolved"]["temperature_schedule"]
    assert (schedule["steps"], schedule["source"], schedule["start"]) == (1, "fraction", 3.0)
    assert stored["model"]["router_config"]["temperature"]["steps"] == 1
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint-3", "checkpoint-6"]
    last = run / "checkpoint-6"
    for name in ("model.safetensors", "config.json", "tokenizer.json", "optimizer.pt"):
        assert (last / name).is_file(), name
    assert list((run / "tensorboard").glob("events.out.tfevents*"))
    assert not [p for p in run.iterdir() if p.name.startswith(".staging")]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["eval_loss"] > 0
    # The loss over the validation documents, its standard error and the per-document sums.
    validation = json.loads((run / "validation.json").read_text())
    assert validation["loss"] == pytest.approx(summary["eval_loss"])
    assert summary["eval_loss_se"] == pytest.approx(validation["se"]) and validation["se"] > 0
    assert summary["eval_tokens"] == 2 * 15 and validation["se_unit"] == "document"


def test_metrics_jsonl_has_losses_schedule_and_routing(finished_run: tuple[Path, str]) -> None:
    run, _ = finished_run
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_logs = [r for r in records if r["type"] == "train"]
    evals = [r for r in records if r["type"] == "eval"]
    assert [r["step"] for r in train_logs] == [2, 4, 6]
    assert {r["step"] for r in evals} >= {3, 6}
    first = train_logs[0]
    for key in ("loss", "learning_rate", "aux_loss", "t", "tokens_per_s", "peak_memory_gb"):
        assert key in first, key
    routing = first["routing"]
    for name in ("dropped", "rerouted"):
        per_layer = routing[f"{name}_by_rank"]
        assert len(per_layer) == 2 and len(per_layer[0]) == 2
        assert first[f"{name}_rank1"] == pytest.approx(sum(layer[0] for layer in per_layer) / 2)
    assert len(routing["load_imbalance"]) == 2
    # t anneals over 1/6 of the run's 6 steps: 3 -> 0 after the first step
    assert [r["t"] for r in train_logs] == [0.0, 0.0, 0.0]
    assert all(r["eval_ppl"] > 1 for r in evals)


def test_schedule_step_is_saved_in_the_checkpoint(finished_run: tuple[Path, str]) -> None:
    run, _ = finished_run
    state = load_file(str(run / "checkpoint-6" / "model.safetensors"))
    steps = [v for k, v in state.items() if k.endswith("schedule.step") or k.endswith(".step")]
    assert steps and all(int(s) == 6 for s in steps)


def test_deepseek_v3_bias_moves_once_per_optimizer_step(tmp_path: Path) -> None:
    """The trainer's step-end callback applies the balancing-bias update (never the forward):
    a checkpoint holds the moved bias and no pending load."""
    cfg = small_config(tmp_path, router="deepseek-v3", max_steps=2, save_steps=2, grad_accum=2)
    result = train(cfg)
    assert result.final_checkpoint is not None
    state = load_file(str(result.final_checkpoint / "model.safetensors"))
    bias = [v for k, v in state.items() if k.endswith("router.expert_bias")]
    load = [v for k, v in state.items() if k.endswith("router.expert_load")]
    assert bias and load
    rate = 1e-3  # the preset's rate: two steps move each expert by at most two rate steps
    assert all(b.abs().sum() > 0 and b.abs().max() <= 2 * rate + 1e-9 for b in bias)
    assert all((v == 0).all() for v in load)


# ------------------------------------------------------------------------------------------------
# resume after SIGKILL: exactly the same weights
# ------------------------------------------------------------------------------------------------
_RUNNER = textwrap.dedent(
    """
    import json, os, signal, sys
    from transformers import TrainerCallback
    from maxscore.training import TrainConfig, train

    cfg = TrainConfig(**json.loads(sys.argv[1]))
    kill_at = int(sys.argv[2])

    class KillAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    train(cfg, callbacks=[KillAt()])
    """
)


def _start(cfg: TrainConfig, kill_at: int = -1) -> subprocess.Popen:
    # One thread each: the two first runs go in parallel, and results are bit-reproducible.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(
        [sys.executable, "-c", _RUNNER, json.dumps(cfg.to_dict()), str(kill_at)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    _, err = proc.communicate(timeout=600)
    return proc.returncode, err


@pytest.mark.slow  # 37 s of three processes. The default run keeps kill -9 then resume
# (test_faults.py::test_kill_during_a_save_then_resume) and a bit-equal resume (test_signals.py)
def test_sigkill_then_resume_gives_identical_weights(tmp_path: Path) -> None:
    full = small_config(tmp_path, "full")
    killed = small_config(tmp_path, "killed")
    full_proc = _start(full)
    crash_proc = _start(killed, kill_at=5)  # after checkpoint-4, before step 6
    code, err = _finish(full_proc)
    assert code == 0, err[-3000:]
    code, err = _finish(crash_proc)
    assert code == -signal.SIGKILL, err[-3000:]
    assert [p.name for p in list_checkpoints(tmp_path / "killed")] == [
        "checkpoint-2",
        "checkpoint-4",
    ]
    code, err = _finish(_start(replace(killed, resume=True)))
    assert code == 0, err[-3000:]
    a = load_file(str(tmp_path / "full" / "checkpoint-6" / "model.safetensors"))
    b = load_file(str(tmp_path / "killed" / "checkpoint-6" / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # metrics: no step logged twice after the resume
    steps = [
        json.loads(line)["step"]
        for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["type"] == "train"
    ]
    assert steps == [2, 4, 6]


# ------------------------------------------------------------------------------------------------
# a crash during a save keeps the last good checkpoint; Ctrl-C saves one
# ------------------------------------------------------------------------------------------------
def test_crash_during_save_keeps_the_last_good_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import Trainer

    cfg = small_config(tmp_path, max_steps=4, save_total_limit=1)
    original = Trainer._save_rng_state

    def crash_at_step_4(self: Trainer, output_dir: str) -> None:
        if self.state.global_step == 4:
            raise OSError("disk full (simulated)")
        original(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_rng_state", crash_at_step_4)
    with pytest.raises(CheckpointSaveError, match="simulated"):
        train(cfg)
    run = tmp_path / "run"
    # the model of step 4 was written before the crash, but only into the staging folder
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint-2"]
    good = run / "checkpoint-2"
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"):
        assert (good / name).is_file(), name
    monkeypatch.setattr(Trainer, "_save_rng_state", original)
    result = train(replace(cfg, resume=True))
    assert result.steps == 4
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint-4"]
    assert not [p for p in run.iterdir() if p.name.startswith(".")]


def test_sigint_saves_a_checkpoint_and_stops(tmp_path: Path) -> None:

    class CtrlCAt3(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            if state.global_step == 3:
                os.kill(os.getpid(), signal.SIGINT)

    cfg = small_config(tmp_path, max_steps=50, save_steps=0)
    before = signal.getsignal(signal.SIGINT)  # a pytest-xdist worker ignores SIGINT
    result = train(cfg, callbacks=[CtrlCAt3()])
    assert result.interrupted
    # the flag is seen at the end of the next step at the latest
    assert result.steps in (3, 4)
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == [f"checkpoint-{result.steps}"]
    assert signal.getsignal(signal.SIGINT) == before


# ------------------------------------------------------------------------------------------------
# streaming, HF datasets, DeepSpeed
# ------------------------------------------------------------------------------------------------
def test_packed_stream_is_deterministic_and_restorable() -> None:
    from maxscore.data.packing import PackedStream
    from maxscore.training.data import load_tokenizer

    tok = load_tokenizer("default")

    def factory(seed: int) -> list[str]:
        import random

        docs = [f"document {i} says hello to the world" for i in range(30)]
        random.Random(seed).shuffle(docs)
        return docs

    stream = PackedStream(factory, tok, seq_len=8, seed=3)
    first = [b["input_ids"] for b in stream]
    again = [b["input_ids"] for b in PackedStream(factory, tok, seq_len=8, seed=3)]
    assert len(first) > 5 and all(torch.equal(a, b) for a, b in zip(first, again))
    assert stream.state_dict()["blocks_produced"] == len(first)
    resumed = PackedStream(factory, tok, seq_len=8, seed=3)
    resumed.load_state_dict({"epoch": 0, "blocks_produced": 4})
    rest = [b["input_ids"] for b in resumed]
    assert all(torch.equal(a, b) for a, b in zip(first[4:], rest)) and len(rest) == len(first) - 4


def test_unknown_hf_dataset_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    from maxscore.data.sources import load_text_splits

    def offline(*args: object, **kwargs: object) -> None:
        raise ConnectionError("Couldn't reach 'nobody/nothing' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match="cannot load dataset 'nobody/nothing'"):
        load_text_splits(TrainConfig(dataset="nobody/nothing"))


def test_c4_alias_streams_allenai_c4_en(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    from maxscore.data.sources import load_text_splits

    calls: list[tuple] = []

    class FakeStream:
        def __init__(self, split: str) -> None:
            self.split = split

        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter({"text": f"{self.split} doc {i}"} for i in range(300))

        def shuffle(self, seed: int, buffer_size: int) -> FakeStream:
            return self

    def fake_load(path: str, name: str, split: str, streaming: bool) -> FakeStream:
        calls.append((path, name, split, streaming))
        return FakeStream(split)

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    splits = load_text_splits(TrainConfig(dataset="c4"))
    assert calls[0] == ("allenai/c4", "en", "train", True)
    assert splits.train is None and splits.stream_factory is not None
    assert splits.validation[0] == "validation doc 0"
    assert next(iter(splits.stream_factory(0))) == "train doc 0"


def test_deepspeed_configs_and_zero3_leaf_marking(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from maxscore.moe import MoE
    from maxscore.training.distributed import DEEPSPEED_CONFIGS, mark_zero3_leaf_modules

    stages = {
        name: json.loads(path.read_text())["zero_optimization"]["stage"]
        for name, path in DEEPSPEED_CONFIGS.items()
    }
    assert stages == {"zero2": 2, "zero3": 3}
    marked: list[tuple] = []
    fake = types.ModuleType("deepspeed.utils")
    fake.set_z3_leaf_modules = lambda model, classes: marked.append((model, classes))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    monkeypatch.setitem(sys.modules, "deepspeed.utils", fake)
    model = torch.nn.Linear(2, 2)
    mark_zero3_leaf_modules(model, "zero2")
    assert marked == []
    mark_zero3_leaf_modules(model, "zero3")
    assert marked == [(model, [MoE])]


@pytest.mark.slow
def test_readme_main_command_exactly(tmp_path: Path) -> None:
    """`maxscore train` with no arguments (run from an empty folder): ~3 min on 2 cores."""
    env = {**os.environ}
    out = subprocess.run(
        [sys.executable, "-m", "maxscore.cli", "train"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "perplexity:" in out.stdout and "dropped slots:" in out.stdout
    assert (tmp_path / "runs" / "tiny-maxscore" / "summary.json").is_file()


def test_training_clips_inside_the_fused_adamw_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Trainer's fused AdamW (GPU and CPU) applies the gradient clipping itself
    (``clipping.py``); the weights after a few clipped steps equal those of the Trainer's own
    clip_grad_norm_."""
    from maxscore.training import trainer as trainer_mod

    calls: list[float] = []
    folded = trainer_mod.clip_grad_norm_in_fused_adam

    def spy(optimizer, parameters, max_norm):  # type: ignore[no-untyped-def]
        calls.append(max_norm)
        return folded(optimizer, parameters, max_norm)

    weights = []
    for fold in (True, False):
        monkeypatch.setattr(trainer_mod, "clip_grad_norm_in_fused_adam", spy)
        if not fold:
            monkeypatch.setattr(trainer_mod, "fused_adam", lambda optimizer: None)
        cfg = small_config(tmp_path, f"fold_{fold}", max_grad_norm=1e-3, save_steps=0, seed=3)
        result = train(cfg)
        assert result.final_checkpoint is not None
        weights.append(load_file(str(result.final_checkpoint / "model.safetensors")))
        assert (len(calls) == cfg.max_steps) == fold  # one clip per optimizer step
        calls.clear()
    for name, value in weights[0].items():
        torch.testing.assert_close(value, weights[1][name], rtol=2e-3, atol=1e-5, msg=name)


def test_quiet_run_writes_no_progress_bars_and_readable_checkpoints(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # transformers' "Writing model shards" bar at every save, and safetensors' mode 0600 for the
    # weights while the checkpoint's other files get the umask's 0644.
    from transformers.utils import logging as hf_logging

    old = os.umask(0o022)
    try:
        train(small_config(tmp_path, max_steps=2, save_steps=2))
    finally:
        os.umask(old)
    err = capfd.readouterr().err
    assert "Writing model shards" not in err
    assert hf_logging.is_progress_bar_enabled()  # restored after the run
    weights = next((tmp_path / "run").glob("checkpoint-*/model.safetensors"))
    assert weights.stat().st_mode & 0o777 == 0o644


def test_default_file_modes_widen_only_stricter_files(tmp_path: Path) -> None:
    from maxscore.file_modes import give_default_file_modes

    strict, wide = tmp_path / "strict", tmp_path / "tool"
    strict.write_text("x")
    wide.write_text("x")
    strict.chmod(0o600)
    wide.chmod(0o755)
    old = os.umask(0o022)
    try:
        give_default_file_modes(tmp_path)
    finally:
        os.umask(old)
    assert strict.stat().st_mode & 0o777 == 0o644
    assert wide.stat().st_mode & 0o777 == 0o755
