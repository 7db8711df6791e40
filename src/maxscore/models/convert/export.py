"""Writing a converted Llama-MoE model back in its source family's format."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoConfig, PreTrainedModel

from maxscore.file_modes import give_default_file_modes
from maxscore.models.adapters import is_adapter_checkpoint, load_merged
from maxscore.models.convert.family import (
    ConversionError,
    build_with_weights,
    maxscore_to_family_state,
)
from maxscore.models.convert.registry import FAMILIES
from maxscore.models.convert.upcycled_layout import upcycled_layout
from maxscore.models.modeling_llama_moe import LlamaMoEForCausalLM
from maxscore.routing.router import Router

__all__ = ["TOKENIZER_FILES", "export_pretrained", "to_family_model"]

#: Tokenizer files copied next to an exported (or upcycled) model when the source has them.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)


def _check_routing(model: LlamaMoEForCausalLM, allow_routing_change: bool) -> dict[str, Any]:
    """The family-config fields for the model's routing (raises when it cannot be expressed)."""
    config = model.config
    spec = FAMILIES[config.source_family]
    router_config = config.router_config.to_dict()
    if allow_routing_change:
        try:
            return spec.routing_config(router_config)
        except ConversionError:
            # Keep whatever the original checkpoint said about the weighting.
            return {}
    fields = spec.routing_config(router_config)
    for module in model.modules():
        if not isinstance(module, Router):
            continue
        if router_config["operator"] == "softtopk" and float(module.temperature()) != 0.0:
            raise ConversionError(
                f"cannot export to {config.source_family}: the SoftTopk scale t is "
                f"{float(module.temperature()):.3g}, not 0, so expert weights are boosted beyond "
                "the softmax; export after the t schedule has ended, or pass "
                "allow_routing_change=True (--allow-routing-change)"
            )
        if bool(module.expert_bias.ne(0).any()):
            raise ConversionError(
                f"cannot export to {config.source_family}: the routers carry a DeepSeek-V3 "
                "balancing bias the family has no place for; pass allow_routing_change=True"
            )
        break
    return fields


def to_family_model(
    model: LlamaMoEForCausalLM, allow_routing_change: bool = False
) -> PreTrainedModel:
    """The model as an instance of its source family's transformers class (same weights): the
    family it was converted from, or for an upcycled model the family whose layout holds it.

    In ``eval()`` mode the result's logits equal ``model``'s (the routing check guarantees the
    family routes as ``model`` does in evaluation). Raises :class:`ConversionError` for a model
    that was not converted from a family, or whose routing the family cannot express unless
    ``allow_routing_change`` (then the weights are exported and the family's routing applies).
    """
    config = model.config
    if config.upcycled_from is not None and config.source_family is None:
        upcycled_layout(config)  # raises with the reason no family holds it
    if config.source_family not in FAMILIES or config.source_config is None:
        raise ConversionError(
            "this model was not converted from a Hugging Face MoE family (no source_family / "
            "source_config in its config), so there is no format to export it to"
        )
    spec = FAMILIES[config.source_family]
    family_fields = _check_routing(model, allow_routing_change)
    source = {
        key: value
        for key, value in config.source_config.items()
        if key not in ("transformers_version", "architectures", "model_type")
    }
    source.update(family_fields)
    hf_config = AutoConfig.for_model(config.source_family, **source)
    model_class = getattr(transformers, spec.model_class)
    hf_model = build_with_weights(
        lambda: model_class(hf_config),
        maxscore_to_family_state(model.state_dict()),
        lambda name: bool(hf_config.tie_word_embeddings) and name == "lm_head.weight",
        spec.model_class,
    )
    hf_model.eval()
    return hf_model


def export_pretrained(
    model: LlamaMoEForCausalLM | str | Path,
    output_dir: str | Path,
    allow_routing_change: bool = False,
) -> Path:
    """Save ``model`` (or the maxscore checkpoint at that path) in its source family's format.

    The output loads with the family's transformers class (``AutoModelForCausalLM``, no remote
    code). Tokenizer files of a checkpoint directory are copied along. A LoRA run's checkpoint
    (a peft adapter) is merged into its base first.
    """
    source_dir: Path | None = None
    if not isinstance(model, LlamaMoEForCausalLM):
        source_dir = Path(model)
        if is_adapter_checkpoint(source_dir):
            model = load_merged(source_dir)  # a LoRA checkpoint: its adapter merged into the base
        else:
            model = LlamaMoEForCausalLM.from_pretrained(str(source_dir))
    hf_model = to_family_model(model, allow_routing_change)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_model.save_pretrained(out)
    give_default_file_modes(out)
    if source_dir is not None:
        for name in TOKENIZER_FILES:
            if (source_dir / name).is_file() and not (out / name).exists():
                shutil.copyfile(source_dir / name, out / name)
    return out
