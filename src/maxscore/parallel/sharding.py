"""A model's experts sharded over the ``ep`` groups of the mesh, and full checkpoints of it.

:func:`apply_expert_parallel` gives every MoE layer of a model (any ``nn.Module`` holding
:class:`~maxscore.moe.MoE` layers) an :class:`~maxscore.moe.expert_parallel.ExpertParallel`
layout over the mesh's ``ep`` group and keeps only this process's block of each layer's stacked
expert weights. Parameter names do not change: ``model.layers.3.mlp.experts.gate_up`` is
``[e/P, D, 2F]`` on every process, holding experts ``r*e/P .. (r+1)*e/P - 1`` on ``ep`` rank
``r``. Everything else is untouched (replicated on every process).

Checkpoints stay the one-device Hugging Face format: :func:`full_state_dict` gathers every
expert tensor back to ``[e, ...]`` (an all-gather over the ``ep`` group of the writing process),
so ``model.safetensors`` loads with ``from_pretrained`` on one process (``maxscore eval`` /
``generate``) or any other layout, and :func:`local_state_dict` cuts this process's block out of
such a full state dict when a sharded run resumes. The optimizer state goes through
``torch.distributed.checkpoint`` instead (:mod:`maxscore.parallel.checkpoint`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from maxscore.moe.expert_parallel import ExpertParallel, all_gather_rows, shard_moe_experts
from maxscore.moe.layer import MoE
from maxscore.parallel.config import ParallelConfig

__all__ = [
    "ExpertSharding",
    "apply_expert_parallel",
    "full_state_dict",
    "local_state_dict",
    "moe_layers",
]

#: The stacked expert weights of a MoE layer that expert parallelism splits along dim 0.
EXPERT_WEIGHTS = ("gate_up", "down")


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """Every MoE layer of ``model`` with its qualified name."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


@dataclass
class ExpertSharding:
    """How a model's experts are spread: the mesh and each sharded parameter's layout.

    Attributes:
        mesh: the ``("dp", "ep")`` device mesh (:func:`maxscore.parallel.mesh.build_device_mesh`).
        layouts: qualified name of each sharded expert parameter -> its layer's layout.
    """

    mesh: DeviceMesh
    layouts: dict[str, ExpertParallel] = field(default_factory=dict)

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("ep")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("dp")

    @property
    def ep_size(self) -> int:
        return self.mesh.size(1)

    @property
    def dp_size(self) -> int:
        return self.mesh.size(0)

    @property
    def world_size(self) -> int:
        return self.mesh.size()

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def expert_names(self) -> frozenset[str]:
        return frozenset(self.layouts)

    def split_parameters(self, model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """``(dense, experts)``: the model's trainable parameters, replicated ones first."""
        dense, experts = [], []
        for name, param in _named_parameters(model):
            if param.requires_grad:
                (experts if name in self.layouts else dense).append(param)
        return dense, experts


def _named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    # A DDP / compile wrapper prefixes names; the sharding speaks the bare model's names.
    inner = getattr(model, "module", model)
    return inner.named_parameters()


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> ExpertSharding:
    """Shard every MoE layer's experts of ``model`` over ``mesh["ep"]`` (see module docs).

    Call on the bare model (before DDP wraps it and before the optimizer is built), on every
    process, with the same weights everywhere (a seeded init or a loaded checkpoint).
    """
    layers = moe_layers(model)
    ep_size = mesh.size(1)
    ParallelConfig(ep_size).check_experts([moe.num_experts for _, moe in layers])
    sharding = ExpertSharding(mesh)
    group = mesh.get_group("ep")
    for name, moe in layers:
        ep = ExpertParallel.of_group(group, moe.num_experts)
        shard_moe_experts(moe, ep)
        prefix = f"{name}.experts." if name else "experts."
        for weight in EXPERT_WEIGHTS:
            sharding.layouts[prefix + weight] = ep
    return sharding


def _whole(value: Tensor) -> Tensor:
    """A DTensor (an FSDP2 shard) all-gathered to the whole tensor; anything else as it is."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def full_state_dict(model: nn.Module, sharding: ExpertSharding) -> dict[str, Tensor] | None:
    """The model's state dict with every tensor whole (experts ``[e, ...]``), for a checkpoint.

    A collective that every process must call. Dense parameters sharded by FSDP2 (DTensors) are
    all-gathered first, on every process (their groups span all processes); then the processes
    with ``dp`` rank 0 (global rank 0, the writer, among them) gather the experts over their
    ``ep`` group. Returns the state dict there and ``None`` on the other processes.
    """
    state = {
        name: _whole(value) for name, value in getattr(model, "module", model).state_dict().items()
    }
    if sharding.dp_rank != 0:
        return None
    group = sharding.ep_group
    for name in sorted(sharding.layouts):  # the same order on every process
        state[name] = all_gather_rows(state[name].detach(), group)
    return state


def local_state_dict(full: Mapping[str, Tensor], sharding: ExpertSharding) -> dict[str, Tensor]:
    """This process's part of a full state dict: each expert tensor cut to its block."""
    out = dict(full)
    for name, ep in sharding.layouts.items():
        if name not in out:
            continue
        tensor = out[name]
        if tensor.shape[0] != ep.num_experts:
            raise ValueError(
                f"{name}: the checkpoint holds {tensor.shape[0]} experts, the model "
                f"{ep.num_experts}"
            )
        out[name] = tensor[ep.local_slice()]
    return out
