"""Optimizer state through ``torch.distributed.checkpoint`` (DCP), resharded on load.

Under expert parallelism each process holds the optimizer state of its own experts, so the one
``optimizer.pt`` that process 0 writes under plain DDP would lose the others'. Here every
process writes its part into one DCP folder (``optimizer.dcp/``: a ``.metadata`` file and one
``.distcp`` file per writing process), in parallel:

* the state of every expert parameter (``exp_avg``, ``exp_avg_sq`` ``[e/P, ...]``) is presented
  to DCP as a ``DTensor`` view of the whole ``[e, ...]`` tensor, ``Shard(0)`` over the mesh's
  ``ep`` dimension and ``Replicate()`` over ``dp`` (``DTensor.from_local``, no copy), so DCP
  records where each block lies in the whole tensor and writes each block once;
* replicated state (dense parameters, ``step``) is written once (DCP deduplicates equal keys).

Loading builds the same structure for the *current* layout and lets DCP read each process's
block, whatever layout wrote it: a checkpoint saved with ``P = 2`` resumes with ``P = 4``, with
``P = 1`` on one process, or the other way round. The state dict is keyed by parameter name
(``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``), not by position, so the
optimizer's parameter order need not match either. FSDP2-sharded dense state is already DTensor
and is resharded the same way.

The model weights themselves stay in the Hugging Face ``model.safetensors`` (whole experts,
:func:`maxscore.parallel.sharding.full_state_dict`), which every loader understands.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard

from maxscore.parallel.sharding import ExpertSharding

__all__ = [
    "OPTIMIZER_DCP_DIR",
    "load_optimizer_state",
    "local_optimizer_state",
    "save_optimizer_state",
]

#: The DCP folder of the optimizer state inside a checkpoint.
OPTIMIZER_DCP_DIR = "optimizer.dcp"


def _bare(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer


def _as_global_views(state: dict[str, Any], sharding: ExpertSharding | None) -> dict[str, Any]:
    """Expert entries of an optimizer state dict as DTensor views of the whole tensors."""
    if sharding is None or sharding.ep_size == 1:
        return state
    placements = [Replicate(), Shard(0)]
    # New dicts: the per-parameter dicts of the state dict are the optimizer's own.
    per_name = dict(state["state"])
    for name, per_param in per_name.items():
        if name in sharding.layouts:
            per_name[name] = {
                key: DTensor.from_local(value, sharding.mesh, placements, run_check=False)
                if isinstance(value, torch.Tensor) and value.dim() > 0
                else value
                for key, value in per_param.items()
            }
    return {**state, "state": per_name}


def _as_local(state: dict[str, Any], sharding: ExpertSharding | None) -> dict[str, Any]:
    """The inverse of :func:`_as_global_views` (FSDP2's own DTensors stay)."""
    if sharding is None or sharding.ep_size == 1:
        return state
    per_name = dict(state["state"])
    for name, per_param in per_name.items():
        if name in sharding.layouts:
            per_name[name] = {
                key: value.to_local() if hasattr(value, "to_local") else value
                for key, value in per_param.items()
            }
    return {**state, "state": per_name}


def _single_process() -> bool:
    """No process group: DCP reads and writes everything itself (one process)."""
    return not (dist.is_available() and dist.is_initialized())


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    # DCP warns on every single-process call, even when asked for one (no_dist=True).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_optimizer_state(
    model: nn.Module, optimizer: Any, folder: str | Path, sharding: ExpertSharding | None
) -> Path:
    """Write the optimizer state to ``folder/optimizer.dcp`` (a collective: every process)."""
    path = Path(folder) / OPTIMIZER_DCP_DIR
    state = get_optimizer_state_dict(_bare(model), _inner(optimizer))
    state = {"optimizer": _as_global_views(state, sharding)}
    with _quiet_single_process():
        dcp.save(state, checkpoint_id=str(path), no_dist=_single_process())
    return path


def load_optimizer_state(
    model: nn.Module, optimizer: Any, folder: str | Path, sharding: ExpertSharding | None
) -> None:
    """Read ``folder/optimizer.dcp`` into ``optimizer``, resharded to the current layout."""
    path = Path(folder) / OPTIMIZER_DCP_DIR
    bare, inner = _bare(model), _inner(optimizer)
    # get_optimizer_state_dict creates the (zero) state of an optimizer that has not stepped
    # yet, so the structure DCP fills in is complete.
    state = _as_global_views(get_optimizer_state_dict(bare, inner), sharding)
    with _quiet_single_process():
        dcp.load({"optimizer": state}, checkpoint_id=str(path), no_dist=_single_process())
    set_optimizer_state_dict(
        bare, inner, _as_local(state, sharding), options=StateDictOptions(strict=True)
    )


def local_optimizer_state(
    full: dict[str, Any], model: nn.Module, optimizer: Any, sharding: ExpertSharding
) -> dict[str, Any]:
    """A one-process ``optimizer.state_dict()`` (whole experts) cut to this process's experts.

    For a run with expert parallelism resuming from a checkpoint written without it (its
    ``optimizer.pt``). Entries are matched by position, as ``Optimizer.load_state_dict`` does:
    the model and its optimizer are built the same way in both runs.
    """
    names = {id(p): n for n, p in _bare(model).named_parameters()}
    state = dict(full["state"])
    index = 0
    for group in _inner(optimizer).param_groups:
        for param in group["params"]:
            layout = sharding.layouts.get(names.get(id(param), ""))
            if layout is not None and index in state:
                state[index] = {
                    key: value[layout.local_slice()]
                    if isinstance(value, torch.Tensor) and value.dim() > 0
                    else value
                    for key, value in state[index].items()
                }
            index += 1
    return {"state": state, "param_groups": full["param_groups"]}
