"""Hugging Face Llama-MoE model: configuration, model classes and size presets.

Importing this package (or :mod:`maxscore`, once transformers is loaded) registers the model with
``AutoConfig`` / ``AutoModel`` / ``AutoModelForCausalLM``::

    import maxscore
    from maxscore.models import get_model_config, LlamaMoEForCausalLM

    config = get_model_config("base", router="maxscore")
    model = LlamaMoEForCausalLM(config)
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from maxscore.models.configuration_llama_moe import LlamaMoEConfig
from maxscore.models.modeling_llama_moe import (
    LlamaMoECausalLMOutputWithPast,
    LlamaMoEForCausalLM,
    LlamaMoEModel,
    LlamaMoEModelOutputWithPast,
    LlamaMoEPreTrainedModel,
)
from maxscore.models.presets import MODEL_PRESETS, ModelPreset, get_model_config

# exist_ok: a checkpoint loaded with trust_remote_code may already have registered its copy.
AutoConfig.register(LlamaMoEConfig.model_type, LlamaMoEConfig, exist_ok=True)
AutoModel.register(LlamaMoEConfig, LlamaMoEModel, exist_ok=True)
AutoModelForCausalLM.register(LlamaMoEConfig, LlamaMoEForCausalLM, exist_ok=True)

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
