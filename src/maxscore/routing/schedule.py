"""The schedule of the SoftTopk scale ``t`` (the paper's Eq. "SoftTopk" and Sec. 4, "Hyperparameter t").

``t`` starts at ``start`` and moves to ``end`` over ``steps`` optimizer steps, then stays at
``end``. The default (3 -> 0 over 30,000 steps, linear) reproduces the authors' code's effective
weights for k = 2: the second expert's weight factor ``1 + t`` goes from 4 to 1 (see
:class:`~maxscore.routing.config.TemperatureScheduleConfig` for why this differs from the text's
"t0 = 4 decaying to 1").

Unlike the authors' code, the step counter is a module buffer: it is saved in ``state_dict`` (so
it survives checkpoints and resume) and counts optimizer steps (the trainer calls
:meth:`TemperatureSchedule.advance` once per step), not forward calls.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from maxscore.routing.config import TemperatureScheduleConfig

__all__ = ["TemperatureSchedule"]


class TemperatureSchedule(nn.Module):
    """``t(step)`` for SoftTopk; ``step`` is a long buffer in the state dict.

    Shapes (``s`` = ``min(step / steps, 1)``):

    * ``linear``:   ``t = start + (end - start) · s``
    * ``cosine``:   ``t = end + (start - end) · (1 + cos(π s)) / 2``
    * ``constant``: ``t = start``

    ``steps = 0`` means the schedule is already finished (``t = end``; ``start`` for constant).
    """

    step: Tensor

    def __init__(self, config: TemperatureScheduleConfig | None = None) -> None:
        super().__init__()
        self.config = config if config is not None else TemperatureScheduleConfig()
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def advance(self, n: int = 1) -> None:
        """Count ``n`` more optimizer steps (in place, on the buffer's device; no host sync)."""
        if n < 0:
            raise ValueError(f"cannot advance the temperature schedule by a negative n={n}")
        self.step.add_(n)

    def value(self) -> Tensor:
        """``t`` at the current step: a 0-dim fp32 tensor on the buffer's device (no host sync)."""
        cfg = self.config
        if cfg.shape == "constant":
            return torch.full((), cfg.start, dtype=torch.float32, device=self.step.device)
        if cfg.steps == 0:
            return torch.full((), cfg.end, dtype=torch.float32, device=self.step.device)
        s = (self.step.to(torch.float32) / float(cfg.steps)).clamp(0.0, 1.0)
        if cfg.shape == "linear":
            return cfg.start + (cfg.end - cfg.start) * s
        return cfg.end + (cfg.start - cfg.end) * 0.5 * (1.0 + torch.cos(math.pi * s))

    def extra_repr(self) -> str:
        c = self.config
        return f"start={c.start}, end={c.end}, steps={c.steps}, shape={c.shape!r}"
