"""How a run is spread over its processes: :class:`ParallelConfig`.

The processes form a 2-D grid (:mod:`maxscore.parallel.mesh`): ``W = D x P`` processes, where
``P = expert_parallel`` processes share one copy of the experts (each holds ``e / P`` of every MoE
layer's experts) and ``D = W / P`` such groups are data-parallel replicas of the experts. Every
process holds the dense parameters (attention, embeddings, routers, shared experts) and routes its
own micro-batch, so for the dense parameters all ``W`` processes are data-parallel.

Nothing here imports torch: the CLI checks the options before anything heavy loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ParallelConfig", "ParallelConfigError"]


class ParallelConfigError(ValueError):
    """A parallel layout that cannot work (sizes that do not divide)."""


@dataclass(frozen=True)
class ParallelConfig:
    """The parallel layout of a run.

    Attributes:
        expert_parallel: ``P``, processes over which each MoE layer's experts are spread (1: every
            process holds every expert, plain data parallelism). Must divide the number of
            processes and every MoE layer's number of experts.
    """

    expert_parallel: int = 1

    def __post_init__(self) -> None:
        p = self.expert_parallel
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise ParallelConfigError(f"expert_parallel must be an int >= 1, got {p!r}")

    @property
    def enabled(self) -> bool:
        """Whether experts are spread over several processes."""
        return self.expert_parallel > 1

    def data_parallel(self, world_size: int) -> int:
        """``D = W / P``: the replicas of each expert (after :meth:`validate`)."""
        return world_size // self.expert_parallel

    def validate(self, world_size: int, num_experts: Sequence[int] = ()) -> None:
        """Raise :class:`ParallelConfigError` unless ``P`` divides ``world_size`` and every
        MoE layer's expert count in ``num_experts`` (an empty sequence: a model with no MoE
        layer, refused when ``P > 1``: there would be nothing to spread)."""
        self.check_world_size(world_size)
        self.check_experts(num_experts)

    def check_world_size(self, world_size: int) -> None:
        """Raise unless ``P`` divides the number of processes."""
        p = self.expert_parallel
        if world_size % p != 0:
            raise ParallelConfigError(
                f"--expert-parallel {p} must divide the number of processes ({world_size}); "
                f"launch a multiple of {p} processes (torchrun --nproc-per-node ...)"
            )

    def check_experts(self, num_experts: Sequence[int]) -> None:
        """Raise unless ``P`` divides every MoE layer's number of experts (``P > 1`` only)."""
        p = self.expert_parallel
        if p == 1:
            return
        if not num_experts:
            raise ParallelConfigError(
                f"--expert-parallel {p}: the model has no MoE layer whose experts could be spread"
            )
        for e in sorted(set(num_experts)):
            if e % p != 0:
                raise ParallelConfigError(
                    f"--expert-parallel {p} must divide the number of experts ({e}); every "
                    "process holds the same number of experts"
                )
