"""How long the SoftTopk ``t`` schedule runs in a training run (the paper's Sec. "Hyperparameter t").

The authors decay ``t`` over the first 30,000 of their 180,000 optimizer steps: 1/6 of the run.
A run of a few hundred steps that keeps the absolute 30,000 never leaves ``t ≈ t0`` (a 400-step
Base run ends at t = 2.96 instead of 0), and in such a run MaxScore loses its lead over GShard,
which the proportioned schedule keeps (0.02 nats on two seeds). So in training the length
follows the run:

1. ``TrainConfig.temperature_steps`` when given (``--temperature-steps``; the ``paper`` recipe
   sets 30,000), or ``router_overrides["temperature"]["steps"]``: an explicit length;
2. else, when resuming, the length stored in the run directory's ``config.json`` when the run
   started, so a resumed run continues the same schedule even if its step budget changed;
3. else ``round(temperature_fraction * total_steps)`` (default 1/6: 30k of the paper's 180k).

The resolved schedule is written into the model's router config (so checkpoints carry it) and
into ``config.json`` under ``resolved.temperature_schedule``. A router or MoE layer built outside
training keeps :class:`~maxscore.routing.config.TemperatureScheduleConfig`'s documented default,
3 -> 0 over 30,000 steps.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from maxscore.routing.config import RouterConfig
from maxscore.training.config import TrainConfig

__all__ = [
    "PAPER_TEMPERATURE_FRACTION",
    "PAPER_TEMPERATURE_STEPS",
    "PAPER_TOTAL_STEPS",
    "ResolvedTemperature",
    "apply_temperature",
    "resolve_temperature",
]

#: The authors' schedule length and run length, in optimizer steps.
PAPER_TEMPERATURE_STEPS = 30_000
PAPER_TOTAL_STEPS = 180_000
#: The share of a run over which training anneals ``t`` by default (1/6).
PAPER_TEMPERATURE_FRACTION = PAPER_TEMPERATURE_STEPS / PAPER_TOTAL_STEPS


@dataclass(frozen=True)
class ResolvedTemperature:
    """The ``t`` schedule a run uses: the router's start / end / shape plus the resolved length.

    Attributes:
        start, end, shape: from the router preset and ``router_overrides``.
        steps: optimizer steps over which ``t`` goes from ``start`` to ``end``.
        source: where ``steps`` came from: ``"explicit"``, ``"stored"`` (resume) or
            ``"fraction"`` (of the run's optimizer steps).
        fraction: ``steps / total_steps`` of this run.
    """

    start: float
    end: float
    steps: int
    shape: str
    source: str
    fraction: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _stored_steps(run_dir: Path) -> int | None:
    """The schedule length of the run stored in ``run_dir`` (its model's router config), if any.

    The model section of ``config.json`` holds the router config the run was built with, in
    runs written before the length followed the run too (those used the fixed 30,000).
    """
    path = run_dir / "config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        stored = data["model"]["router_config"]["temperature"]["steps"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return None
    return stored if isinstance(stored, int) else None


def resolve_temperature(
    config: TrainConfig, router_config: RouterConfig, total_steps: int, resume_from: Path | None
) -> ResolvedTemperature:
    """The schedule of this run (module docstring: explicit, else stored on resume, else 1/6).

    Args:
        config: the training config (``temperature_steps``, ``temperature_fraction``).
        router_config: the run's resolved :class:`~maxscore.routing.config.RouterConfig`.
        total_steps: optimizer steps of the run.
        resume_from: the checkpoint a resume starts from (``None``: a fresh run).
    """
    schedule = router_config.temperature
    given = config.router_overrides.get("temperature")
    # A dict from the CLI / JSON, or a TemperatureScheduleConfig from Python.
    override = given.get("steps") if isinstance(given, dict) else getattr(given, "steps", None)
    stored = _stored_steps(config.run_dir) if resume_from is not None else None
    if config.temperature_steps is not None:
        steps, source = config.temperature_steps, "explicit"
    elif override is not None:
        steps, source = int(override), "explicit"
    elif stored is not None:
        steps, source = stored, "stored"
    else:
        steps, source = round(config.temperature_fraction * total_steps), "fraction"
    return ResolvedTemperature(
        start=schedule.start,
        end=schedule.end,
        steps=steps,
        shape=schedule.shape,
        source=source,
        fraction=steps / max(total_steps, 1),
    )


def apply_temperature(model_config: Any, temperature: ResolvedTemperature) -> None:
    """Write the resolved length into ``model_config``'s router config (checkpoints keep it)."""
    router = model_config.router_config
    schedule = replace(router.temperature, steps=temperature.steps)
    model_config.router_config = replace(router, temperature=schedule)
