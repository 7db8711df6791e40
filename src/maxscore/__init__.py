"""maxscore: Maximum Score Routing and every baseline router for Mixture-of-Experts.

Importing the package registers the Llama-MoE model (``model_type = "maxscore_llama_moe"``) with
``AutoConfig``, ``AutoModel`` and ``AutoModelForCausalLM``, so checkpoints load with the Auto
classes. Everything else (training, evaluation, analysis) is imported on demand.
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from maxscore.models import LlamaMoEConfig, LlamaMoEForCausalLM, LlamaMoEModel, get_model_config

__version__ = "0.1.0"

# exist_ok: a checkpoint loaded with trust_remote_code may already have registered its copy.
AutoConfig.register(LlamaMoEConfig.model_type, LlamaMoEConfig, exist_ok=True)
AutoModel.register(LlamaMoEConfig, LlamaMoEModel, exist_ok=True)
AutoModelForCausalLM.register(LlamaMoEConfig, LlamaMoEForCausalLM, exist_ok=True)

__all__ = [
    "LlamaMoEConfig",
    "LlamaMoEForCausalLM",
    "LlamaMoEModel",
    "__version__",
    "get_model_config",
]
