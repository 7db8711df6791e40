"""Training on several processes: expert parallelism inside data parallelism, on PyTorch pieces.

* :mod:`~maxscore.parallel.config`: :class:`ParallelConfig` (the expert-parallel size) and its
  checks against the world size and the number of experts.
* :mod:`~maxscore.parallel.mesh`: the 2-D ``DeviceMesh`` ``("dp", "ep")`` of the processes.
* :mod:`~maxscore.parallel.sharding`: shard a model's experts over the ``ep`` groups
  (:func:`apply_expert_parallel`), gather them back for a full checkpoint, slice a full one.
* :mod:`~maxscore.parallel.gradients`: the experts' gradient reduction over the ``dp`` groups
  and the global gradient norm / clipping.
* :mod:`~maxscore.parallel.checkpoint`: optimizer state through ``torch.distributed.checkpoint``
  (resharded on load: saved on N processes, resumed on M).
* :mod:`~maxscore.parallel.fsdp`: FSDP2 (``fully_shard``) of the dense parameters around the
  expert-parallel experts.

The token exchange itself is :mod:`maxscore.moe.expert_parallel`. Names resolve lazily.
"""

from typing import TYPE_CHECKING

from maxscore._lazy import lazy_exports

if TYPE_CHECKING:
    from maxscore.parallel.checkpoint import load_optimizer_state, save_optimizer_state
    from maxscore.parallel.config import ParallelConfig
    from maxscore.parallel.fsdp import shard_dense_parameters
    from maxscore.parallel.gradients import clip_grad_norm_, sync_expert_gradients
    from maxscore.parallel.mesh import build_device_mesh
    from maxscore.parallel.sharding import (
        ExpertSharding,
        apply_expert_parallel,
        full_state_dict,
        local_state_dict,
    )

_EXPORTS = {
    "maxscore.parallel.checkpoint": ("load_optimizer_state", "save_optimizer_state"),
    "maxscore.parallel.config": ("ParallelConfig",),
    "maxscore.parallel.fsdp": ("shard_dense_parameters",),
    "maxscore.parallel.gradients": ("clip_grad_norm_", "sync_expert_gradients"),
    "maxscore.parallel.mesh": ("build_device_mesh",),
    "maxscore.parallel.sharding": (
        "ExpertSharding",
        "apply_expert_parallel",
        "full_state_dict",
        "local_state_dict",
    ),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = [
    "ExpertSharding",
    "ParallelConfig",
    "apply_expert_parallel",
    "build_device_mesh",
    "clip_grad_norm_",
    "full_state_dict",
    "load_optimizer_state",
    "local_state_dict",
    "save_optimizer_state",
    "shard_dense_parameters",
    "sync_expert_gradients",
]
