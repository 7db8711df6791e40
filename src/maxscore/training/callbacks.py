"""The trainer's callbacks: each one job at a point of the Hugging Face ``Trainer``'s loop.

* :class:`RouterStepCallback`: after every optimizer step, the routers count it (the SoftTopk
  ``t`` schedule, the DeepSeek-V3 balancing bias).
* :class:`RoutingStatisticsCallback`: after every optimizer step, the routing statistics go to
  the trainer's :class:`~maxscore.training.metrics.TrainingMetrics`.
* :class:`FinalCheckpointCallback`: a checkpoint at the last step and on Ctrl-C (SIGINT).
* :class:`GarbageCollectionCallback`: Python's garbage collected every N steps, not whenever
  its allocation counters say.
* :class:`RunDirectoryCallback`: tells the run directory when a checkpoint is in place.
* :class:`CompactProgressCallback`: the progress bar with one readable line per log.
* :func:`tensorboard_callback`: TensorBoard logs in ``<run>/tensorboard``.
"""

from __future__ import annotations

import gc
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from maxscore.training.config import ConfigError
from maxscore.training.distributed import is_main_process, unwrap
from maxscore.training.metrics import TrainingMetrics, format_log_line
from maxscore.training.reporting import wants_tensorboard
from maxscore.training.run_dir import RunDirectory

__all__ = [
    "CompactProgressCallback",
    "FinalCheckpointCallback",
    "GarbageCollectionCallback",
    "RouterStepCallback",
    "RoutingStatisticsCallback",
    "RunDirectoryCallback",
    "tensorboard_callback",
]


class RouterStepCallback(TrainerCallback):
    """Count every optimizer step in the routers (``model.advance_router_schedule()``).

    The SoftTopk ``t`` schedule advances and DeepSeek-V3 balancing biases move by the loads of
    the step (:meth:`maxscore.routing.router.Router.advance_schedule`), on every process at the
    same point (the bias update all-reduces the loads). ``on_step_end`` runs after the optimizer
    step and before the Trainer decides to save, so a checkpoint at step N holds the schedule
    and the biases after N steps, and a resumed run continues exactly.
    """

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> Any:
        target = unwrap(model)
        if hasattr(target, "advance_router_schedule"):
            target.advance_router_schedule()
        return control


class RoutingStatisticsCallback(TrainerCallback):
    """Add each optimizer step's routing statistics (its last micro-batch's) to ``metrics``."""

    def __init__(self, metrics: TrainingMetrics, trainer: Any) -> None:
        self.metrics = metrics
        self.trainer = trainer  # its model, when the callback is given none

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> Any:
        self.metrics.add_routing(model if model is not None else self.trainer.model)
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


class GarbageCollectionCallback(TrainerCallback):
    """Python's garbage collector on a schedule: off during training, the young generations
    collected every ``interval`` optimizer steps, a full collection at the end.

    Python starts a full (oldest-generation) collection on its own when enough objects have
    survived the younger ones; it walks every object the process holds, and after
    ``torch.compile`` of a 12-layer, 128-expert model those are about 700,000 (0.4-0.6 s for one
    collection on a 2-core CPU), so the step it falls in stalls; training runs on an H100 showed
    one-off stalls of that size (benchmarks/flow_solver/README.md). On a schedule the pauses are
    short (the young generations: 12.5 ms every 50 steps there) and fall at the same steps in
    every process, so no process of a distributed run waits for another's collection. Objects
    that reach the old generation stay until training ends, as with torchtitan's ``gc_freq``.
    ``install`` / ``uninstall`` around ``Trainer.train`` restore the collector's state even when
    training raises.
    """

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._was_enabled: bool | None = None

    def install(self) -> None:
        if self.interval > 0 and self._was_enabled is None:
            self._was_enabled = gc.isenabled()
            gc.collect(1)
            gc.disable()

    def uninstall(self) -> None:
        if self._was_enabled is not None:
            if self._was_enabled:
                gc.enable()
            self._was_enabled = None
            gc.collect()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        if self._was_enabled is not None and state.global_step % self.interval == 0:
            gc.collect(1)
        return control


def _can_install_signal_handler() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


class RunDirectoryCallback(TrainerCallback):
    """Tells the run directory when a checkpoint is in place (a replaced run can go then)."""

    def __init__(self, directory: RunDirectory) -> None:
        self.directory = directory

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        if is_main_process():
            self.directory.checkpoint_written()
        return control


class CompactProgressCallback(ProgressCallback):
    """Trainer's tqdm bar (with ETA), but one readable line per log instead of a dict."""

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> Any:
        if not state.is_world_process_zero or self.training_bar is None or not logs:
            return
        self.training_bar.write(format_log_line(state.global_step, state.max_steps, logs))


def tensorboard_callback(run_dir: Path, report_to: str) -> TrainerCallback | None:
    """TensorBoard logging into ``<run>/tensorboard`` when ``report_to`` asks for it (``None``:
    not wanted, or ``auto`` without the package)."""
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
