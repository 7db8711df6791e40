"""A new router on a pretrained model leaves the model as it is at step 0.

Every supported family (and every dense model, through upcycling) combines its experts with
plain softmax weights. MaxScore's SoftTopk (the paper's Eq. "SoftTopk") boosts the rank-r choice
of a token to ``Softmax(a)_i * (1 + t (min(r, k) - 1))``; with the paper's schedule starting at
``t = 3`` a converted model would compute something else before any update (eval logits move,
and ``export`` is refused until ``t`` is back at 0). So the rule is:

    When a SoftTopk preset is put on weights trained under softmax weights (a checkpoint
    converted from a family, an upcycled model, or a checkpoint of either given another
    router), its ``t`` schedule starts at its end value (``t = 0``: the softmax).

At step 0 the model then computes what it did wherever MaxScore's assignment (the flow of
Eq. 7-8) gives a token the experts the family's top-k gives it, and only the assignment is new.
An explicit ``temperature.start`` in the router options wins
(``--router-option temperature='{"start": 3}'`` anneals as in pre-training). Models built from
scratch keep the preset's schedule (3 -> 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from maxscore.routing.operators import get_operator_spec
from maxscore.routing.resolve import resolve_router

__all__ = ["warm_start_fields"]


def warm_start_fields(
    preset: str, fields: Mapping[str, Any], given: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The ``temperature`` field that starts ``preset``'s SoftTopk schedule at its end.

    ``fields``: the router fields chosen so far (they resolve the operator and schedule);
    ``given``: those the user gave (default: ``fields``). ``{}`` when the operator has no ``t``
    or ``given`` names a start.
    """
    explicit = (fields if given is None else given).get("temperature")
    if hasattr(explicit, "__dataclass_fields__"):
        return {}  # a whole TemperatureScheduleConfig: every value given
    if "start" in dict(explicit or {}):
        return {}
    resolved = resolve_router(preset, fields)
    if not get_operator_spec(resolved.operator).uses_temperature:
        return {}
    schedule = asdict(resolved.temperature)
    return {"temperature": {**schedule, "start": schedule["end"]}}
