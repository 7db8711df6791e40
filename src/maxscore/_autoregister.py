"""Registration of the Llama-MoE model with transformers' Auto classes, deferred until needed.

``import maxscore`` promises that ``AutoConfig`` / ``AutoModelForCausalLM`` know the model
(``model_type = "maxscore_llama_moe"``). Registering imports torch and transformers (several
seconds), which ``maxscore --help`` must not pay. So: when transformers is already imported the
model is registered at once; otherwise a one-shot import hook registers it right after
transformers finishes importing, i.e. before any Auto class can be used.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

_MODELS = "maxscore.models"  # registers the model when it is imported


def register_now() -> None:
    """Import :mod:`maxscore.models`, which registers the model with the Auto classes."""
    if _MODELS not in sys.modules:  # being imported (it registers at its end) or done
        importlib.import_module(_MODELS)


class _RegisterAfterTransformers(importlib.abc.MetaPathFinder):
    """Wraps the loader of the ``transformers`` package so registration follows its import."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "transformers":
            return None
        sys.meta_path.remove(self)  # one shot; also keeps find_spec below from recursing
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            register_now()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def register_when_transformers_loads() -> None:
    """Register now if transformers is loaded, else right after it is (see the module doc)."""
    if "transformers" in sys.modules:
        register_now()
    elif not any(isinstance(f, _RegisterAfterTransformers) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterTransformers())
