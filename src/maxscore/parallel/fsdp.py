"""FSDP2 (``torch.distributed.fsdp.fully_shard``) of the dense parameters around sharded experts.

Expert parallelism splits the experts; the rest of the model (attention, embeddings, LM head,
routers, norms) is replicated on every process. For models whose dense part does not fit, or
whose replicated optimizer state costs too much, :func:`shard_dense_parameters` shards it over
all ``W`` processes with FSDP2: one ``fully_shard`` per decoder layer (the model's
``_no_split_modules``) and one for the root, each gathering its parameters for its forward and
backward and reduce-scattering (averaging) their gradients. The experts are passed as
``ignored_params``: FSDP2 leaves them alone (they are already split by expert parallelism, and
their gradients are reduced over the mesh's ``dp`` groups by
:func:`maxscore.parallel.gradients.sync_expert_gradients`).

``maxscore train --expert-parallel N --fsdp`` applies it after sharding the experts
(:func:`maxscore.training.parallel.trainer_for`); checkpoints stay whole (the dense shards are
all-gathered into ``model.safetensors``, :func:`distribute_like` cuts them again on resume).

Why FSDP2 and not ZeRO here: it is PyTorch's own, composes with the expert layout per parameter
(``ignored_params``), keeps parameters as ``DTensor`` so the optimizer checkpoint reshards
through the same ``torch.distributed.checkpoint`` path as the experts', and runs on gloo (CPU),
so it is tested without GPUs. ``torch >= 2.7`` (``ignored_params``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from maxscore.parallel.mesh import default_device_type
from maxscore.parallel.sharding import ExpertSharding

__all__ = ["distribute_like", "shard_dense_parameters"]

_WORLD_MESHES: dict[tuple[str, int], DeviceMesh] = {}


def _world_mesh(device_type: str) -> DeviceMesh:
    """A 1-D mesh of all processes (cached: building one creates a process group)."""
    key = (device_type, dist.get_world_size())
    if key not in _WORLD_MESHES:
        _WORLD_MESHES[key] = init_device_mesh(device_type, (key[1],), mesh_dim_names=("fsdp",))
    return _WORLD_MESHES[key]


def _blocks(model: nn.Module) -> list[nn.Module]:
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def shard_dense_parameters(
    model: nn.Module, sharding: ExpertSharding | None, **fully_shard_kwargs: Any
) -> nn.Module:
    """``fully_shard`` each decoder block and the root of ``model`` over all processes, with
    the expert-parallel experts (``sharding``) ignored; returns ``model`` (now an FSDP module).

    ``fully_shard_kwargs`` go to every ``fully_shard`` call (``mp_policy``,
    ``reshard_after_forward``, ...).
    """
    device_type = sharding.mesh.device_type if sharding is not None else default_device_type()
    mesh = _world_mesh(device_type)
    ignored: set[nn.Parameter] = set()
    if sharding is not None:
        ignored = set(sharding.split_parameters(model)[1])
    blocks = _blocks(model)
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} names no decoder blocks (_no_split_modules) to shard"
        )
    # torch warns when a sharded block returns a view (an in-place op on it would skip FSDP2's
    # pre-backward hook); the decoder layers return the router logits as a view, which nothing
    # modifies in place, so the warning (once per layer and step) is noise here.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    for block in blocks:
        block_ignored = {p for p in block.parameters() if p in ignored}
        fully_shard(block, mesh=mesh, ignored_params=block_ignored or None, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, ignored_params=ignored or None, **fully_shard_kwargs)
    return model


def distribute_like(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (whole tensors, a checkpoint's) with every entry that ``model`` holds as a
    DTensor (FSDP2-sharded) cut to this process's shard of it, ready for ``load_state_dict``.

    No communication: every process read the whole tensor from the checkpoint, so each takes its
    own shard (``src_data_rank=None``) instead of receiving it from rank 0.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    out = dict(state)
    for name, current in model.state_dict().items():
        if isinstance(current, DTensor) and name in out:
            whole = out[name].to(device=current.device, dtype=current.dtype)
            out[name] = distribute_tensor(
                whole, current.device_mesh, current.placements, src_data_rank=None
            )
    return out
