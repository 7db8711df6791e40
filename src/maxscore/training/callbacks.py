"""The trainer's callbacks: each one job at a point of the Hugging Face ``Trainer``'s loop.

* :class:`RouterStepCallback`: after every optimizer step, the routers count it (the SoftTopk
  ``t`` schedule, the DeepSeek-V3 balancing bias).
* :class:`RoutingStatisticsCallback`: after every optimizer step, the routing statistics go to
  the trainer's :class:`~maxscore.training.metrics.TrainingMetrics`.
* :class:`FinalCheckpointCallback`: a checkpoint at the last step and on Ctrl-C (SIGINT),
  SIGTERM or SIGUSR1 (a scheduler's preemption), then a clean stop.
* :class:`GarbageCollectionCallback`: Python's garbage collected every N steps, not whenever
  its allocation counters say.
* :class:`DeterministicAlgorithms`: torch's deterministic settings around a run
  (``--deterministic``), restored after it.
* :class:`RunDirectoryCallback`: tells the run directory when a checkpoint is in place.
* :class:`CompactProgressCallback`: the progress bar with one readable line per log.
* :func:`tensorboard_callback`: TensorBoard logs in ``<run>/tensorboard``.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from maxscore.training.config import ConfigError
from maxscore.training.distributed import is_main_process, unwrap
from maxscore.training.metrics import TrainingMetrics, format_log_line
from maxscore.training.reporting import wants_tensorboard
from maxscore.training.run_dir import RunDirectory
from maxscore.training.write_errors import reported_write, silence_tensorboard_writer_thread

__all__ = [
    "CUBLAS_WORKSPACE_CONFIG",
    "REPEATED_SIGNAL_S",
    "STOP_SIGNALS",
    "CompactProgressCallback",
    "DeterministicAlgorithms",
    "FinalCheckpointCallback",
    "GarbageCollectionCallback",
    "NondeterministicOperationError",
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


#: The signals that ask a run for a checkpoint and a clean stop at the end of the current step:
#: Ctrl-C, SIGTERM (Slurm's preemption and time limit, ``docker stop``, ``timeout``, ``kill``)
#: and SIGUSR1 (the preemption warning many clusters send, e.g. Slurm's ``--signal=USR1@120``)
#: where the platform has it.
STOP_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1") if hasattr(signal, name)
)

#: The same SIGTERM / SIGUSR1 again within this many seconds is the same request delivered
#: twice, not a second one: Slurm signals every process of a job step and torchrun forwards the
#: signal it got to its workers, so each worker sees it twice at once.
REPEATED_SIGNAL_S = 2.0


class FinalCheckpointCallback(TrainerCallback):
    """Save at the last step (so the run always ends with a checkpoint), and on a stop signal.

    ``install`` / ``uninstall`` around ``Trainer.train`` put handlers for :data:`STOP_SIGNALS`
    in place and the previous ones back (also when training raises). The first stop signal asks
    for a checkpoint at the end of the current optimizer step and ends training there
    (``interrupted``; ``stop_signal`` says which signal, for the exit status: 128 + its number,
    see :attr:`maxscore.training.run.TrainResult.exit_status`); a second one aborts at once
    without saving (``KeyboardInterrupt``, like a second Ctrl-C), except the same SIGTERM /
    SIGUSR1 repeated within :data:`REPEATED_SIGNAL_S` seconds. Under DDP the processes agree
    at logging steps (the signal may reach only some of them).
    """

    def __init__(self, save_final: bool = True) -> None:
        self.save_final = save_final
        self.interrupted = False
        self.stop_signal: int | None = None
        self._signalled_at = 0.0
        self._previous_handlers: dict[int, Any] = {}

    def install(self) -> None:
        if not _can_install_signal_handler() or self._previous_handlers:
            return
        for signum in STOP_SIGNALS:
            self._previous_handlers[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        previous, self._previous_handlers = self._previous_handlers, {}
        for signum, handler in previous.items():
            # None: a handler installed outside Python, which cannot be put back; the default.
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self.interrupted:
            repeated = signum == self.stop_signal and signum != signal.SIGINT
            if repeated and now - self._signalled_at < REPEATED_SIGNAL_S:
                return
            raise KeyboardInterrupt
        self.interrupted = True
        self.stop_signal = signum
        self._signalled_at = now
        if signum == signal.SIGINT:
            message = (
                "\nmaxscore: interrupted; saving a checkpoint at the end of this step "
                "(Ctrl-C again to abort without saving)"
            )
        else:
            message = (
                f"\nmaxscore: {signal.Signals(signum).name} received; saving a checkpoint at the "
                "end of this step, then stopping (another signal aborts without saving)"
            )
        _say_from_handler(message)

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        stop = self.interrupted
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        at_check = state.global_step % max(args.logging_steps, 1) == 0
        if distributed and at_check:
            # Every process must take the same decision, or the collective save would hang; the
            # all-reduce is a host sync, so it only runs at logging steps (a signal then saves at
            # the next logging step). The maximum carries the signal's number to every process.
            flag = torch.tensor(
                [float(self.stop_signal or 0) if stop else 0.0],
                device="cuda" if torch.cuda.is_available() else "cpu",
            )
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            signum = int(flag.item())
            stop = signum > 0
            if stop and not self.interrupted:
                self.stop_signal = signum
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
            elif not stop and not _scheduled_save(args, state.global_step):
                # The Trainer's own flow saves at the last step under a "steps" strategy;
                # without --save-final only a save_steps multiple or a stop signal saves there.
                control.should_save = False
        return control


def _say_from_handler(message: str) -> None:
    """Print from a signal handler: ``print`` raises if the signal came in the middle of a
    write to stderr (a buffered stream is not re-entrant); then the bytes go to fd 2 directly."""
    try:
        print(message, file=sys.stderr, flush=True)
    except RuntimeError:
        with contextlib.suppress(OSError):
            os.write(2, (message + "\n").encode())


class GarbageCollectionCallback(TrainerCallback):
    """Python's garbage collector on a schedule: off during training, the young generations
    collected every ``interval`` optimizer steps, a full collection at the end.

    Python starts a full (oldest-generation) collection on its own when enough objects have
    survived the younger ones; it walks every object the process holds, and after
    ``torch.compile`` of a 12-layer, 128-expert model those are about 700,000 (0.4-0.6 s for one
    collection on a 2-core CPU), so the step it falls in stalls; GPU training runs show one-off
    stalls of that size (benchmarks/flow_solver/README.md). On a schedule the pauses are
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


#: The cuBLAS workspace setting of deterministic mode (one of the two torch accepts there).
CUBLAS_WORKSPACE_CONFIG = ":4096:8"
_CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


class NondeterministicOperationError(RuntimeError):
    """An operation torch refused under ``--deterministic``: it has no deterministic
    implementation on this device (the message names it; torch's error is the cause)."""


class DeterministicAlgorithms:
    """``TrainConfig.deterministic``: torch's deterministic settings for one run, restored after.

    ``install`` (before the model is built and before anything runs on the GPU) /
    ``uninstall`` (in a ``finally``) around the run, as :class:`GarbageCollectionCallback` does
    with Python's collector, so a process that trains several runs (``maxscore compare``, the
    tests) gets its previous settings back even when the run raises. While installed:

    * ``torch.use_deterministic_algorithms(True)``, not ``warn_only``: an operation that has no
      deterministic implementation raises (:meth:`explain` turns that error into a
      :class:`NondeterministicOperationError` saying that ``--deterministic`` asked for it);
      those that have one (``index_add_``, ``scatter_add_``, ``index_put_`` with accumulation,
      ``gather`` / ``index_select`` backward on CUDA) switch to it;
    * ``torch.backends.cudnn.deterministic = True`` and ``benchmark = False``;
    * ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` when the environment has no value: cuBLAS may split a
      product's reduction differently with the workspace it gets, so torch allows cuBLAS under
      deterministic algorithms only with one of the two fixed configurations (``:4096:8``,
      ``:16:8``) and reads the size when it creates a handle's workspace, i.e. at the first
      product: set before the model is built, not inside the training loop;
    * with ``compile``, ``torch._inductor.config.deterministic = True`` (no autotuning or
      padding chosen by timing on the device, whose choices can change the numerics from run to
      run); a torch without that attribute is refused (:meth:`check`), not trusted.

    Seeds are the Trainer's (transformers' ``set_seed``: ``random``, NumPy, torch and every
    CUDA device; ``build_model`` seeds the initialisation the same way), data order is seeded
    by ``data_seed``, DataLoader workers by ``seed_worker``, streaming shuffle buffers by the
    run's seed, and the model has no dropout. transformers' ``enable_full_determinism`` is not
    used: it sets ``CUDA_LAUNCH_BLOCKING=1`` (every kernel launch synchronous: slower, and not
    needed for determinism on one stream), overwrites a ``CUBLAS_WORKSPACE_CONFIG`` the user
    set, and restores nothing.

    Outside torch's switch: the MoE layer's Triton kernels (:mod:`maxscore.moe.dispatch`: a
    gather-sum in a fixed slot order, run with one fixed tile configuration in this mode
    because Triton's autotuner fails under it, and integer running counts, no atomics) and the flow
    solver's CUDA kernels, whose assignment is a function of the input
    (:mod:`maxscore.routing.flow.global_cuda`, "Determinism").
    """

    def __init__(self, enabled: bool, compile: bool = False) -> None:
        self.enabled = enabled
        self.compile = compile
        self._previous: dict[str, Any] | None = None

    @staticmethod
    def check(compile: bool) -> None:
        """Raise :class:`ConfigError` where deterministic mode cannot be honoured here: with
        ``compile`` on a torch whose inductor has no deterministic mode, or with a
        ``CUBLAS_WORKSPACE_CONFIG`` that torch does not accept as deterministic."""
        if compile and not hasattr(_inductor_config(), "deterministic"):
            raise ConfigError(
                f"--deterministic with --compile needs torch._inductor.config.deterministic "
                f"(inductor's deterministic mode), which torch {torch.__version__} does not "
                "have; drop --compile (or --deterministic), or use a newer torch"
            )
        workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        if workspace is not None and workspace not in _CUBLAS_DETERMINISTIC:
            raise ConfigError(
                f"--deterministic: CUBLAS_WORKSPACE_CONFIG={workspace} is not one of the "
                f"settings under which cuBLAS is deterministic ({', '.join(_CUBLAS_DETERMINISTIC)});"
                " unset it (deterministic mode then uses :4096:8) or drop --deterministic"
            )

    @property
    def active(self) -> bool:
        """Whether the settings are installed now."""
        return self._previous is not None

    def install(self) -> None:
        if not self.enabled or self._previous is not None:
            return
        self.check(self.compile)
        inductor = _inductor_config()
        self._previous = {
            "algorithms": torch.are_deterministic_algorithms_enabled(),
            "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            "inductor": getattr(inductor, "deterministic", None),
        }
        # Before the first cuBLAS call of the run (see the class docstring); a value the user
        # set is kept (check() refused one that is not deterministic).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        if self.compile and inductor is not None:
            inductor.deterministic = True

    def uninstall(self) -> None:
        previous, self._previous = self._previous, None
        if previous is None:
            return
        # use_deterministic_algorithms sets inductor's flag too (torch 2.11's and 2.13's do): inductor's
        # own previous value goes back after it.
        torch.use_deterministic_algorithms(previous["algorithms"], warn_only=previous["warn_only"])
        torch.backends.cudnn.deterministic = previous["cudnn_deterministic"]
        torch.backends.cudnn.benchmark = previous["cudnn_benchmark"]
        inductor = _inductor_config()
        if inductor is not None and previous["inductor"] is not None:
            inductor.deterministic = previous["inductor"]
        if previous["cublas"] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = previous["cublas"]

    def explain(self, error: BaseException) -> NondeterministicOperationError | None:
        """The error to raise instead of torch's ``error`` when deterministic mode caused it (an
        operation without a deterministic implementation, or cuBLAS without a deterministic
        workspace), else ``None``."""
        if not self.enabled or not isinstance(error, RuntimeError):
            return None
        text = str(error)
        if "deterministic" not in text.lower() or isinstance(error, NondeterministicOperationError):
            return None
        return NondeterministicOperationError(
            "--deterministic (TrainConfig.deterministic) made torch refuse an operation that "
            "has no deterministic implementation on this device; drop --deterministic to run "
            "it (same-seed reruns then differ slightly), or the option that selects that "
            f"operation. torch said: {text}"
        )


def _inductor_config() -> ModuleType | None:
    """``torch._inductor.config`` (imported on first use: it takes seconds), ``None`` where
    this torch has no inductor."""
    try:
        return importlib.import_module("torch._inductor.config")
    except ImportError:
        return None


def _can_install_signal_handler() -> bool:
    return threading.current_thread() is threading.main_thread()


class RunDirectoryCallback(TrainerCallback):
    """Tells the run directory when a checkpoint is in place: a scheduled one (a ``save_steps``
    multiple, or the last step) lets a replaced run go; one saved at a stop signal does not."""

    def __init__(self, directory: RunDirectory) -> None:
        self.directory = directory

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        if is_main_process():
            self.directory.checkpoint_written(scheduled=is_scheduled_save(args, state))
        return control


def is_scheduled_save(args: Any, state: Any) -> bool:
    """Whether the checkpoint of ``state.global_step`` is one the run was set to write (every
    ``save_steps``, or at the last step), not one a stop signal asked for in between."""
    step = state.global_step
    if state.max_steps and step >= state.max_steps:
        return True
    return _scheduled_save(args, step)


def _scheduled_save(args: Any, step: int) -> bool:
    """Whether ``step`` is a multiple of ``save_steps`` under the "steps" save strategy."""
    strategy = getattr(args.save_strategy, "value", args.save_strategy)
    every = args.save_steps
    return strategy == "steps" and bool(every) and every >= 1 and step % int(every) == 0


class CompactProgressCallback(ProgressCallback):
    """Trainer's tqdm bar (with ETA), but one readable line per log instead of a dict."""

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> Any:
        if not state.is_world_process_zero or self.training_bar is None or not logs:
            return
        self.training_bar.write(format_log_line(state.global_step, state.max_steps, logs))


def tensorboard_callback(run_dir: Path, report_to: str) -> TrainerCallback | None:
    """TensorBoard logging into ``<run>/tensorboard`` when ``report_to`` asks for it (``None``:
    not wanted, or ``auto`` without the package).

    A full disk or a read-only folder under the event files ends the run with the one line of
    :mod:`~maxscore.training.write_errors`, like every other file of the run. Turning
    TensorBoard off and training on was the alternative; it is not taken because the event
    files live in the run directory, on the same file system as ``metrics.jsonl`` and the
    checkpoints: the next metrics line or checkpoint would fail the same way a few steps
    later, and those steps could not be saved anyway. Stopping at once keeps the newest
    checkpoint the newest work, and the message says what to do.
    """
    wanted = wants_tensorboard(report_to)
    if wanted == "no":
        return None
    try:  # transformers' TensorBoard integration, only for runs that report to TensorBoard
        from transformers.integrations import TensorBoardCallback

        # Raises without tensorboard / tensorboardX.
        return _tensorboard_callback_class(TensorBoardCallback)(run_dir)
    except (ImportError, RuntimeError):
        if wanted == "required":
            raise ConfigError("report_to=tensorboard needs the tensorboard package") from None
        return None


def _tensorboard_callback_class(base: type) -> type:
    """``transformers``' ``TensorBoardCallback`` whose writes report a full disk in one line.

    The writes happen in ``SummaryWriter``'s background thread; a failed one is raised again in
    the training thread by the next ``add_scalar`` / ``flush`` (the Trainer's callback flushes
    after every log), inside the hooks below. The thread's own traceback is kept off the
    console (``silence_tensorboard_writer_thread``).
    """

    class ReportedTensorBoardCallback(base):  # type: ignore[misc, valid-type]
        def __init__(self, run_dir: Path) -> None:
            super().__init__()
            self.run_dir = run_dir
            self.logging_dir = str(run_dir / "tensorboard")
            silence_tensorboard_writer_thread()

        def _reported(self) -> contextlib.AbstractContextManager[None]:
            return reported_write("the TensorBoard logs in", self.logging_dir, self.run_dir)

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            with self._reported():
                return super().on_train_begin(args, state, control, **kw)

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> Any:
            with self._reported():
                return super().on_log(args, state, control, logs=logs, **kw)

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            worker = self._writer_thread()
            with self._reported():
                result = super().on_train_end(args, state, control, **kw)
                # close() joins the thread but does not raise what it failed with.
                failure = getattr(worker, "exception", None)
                if failure is not None:
                    raise failure
            return result

        def _writer_thread(self) -> Any:
            """The ``SummaryWriter``'s background thread (``None`` where the writer has none:
            tensorboardX, or a version that keeps it elsewhere)."""
            writer = getattr(getattr(self, "tb_writer", None), "file_writer", None)
            async_writer = getattr(getattr(writer, "event_writer", None), "_async_writer", None)
            return getattr(async_writer, "_worker", None)

    return ReportedTensorBoardCallback
