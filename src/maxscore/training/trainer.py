"""The trainer itself: :class:`MaxScoreTrainer`, the Hugging Face ``Trainer`` of a run.

What it changes in the stock ``Trainer``:

* MoE metrics: the aux loss of every micro-batch and the routing statistics of every optimizer
  step are kept on the device and added to the training logs at logging steps
  (:class:`~maxscore.training.metrics.TrainingMetrics`); evaluation logs get the perplexity, and
  a validation set that carries each token's document its loss over documents with the standard
  error (:mod:`maxscore.training.validation_set`);
* atomic checkpoints: written into a staging folder, verified (``integrity.json``), renamed into
  place, then old ones rotated (:mod:`maxscore.training.checkpoint`); a failed save leaves the
  published checkpoints untouched;
* full training micro-batches only, gradient clipping folded into the fused AdamW step where
  that is exact (:mod:`maxscore.training.clipping`), and a CPU multi-process resume fix.

A run is prepared and started by :mod:`maxscore.training.run`; the callbacks it adds are in
:mod:`maxscore.training.callbacks`.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DistributedType
from transformers import Trainer

from maxscore.checkpoints.integrity import write_integrity_record
from maxscore.checkpoints.layout import CONFIG_FILE
from maxscore.training import checkpoint as ckpt
from maxscore.training.callbacks import RoutingStatisticsCallback
from maxscore.training.clipping import clip_grad_norm_in_fused_adam, fused_adam
from maxscore.training.metrics import TrainingMetrics

# Scripts that build a model the way a run does import these from here as well.
from maxscore.training.model_build import build_model, build_model_config
from maxscore.training.precision import keep_half_precision_outputs
from maxscore.training.validation_set import DOCUMENT_KEY, DocumentLosses, ValidationSummary

__all__ = ["TRAIN_CONFIG_IN_CHECKPOINT", "MaxScoreTrainer", "build_model", "build_model_config"]

#: The run's ``config.json`` as copied into each checkpoint.
TRAIN_CONFIG_IN_CHECKPOINT = "maxscore_train_config.json"


class MaxScoreTrainer(Trainer):
    """HF Trainer with MoE metrics in its logs and atomic checkpoints (module docstring).

    ``tokens_per_step``: training tokens per optimizer step over all processes (for the logged
    token counts and tokens/s); ``save_total_limit``: checkpoints kept (0 keeps all).
    """

    def __init__(self, *args: Any, tokens_per_step: int, save_total_limit: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.keep_checkpoints = save_total_limit
        #: The training-log fields this trainer adds (aux loss, routing, t, tokens/s, memory).
        self.metrics = TrainingMetrics(tokens_per_step)
        self._staging_root: Path | None = None
        self._document_losses = DocumentLosses()
        #: The last evaluation's loss, standard error and per-document sums (with its step).
        self.last_validation: ValidationSummary | None = None
        self.last_validation_step: int | None = None
        self.add_callback(RoutingStatisticsCallback(self.metrics, self))

    def get_train_dataloader(self) -> Any:
        """Full micro-batches only: an epoch's partial last batch is left out (training only).

        A run longer than an epoch of a map-style dataset would otherwise meet one smaller batch
        per epoch: a different shape for the compiled layers (a recompilation mid-run, and with
        GShard's one routing group per batch a different capacity) and a noisier step. At
        most ``global batch - 1`` blocks per epoch go unused (the data is reshuffled each
        epoch); ``prepare`` guarantees at least one full global batch. Evaluation
        keeps every block.
        """
        previous = self.args.dataloader_drop_last
        self.args.dataloader_drop_last = True
        try:
            return super().get_train_dataloader()
        finally:
            self.args.dataloader_drop_last = previous

    def _clip_grad_norm(self, model: Any) -> Any:
        """Clipping inside the fused AdamW step where that is exact (``clipping.py``): one pass
        fewer over the fp32 gradients. Elsewhere (DeepSpeed, FSDP, a GradScaler, another
        optimizer) the Trainer's own ``clip_grad_norm_``."""
        optimizer = fused_adam(self.optimizer)
        plain = self.accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_GPU)
        if optimizer is None or not plain or self.accelerator.scaler is not None:
            return super()._clip_grad_norm(model)
        return clip_grad_norm_in_fused_adam(optimizer, model.parameters(), self.args.max_grad_norm)

    # -- losses and logs ------------------------------------------------------------------------
    def compute_loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        keep_half_precision_outputs(model)  # a dict lookup once the wrapper is gone
        loss, outputs = super().compute_loss(
            model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
        )
        if model.training:
            aux = outputs.get("aux_loss") if isinstance(outputs, dict) else None
            if isinstance(aux, torch.Tensor):
                self.metrics.add_aux_loss(aux)
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            self.metrics.log_fields(logs, self.model, self.state.global_step, self.args.device)
        if "eval_loss" in logs:
            logs["eval_ppl"] = math.exp(min(logs["eval_loss"], 50.0))
        super().log(logs, start_time)

    def start_timer(self) -> None:
        """Mark the start of the timed training (first tokens/s covers the next step onwards)."""
        self.metrics.start_timer(self.state.global_step)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        begin = time.perf_counter()
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            self.metrics.pause(time.perf_counter() - begin)

    # -- validation by document (maxscore.training.validation_set) -------------------------------
    def prediction_step(
        self,
        model: Any,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Validation batches carry each token's document: sum the token losses by document."""
        documents = inputs.pop(DOCUMENT_KEY, None)
        if documents is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self._document_losses.add(model, inputs, documents)
        return loss.detach(), None, None

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's loop, plus the loss over documents and its standard error."""
        size = getattr(self.eval_dataset, "num_documents", None)
        if size is None:
            self._document_losses.clear()
        else:
            self._document_losses.reset(size, self.args.device)
        output = super().evaluation_loop(*args, **kwargs)
        sums, counts = self._document_losses.gather()
        if any(counts):
            summary = ValidationSummary.from_sums(sums, counts)
            output.metrics.update(summary.metrics(kwargs.get("metric_key_prefix", "eval")))
            self.last_validation, self.last_validation_step = summary, self.state.global_step
        return output

    # -- atomic checkpoints -------------------------------------------------------------------
    def _get_output_dir(self, trial: Any) -> str:
        if self._staging_root is not None:
            return str(self._staging_root)
        return super()._get_output_dir(trial)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Write into a staging folder, fsync, rename into place, then rotate old ones."""
        begin = time.perf_counter()
        run_dir = Path(self.args.output_dir)
        name = f"checkpoint-{self.state.global_step}"
        staging_root = run_dir / f"{ckpt.STAGING_PREFIX}{name}"
        if self.args.should_save and staging_root.exists():
            shutil.rmtree(staging_root)
        self.accelerator.wait_for_everyone()
        self._staging_root = staging_root
        try:
            super()._save_checkpoint(model, trial)
            if self.args.should_save:
                staged = staging_root / name
                config_src = run_dir / CONFIG_FILE
                if config_src.is_file():
                    shutil.copyfile(config_src, staged / TRAIN_CONFIG_IN_CHECKPOINT)
                write_integrity_record(staged)
                ckpt.publish_checkpoint(staged, run_dir / name)
        except Exception as err:
            # A full disk (or any write error): the half-written staging folder goes, the
            # published checkpoints were never touched. The reason is read first: torch's zip
            # writer reports a full disk without an errno, so the free space decides, and
            # removing the staging folder frees it again.
            failure = ckpt.CheckpointSaveError(name, run_dir, err)
            shutil.rmtree(staging_root, ignore_errors=True)
            raise failure from err
        finally:
            self._staging_root = None
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            shutil.rmtree(staging_root, ignore_errors=True)
            ckpt.rotate_checkpoints(run_dir, self.keep_checkpoints)
        self.accelerator.wait_for_everyone()
        self.metrics.pause(time.perf_counter() - begin)

    # -- resume ---------------------------------------------------------------------------------
    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Load optimizer / scheduler state; works around a CPU multi-process resume failure.

        Under DDP on the CPU (torchrun + ``use_cpu``) accelerate gives every process the device
        ``cpu:0`` (``PartialState.set_device``), and ``Trainer._load_optimizer_and_scheduler``
        loads ``optimizer.pt`` with ``map_location=self.args.device`` whenever
        ``world_size > 1``. ``torch.load`` only restores storages to the location ``"cpu"``,
        not ``"cpu:0"`` ("don't know how to restore data location ... (tagged with cpu:0)").
        On that path (plain DDP on CPU) both files are loaded with ``map_location="cpu"``;
        everything else is the Trainer's own code.
        """
        device = self.args.device
        optimizer_file = Path(checkpoint or "") / "optimizer.pt"
        scheduler_file = Path(checkpoint or "") / "scheduler.pt"
        plain_cpu_ddp = (
            checkpoint is not None
            and device.type == "cpu"
            and device.index is not None
            and not self.is_deepspeed_enabled
            and not self.is_fsdp_enabled
            and optimizer_file.is_file()
            and scheduler_file.is_file()
        )
        if not plain_cpu_ddp:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        self.optimizer.load_state_dict(
            torch.load(optimizer_file, map_location="cpu", weights_only=True)
        )
        self.lr_scheduler.load_state_dict(
            torch.load(scheduler_file, map_location="cpu", weights_only=True)
        )
