"""The family table: transformers ``model_type`` -> :class:`~.family.FamilySpec`."""

from __future__ import annotations

from maxscore.models.convert.family import FamilySpec
from maxscore.models.convert.mixtral import MIXTRAL
from maxscore.models.convert.olmoe import OLMOE
from maxscore.models.convert.qwen_moe import QWEN2_MOE, QWEN3_MOE

__all__ = ["FAMILIES"]

#: Supported families by transformers ``model_type``.
FAMILIES: dict[str, FamilySpec] = {
    spec.model_type: spec for spec in (MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE)
}
