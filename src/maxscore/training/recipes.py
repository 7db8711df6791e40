"""Training recipes: named sets of :class:`~maxscore.training.config.TrainConfig` fields.

* ``"paper"``: the paper's setup: context 512, global batch 688 sequences, 180k steps, AdamW
  lr 3e-5, weight decay 0.1, betas (0.9, 0.95), eps 1e-6, a warmup-stable-decay schedule with 2k
  warmup steps and decay over the last 6k, the SoftTopk ``t`` annealed over 30k steps, bf16,
  activation checkpointing, C4 and a LLaMA tokenizer.
* ``"paper-shape"``: the paper's optimizer and schedule *shape* scaled to the run's length, for
  short runs: the same AdamW betas / eps / weight decay, WSD with warmup over 2/180 and decay
  over the last 6/180 of the run, ``t`` annealed over 1/6 of it (30k of 180k). Model, data,
  batch, learning rate and budget stay the user's.

Plain data: :func:`maxscore.training.config.apply_recipe` applies one, the fields the user set
explicitly winning.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PAPER_GLOBAL_BATCH", "PAPER_RECIPE", "PAPER_SHAPE_RECIPE", "RECIPES"]

#: The paper's training setup. ``dataset="c4"`` streams allenai/c4 ``en``.
PAPER_RECIPE: dict[str, Any] = {
    "model": "base",
    "dataset": "c4",
    "dataset_config": "en",
    "streaming": True,
    "tokenizer": "default",
    "seq_len": 512,
    # 688 sequences per optimizer step in total; with 8 GPUs x 43 x 2 = 688.
    "batch_size": 43,
    "grad_accum": 2,
    "max_steps": 180_000,
    "lr": 3e-5,
    "weight_decay": 0.1,
    "adam_beta1": 0.9,
    "adam_beta2": 0.95,
    "adam_eps": 1e-6,
    "lr_schedule": "wsd",
    "warmup_steps": 2_000,
    "decay_steps": 6_000,
    # The authors' t schedule: 3 -> 0 over the first 30k optimizer steps.
    "temperature_steps": 30_000,
    "precision": "bf16",
    "gradient_checkpointing": True,
    "compile": True,
    "eval_steps": 2_000,
    "save_steps": 2_000,
    "logging_steps": 50,
    "save_total_limit": 3,
}

#: The paper's optimizer and schedule shape, scaled to a run of any length: its 2k warmup and
#: 6k decay steps and 30k ``t`` steps as shares of its 180k steps.
PAPER_SHAPE_RECIPE: dict[str, Any] = {
    "weight_decay": 0.1,
    "adam_beta1": 0.9,
    "adam_beta2": 0.95,
    "adam_eps": 1e-6,
    "lr_schedule": "wsd",
    "warmup_steps": 0,
    "warmup_ratio": 2_000 / 180_000,
    "decay_steps": 0,
    "decay_ratio": 6_000 / 180_000,
    "temperature_steps": None,
    "temperature_fraction": 30_000 / 180_000,
}

#: Recipes by name (``--recipe``): the fields each one sets.
RECIPES: dict[str, dict[str, Any]] = {"paper": PAPER_RECIPE, "paper-shape": PAPER_SHAPE_RECIPE}

#: Global batch of the paper's recipe, in sequences.
PAPER_GLOBAL_BATCH = 688
