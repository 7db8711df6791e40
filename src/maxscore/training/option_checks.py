"""Checks of the model, parallelism and speed options of a training run, made before anything is
written (the router options are checked where the router is resolved,
:func:`maxscore.routing.resolve.resolve_router`).

``--model-option`` values come from ``KEY=VALUE`` flags or config files, and a Hugging Face
config accepts any keyword: a misspelt key (``num_hiden_layers=2``) must not be stored and
ignored, and a value of the wrong type must not fail at the first forward pass. Both are refused
here with the list of valid keys or the expected type.
"""

from __future__ import annotations

from typing import Any

from maxscore.config_types import annotations_of, check_value
from maxscore.models.config_names import FOREIGN_NAMES
from maxscore.models.configuration_llama_moe import ROUTER_SETTING_TYPES, LlamaMoEConfig
from maxscore.parallel.config import ParallelConfig, ParallelConfigError
from maxscore.training.config import ConfigError, TrainConfig

#: Model config fields that have their own flag instead of ``--model-option``.
_OWN_FLAGS = {"router": "--router", "router_config": "--router-option KEY=VALUE"}


def model_option_types() -> dict[str, Any]:
    """``--model-option`` keys (the Llama-MoE config's own fields, the top-level names of router
    settings such as ``eval_routing`` and ``norm_topk_prob``, and other families' names of our
    fields) and their types."""
    # Other families' names (num_local_experts, mlp_only_layers, ...) are checked by the config,
    # which maps or refuses each.
    foreign = dict.fromkeys(FOREIGN_NAMES, Any)
    hints = {**foreign, **annotations_of(LlamaMoEConfig, own_only=True), **ROUTER_SETTING_TYPES}
    return {name: hint for name, hint in hints.items() if name not in _OWN_FLAGS}


def validate_model_options(options: dict[str, Any]) -> None:
    """Refuse unknown ``--model-option`` keys (listing the valid ones) and mistyped values."""
    types = model_option_types()
    for key, value in options.items():
        if key in _OWN_FLAGS:
            raise ConfigError(f"model option {key!r} is set with {_OWN_FLAGS[key]}")
        if key not in types:
            raise ConfigError(f"unknown model option {key!r}; valid options: {sorted(types)}")
        problem = check_value(key, value, types[key])
        if problem is not None:
            raise ConfigError(f"model option {problem}")


def check_parallel_options(config: TrainConfig, world_size: int, model_config: Any) -> None:
    """Refuse an expert-parallel size that cannot work: with DeepSpeed, or not dividing the
    processes or every MoE layer's experts; and FSDP2 of the dense parameters without expert
    parallelism or with compiled layers."""
    if config.fsdp and config.expert_parallel == 1:
        raise ConfigError(
            "--fsdp shards the dense parameters around expert-parallel experts: it needs "
            "--expert-parallel 2 or more"
        )
    if config.fsdp and config.compile:
        # Compiled layers inside FSDP2's per-block modules are not tested here: refused rather
        # than left to fail (or recompile) somewhere inside the first step.
        raise ConfigError("--fsdp does not combine with --compile yet; pass --no-compile")
    if config.expert_parallel == 1:
        return
    if config.deepspeed is not None:
        raise ConfigError(
            "--expert-parallel does not combine with --deepspeed (ZeRO would partition the "
            "experts again); use one of them"
        )
    layers = range(getattr(model_config, "num_hidden_layers", 0))
    is_moe = getattr(model_config, "is_moe_layer", None)
    experts = [model_config.num_experts for i in layers if is_moe is not None and is_moe(i)]
    try:
        ParallelConfig(config.expert_parallel).validate(world_size, experts)
    except ParallelConfigError as err:
        raise ConfigError(str(err)) from err


def check_float8_options(config: TrainConfig) -> None:
    """Refuse ``--precision fp8`` with the options whose layers or weights it is not tested
    with: LoRA (peft wraps the linear layers float8 converts), DeepSpeed (its bf16 engine holds
    and casts the weights itself) and FSDP2 sharding."""
    if config.precision != "fp8":
        return
    others = {
        "--lora": config.lora,
        "--deepspeed": config.deepspeed is not None,
        "--fsdp": config.fsdp,
    }
    for flag, used in others.items():
        if used:
            raise ConfigError(
                f"--precision fp8 does not combine with {flag} yet; use --precision bf16"
            )
