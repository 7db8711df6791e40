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

Parameter groups are written merged by hyperparameters (:func:`_merged_param_groups`): an
FSDP2 run splits each of the Trainer's groups (weight decay / none) into its DTensor and its
plain parameters (a foreach or fused step cannot mix them), a run without FSDP2 does not, and
DCP fills a list of groups by position. Merged, the saved list is the same in every layout (and
the same as an unsplit run's, so older checkpoints load too); ``set_optimizer_state_dict`` then
hands each of the current optimizer's groups the hyperparameters of the saved group that holds
its parameters.

The model weights themselves stay in the Hugging Face ``model.safetensors`` (whole experts,
:func:`maxscore.parallel.sharding.full_state_dict`), which every loader understands.
"""

from __future__ import annotations

import copy
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
    "scheduler_state_for",
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


def _merged_param_groups(state: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """``state`` with its parameter groups merged by equal hyperparameters, each group's
    parameters in the model's order and the groups in the order of their first parameter."""
    groups: list[dict[str, Any]] = []
    for group in state["param_groups"]:
        hyper = {key: value for key, value in group.items() if key != "params"}
        same = next((g for g in groups if g["hyper"] == hyper), None)
        if same is None:
            groups.append({"hyper": hyper, "params": list(group["params"])})
        else:
            same["params"].extend(group["params"])
    rank = {name: index for index, name in enumerate(order)}
    for group in groups:
        group["params"].sort(key=lambda name: rank.get(name, len(rank)))
    groups.sort(key=lambda g: rank.get(g["params"][0], len(rank)) if g["params"] else len(rank))
    merged = [{**g["hyper"], "params": g["params"]} for g in groups]
    return {**state, "param_groups": merged}


def _regrouped(loaded: list[dict[str, Any]], current: list[dict[str, Any]]) -> list[dict]:
    """The loaded (merged) groups' hyperparameters laid out as the optimizer's own groups.

    ``set_optimizer_state_dict`` gives each loaded group's hyperparameters to one optimizer
    group only, so a merged group spanning two of them (the split groups of an FSDP2 run) would
    leave the other without any; here every current group takes them from the loaded group that
    holds its first parameter.
    """
    owner = {name: group for group in loaded for name in group["params"]}
    groups = []
    for group in current:
        source = owner.get(group["params"][0]) if group["params"] else None
        hyper = {k: v for k, v in (source or group).items() if k != "params"}
        groups.append({**hyper, "params": list(group["params"])})
    return groups


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
    bare = _bare(model)
    state = get_optimizer_state_dict(bare, _inner(optimizer))
    state = _merged_param_groups(state, [name for name, _ in bare.named_parameters()])
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
    current = get_optimizer_state_dict(bare, inner)
    state = _merged_param_groups(current, [name for name, _ in bare.named_parameters()])
    state = _as_global_views(state, sharding)
    with _quiet_single_process():
        dcp.load({"optimizer": state}, checkpoint_id=str(path), no_dist=_single_process())
    state = {**state, "param_groups": _regrouped(state["param_groups"], current["param_groups"])}
    set_optimizer_state_dict(
        bare, inner, _as_local(state, sharding), options=StateDictOptions(strict=True)
    )
    # A group whose parameters no saved group holds would be left without its hyperparameters
    # (its step would fail on a missing key, or worse run with another group's).
    for index, group in enumerate(inner.param_groups):
        missing = sorted(key for key in inner.defaults if key not in group)
        if missing:
            raise ValueError(
                f"{path}: the saved parameter groups do not cover the optimizer's group "
                f"{index} (missing {missing}); the checkpoint's groups differ from this run's"
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


def scheduler_state_for(state: dict[str, Any], groups: int) -> dict[str, Any]:
    """A learning-rate scheduler's state saved with another number of parameter groups, fitted
    to ``groups`` (an FSDP2 run splits its optimizer's groups, see the module docs).

    Per-group entries (``base_lrs``, ``_last_lr``, ``lr_lambdas``) are lists; where one has
    another length and all its entries are equal (one schedule for every group, as the Trainer
    builds it) it is repeated to ``groups`` entries. Different entries cannot be matched to
    groups: ValueError.
    """
    out = dict(state)
    for key, values in state.items():
        if not isinstance(values, list) or len(values) in (0, groups):
            continue
        if any(value != values[0] for value in values):
            raise ValueError(
                f"the scheduler state holds {len(values)} different {key!r} entries; the "
                f"optimizer has {groups} parameter groups"
            )
        out[key] = [copy.deepcopy(values[0]) for _ in range(groups)]
    return out
