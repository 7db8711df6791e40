"""A training run: :func:`prepare` checks everything and builds what the run needs, :func:`train`
runs it on :class:`~maxscore.training.trainer.MaxScoreTrainer` and returns a :class:`TrainResult`.

:func:`train` is the Python API behind ``maxscore train``::

    from maxscore.training import TrainConfig, train
    result = train(TrainConfig(model="tiny", router="maxscore", max_steps=300))
    print(result.eval_loss, result.perplexity)

What it adds to the stock ``Trainer`` (everything else — AdamW, the WSD schedule, gradient
accumulation, mixed precision, DDP / DeepSpeed, skipping trained batches on resume, RNG state —
is the Trainer's own):

* the run directory (:mod:`maxscore.training.run_dir`): ``config.json`` (the training config and
  everything resolved from it), checkpoints, ``metrics.jsonl``, ``summary.json``,
  ``validation.json``, TensorBoard logs in ``tensorboard/``;
* the routers count every optimizer step (:class:`~maxscore.training.callbacks.RouterStepCallback`:
  the SoftTopk ``t`` schedule, whose step counter is a buffer in the model's state dict, so
  checkpoints carry it, and the DeepSeek-V3 balancing bias);
* MoE metrics in every training log and one line per log in ``metrics.jsonl``
  (:mod:`maxscore.training.metrics`);
* the run directory's lock: one process owns it from :func:`prepare` to the end of
  :func:`train` (:func:`~maxscore.training.run_lock.lock_run_dir`);
* atomic checkpoints with the tokenizer, Ctrl-C, SIGTERM or SIGUSR1 saving a checkpoint at the
  end of the current step (:mod:`maxscore.training.trainer`, :mod:`maxscore.training.callbacks`;
  ``maxscore train`` then exits with 128 + the signal's number, :attr:`TrainResult.exit_status`);
* ``--deterministic``: torch's deterministic settings from before the model is built to the end
  of the final evaluation, restored after
  (:class:`~maxscore.training.callbacks.DeterministicAlgorithms`).
"""

from __future__ import annotations

import json
import math
import signal
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.utils import logging as hf_logging

from maxscore.checkpoints.integrity import newest_intact
from maxscore.checkpoints.layout import (
    CONFIG_FILE,
    METRICS_FILE,
    last_checkpoint,
    list_checkpoints,
    pending_previous_run,
)
from maxscore.data.packing import collate_blocks
from maxscore.models.compile_options import router_allows_mix_order_reduction
from maxscore.training.callbacks import (
    CompactProgressCallback,
    DeterministicAlgorithms,
    FinalCheckpointCallback,
    GarbageCollectionCallback,
    RouterStepCallback,
    RunDirectoryCallback,
    tensorboard_callback,
)
from maxscore.training.config import ConfigError, TrainConfig
from maxscore.training.continue_command import how_to_continue
from maxscore.training.data import TrainingData, build_training_data, load_tokenizer
from maxscore.training.disk_space import disk_space_warning
from maxscore.training.distributed import (
    check_deepspeed_installed,
    deepspeed_config_path,
    is_main_process,
    mark_zero3_leaf_modules,
    single_process_launcher_env,
    world_size,
    zero_stage,
)
from maxscore.training.fused_loss import check_fused_loss
from maxscore.training.lora import RouterStepsOnResume, apply_lora, check_lora_options
from maxscore.training.matmul_precision import kept_matmul_precision
from maxscore.training.metrics import (
    MetricsJsonlCallback,
    peak_memory_gb,
    summarize_routing,
    truncate_metrics,
)
from maxscore.training.model_build import apply_speed_options, build_model, build_model_config
from maxscore.training.option_checks import check_float8_options, check_parallel_options
from maxscore.training.parallel import trainer_for
from maxscore.training.precision import autocast_dtype, resolve_precision
from maxscore.training.pretrained import (
    is_pretrained_model,
    load_pretrained_model,
    pretrained_tokenizer,
)
from maxscore.training.recipes import PAPER_GLOBAL_BATCH
from maxscore.training.reporting import (
    TrackerStartError,
    check_report_to,
    guard_tracker_start,
    trainer_report_to,
)
from maxscore.training.run_dir import RunDirectory, RunDirPlan, check_run_dir
from maxscore.training.run_lock import lock_run_dir
from maxscore.training.temperature import (
    ResolvedTemperature,
    apply_temperature,
    resolve_temperature,
)
from maxscore.training.trainer import MaxScoreTrainer
from maxscore.training.validation_set import VALIDATION_FILE
from maxscore.training.write_errors import RunWriteError, append_text, write_text

__all__ = [
    "SUMMARY_FILE",
    "PreparedRun",
    "TrainResult",
    "format_summary",
    "prepare",
    "train",
    "training_arguments",
    "write_resolved_config",
]

SUMMARY_FILE = "summary.json"


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
    #: the signal that stopped the run (``interrupted``): SIGINT, SIGTERM or SIGUSR1
    stop_signal: int | None = None

    @property
    def exit_status(self) -> int:
        """The status ``maxscore train`` exits with: 0 for a finished run; for one stopped by
        a signal (its checkpoint saved, ``--resume`` continues it) 128 + the signal's number,
        what a shell reports for a process that signal killed: 130 for Ctrl-C, 143 for SIGTERM,
        138 for SIGUSR1 on Linux. A scheduler's epilog, ``sbatch --requeue`` scripts or a retry
        loop thus see a run that did not complete, and which signal ended it."""
        if not self.interrupted:
            return 0
        return 128 + int(self.stop_signal or signal.SIGINT)

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
    run-directory conflicts, a run directory in use by another process) raises
    :class:`ConfigError` from here. On process 0 the returned run holds the run directory's
    lock (:func:`~maxscore.training.run_lock.lock_run_dir`, taken before the directory is looked
    at) until :func:`train` ends; a refusal here releases it.
    """
    check_report_to(config.report_to)
    ws = world_size()
    check_float8_options(config)
    precision = resolve_precision(config.precision)
    check_fused_loss(config)
    if config.deterministic:
        DeterministicAlgorithms.check(config.compile)
    if config.deepspeed is not None:
        deepspeed_config_path(config.deepspeed)
        if config.compile and zero_stage(config.deepspeed) == 3:
            raise ConfigError(
                "--compile is not supported with ZeRO-3 (DeepSpeed partitions parameters with "
                "hooks that compiled layers bypass); pass --no-compile, or use --deepspeed zero2"
            )
        # After the options' own conflicts: those are reported whether or not it is installed.
        check_deepspeed_installed()
    pretrained = is_pretrained_model(config.model)
    # A checkpoint's config first: a bad --model is reported before its tokenizer is read.
    model_config = build_model_config(config) if pretrained else None
    tokenizer = load_tokenizer(pretrained_tokenizer(config) if pretrained else config.tokenizer)
    if model_config is None:
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
    check_parallel_options(config, ws, model_config)
    check_lora_options(config, model_config)
    plan = check_run_dir(config) if is_main_process() else _follower_plan(config)
    try:
        total_steps = config.total_steps(ws)
        # The SoftTopk t schedule follows the run (or a resumed run's stored length); resolved once.
        temperature = resolve_temperature(
            config, model_config.router_config, total_steps, plan.resume_from
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
    except BaseException:
        plan.release_lock()  # refused after the lock was taken: the directory is free again
        raise


def _follower_plan(config: TrainConfig) -> RunDirPlan:
    """The run-directory plan of a process other than 0: process 0 checks and owns the folder
    (it may be moving a replaced run aside); the others only read where to resume from."""
    plan = RunDirPlan(config.run_dir)
    if config.resume:
        plan.resume_from, plan.damaged = newest_intact(list_checkpoints(config.run_dir))
    return plan


def training_arguments(run: PreparedRun) -> TrainingArguments:
    """The Trainer's arguments for a prepared run."""
    cfg = run.config
    if cfg.deepspeed:
        single_process_launcher_env()
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
    deepspeed = deepspeed_config_path(cfg.deepspeed) if cfg.deepspeed else None
    args = TrainingArguments(
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
        # fp8 trains under bf16 autocast around its float8 layers (apply_float8).
        bf16=autocast_dtype(run.precision) == torch.bfloat16,
        fp16=autocast_dtype(run.precision) == torch.float16,
        **_activation_checkpointing_argument(cfg.gradient_checkpointing),
        # torch's fused AdamW on GPUs and CPUs alike (each parameter updated in one pass; on
        # the CPU 0.4x the time of the for-loop AdamW, about 5 s of the default job); it also
        # takes the gradient clipping into its step (clipping.py).
        optim="adamw_torch_fused",
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
    if run.world_size == 1 and args.n_gpu > 1:
        # One process that sees several GPUs would make the Trainer wrap the model in
        # nn.DataParallel, whose replicas return per-GPU aux losses and routing statistics
        # (and run the routing kernels on copies); data parallelism here is torchrun's.
        print(
            f"maxscore: {args.n_gpu} GPUs visible to one process: training on {args.device} "
            f"only; launch with torchrun --nproc-per-node {args.n_gpu} to use them all",
            file=sys.stderr,
        )
        args._n_gpu = 1  # the Trainer's own count of the GPUs it spreads a batch over
    return args


def _activation_checkpointing_argument(enabled: bool) -> dict[str, bool]:
    """``TrainingArguments``' activation-checkpointing flag under its current name.

    transformers renamed ``gradient_checkpointing`` to ``activation_checkpointing`` and warns
    (FutureWarning) whenever the old name is passed, even as False; the supported transformers
    range has both spellings.
    """
    names = {f.name for f in fields(TrainingArguments)}
    key = (
        "activation_checkpointing"
        if "activation_checkpointing" in names
        else "gradient_checkpointing"
    )
    return {key: enabled}


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
        text = json.dumps(resolved, indent=2, default=str) + "\n"
        write_text(run.run_dir / CONFIG_FILE, text, "the run's config", run.run_dir)


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
    plan = run.run_dir_plan or RunDirPlan(run.run_dir, run.resume_from)
    main = is_main_process()
    if main and (plan.lock is None or not plan.lock.held):
        # A plan made without check_run_dir, or whose run already ended: the directory is
        # taken again before anything in it changes (run_lock.lock_run_dir).
        plan.lock = lock_run_dir(plan.path)
    directory = RunDirectory(plan)
    try:
        if main:
            directory.open()
        try:
            result = _train(run, [*(callbacks or []), RunDirectoryCallback(directory)])
        except BaseException as err:
            if main:
                # A tracker that did not start is the environment's fault, not the run's: its
                # directory (which the tracker may have written into) stays for the next try.
                directory.close(failed=True, keep=isinstance(err, TrackerStartError))
                _advise(err, directory.resumable)
            raise
        if main:
            directory.close(failed=False, interrupted=result.interrupted)
    finally:
        plan.release_lock()  # after the directory is settled (a replaced run put back or gone)
    return result


def _advise(err: BaseException, resumable: bool) -> None:
    """Say how to go on after a failed run that has a checkpoint, with the exact command
    (:func:`~maxscore.training.continue_command.how_to_continue`). A failed write says it in its
    own line (:mod:`maxscore.training.write_errors`); a configuration error needs a change, not
    a rerun, and gets none."""
    if resumable and not isinstance(err, (RunWriteError, ConfigError)):
        print(f"maxscore: the run failed; {how_to_continue(True)}", file=sys.stderr, flush=True)


def _train(run: PreparedRun, callbacks: list[TrainerCallback]) -> TrainResult:
    """:func:`train` inside an opened run directory, with ``--deterministic``'s settings
    installed before the model is built (before anything runs on the GPU) and restored when the
    run ends or raises (:class:`~maxscore.training.callbacks.DeterministicAlgorithms`)."""
    determinism = DeterministicAlgorithms(run.config.deterministic, compile=run.config.compile)
    determinism.install()
    # --quiet also silences transformers' own bars ("Writing model shards" at every save).
    bars_were_on = hf_logging.is_progress_bar_enabled()
    if run.config.quiet:
        hf_logging.disable_progress_bar()
    try:
        with kept_matmul_precision():  # TrainingArguments switches TF32 on process-wide
            return _train_and_evaluate(run, callbacks)
    except RuntimeError as err:
        explained = determinism.explain(err)
        if explained is None:
            raise
        raise explained from err
    finally:
        determinism.uninstall()
        if bars_were_on:
            hf_logging.enable_progress_bar()


def _warn_if_checkpoints_will_not_fit(run: PreparedRun, model: nn.Module) -> None:
    """One warning line at the start when the checkpoints this run keeps at once outgrow the
    disk (``disk_space.py``); only where one process sees the whole checkpoint."""
    cfg = run.config
    sharded = cfg.deepspeed is not None or cfg.lora or cfg.fsdp or cfg.expert_parallel > 1
    if sharded or not is_main_process():
        return
    warning = disk_space_warning(
        run.run_dir,
        model,
        total_steps=run.total_steps,
        save_steps=cfg.save_steps,
        save_final=cfg.save_final,
        keep=cfg.save_total_limit,
    )
    if warning is not None:
        print(warning, file=sys.stderr)


def _train_and_evaluate(run: PreparedRun, callbacks: list[TrainerCallback]) -> TrainResult:
    """The model built, trained and evaluated; the result written to the run directory."""
    cfg = run.config
    write_resolved_config(run)
    # ZeRO-3 partitions parameters itself, so a DeepSpeed run's model is handed over on the CPU;
    # a fresh one is still drawn on the GPU, so that its weights equal a DDP run's of the seed.
    if is_pretrained_model(cfg.model):
        model = load_pretrained_model(cfg, run.model_config, on_gpu=cfg.deepspeed is None)
    else:
        model = build_model(
            run.model_config, cfg.seed, on_gpu=True, to_cpu=cfg.deepspeed is not None
        )
    if cfg.gradient_checkpointing and not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"model preset {cfg.model!r} does not support gradient checkpointing")
    mark_zero3_leaf_modules(model, cfg.deepspeed)
    apply_speed_options(model, cfg, run.precision)  # before LoRA, compilation and wrapping
    _warn_if_checkpoints_will_not_fit(run, model)
    extra_callbacks: list[TrainerCallback] = []
    if cfg.lora:
        model = apply_lora(model, cfg, run.run_dir, run.tokenizer)
        extra_callbacks.append(RouterStepsOnResume())
    if cfg.compile:
        # One MoE layer routes a whole micro-batch at once (in evaluation too: same batch size).
        experts = 0 if run.model_config.is_dense else run.model_config.num_experts
        model.compile_layers(
            mode=cfg.compile_mode,
            mix_order_reduction=router_allows_mix_order_reduction(
                cfg.batch_size * cfg.seq_len, experts
            ),
        )

    args = training_arguments(run)
    # trainer_for shards the experts for --expert-parallel.
    trainer_class, parallel_kwargs = trainer_for(model, cfg, args, run.resume_from)
    final_cb = FinalCheckpointCallback(save_final=cfg.save_final)
    gc_cb = GarbageCollectionCallback(cfg.gc_interval)
    trainer = trainer_class(
        model=model,
        args=args,
        train_dataset=run.data.train,
        eval_dataset=run.data.validation,
        processing_class=run.tokenizer,
        data_collator=collate_blocks,
        tokens_per_step=cfg.tokens_per_step(run.world_size),
        save_total_limit=cfg.save_total_limit,
        callbacks=[RouterStepCallback(), *extra_callbacks, final_cb, gc_cb, *callbacks],
        **parallel_kwargs,
    )
    trainer.remove_callback(PrinterCallback)
    if trainer.pop_callback(ProgressCallback) is not None and not cfg.quiet:
        trainer.add_callback(CompactProgressCallback())
    trainer.add_callback(MetricsJsonlCallback(run.run_dir / METRICS_FILE, trainer.metrics))
    tensorboard = tensorboard_callback(run.run_dir, cfg.report_to)
    if tensorboard is not None:
        trainer.add_callback(tensorboard)
    guard_tracker_start(trainer)

    if run.resume_from is not None:
        step = int(run.resume_from.name.split("-")[-1])
        if is_main_process():
            truncate_metrics(run.run_dir / METRICS_FILE, step)
            print(f"maxscore: resuming from {run.resume_from}", file=sys.stderr)

    final_cb.install()
    gc_cb.install()
    start = time.perf_counter()
    try:
        trainer.start_timer()
        output = trainer.train(
            resume_from_checkpoint=str(run.resume_from) if run.resume_from else None
        )
    finally:
        gc_cb.uninstall()
        final_cb.uninstall()
    runtime = time.perf_counter() - start

    interrupted = final_cb.interrupted
    metrics: dict[str, float] = {}
    if not interrupted and len(run.data.validation) > 0:
        metrics = _final_evaluation(trainer)
    eval_loss = metrics.get("eval_loss")
    history = [h for h in trainer.state.log_history if "tokens_per_s" in h]
    speeds = [h["tokens_per_s"] for h in history]
    routing = trainer.metrics.last_routing
    result = TrainResult(
        run_dir=run.run_dir,
        final_checkpoint=last_checkpoint(run.run_dir),
        steps=trainer.state.global_step,
        tokens=trainer.state.global_step * cfg.tokens_per_step(run.world_size),
        eval_loss=eval_loss,
        perplexity=math.exp(min(eval_loss, 50.0)) if eval_loss is not None else None,
        train_loss=output.training_loss if output is not None else None,
        tokens_per_s=sum(speeds) / len(speeds) if speeds else None,
        peak_memory_gb=peak_memory_gb(),
        runtime_s=runtime,
        interrupted=interrupted,
        stop_signal=final_cb.stop_signal if interrupted else None,
        routing=summarize_routing(routing),
        eval_loss_se=metrics.get("eval_loss_se"),
        eval_tokens=metrics.get("eval_tokens"),
        eval_documents=metrics.get("eval_documents"),
    )
    if trainer.is_world_process_zero():
        summary = json.dumps(result.to_dict(), indent=2, default=str) + "\n"
        write_text(run.run_dir / SUMMARY_FILE, summary, "the run's summary", run.run_dir)
        if metrics and trainer.last_validation is not None:
            payload = {"step": result.steps, **trainer.last_validation.to_dict()}
            write_text(
                run.run_dir / VALIDATION_FILE,
                json.dumps(payload) + "\n",
                "the validation result",
                run.run_dir,
            )
        record = {"type": "final", "step": result.steps, **result.to_dict()}
        line = json.dumps(record, default=str) + "\n"
        append_text(run.run_dir / METRICS_FILE, line, "the training metrics", run.run_dir)
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


def format_summary(result: TrainResult) -> str:
    """The lines ``maxscore train`` prints at the end."""
    lines = [f"run directory:     {result.run_dir}"]
    if result.interrupted:
        how = "interrupted"
        if result.stop_signal not in (None, signal.SIGINT):
            how = f"stopped by {signal.Signals(result.stop_signal).name}"
        lines.append(f"{how} at step {result.steps}; checkpoint: {result.final_checkpoint}")
        previous = pending_previous_run(result.run_dir)
        if previous is not None:
            lines.append(
                f"the previous run stays as {previous.name} until this one, continued, reaches "
                "a scheduled checkpoint or its end"
            )
        lines.append(how_to_continue(True))
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
    lines.append(f"final checkpoint:  {result.final_checkpoint or 'none (--no-save-final)'}")
    return "\n".join(lines)
