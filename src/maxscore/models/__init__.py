"""Hugging Face Llama-MoE model: configuration, model classes and size presets.

Importing :mod:`maxscore` registers the model with ``AutoConfig`` / ``AutoModelForCausalLM``::

    import maxscore
    from maxscore.models import get_model_config, LlamaMoEForCausalLM

    config = get_model_config("base", router="maxscore")
    model = LlamaMoEForCausalLM(config)
"""

from __future__ import annotations

from maxscore.models.configuration_llama_moe import LlamaMoEConfig
from maxscore.models.modeling_llama_moe import (
    LlamaMoECausalLMOutputWithPast,
    LlamaMoEForCausalLM,
    LlamaMoEModel,
    LlamaMoEModelOutputWithPast,
    LlamaMoEPreTrainedModel,
)
from maxscore.models.presets import MODEL_PRESETS, ModelPreset, get_model_config

__all__ = [
    "MODEL_PRESETS",
    "LlamaMoECausalLMOutputWithPast",
    "LlamaMoEConfig",
    "LlamaMoEForCausalLM",
    "LlamaMoEModel",
    "LlamaMoEModelOutputWithPast",
    "LlamaMoEPreTrainedModel",
    "ModelPreset",
    "get_model_config",
]
