"""A run leaves the process's float32 matmul precision as it found it.

transformers' ``TrainingArguments`` switches TF32 on process-wide on a GPU (bf16 or ``tf32``);
without the restore, float32 work after a run (a test comparing two models, an analysis) would
silently run in TF32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers.training_args as training_args

from maxscore.training import train
from maxscore.training.matmul_precision import _read, kept_matmul_precision
from test_training import small_config


def _switch_tf32_on() -> None:
    if hasattr(torch.backends, "fp32_precision"):
        torch.backends.fp32_precision = "tf32"
    else:
        torch.backends.cuda.matmul.allow_tf32 = True


def test_the_block_cannot_keep_tf32_on() -> None:
    before = _read()
    with kept_matmul_precision():
        _switch_tf32_on()
        assert _read() != before
    assert _read() == before


def test_a_run_restores_what_training_arguments_switched_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On the CPU transformers leaves TF32 alone (it switches it on for tf32=True, which the run
    # passes on a GPU); here its own switch is called as it would be on a GPU.
    built = training_args.TrainingArguments.__post_init__
    seen: list[dict[str, object]] = []

    def post_init_on_a_gpu(self: training_args.TrainingArguments) -> None:
        built(self)
        training_args.enable_tf32(True)
        seen.append(_read())

    monkeypatch.setattr(training_args.TrainingArguments, "__post_init__", post_init_on_a_gpu)
    before = _read()
    train(small_config(tmp_path, max_steps=2))
    assert seen and seen[0] != before, "TF32 was not switched on during the run"
    assert _read() == before
