"""maxscore: Maximum Score Routing and every baseline router for Mixture-of-Experts.

Importing the package registers the Llama-MoE model (``model_type = "maxscore_llama_moe"``) with
``AutoConfig``, ``AutoModel`` and ``AutoModelForCausalLM``, so checkpoints load with the Auto
classes. The registration happens once transformers is imported (at once if it already is), and
every name, here and in the subpackages, is imported on first use: ``maxscore --help`` starts
without loading torch or transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from maxscore._autoregister import register_when_transformers_loads
from maxscore._lazy import lazy_exports

if TYPE_CHECKING:
    from maxscore.models import LlamaMoEConfig, LlamaMoEForCausalLM, LlamaMoEModel, get_model_config

__version__ = "0.1.0"

register_when_transformers_loads()

_EXPORTS = {
    "maxscore.models": (
        "LlamaMoEConfig",
        "LlamaMoEForCausalLM",
        "LlamaMoEModel",
        "get_model_config",
    )
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = [
    "LlamaMoEConfig",
    "LlamaMoEForCausalLM",
    "LlamaMoEModel",
    "__version__",
    "get_model_config",
]
