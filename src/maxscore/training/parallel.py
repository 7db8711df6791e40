"""``maxscore train --expert-parallel N``: expert parallelism inside the Trainer's data parallelism.

Under ``torchrun --nproc-per-node W ... --expert-parallel P`` the ``W`` processes form the mesh
``("dp", "ep") = (W / P, P)`` (:mod:`maxscore.parallel.mesh`); every MoE layer's experts are
spread over each ``ep`` group (:func:`maxscore.parallel.sharding.apply_expert_parallel`) and the
Trainer's DDP averages only the replicated parameters: the expert parameters are on DDP's ignore
list, and :class:`ExpertParallelTrainer` reduces their gradients over the ``dp`` groups and clips
by the global norm before each optimizer step (:mod:`maxscore.parallel.gradients`). Each process
keeps its own micro-batch and its own routing, as under plain DDP, so the global batch is still
``W x batch_size x grad_accum`` sequences.

Checkpoints (:class:`ExpertParallelTrainer`):

* ``model.safetensors`` holds the whole experts (gathered over the writer's ``ep`` group): the
  folder is an ordinary Hugging Face checkpoint that ``maxscore eval`` / ``generate`` and
  ``from_pretrained`` load on one process;
* ``optimizer.dcp/`` holds the optimizer state, every process writing its part through
  ``torch.distributed.checkpoint`` (:mod:`maxscore.parallel.checkpoint`), which reshards on load;
* ``scheduler.pt``, ``rng_state_<rank>.pth`` and ``trainer_state.json`` as usual.

With ``--fsdp`` the dense parameters are sharded over all processes by FSDP2 instead of being
replicated under DDP (:func:`maxscore.parallel.fsdp.shard_dense_parameters`; the experts stay
expert-parallel): the Trainer then prepares the model without DDP (autocast only), FSDP2
averages the dense gradients, checkpoints all-gather the dense shards into the same whole
``model.safetensors`` and the optimizer state goes into the same ``optimizer.dcp/``, so a run
with ``--fsdp`` resumes without it and the other way round.

So ``--resume`` works with the same layout and with another one (another ``P``, another number of
processes, or one process without expert parallelism); a run without it resumes into one with it
too (its ``optimizer.pt`` is cut to each process's experts). A resumed run on another number of
processes continues from the same weights, optimizer state, schedule and step, but not through
the same batches (the data order is per process).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DistributedType
from safetensors.torch import load_file
from torch.nn.parallel import DistributedDataParallel

from maxscore.parallel.checkpoint import (
    OPTIMIZER_DCP_DIR,
    load_optimizer_state,
    local_optimizer_state,
    save_optimizer_state,
    scheduler_state_for,
)
from maxscore.parallel.config import ParallelConfig
from maxscore.parallel.gradients import clip_grad_norm_, sync_expert_gradients, total_grad_norm
from maxscore.parallel.mesh import build_device_mesh
from maxscore.parallel.sharding import (
    ExpertSharding,
    apply_expert_parallel,
    full_state_dict,
    local_state_dict,
)
from maxscore.training.clipping import fused_adam
from maxscore.training.config import TrainConfig
from maxscore.training.distributed import unwrap
from maxscore.training.trainer import MaxScoreTrainer

__all__ = [
    "ExpertParallelTrainer",
    "read_model_weights",
    "trainer_for",
]


def read_model_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """The weights of a Hugging Face checkpoint folder (one safetensors file or an index)."""
    folder = Path(folder)
    single = folder / "model.safetensors"
    if single.is_file():
        return load_file(str(single), device="cpu")
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        raise FileNotFoundError(f"no model.safetensors (or its index) in {folder}")
    weights: dict[str, torch.Tensor] = {}
    for name in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        weights.update(load_file(str(folder / name), device="cpu"))
    return weights


class ExpertParallelTrainer(MaxScoreTrainer):
    """:class:`MaxScoreTrainer` for sharded experts (module docs): gradient reduction and
    clipping over all processes, whole-expert model checkpoints, DCP optimizer state.

    ``sharding`` is ``None`` for a run without expert parallelism that resumes from a
    checkpoint written with it (its optimizer state is in ``optimizer.dcp/``). ``fsdp``: the
    dense parameters were sharded by FSDP2 (:func:`trainer_for`).
    """

    def __init__(
        self, *args: Any, sharding: ExpertSharding | None = None, fsdp: bool = False, **kwargs: Any
    ):
        super().__init__(*args, **kwargs)
        self.sharding = sharding
        self.fsdp = fsdp

    # -- FSDP2 ----------------------------------------------------------------------------------
    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        if not (self.fsdp and training) or getattr(model, "_is_accelerate_prepared", False):
            return super()._wrap_model(model, training, dataloader)
        # FSDP2 already reduces the dense gradients: accelerate's prepare would wrap the model
        # in DDP, which refuses DTensor parameters. evaluation_mode prepares everything else
        # (autocast) and marks the model prepared, so the Trainer's own prepare call that
        # follows leaves it as it is.
        return self.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)

    def create_optimizer(self, model: Any = None) -> Any:
        optimizer = super().create_optimizer(model)
        if self.fsdp:
            _separate_dtensor_groups(getattr(optimizer, "optimizer", optimizer))
        return optimizer

    # -- gradients ------------------------------------------------------------------------------
    def _expert_gradients_ready(self, model: Any) -> tuple[list, list]:
        assert self.sharding is not None
        dense, experts = self.sharding.split_parameters(unwrap(model))
        sync_expert_gradients(experts, self.sharding)
        return dense, experts

    def _clip_grad_norm(self, model: Any) -> Any:
        if self.sharding is None:
            return super()._clip_grad_norm(model)
        dense, experts = self._expert_gradients_ready(model)
        plain = self.accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_GPU)
        # Not under FSDP2: the fused step's grad_scale (a plain tensor) would meet DTensors.
        plain = plain and not self.fsdp
        fused = fused_adam(self.optimizer) if plain and self.accelerator.scaler is None else None
        return clip_grad_norm_(dense, experts, self.sharding, self.args.max_grad_norm, fused)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        # Without clipping (--max-grad-norm 0) the experts' gradients are reduced here.
        if self.sharding is not None and grad_norm is None:
            dense, experts = self._expert_gradients_ready(model)
            grad_norm = total_grad_norm(dense, experts, self.sharding)
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    # -- checkpoints ----------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self.sharding is None:
            return super().save_model(output_dir, _internal_call)
        state = full_state_dict(unwrap(self.model), self.sharding)  # a collective
        if self.args.should_save:
            with _unsharded_class(unwrap(self.model)):
                self._save(output_dir or self.args.output_dir, state_dict=state)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.sharding is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        save_optimizer_state(self.model, self.optimizer, output_dir, self.sharding)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        # Every process's files are in the staging folder before process 0 records and
        # publishes it (MaxScoreTrainer._save_checkpoint).
        self.accelerator.wait_for_everyone()

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self.sharding is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        target = unwrap(model if model is not None else self.model)
        weights = local_state_dict(read_model_weights(resume_from_checkpoint), self.sharding)
        if self.fsdp:
            from maxscore.parallel.fsdp import distribute_like

            weights = distribute_like(target, weights)
        self._issue_warnings_after_load(target.load_state_dict(weights, strict=False))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        folder = Path(checkpoint or "")
        if checkpoint is not None and (folder / OPTIMIZER_DCP_DIR).is_dir():
            load_optimizer_state(self.model, self.optimizer, folder, self.sharding)
        elif checkpoint is not None and self.sharding is not None:
            if self.fsdp:
                raise ValueError(
                    f"{checkpoint} holds its optimizer state in optimizer.pt (a run without "
                    "expert parallelism): resume it without --fsdp first, whose next checkpoint "
                    "writes optimizer.dcp/"
                )
            full = torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True)
            state = local_optimizer_state(full, self.model, self.optimizer, self.sharding)
            self.optimizer.load_state_dict(state)
        else:
            return super()._load_optimizer_and_scheduler(checkpoint)
        saved = torch.load(folder / "scheduler.pt", map_location="cpu", weights_only=True)
        groups = len(getattr(self.optimizer, "optimizer", self.optimizer).param_groups)
        self.lr_scheduler.load_state_dict(scheduler_state_for(saved, groups))


@contextmanager
def _unsharded_class(model: torch.nn.Module) -> Iterator[None]:
    """The model as its own class while it is saved, not FSDP2's subclass of it.

    ``fully_shard`` turns ``LlamaMoEForCausalLM`` into ``FSDPLlamaMoEForCausalLM`` (a subclass
    defined inside torch); ``save_pretrained`` would record that class in ``config.json``'s
    ``auto_map`` and copy torch's FSDP source files into the checkpoint instead of the model's
    own code. Saving reads parameters only (no forward), so the swap is safe for its duration.
    """
    from torch.distributed.fsdp import FSDPModule

    cls = type(model)
    if not issubclass(cls, FSDPModule):
        yield
        return
    model.__class__ = next(b for b in cls.__bases__ if not issubclass(b, FSDPModule))
    try:
        yield
    finally:
        model.__class__ = cls


def _separate_dtensor_groups(optimizer: torch.optim.Optimizer) -> None:
    """Split every parameter group into its FSDP2-sharded (DTensor) and its plain parameters.

    A foreach or fused AdamW step handles one group's tensors in one call, which cannot mix
    DTensors with plain tensors (the experts). Before the first step, so there is no state to
    move; recent transformers versions split the groups themselves (then nothing changes here).
    """
    from torch.distributed.tensor import DTensor

    groups: list[dict[str, Any]] = []
    for group in optimizer.param_groups:
        kinds: dict[Any, list[Any]] = {}
        for param in group["params"]:
            mesh = param.device_mesh if isinstance(param, DTensor) else None
            kinds.setdefault(mesh, []).append(param)
        groups.extend({**group, "params": params} for params in kinds.values())
    optimizer.param_groups[:] = groups


def _ddp_ignores(model: torch.nn.Module, sharding: ExpertSharding) -> None:
    """Keep DDP's all-reduce (averaging over every process) off the experts."""
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, sorted(sharding.expert_names)
    )


def trainer_for(
    model: torch.nn.Module, config: TrainConfig, args: Any, resume_from: Path | None
) -> tuple[type[MaxScoreTrainer], dict[str, Any]]:
    """The Trainer class for this run and its extra arguments; shards the experts of ``model``.

    ``args`` are the run's ``TrainingArguments`` (reading ``args.device`` sets up the process
    group). Without expert parallelism (and no ``optimizer.dcp`` to resume from) the plain
    :class:`MaxScoreTrainer`.
    """
    resumes_dcp = resume_from is not None and (Path(resume_from) / OPTIMIZER_DCP_DIR).is_dir()
    if config.expert_parallel == 1:
        if resumes_dcp:
            return ExpertParallelTrainer, {"sharding": None}
        return MaxScoreTrainer, {}
    _ = args.device  # initialises the process group (accelerate's PartialState)
    mesh = build_device_mesh(ParallelConfig(config.expert_parallel))
    sharding = apply_expert_parallel(model, mesh)
    if config.fsdp:
        from maxscore.parallel.fsdp import shard_dense_parameters

        shard_dense_parameters(model, sharding)
    else:
        _ddp_ignores(model, sharding)
    return ExpertParallelTrainer, {"sharding": sharding, "fsdp": config.fsdp}
