"""The processes as a 2-D ``DeviceMesh``: ``("dp", "ep")``.

Mesh dimension ``ep`` (size ``P``) holds the processes that together hold one copy of the
experts and exchange tokens by all-to-all; ``dp`` (size ``D = W / P``) holds the processes that
hold the same experts (data-parallel replicas of them). The ``ep`` groups are runs of consecutive
ranks (ranks ``0 .. P-1``, ``P .. 2P-1``, ...), so with ``torchrun --nproc-per-node`` a multiple
of ``P`` an expert-parallel group never spans two machines: the all-to-all stays on NVLink, and
only the experts' gradient all-reduce (over ``dp``) and the dense parameters' one cross machines.

``torch.distributed.device_mesh.init_device_mesh`` builds the process groups (one collective
``new_group`` per group, on every process); meshes are cached per shape, so several runs in one
process (``maxscore compare``) reuse them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from maxscore.parallel.config import ParallelConfig

__all__ = ["build_device_mesh", "default_device_type"]

_MESHES: dict[tuple[str, int, int], DeviceMesh] = {}


def default_device_type() -> str:
    """``"cuda"`` where the process group runs on GPUs (NCCL), else ``"cpu"`` (gloo)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_device_mesh(config: ParallelConfig, device_type: str | None = None) -> DeviceMesh:
    """The ``("dp", "ep")`` mesh of all processes of the (initialised) default process group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "expert parallelism needs a process group: launch with torchrun (or call "
            "torch.distributed.init_process_group first)"
        )
    world = dist.get_world_size()
    config.check_world_size(world)
    device_type = device_type or default_device_type()
    key = (device_type, world, config.expert_parallel)
    mesh = _MESHES.get(key)
    if mesh is None:
        shape = (config.data_parallel(world), config.expert_parallel)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=("dp", "ep"))
        _MESHES[key] = mesh
    return mesh
