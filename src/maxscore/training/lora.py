"""``--lora``: fine-tune through LoRA adapters (``peft``) instead of every weight.

The model of the run (a converted, upcycled or maxscore checkpoint, routed by ``--router``) is
saved once as the run's ``base/`` (a maxscore checkpoint with the tokenizer), wrapped with the
adapters of :data:`maxscore.models.adapters.LORA_TARGETS`, and trained; every checkpoint holds
the adapter the standard way (peft's ``adapter_config.json`` + ``adapter_model.safetensors``,
naming ``base/``), ``--resume`` restores it through the Trainer, and ``maxscore export`` /
``maxscore eval`` merge it into the base weights (:func:`maxscore.models.adapters.load_merged`).

The routers' step counters (the SoftTopk ``t`` schedule) are state of the frozen base, not of
the adapter; a resumed run counts the steps already trained back into them
(:class:`RouterStepsOnResume`). A DeepSeek-V3 balancing bias (also router state, moved every
step) would be lost between checkpoints, and expert parallelism shards weights the adapter
wraps: both are refused with LoRA.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from maxscore.models.adapters import LORA_TARGETS, lora_config
from maxscore.training.config import ConfigError, TrainConfig
from maxscore.training.distributed import is_main_process

__all__ = ["BASE_DIR", "RouterStepsOnResume", "apply_lora", "check_lora_options"]

#: The run-directory folder holding the model the adapters are trained on.
BASE_DIR = "base"


def check_lora_options(config: TrainConfig, model_config: Any) -> None:
    """Refuse LoRA settings that cannot work, before anything is written."""
    if not config.lora:
        return
    if importlib.util.find_spec("peft") is None:
        raise ConfigError(
            "--lora needs the peft package, which is not installed: pip install "
            "'maxscore[lora]' (or pip install peft)"
        )
    targets = _targets(config)
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown or not targets:
        raise ConfigError(
            f"--lora-targets {config.lora_targets!r}: unknown target(s) {unknown}; "
            f"choose from {', '.join(LORA_TARGETS)}"
        )
    if config.lora_r < 1:
        raise ConfigError(f"--lora-r must be >= 1, got {config.lora_r}")
    if config.expert_parallel > 1 or config.deepspeed is not None:
        raise ConfigError(
            "--lora trains on one process's full model: drop --expert-parallel / --deepspeed"
        )
    if getattr(getattr(model_config, "router_config", None), "bias_update_rate", 0) > 0:
        raise ConfigError(
            "--lora with a DeepSeek-V3 balancing bias (bias_update_rate > 0): the bias is router "
            "state outside the adapter and would be lost between checkpoints; use another router"
        )


def _targets(config: TrainConfig) -> list[str]:
    return [t.strip() for t in config.lora_targets.split(",") if t.strip()]


def apply_lora(model: Any, config: TrainConfig, run_dir: Path, tokenizer: Any) -> Any:
    """``model`` with LoRA adapters; its weights saved as ``run_dir/base`` first (process 0).

    The adapters' ``base_model_name_or_path`` is that folder, so adapter checkpoints load and
    merge without the run's command line.
    """
    # On use: peft is an optional dependency (maxscore[lora]).
    from peft import get_peft_model

    base = (run_dir / BASE_DIR).resolve()
    if is_main_process() and not (base / "config.json").is_file():
        model.save_pretrained(base)
        tokenizer.save_pretrained(base)
    # peft writes the model's `name_or_path` into adapter_config.json (base_model_name_or_path).
    model.config._name_or_path = model.name_or_path = str(base)
    peft_model = get_peft_model(
        model, lora_config(_targets(config), config.lora_r, config.lora_alpha)
    )
    if config.gradient_checkpointing:
        # Frozen embeddings give checkpointed layers inputs without gradients.
        peft_model.enable_input_require_grads()
    return peft_model


class RouterStepsOnResume(TrainerCallback):
    """On a resumed LoRA run, advance the routers by the steps already trained (their counters
    live in the frozen base, which restarts where the run started)."""

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
    ) -> Any:
        if model is not None and state.global_step > 0:
            model.advance_router_schedule(state.global_step)
        return control
