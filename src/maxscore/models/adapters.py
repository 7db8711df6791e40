"""LoRA adapters on the Llama-MoE model, through ``peft``: which weights, and loading them back.

Targets (:data:`LORA_TARGETS`, ``--lora-targets``):

* ``attention``: LoRA on the q / k / v / o projections (``nn.Linear``);
* ``experts``: LoRA on the stacked expert weights ``gate_up [e, D, 2F]`` and ``down [e, F, D]``,
  one low-rank pair per expert (peft's ``target_parameters``, which adds ``B_j A_j`` to expert
  ``j``'s matrix while the experts run);
* ``mlp``: LoRA on dense MLP layers and shared experts (``gate_proj`` / ``up_proj`` /
  ``down_proj``);
* ``router``: the router gate ``W_g [e, D]`` trained in full and saved with the adapter (peft's
  ``modules_to_save``): a rank-r pair costs ``r (e + D)`` against the gate's ``e D``, no saving
  for the few experts of a row, and the router reads its weight directly to compute the logits
  in fp32, past a LoRA wrapper's forward.

An adapter checkpoint is peft's standard ``adapter_config.json`` + ``adapter_model.safetensors``;
its ``base_model_name_or_path`` names a maxscore checkpoint (the run's ``base/``), so
``PeftModel.from_pretrained(LlamaMoEForCausalLM.from_pretrained(base), adapter)`` loads it and
:func:`load_merged` gives the merged model (``export`` and ``eval`` use it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ADAPTER_CONFIG",
    "LORA_TARGETS",
    "LoraTarget",
    "is_adapter_checkpoint",
    "load_merged",
    "lora_config",
]

#: peft's adapter config file: its presence makes a folder an adapter checkpoint.
ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class LoraTarget:
    """What one ``--lora-targets`` name adapts.

    Attributes:
        modules: regular expression of ``nn.Linear`` names (inside a decoder layer) given LoRA.
        parameters: parameter names given per-expert LoRA (peft ``target_parameters``).
        full: module names trained in full and saved with the adapter (peft
            ``modules_to_save``).
    """

    modules: str | None = None
    parameters: tuple[str, ...] = ()
    full: tuple[str, ...] = ()


#: ``--lora-targets`` names -> what they adapt (module docstring).
LORA_TARGETS: dict[str, LoraTarget] = {
    "attention": LoraTarget(modules=r"self_attn\.(q|k|v|o)_proj"),
    "experts": LoraTarget(parameters=("mlp.experts.gate_up", "mlp.experts.down")),
    "mlp": LoraTarget(modules=r"mlp\.(shared_experts\.)?(gate|up|down)_proj"),
    "router": LoraTarget(full=("router.gate",)),
}


def lora_config(targets: list[str], rank: int, alpha: float) -> Any:
    """peft's ``LoraConfig`` for ``targets`` (names of :data:`LORA_TARGETS`)."""
    # On use: peft is an optional dependency (maxscore[lora]).
    from peft import LoraConfig

    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown or not targets:
        raise ValueError(f"unknown LoRA target(s) {unknown}; known: {', '.join(LORA_TARGETS)}")
    chosen = [LORA_TARGETS[t] for t in targets]
    patterns = [t.modules for t in chosen if t.modules]
    return LoraConfig(
        r=rank,
        lora_alpha=alpha,
        # peft full-matches a string against each module name.
        target_modules=rf".*\.({'|'.join(patterns)})" if patterns else [],
        target_parameters=[p for t in chosen for p in t.parameters] or None,
        modules_to_save=[m for t in chosen for m in t.full] or None,
        task_type="CAUSAL_LM",
    )


def is_adapter_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a folder holding a peft adapter (not full weights)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def load_merged(path: str | Path, **base_kwargs: Any) -> Any:
    """The Llama-MoE model of an adapter checkpoint with its adapter merged into the weights.

    The base is the checkpoint its ``adapter_config.json`` names (``base_model_name_or_path``);
    ``base_kwargs`` go to its ``from_pretrained`` (e.g. ``dtype``).
    """
    # On use: peft is an optional dependency (maxscore[lora]); the model module loads torch,
    # and this one is read when `maxscore eval` / `export` start.
    from peft import PeftModel

    from maxscore.models.modeling_llama_moe import LlamaMoEForCausalLM

    config = json.loads((Path(path) / ADAPTER_CONFIG).read_text())
    base_path = config.get("base_model_name_or_path")
    if not base_path or not Path(base_path).is_dir():
        raise FileNotFoundError(
            f"{path}: its adapter's base model {base_path!r} is not a folder here; the adapter "
            "needs the base checkpoint it was trained on"
        )
    base = LlamaMoEForCausalLM.from_pretrained(base_path, **base_kwargs)
    return PeftModel.from_pretrained(base, str(path)).merge_and_unload()
