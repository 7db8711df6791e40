"""Training on Hugging Face ``Trainer``: the run directory, callbacks, atomic checkpoints, resume.

:func:`train` is the Python API behind ``maxscore train``::

    from maxscore.training import TrainConfig, train
    result = train(TrainConfig(model="tiny", router="maxscore", max_steps=300))
    print(result.eval_loss, result.perplexity)

What it adds to the stock ``Trainer`` (everything else — AdamW, the WSD schedule, gradient
accumulation, mixed precision, DDP / DeepSpeed, skipping trained batches on resume, RNG state —
is the Trainer's own):

* :class:`RouterScheduleCallback` advances the SoftTopk ``t`` schedule once per optimizer step
  (``model.advance_router_schedule()``); the schedule's step counter is a buffer in the model's
  state dict, so checkpoints carry it.
* :class:`MaxScoreTrainer` keeps the MoE aux loss and per-layer routing statistics on the device
  between logging steps (no host synchronisation per step), sums them over all processes at
  logging time (DDP / DeepSpeed), and adds them, with ``t``, tokens/s and peak memory, to every
  training log; evaluation logs get the perplexity.
* :class:`MetricsJsonlCallback` writes every log to ``metrics.jsonl`` (schema in
  :data:`METRICS_SCHEMA`); TensorBoard logs go to ``<run>/tensorboard``.
* Checkpoints are written atomically (:mod:`maxscore.training.checkpoint`); the tokenizer is saved
  with each one; Ctrl-C (SIGINT) saves a checkpoint at the end of the current step and stops.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import MethodType
from typing import Any

import torch
from accelerate.utils import DistributedType
from accelerate.utils.operations import ConvertOutputsToFp32
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from maxscore.training import checkpoint as ckpt
from maxscore.training.clipping import clip_grad_norm_in_fused_adam, fused_adam
from maxscore.training.config import PAPER_GLOBAL_BATCH, RUNTIME_FIELDS, ConfigError, TrainConfig
from maxscore.training.data import (
    TrainingData,
    build_training_data,
    collate_blocks,
    load_tokenizer,
)
from maxscore.training.integrity import newest_intact, write_integrity_record
from maxscore.training.option_checks import (
    validate_model_options,
    validate_router_options,
    validate_router_setup_of,
)
from maxscore.training.reporting import check_report_to, trainer_report_to, wants_tensorboard
from maxscore.training.run_dir import RunDirectory, RunDirPlan, check_run_dir
from maxscore.training.temperature import (
    ResolvedTemperature,
    apply_temperature,
    resolve_temperature,
)
from maxscore.training.validation_set import (
    DOCUMENT_KEY,
    VALIDATION_FILE,
    DocumentLosses,
    ValidationSummary,
)

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"
TRAIN_CONFIG_IN_CHECKPOINT = "maxscore_train_config.json"

#: Shipped DeepSpeed configs, by short name.
DEEPSPEED_CONFIGS = {
    "zero2": Path(__file__).resolve().parent.parent / "configs" / "deepspeed_zero2.json",
    "zero3": Path(__file__).resolve().parent.parent / "configs" / "deepspeed_zero3.json",
}

#: What a line of ``metrics.jsonl`` holds (every key optional except ``type`` and ``step``).
METRICS_SCHEMA: dict[str, str] = {
    "type": '"train" (training log), "eval" (validation), "end" (the Trainer\'s runtime '
    'summary) or "final" (end-of-run summary: the fields of summary.json)',
    "step": "optimizer step (global)",
    "epoch": "fractional epoch",
    "loss": "training loss (LM loss plus aux losses as the model returns it), mean since last log",
    "grad_norm": "gradient norm before clipping",
    "learning_rate": "learning rate",
    "aux_loss": "MoE load-balancing (and z-) loss as returned by the model, mean since last log "
    "(over all processes)",
    "t": "SoftTopk scale t after this step",
    "tokens": "training tokens processed so far (all processes)",
    "tokens_per_s": "training tokens per second since the last log (all processes; eval and "
    "checkpoint time excluded)",
    "peak_memory_gb": "peak CUDA memory allocated on this process (GiB), or peak RSS on CPU",
    "dropped_rank{r}": "mean over MoE layers of the share of tokens whose rank-r choice was "
    "dropped: the token is processed by fewer than k experts (1-based rank)",
    "rerouted_rank{r}": "mean over MoE layers of the share of tokens whose rank-r choice was not "
    "given but the slot was filled by another expert (1-based rank)",
    "load_imbalance": "mean over MoE layers of max/mean expert load",
    "unused_experts": "mean over MoE layers of the number of experts given no token",
    "routing": "per-layer lists, averaged over the optimizer steps since the last log and over "
    "all processes (last micro-batch of each step): dropped_by_rank[L][k], rerouted_by_rank[L][k], "
    "load_imbalance[L], "
    "unused_experts[L], tokens_per_expert[L][e], load_over_capacity[L][e], "
    "mean_affinity_by_rank[L][k], aux_loss[L], z_loss[L]; moe_layers[L] gives the decoder layer "
    "index of each entry (dense layers are left out)",
    "eval_loss": "validation LM loss (eval routing, causal by default): mean over the tokens of "
    "the whole validation split (or --max-eval-blocks evenly spaced blocks)",
    "eval_loss_se": "standard error of eval_loss over validation documents (the split is a random "
    "sample of documents; see maxscore.training.validation_set)",
    "eval_tokens": "validation tokens the loss is the mean over",
    "eval_documents": "validation documents they come from",
    "eval_ppl": "exp(eval_loss)",
}


# ------------------------------------------------------------------------------------------------
# small helpers
# ------------------------------------------------------------------------------------------------
def resolve_precision(precision: str) -> str:
    """``"auto"`` -> bf16 on a CUDA GPU that supports it, else fp32."""
    if precision != "auto":
        if precision in ("bf16", "fp16") and not torch.cuda.is_available():
            raise ConfigError(f"precision {precision} needs a CUDA GPU; use fp32 (or auto) on CPU")
        return precision
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


def world_size() -> int:
    """Processes of this run (torchrun / accelerate set WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def peak_memory_gb() -> float:
    """Peak CUDA memory allocated by this process, or its peak RSS without a GPU (GiB)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def unwrap(model: Any) -> Any:
    """The model inside DDP / DeepSpeed / compile wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return getattr(model, "_orig_mod", model)


def keep_half_precision_outputs(model: Any) -> bool:
    """Undo accelerate's fp32 conversion of the model's outputs (bf16 / fp16 autocast runs).

    With native mixed precision, accelerate wraps ``forward`` so that every half-precision output
    is cast to fp32. The loss is already computed in fp32 inside ``forward``; the other outputs
    are the logits, ``[B, L, vocab]``, whose fp32 copy took 6.5 ms per Base micro-batch of
    128 x 512 tokens on an H100 (4% of the step; peak memory 47.1 -> 43.2 GiB without it,
    ``benchmarks/train_throughput.md``). The autocast wrapper stays; only the conversion is
    removed. Accelerate wraps the model before DDP does, so the wrapper sits on the inner module;
    the outer one is checked too. Returns whether a conversion was removed.
    """
    removed = False
    for target in {id(m): m for m in (model, unwrap(model))}.values():
        forward = target.__dict__.get("forward")  # accelerate sets an instance attribute
        if forward is None:
            continue
        bound = isinstance(forward, MethodType)
        wrapper = getattr(forward.__func__ if bound else forward, "__wrapped__", None)
        if isinstance(wrapper, ConvertOutputsToFp32):
            inner = wrapper.model_forward
            target.forward = MethodType(inner, target) if bound else inner
            removed = True
    return removed


def find_temperature_schedule(model: Any) -> Any | None:
    """The first SoftTopk schedule module of ``model`` (all layers share the same value)."""
    from maxscore.routing.schedule import TemperatureSchedule

    for module in unwrap(model).modules():
        if isinstance(module, TemperatureSchedule):
            return module
    return None


# ------------------------------------------------------------------------------------------------
# model
# ------------------------------------------------------------------------------------------------
def build_model_config(
    config: TrainConfig, vocab_size: int, special_tokens: dict[str, int | None] | None = None
) -> Any:
    """The :class:`LlamaMoEConfig` of a model preset + router preset + overrides.

    Raises ConfigError for unknown presets or invalid overrides (before any training).
    """
    from maxscore.models.presets import get_model_config
    from maxscore.routing.presets import ROUTER_PRESETS
    from maxscore.training.pretrained import is_pretrained_model, pretrained_model_config

    if is_pretrained_model(config.model):
        # A checkpoint directory or hub name (its own vocabulary and special tokens).
        return _check_seq_len(config, pretrained_model_config(config))
    if config.router not in ROUTER_PRESETS:
        raise ConfigError(
            f"unknown router preset {config.router!r}; available: {sorted(ROUTER_PRESETS)}"
        )
    validate_model_options(config.model_overrides)
    validate_router_options(config.router_overrides)
    overrides = dict(config.model_overrides)
    overrides.setdefault("vocab_size", vocab_size)
    # The tokenizer's BOS/EOS/PAD ids go into the model (and generation) config, so checkpoints
    # generate and pad correctly.
    for key, value in (special_tokens or {}).items():
        if value is not None:
            overrides.setdefault(key, value)
    if config.router_overrides:
        overrides["router_config"] = {
            **(overrides.get("router_config") or {}),
            **config.router_overrides,
        }
    try:
        model_config = get_model_config(config.model, router=config.router, **overrides)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"invalid model/router settings: {err}") from err
    validate_router_setup_of(model_config)
    return _check_seq_len(config, model_config)


def _check_seq_len(config: TrainConfig, model_config: Any) -> Any:
    max_len = getattr(model_config, "max_position_embeddings", None)
    if max_len is not None and config.seq_len > max_len:
        raise ConfigError(
            f"seq_len={config.seq_len} is above the model's maximum of {max_len} tokens "
            f"(preset {config.model!r}); use a shorter --seq-len or override "
            "max_position_embeddings"
        )
    return model_config


def build_model(model_config: Any, seed: int, on_gpu: bool = False) -> Any:
    """A freshly initialised :class:`LlamaMoEForCausalLM` (seeded).

    With ``on_gpu`` the weights are created and initialised directly on this process's GPU
    (``cuda:LOCAL_RANK``): initialising a Base-size model on the CPU first costs several seconds.
    """
    from transformers import set_seed

    from maxscore.models import LlamaMoEForCausalLM

    set_seed(seed)
    if on_gpu and torch.cuda.is_available():
        with torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"):
            return LlamaMoEForCausalLM(model_config)
    return LlamaMoEForCausalLM(model_config)


# ------------------------------------------------------------------------------------------------
# callbacks
# ------------------------------------------------------------------------------------------------
class RouterScheduleCallback(TrainerCallback):
    """Advance the SoftTopk ``t`` schedule once per optimizer step.

    ``on_step_end`` runs after the optimizer step and before the Trainer decides to save, so a
    checkpoint at step N holds the schedule after N steps, and a resumed run continues exactly.
    """

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> Any:
        target = unwrap(model)
        if hasattr(target, "advance_router_schedule"):
            target.advance_router_schedule()
        return control


class FinalCheckpointCallback(TrainerCallback):
    """Save at the last step (so the run always ends with a checkpoint) and on Ctrl-C."""

    def __init__(self, save_final: bool = True) -> None:
        self.save_final = save_final
        self.interrupted = False
        self._previous_handler: Any = None

    # SIGINT: first Ctrl-C asks for a checkpoint and a clean stop; a second one aborts.
    def install(self) -> None:
        if not _can_install_signal_handler():
            return
        self._previous_handler = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, self._handle)

    def uninstall(self) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGINT, self._previous_handler)
            self._previous_handler = None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.interrupted:
            raise KeyboardInterrupt
        self.interrupted = True
        print(
            "\nmaxscore: interrupted; saving a checkpoint at the end of this step "
            "(Ctrl-C again to abort without saving)",
            file=sys.stderr,
            flush=True,
        )

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        stop = self.interrupted
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        at_check = state.global_step % max(args.logging_steps, 1) == 0
        if distributed and at_check:
            # Every process must take the same decision, or the collective save would hang; the
            # all-reduce is a host sync, so it only runs at logging steps (Ctrl-C then saves at
            # the next logging step).
            flag = torch.tensor(
                [1.0 if stop else 0.0],
                device="cuda" if torch.cuda.is_available() else "cpu",
            )
            torch.distributed.all_reduce(flag)
            stop = bool(flag.item() > 0)
            self.interrupted = stop
        elif distributed:
            stop = False
        if stop:
            control.should_save = True
            control.should_training_stop = True
        if state.global_step >= state.max_steps:
            # A run shorter than --logging-steps still gets its routing and tokens/s logged
            # (the end-of-run summary is built from the last training log).
            control.should_log = True
            if self.save_final:
                control.should_save = True
        return control


class RunDirectoryCallback(TrainerCallback):
    """Tells the run directory when a checkpoint is in place (a replaced run can go then)."""

    def __init__(self, directory: RunDirectory) -> None:
        self.directory = directory

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        if is_main_process():
            self.directory.checkpoint_written()
        return control


def _can_install_signal_handler() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


class MetricsJsonlCallback(TrainerCallback):
    """Append every log to ``<run>/metrics.jsonl`` (process 0 only)."""

    def __init__(self, path: Path, trainer_ref: MaxScoreTrainer | None = None) -> None:
        self.path = path
        self.trainer_ref = trainer_ref

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> Any:
        if not state.is_world_process_zero or not logs:
            return control
        record: dict[str, Any] = {
            "type": "eval" if any(k.startswith("eval_") for k in logs) else "train",
            "step": state.global_step,
        }
        if "train_runtime" in logs:
            record["type"] = "end"
        for key, value in logs.items():
            if isinstance(value, (int, float, str)):
                record[key] = value
        if record["type"] == "train" and self.trainer_ref is not None:
            routing = self.trainer_ref.last_routing
            if routing:
                record["routing"] = routing
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        return control


class CompactProgressCallback(ProgressCallback):
    """Trainer's tqdm bar (with ETA), but one readable line per log instead of a dict."""

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> Any:
        if not state.is_world_process_zero or self.training_bar is None or not logs:
            return
        self.training_bar.write(format_log_line(state.global_step, state.max_steps, logs))


def format_log_line(step: int, max_steps: int, logs: dict[str, Any]) -> str:
    """``step 10/300 | loss 7.12 | lr 1.0e-03 | ...`` for the console."""
    parts = [f"step {step}/{max_steps}"]
    fmt = {
        "loss": ("loss", "{:.4f}"),
        "eval_loss": ("val loss", "{:.4f}"),
        "eval_ppl": ("val ppl", "{:.2f}"),
        "aux_loss": ("aux", "{:.4f}"),
        "learning_rate": ("lr", "{:.2e}"),
        "t": ("t", "{:.3f}"),
        "dropped_rank1": ("drop r1", "{:.3f}"),
        "dropped_rank2": ("drop r2", "{:.3f}"),
        "rerouted_rank1": ("reroute r1", "{:.3f}"),
        "rerouted_rank2": ("reroute r2", "{:.3f}"),
        "load_imbalance": ("imbalance", "{:.2f}"),
        "tokens_per_s": ("tok/s", "{:,.0f}"),
        "peak_memory_gb": ("mem GiB", "{:.2f}"),
    }
    for key, (label, pattern) in fmt.items():
        if key in logs and isinstance(logs[key], (int, float)):
            parts.append(f"{label} {pattern.format(logs[key])}")
    return " | ".join(parts)


# ------------------------------------------------------------------------------------------------
# the Trainer
# ------------------------------------------------------------------------------------------------
class MaxScoreTrainer(Trainer):
    """HF Trainer with MoE metrics in its logs and atomic checkpoints."""

    def __init__(self, *args: Any, tokens_per_step: int, save_total_limit: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.tokens_per_step = tokens_per_step
        self.keep_checkpoints = save_total_limit
        self.last_routing: dict[str, Any] = {}
        self._aux_sum: torch.Tensor | None = None
        self._aux_count = 0
        self._routing_sum: list[dict[str, torch.Tensor]] | None = None
        self._routing_count = 0
        self._staging_root: Path | None = None
        self._last_log_time: float | None = None
        self._last_log_step = 0
        self._paused_s = 0.0
        self._schedule: Any = None
        self._moe_layers: list[int] = []
        self._document_losses = DocumentLosses()
        #: The last evaluation's loss, standard error and per-document sums (with its step).
        self.last_validation: ValidationSummary | None = None
        self.last_validation_step: int | None = None
        self.add_callback(_RoutingAccumulator(self))

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

    # -- losses and routing statistics, kept on the device ----------------------------------
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
                aux = aux.detach().float()
                self._aux_sum = aux if self._aux_sum is None else self._aux_sum + aux
                self._aux_count += 1
        return (loss, outputs) if return_outputs else loss

    def accumulate_routing(self, model: Any) -> None:
        """Add the last forward's per-layer routing statistics to the running sums (device)."""
        target = unwrap(model)
        if not hasattr(target, "routing_statistics"):
            return
        stats = target.routing_statistics()
        if not stats:
            return
        # Dense layers report empty dicts; keep MoE layers only (their indices in moe_layers).
        self._moe_layers = [i for i, layer in enumerate(stats) if layer]
        current = [
            {k: v.detach().float() for k, v in layer.items() if isinstance(v, torch.Tensor)}
            for layer in stats
            if layer
        ]
        if not current:
            return
        if self._routing_sum is None or len(self._routing_sum) != len(current):
            self._routing_sum = current
            self._routing_count = 1
        else:
            for acc, layer in zip(self._routing_sum, current):
                for key, value in layer.items():
                    acc[key] = acc[key] + value if key in acc else value
            self._routing_count += 1

    def _pop_routing(self) -> dict[str, Any]:
        if not self._routing_sum:
            return {}
        n = max(self._routing_count, 1)
        per_layer = [{k: (v / n).tolist() for k, v in layer.items()} for layer in self._routing_sum]
        self._routing_sum, self._routing_count = None, 0
        keys = per_layer[0].keys()
        out: dict[str, Any] = {key: [layer[key] for layer in per_layer] for key in keys}
        out["moe_layers"] = list(self._moe_layers)
        return out

    # -- logs ---------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            self._add_train_metrics(logs)
        if "eval_loss" in logs:
            logs["eval_ppl"] = math.exp(min(logs["eval_loss"], 50.0))
        super().log(logs, start_time)

    def _all_reduce_accumulators(self) -> None:
        """Sum the aux-loss and routing accumulators (and their counts) over all processes.

        Called at logging time only (every process logs at the same steps), so the training
        steps themselves never synchronise. Afterwards every process holds the global sums and
        counts, and the means logged by :meth:`_add_train_metrics` are the same everywhere: the
        mean over all processes' steps (with equal step counts, the mean of the per-process
        means). One small all-reduce checks that all processes hold accumulators of the same
        layout first; where they do not (which the training loop never produces), the local
        values are logged and a warning is printed rather than risking a mismatched collective.
        """
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
        layers = self._routing_sum or []
        slots = [(i, key) for i, layer in enumerate(layers) for key in sorted(layer)]
        parts = [layers[i][key].reshape(-1) for i, key in slots]
        if self._aux_sum is not None:
            parts.append(self._aux_sum.reshape(-1))
        device = parts[0].device if parts else self.args.device
        numel = sum(part.numel() for part in parts)
        has_aux = float(self._aux_sum is not None)
        layout = torch.tensor(
            [numel, -numel, has_aux, -has_aux], device=device, dtype=torch.float64
        )
        dist.all_reduce(layout, op=dist.ReduceOp.MAX)
        if layout[0].item() != -layout[1].item() or layout[2].item() != -layout[3].item():
            if not getattr(self, "_warned_layout", False):
                self._warned_layout = True
                print(
                    "maxscore: routing statistics differ in layout between processes; logging "
                    "this process's own values",
                    file=sys.stderr,
                )
            return
        counts = torch.tensor([float(self._aux_count), float(self._routing_count)], device=device)
        flat = torch.cat([counts, *[part.float() for part in parts]])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        self._aux_count, self._routing_count = (int(c) for c in flat[:2].tolist())
        offset = 2
        for i, key in slots:
            value = layers[i][key]
            layers[i][key] = flat[offset : offset + value.numel()].view_as(value)
            offset += value.numel()
        if self._aux_sum is not None:
            self._aux_sum = flat[offset : offset + self._aux_sum.numel()].view_as(self._aux_sum)

    def _add_train_metrics(self, logs: dict[str, float]) -> None:
        self._all_reduce_accumulators()
        if self._aux_sum is not None and self._aux_count:
            logs["aux_loss"] = float(self._aux_sum / self._aux_count)
            self._aux_sum, self._aux_count = None, 0
        if self._schedule is None:
            self._schedule = find_temperature_schedule(self.model) or False
        if self._schedule:
            logs["t"] = float(self._schedule.value())
        routing = self._pop_routing()
        self.last_routing = routing
        if routing:
            for name in ("dropped", "rerouted"):
                per_layer = routing.get(f"{name}_by_rank")
                for rank, value in enumerate(_mean_over_layers(per_layer) if per_layer else []):
                    logs[f"{name}_rank{rank + 1}"] = value
            for key in ("load_imbalance", "unused_experts"):
                values = routing.get(key)
                if values:
                    logs[key] = float(sum(values) / len(values))
        now = time.perf_counter()
        step = self.state.global_step
        logs["tokens"] = step * self.tokens_per_step
        if self._last_log_time is not None and step > self._last_log_step:
            elapsed = max(now - self._last_log_time - self._paused_s, 1e-9)
            logs["tokens_per_s"] = (step - self._last_log_step) * self.tokens_per_step / elapsed
        self._last_log_time, self._last_log_step, self._paused_s = now, step, 0.0
        logs["peak_memory_gb"] = peak_memory_gb()

    def start_timer(self) -> None:
        """Mark the start of the timed training (first tokens/s covers step 1 onwards)."""
        self._last_log_time = time.perf_counter()
        self._last_log_step = self.state.global_step

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        begin = time.perf_counter()
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            self._paused_s += time.perf_counter() - begin

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
            # published checkpoints were never touched.
            shutil.rmtree(staging_root, ignore_errors=True)
            raise ckpt.CheckpointSaveError(name, run_dir, err) from err
        finally:
            self._staging_root = None
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            shutil.rmtree(staging_root, ignore_errors=True)
            ckpt.rotate_checkpoints(run_dir, self.keep_checkpoints)
        self.accelerator.wait_for_everyone()
        self._paused_s += time.perf_counter() - begin

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


class _RoutingAccumulator(TrainerCallback):
    def __init__(self, trainer: MaxScoreTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> Any:
        self.trainer.accumulate_routing(model if model is not None else self.trainer.model)
        return control


# ------------------------------------------------------------------------------------------------
# run directory
# ------------------------------------------------------------------------------------------------
def _truncate_metrics(path: Path, last_step: int) -> None:
    """Drop metrics logged after the checkpoint we resume from (they will be logged again)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= last_step:
                kept.append(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
    path.write_text("".join(line + "\n" for line in kept))


# ------------------------------------------------------------------------------------------------
# the API
# ------------------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    """What :func:`train` returns (also written to ``<run>/summary.json``)."""

    run_dir: Path
    final_checkpoint: Path | None
    steps: int
    tokens: int
    eval_loss: float | None
    perplexity: float | None
    train_loss: float | None
    tokens_per_s: float | None
    peak_memory_gb: float
    runtime_s: float
    interrupted: bool
    routing: dict[str, Any] = field(default_factory=dict)
    eval_loss_se: float | None = None
    eval_tokens: int | None = None
    eval_documents: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["run_dir"] = str(self.run_dir)
        out["final_checkpoint"] = str(self.final_checkpoint) if self.final_checkpoint else None
        return out


@dataclass
class PreparedRun:
    """Everything built before training starts (where bad input is caught)."""

    config: TrainConfig
    run_dir: Path
    resume_from: Path | None
    tokenizer: Any
    model_config: Any
    data: TrainingData
    precision: str
    world_size: int
    total_steps: int
    run_dir_plan: RunDirPlan | None = None
    temperature: ResolvedTemperature | None = None


def prepare(config: TrainConfig) -> PreparedRun:
    """Validate everything and build tokenizer, model config and data; no training yet.

    All bad input (unknown preset / dataset / tokenizer, seq_len too long, corpus too small,
    run-directory conflicts) raises :class:`ConfigError` from here.
    """
    config.validate()
    check_report_to(config.report_to)
    ws = world_size()
    precision = resolve_precision(config.precision)
    if config.deepspeed is not None:
        _deepspeed_config_path(config.deepspeed)
        if config.compile and _zero_stage(config.deepspeed) == 3:
            raise ConfigError(
                "--compile is not supported with ZeRO-3 (DeepSpeed partitions parameters with "
                "hooks that compiled layers bypass); pass --no-compile, or use --deepspeed zero2"
            )
    from maxscore.training.pretrained import (
        is_pretrained_model,
        pretrained_model_config,
        pretrained_tokenizer,
    )

    pretrained = is_pretrained_model(config.model)
    if pretrained:
        pretrained_model_config(config)  # a bad --model is reported before its tokenizer
    tokenizer = load_tokenizer(pretrained_tokenizer(config) if pretrained else config.tokenizer)
    model_config = build_model_config(
        config,
        vocab_size=len(tokenizer),
        special_tokens={
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id
            if tokenizer.pad_token_id is not None
            else tokenizer.eos_token_id,
        },
    )
    if len(tokenizer) > model_config.vocab_size:
        raise ConfigError(
            f"tokenizer {config.tokenizer!r} has {len(tokenizer)} tokens but the model's "
            f"vocab_size is {model_config.vocab_size}"
            + ("; pass --tokenizer with the checkpoint's own tokenizer" if pretrained else "")
        )
    from maxscore.training.parallel import check_parallel_options

    check_parallel_options(config, ws, model_config)
    plan = check_run_dir(config) if is_main_process() else _follower_plan(config)
    total_steps = config.total_steps(ws)
    # The SoftTopk t schedule follows the run (or a resumed run's stored length); resolved once.
    temperature = resolve_temperature(
        config, model_config.get_router_config(), total_steps, plan.resume_from
    )
    apply_temperature(model_config, temperature)
    global_batch = config.batch_size * config.grad_accum * ws
    if config.recipe == "paper" and global_batch != PAPER_GLOBAL_BATCH and is_main_process():
        print(
            f"maxscore: global batch is {global_batch} sequences ({config.batch_size} x "
            f"{config.grad_accum} x {ws} GPUs), the paper's is {PAPER_GLOBAL_BATCH}; set "
            "--batch-size / --grad-accum to match",
            file=sys.stderr,
        )
    data = build_training_data(
        config,
        tokenizer,
        min_train_blocks=global_batch,
        max_train_blocks=total_steps * global_batch,
    )
    return PreparedRun(
        config,
        plan.path,
        plan.resume_from,
        tokenizer,
        model_config,
        data,
        precision,
        ws,
        total_steps,
        plan,
        temperature,
    )


def _follower_plan(config: TrainConfig) -> RunDirPlan:
    """The run-directory plan of a process other than 0: process 0 checks and owns the folder
    (it may be moving a replaced run aside); the others only read where to resume from."""
    plan = RunDirPlan(config.run_dir)
    if config.resume:
        plan.resume_from, plan.damaged = newest_intact(ckpt.list_checkpoints(config.run_dir))
    return plan


def _deepspeed_config_path(name: str) -> str:
    if name in DEEPSPEED_CONFIGS:
        return str(DEEPSPEED_CONFIGS[name])
    if not Path(name).is_file():
        raise ConfigError(
            f"DeepSpeed config {name!r} is neither a shipped one ({sorted(DEEPSPEED_CONFIGS)}) "
            "nor a file"
        )
    return name


def _single_process_launcher_env() -> None:
    """Launcher variables for a DeepSpeed run started without a launcher (one process).

    ``deepspeed.init_distributed`` needs RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; without
    them it falls back to MPI discovery, which fails without ``mpi4py`` and an MPI launch. A
    plain ``maxscore train --deepspeed zero2`` (no torchrun / deepspeed launcher: none of RANK,
    LOCAL_RANK, WORLD_SIZE set) is therefore given the environment of a one-process launch;
    MASTER_ADDR / MASTER_PORT already set are kept, else 127.0.0.1 and a free local port.
    """
    if any(name in os.environ for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})


def _training_arguments(run: PreparedRun) -> TrainingArguments:
    cfg = run.config
    if cfg.deepspeed:
        _single_process_launcher_env()
    warmup, decay = cfg.warmup_and_decay(run.world_size)
    scheduler: dict[str, Any] = {
        "wsd": {
            "lr_scheduler_type": "warmup_stable_decay",
            "lr_scheduler_kwargs": {
                "num_decay_steps": decay,
                "decay_type": cfg.decay_shape,
                "min_lr_ratio": cfg.min_lr_ratio,
            },
        },
        "cosine": {"lr_scheduler_type": "cosine"},
        "linear": {"lr_scheduler_type": "linear"},
        "constant": {"lr_scheduler_type": "constant_with_warmup"},
    }[cfg.lr_schedule]
    deepspeed = _deepspeed_config_path(cfg.deepspeed) if cfg.deepspeed else None
    return TrainingArguments(
        output_dir=str(run.run_dir),
        per_device_train_batch_size=cfg.batch_size,
        per_device_eval_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.grad_accum,
        max_steps=run.total_steps,
        learning_rate=cfg.lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_epsilon=cfg.adam_eps,
        max_grad_norm=cfg.max_grad_norm,
        warmup_steps=warmup,
        **scheduler,
        logging_steps=cfg.logging_steps or run.total_steps,
        eval_strategy="steps" if cfg.eval_steps else "no",
        eval_steps=cfg.eval_steps or None,
        save_strategy="steps" if cfg.save_steps else "no",
        save_steps=cfg.save_steps or run.total_steps,
        # Rotation happens in MaxScoreTrainer, after a new checkpoint is complete.
        save_total_limit=None,
        bf16=run.precision == "bf16",
        fp16=run.precision == "fp16",
        **_activation_checkpointing_argument(cfg.gradient_checkpointing),
        # Fused AdamW on GPUs (one kernel for all parameters); the reference loop on CPU.
        optim="adamw_torch_fused" if torch.cuda.is_available() else "adamw_torch",
        tf32=True if torch.cuda.is_available() else None,
        seed=cfg.seed,
        data_seed=cfg.seed,
        # TensorBoard is added explicitly, to write into <run>/tensorboard; other trackers
        # (wandb, mlflow, trackio) are the Trainer's own integrations.
        report_to=trainer_report_to(cfg.report_to),
        dataloader_num_workers=cfg.num_workers,
        dataloader_pin_memory=torch.cuda.is_available(),
        # Pinned batches copied without blocking the host: a blocking copy waits for the GPU to
        # drain, so the CPU cannot queue the next micro-batch's kernels ahead.
        accelerator_config={"non_blocking": torch.cuda.is_available()},
        # Without a GPU, torchrun-launched processes only form a (gloo) DDP group with use_cpu.
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=cfg.quiet,
        # The NaN/inf filter reads the loss on the host after every micro-batch (a sync that
        # stalls the GPU each step); a non-finite loss still shows in the logged mean.
        logging_nan_inf_filter=False,
        remove_unused_columns=False,
        prediction_loss_only=True,
        ddp_find_unused_parameters=False,
        deepspeed=deepspeed,
    )


def _activation_checkpointing_argument(enabled: bool) -> dict[str, bool]:
    """``TrainingArguments``' activation-checkpointing flag under its current name.

    transformers renamed ``gradient_checkpointing`` to ``activation_checkpointing`` and warns
    (FutureWarning) whenever the old name is passed, even as False; the supported transformers
    range has both spellings.
    """
    from dataclasses import fields

    names = {f.name for f in fields(TrainingArguments)}
    key = (
        "activation_checkpointing"
        if "activation_checkpointing" in names
        else "gradient_checkpointing"
    )
    return {key: enabled}


def _zero_stage(deepspeed: str) -> int | None:
    """The ZeRO stage of a DeepSpeed config (shipped name or JSON path)."""
    config = json.loads(Path(_deepspeed_config_path(deepspeed)).read_text())
    return config.get("zero_optimization", {}).get("stage")


def _mark_zero3_leaf_modules(model: Any, deepspeed: str | None) -> None:
    """ZeRO-3 must not hook inside an MoE block (experts run data-dependently), see SPEC §5."""
    if deepspeed is None or _zero_stage(deepspeed) != 3:
        return
    try:
        from deepspeed.utils import set_z3_leaf_modules
    except ImportError as err:
        raise ConfigError(
            "--deepspeed needs the deepspeed package (pip install deepspeed)"
        ) from err
    from maxscore.moe import MoE

    set_z3_leaf_modules(model, [MoE])


def _tensorboard_callback(run_dir: Path, report_to: str) -> TrainerCallback | None:
    wanted = wants_tensorboard(report_to)
    if wanted == "no":
        return None
    try:
        from transformers.integrations import TensorBoardCallback

        callback = TensorBoardCallback()
    except (ImportError, RuntimeError):
        if wanted == "required":
            raise ConfigError("report_to=tensorboard needs the tensorboard package") from None
        return None
    callback.logging_dir = str(run_dir / "tensorboard")
    return callback


def write_resolved_config(run: PreparedRun) -> None:
    """``<run>/config.json``: the training config plus everything derived from it."""
    warmup, decay = run.config.warmup_and_decay(run.world_size)
    resolved = {
        "train": run.config.to_dict(),
        "resolved": {
            "total_steps": run.total_steps,
            "warmup_steps": warmup,
            "decay_steps": decay,
            "world_size": run.world_size,
            "global_batch": run.config.batch_size * run.config.grad_accum * run.world_size,
            "tokens_per_step": run.config.tokens_per_step(run.world_size),
            "temperature_schedule": run.temperature.to_dict() if run.temperature else None,
            "precision": run.precision,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "data": run.data.description,
            "train_blocks": run.data.train_blocks,
            "validation_blocks": len(run.data.validation),
            "vocab_size": len(run.tokenizer),
            "torch": torch.__version__,
        },
        "model": run.model_config.to_dict(),
    }
    if is_main_process():
        (run.run_dir / CONFIG_FILE).write_text(json.dumps(resolved, indent=2, default=str) + "\n")


def train(
    config: TrainConfig,
    callbacks: list[TrainerCallback] | None = None,
    prepared: PreparedRun | None = None,
) -> TrainResult:
    """Train a model as ``config`` says; return the final validation loss and routing summary.

    Args:
        config: the run's settings.
        callbacks: extra ``TrainerCallback`` objects (for instance from tests).
        prepared: the result of :func:`prepare` if the caller already validated the config.
    """
    run = prepared or prepare(config)
    directory = RunDirectory(run.run_dir_plan or RunDirPlan(run.run_dir, run.resume_from))
    main = is_main_process()
    if main:
        directory.open()
    try:
        result = _train(run, [*(callbacks or []), RunDirectoryCallback(directory)])
    except BaseException:
        if main:
            directory.close(failed=True)
        raise
    if main:
        directory.close(failed=False)
    return result


def _train(run: PreparedRun, callbacks: list[TrainerCallback]) -> TrainResult:
    """:func:`train` inside an opened run directory."""
    cfg = run.config
    write_resolved_config(run)
    # ZeRO-3 partitions parameters itself, so only plain / DDP runs initialise on the GPU.
    from maxscore.training.pretrained import is_pretrained_model, load_pretrained_model

    if is_pretrained_model(cfg.model):
        schedule = None if run.temperature is None else run.temperature.schedule()
        model = load_pretrained_model(cfg, on_gpu=cfg.deepspeed is None, temperature=schedule)
    else:
        model = build_model(run.model_config, cfg.seed, on_gpu=cfg.deepspeed is None)
    if cfg.gradient_checkpointing and not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"model preset {cfg.model!r} does not support gradient checkpointing")
    _mark_zero3_leaf_modules(model, cfg.deepspeed)
    if cfg.compile:
        model.compile_layers(mode=cfg.compile_mode)

    args = _training_arguments(run)
    from maxscore.training.parallel import trainer_for  # shards the experts (--expert-parallel)

    trainer_class, parallel_kwargs = trainer_for(model, cfg, args, run.resume_from)
    final_cb = FinalCheckpointCallback(save_final=cfg.save_final)
    trainer = trainer_class(
        model=model,
        args=args,
        train_dataset=run.data.train,
        eval_dataset=run.data.validation,
        processing_class=run.tokenizer,
        data_collator=collate_blocks,
        tokens_per_step=cfg.tokens_per_step(run.world_size),
        save_total_limit=cfg.save_total_limit,
        callbacks=[RouterScheduleCallback(), final_cb, *callbacks],
        **parallel_kwargs,
    )
    trainer.remove_callback(PrinterCallback)
    if trainer.pop_callback(ProgressCallback) is not None and not cfg.quiet:
        trainer.add_callback(CompactProgressCallback())
    trainer.add_callback(MetricsJsonlCallback(run.run_dir / METRICS_FILE, trainer))
    tensorboard = _tensorboard_callback(run.run_dir, cfg.report_to)
    if tensorboard is not None:
        trainer.add_callback(tensorboard)

    if run.resume_from is not None:
        step = int(run.resume_from.name.split("-")[-1])
        if is_main_process():
            _truncate_metrics(run.run_dir / METRICS_FILE, step)
            print(f"maxscore: resuming from {run.resume_from}", file=sys.stderr)

    final_cb.install()
    start = time.perf_counter()
    try:
        trainer.start_timer()
        output = trainer.train(
            resume_from_checkpoint=str(run.resume_from) if run.resume_from else None
        )
    finally:
        final_cb.uninstall()
    runtime = time.perf_counter() - start

    interrupted = final_cb.interrupted
    metrics: dict[str, float] = {}
    if not interrupted and len(run.data.validation) > 0:
        metrics = _final_evaluation(trainer)
    eval_loss = metrics.get("eval_loss")
    history = [h for h in trainer.state.log_history if "tokens_per_s" in h]
    speeds = [h["tokens_per_s"] for h in history]
    routing = trainer.last_routing
    result = TrainResult(
        run_dir=run.run_dir,
        final_checkpoint=ckpt.last_checkpoint(run.run_dir),
        steps=trainer.state.global_step,
        tokens=trainer.state.global_step * cfg.tokens_per_step(run.world_size),
        eval_loss=eval_loss,
        perplexity=math.exp(min(eval_loss, 50.0)) if eval_loss is not None else None,
        train_loss=output.training_loss if output is not None else None,
        tokens_per_s=sum(speeds) / len(speeds) if speeds else None,
        peak_memory_gb=peak_memory_gb(),
        runtime_s=runtime,
        interrupted=interrupted,
        routing=summarize_routing(routing),
        eval_loss_se=metrics.get("eval_loss_se"),
        eval_tokens=metrics.get("eval_tokens"),
        eval_documents=metrics.get("eval_documents"),
    )
    if trainer.is_world_process_zero():
        (run.run_dir / SUMMARY_FILE).write_text(
            json.dumps(result.to_dict(), indent=2, default=str) + "\n"
        )
        if metrics and trainer.last_validation is not None:
            payload = {"step": result.steps, **trainer.last_validation.to_dict()}
            (run.run_dir / VALIDATION_FILE).write_text(json.dumps(payload) + "\n")
        with (run.run_dir / METRICS_FILE).open("a") as handle:
            record = {"type": "final", "step": result.steps, **result.to_dict()}
            handle.write(json.dumps(record, default=str) + "\n")
    return result


def _final_evaluation(trainer: MaxScoreTrainer) -> dict[str, float]:
    """The validation metrics at the last step: those of the evaluation the Trainer already ran
    there (``--eval-steps`` dividing the run length), else of a new one. A validation set with
    each token's document (:mod:`maxscore.training.validation_set`) gives the loss over
    documents with its standard error."""
    step = trainer.state.global_step
    if trainer.last_validation is None or trainer.last_validation_step != step:
        logged = [
            entry
            for entry in trainer.state.log_history
            if entry.get("step") == step and "eval_loss" in entry
        ]
        if logged:
            return {k: v for k, v in logged[-1].items() if k.startswith("eval_")}
        metrics = trainer.evaluate()
        if trainer.last_validation is None or trainer.last_validation_step != step:
            return metrics
    return trainer.last_validation.metrics()


def _mean_over_layers(per_layer: list[list[float]]) -> list[float]:
    """``[L][k]`` -> ``[k]``: the mean over MoE layers of a by-rank statistic."""
    return [sum(layer[r] for layer in per_layer) / len(per_layer) for r in range(len(per_layer[0]))]


def summarize_routing(routing: dict[str, Any]) -> dict[str, Any]:
    """Means over layers of the last logged routing statistics (dropped / rerouted, balance)."""
    if not routing:
        return {}
    out: dict[str, Any] = {}
    for name in ("dropped", "rerouted"):
        per_layer = routing.get(f"{name}_by_rank")
        if per_layer:
            by_rank = _mean_over_layers(per_layer)
            out[f"{name}_by_rank"] = by_rank
            # The share of all k slots of all tokens.
            out[name] = sum(by_rank) / len(by_rank)
    for key in ("load_imbalance", "unused_experts"):
        values = routing.get(key)
        if values:
            out[key] = sum(values) / len(values)
    return out


def format_summary(result: TrainResult) -> str:
    """The lines ``maxscore train`` prints at the end."""
    lines = [f"run directory:     {result.run_dir}"]
    if result.interrupted:
        lines.append(f"interrupted at step {result.steps}; checkpoint: {result.final_checkpoint}")
        lines.append("continue with the same command plus --resume")
        return "\n".join(lines)
    lines.append(f"steps / tokens:    {result.steps} / {result.tokens:,}")
    if result.eval_loss is not None:
        loss = f"{result.eval_loss:.4f}"
        if result.eval_loss_se is not None:
            loss += (
                f" ± {result.eval_loss_se:.4f} (standard error over {result.eval_documents} "
                f"documents, {result.eval_tokens:,} tokens)"
            )
        lines.append(f"validation loss:   {loss}")
        lines.append(f"perplexity:        {result.perplexity:.2f}")
    r = result.routing
    if r:
        for name, label in (("dropped", "dropped slots:"), ("rerouted", "rerouted slots:")):
            ranks = ", ".join(
                f"choice {i + 1}: {v:.1%}" for i, v in enumerate(r.get(f"{name}_by_rank", []))
            )
            lines.append(f"{label:<19}{r.get(name, 0.0):.2%} ({ranks})")
        if "load_imbalance" in r:
            lines.append(f"load imbalance:    {r['load_imbalance']:.3f} (max / mean expert load)")
        if "unused_experts" in r:
            lines.append(f"unused experts:    {r['unused_experts']:.2f} per layer")
    if result.tokens_per_s:
        lines.append(f"throughput:        {result.tokens_per_s:,.0f} tokens/s")
    lines.append(f"peak memory:       {result.peak_memory_gb:.2f} GiB")
    lines.append(f"final checkpoint:  {result.final_checkpoint}")
    return "\n".join(lines)


__all__ = [
    "METRICS_SCHEMA",
    "RUNTIME_FIELDS",
    "FinalCheckpointCallback",
    "MaxScoreTrainer",
    "MetricsJsonlCallback",
    "PreparedRun",
    "RouterScheduleCallback",
    "TrainResult",
    "format_summary",
    "prepare",
    "train",
]
