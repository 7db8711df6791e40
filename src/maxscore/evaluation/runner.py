"""Run lm-evaluation-harness on maxscore checkpoints and collect the results.

The model is loaded here (so the evaluation routing mode can be set and recorded) and handed to
lm-eval's ``HFLM`` wrapper; lm-eval does the prompting, batching and scoring. Bundled offline
tasks are found through a ``TaskManager`` whose ``include_path`` is the package's task
directory.

torch, transformers, safetensors and lm-eval are imported inside the functions that use them:
this module is read when ``maxscore``'s command line is built (``eval``'s options), which must
not wait seconds for them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from maxscore.checkpoints.integrity import (
    describe_damage,
    is_training_state,
    newest_intact,
    verify_checkpoint,
)
from maxscore.checkpoints.layout import CHECKPOINT_RE, pending_previous_run
from maxscore.config_types import choices_of
from maxscore.evaluation.data import EvalDataUnavailableError
from maxscore.evaluation.registry import (
    ResolvedTask,
    TaskSource,
    bundled_tasks_dir,
    hub_offline,
    resolve_tasks,
)
from maxscore.evaluation.results import checkpoint_validation
from maxscore.routing.config import EvalRouting, RouterConfig

logger = logging.getLogger(__name__)

#: The evaluation routings (``RouterConfig.eval_routing``'s choices).
EVAL_ROUTING_MODES: tuple[str, ...] = choices_of(EvalRouting) or ()
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


class EvaluationError(RuntimeError):
    """A user-facing evaluation failure (bad checkpoint, task data unavailable, ...)."""


def is_checkpoint_dir(path: Path) -> bool:
    """A Hugging Face model directory: a ``config.json`` with a ``model_type`` and weights, or a
    LoRA adapter checkpoint (``adapter_config.json``; its base is merged in when loaded)."""
    # On use: maxscore.models loads transformers, which `maxscore --help` must not wait for.
    from maxscore.models.adapters import is_adapter_checkpoint

    if is_adapter_checkpoint(path):
        return True
    config = path / "config.json"
    if not config.is_file() or not any((path / f).is_file() for f in _WEIGHT_FILES):
        return False
    try:
        return "model_type" in json.loads(config.read_text())
    except (OSError, json.JSONDecodeError):
        return False


def find_run_checkpoints(run_dir: Path) -> list[Path]:
    """The checkpoints of a run directory, oldest first, ``final/`` last."""
    numbered = sorted(
        (int(m.group(1)), p)
        for p in run_dir.iterdir()
        if p.is_dir() and (m := CHECKPOINT_RE.match(p.name)) and is_checkpoint_dir(p)
    )
    found = [p for _, p in numbered]
    if is_checkpoint_dir(run_dir / "final"):
        found.append(run_dir / "final")
    return found


@dataclass(frozen=True)
class ResolvedModel:
    """Which checkpoint a user-supplied path means.

    Attributes:
        checkpoint: the Hugging Face model directory to load.
        run_dir: the run directory it belongs to, if any.
        name: the row label in result tables.
    """

    checkpoint: Path
    run_dir: Path | None
    name: str


def resolve_model_path(path: str | Path, name: str | None = None) -> ResolvedModel:
    """Resolve a checkpoint directory or a run directory (its ``final/`` or latest checkpoint).

    Raises:
        EvaluationError: the path does not exist or holds no loadable checkpoint.
    """
    p = Path(path).expanduser()
    previous = pending_previous_run(p)
    if previous is not None and not is_checkpoint_dir(p):
        # An --overwrite of the run has not replaced it yet: the run is still the previous one.
        print(
            f"maxscore eval: {p} is being replaced by an --overwrite run that has not reached a "
            f"scheduled checkpoint; evaluating the previous run ({previous.name}) "
            f"(its own checkpoints: {p}/checkpoint-N)",
            file=sys.stderr,
        )
        name, p = name or p.name, previous
    if not p.exists():
        raise EvaluationError(f"checkpoint or run directory not found: {p}")
    if not p.is_dir():
        raise EvaluationError(f"expected a checkpoint or run directory, got a file: {p}")
    if is_checkpoint_dir(p):
        run_dir = p.parent if (p.parent / "metrics.jsonl").is_file() else None
        label = name or (run_dir.name if run_dir is not None else p.name)
        return ResolvedModel(p.resolve(), run_dir.resolve() if run_dir else None, label)
    checkpoints = find_run_checkpoints(p)
    if not checkpoints:
        raise EvaluationError(
            f"{p} is neither a model checkpoint (config.json with model_type + weights) nor a run "
            "directory with a final/ or checkpoint-N/ checkpoint"
        )
    intact, damaged = newest_intact(checkpoints, include=_model_file)
    if intact is None:
        raise EvaluationError(f"no intact checkpoint in {p}: {describe_damage(damaged)}")
    if damaged:
        print(
            f"maxscore eval: damaged checkpoint(s) in {p}: {describe_damage(damaged)}; "
            f"evaluating {intact.name} instead",
            file=sys.stderr,
        )
    return ResolvedModel(intact.resolve(), p.resolve(), name or p.resolve().name)


def _model_file(name: str) -> bool:
    # Evaluation reads the model, config and tokenizer, not the optimizer state.
    return not is_training_state(name)


def verify_checkpoint_files(checkpoint: Path) -> None:
    """Raise EvaluationError if the files a model loader reads are damaged (integrity record,
    or for checkpoints without one, complete safetensors files)."""
    problems = verify_checkpoint(checkpoint, include=_model_file)
    if problems:
        raise EvaluationError(
            f"checkpoint {checkpoint} is damaged: {', '.join(problems)}. Evaluate an earlier "
            "checkpoint, or the run directory (its newest intact checkpoint is used)"
        )


def check_finite_weights(model: Any, checkpoint: Path) -> None:
    """Refuse a model whose weights hold NaN or inf (a damaged file or a diverged run)."""
    import torch  # on use (module docstring)

    bad = [
        name
        for name, tensor in model.state_dict().items()
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())
    ]
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise EvaluationError(
            f"checkpoint {checkpoint} has non-finite (NaN/inf) weights in {len(bad)} tensor(s) "
            f"({shown}); the file is damaged or the run diverged. Evaluate an earlier checkpoint"
        )


def _router_configs(model: Any) -> list[Any]:
    """Every RouterConfig held by the model's router modules."""
    found = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, RouterConfig):
            found.append((module, config))
    return found


def set_eval_routing(model: Any, mode: str) -> None:
    """Switch every router of ``model`` to evaluation routing ``mode`` (``causal``/``train``).

    Prefers the model's own ``set_eval_routing`` method; otherwise rewrites each router's
    :class:`~maxscore.routing.config.RouterConfig` and the model config's ``eval_routing`` (for
    a Llama-MoE config, its resolved router config) so the saved/recorded config tells the truth.
    """
    if mode not in EVAL_ROUTING_MODES:
        raise EvaluationError(f"routing must be one of {EVAL_ROUTING_MODES}, got {mode!r}")
    setter = getattr(model, "set_eval_routing", None)
    if callable(setter):
        setter(mode)
        return
    for module, config in _router_configs(model):
        module.config = replace(config, eval_routing=mode)
    # Keep the model config consistent with the routers (it is what gets recorded / saved).
    if hasattr(model.config, "eval_routing"):
        model.config.eval_routing = mode


def describe_routing(model: Any) -> dict[str, Any]:
    """What evaluation routing a model uses: mode, router preset/strategy and routing group."""
    info: dict[str, Any] = {}
    configs = _router_configs(model)
    if configs:
        first = configs[0][1]
        info.update(
            eval_routing=first.eval_routing,
            strategy=first.strategy,
            operator=first.operator,
            group=first.group,
            group_size=first.group_size,
            capacity_factor=first.capacity_factor,
        )
        # What eval() mode actually runs (causal evaluation swaps capacity strategies for
        # dropless top-k); asked of the router itself so the record cannot drift from it.
        pick = getattr(configs[0][0], "strategy_for_mode", None)
        if callable(pick) and not configs[0][0].training:
            info["eval_strategy"] = pick()[0]
    router = getattr(model.config, "router", None)
    if isinstance(router, str):
        info["router"] = router
    if not configs:
        info.setdefault("eval_routing", "n/a (no router)")
    return info


def _default_device() -> str:
    import torch  # on use (module docstring)

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(
    checkpoint: Path, device: str, dtype: str = "auto", routing: str | None = "causal"
) -> tuple[Any, Any]:
    """Load model and tokenizer from a checkpoint, set eval mode and the evaluation routing.

    The checkpoint's files are verified first (:func:`verify_checkpoint_files`) and weights
    holding NaN or inf are refused (:func:`check_finite_weights`): a damaged checkpoint must
    not give a score.
    """
    # On use (module docstring). Importing maxscore registered the model with the Auto classes.
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype: Any
    if dtype == "auto":
        # The dtype saved in the checkpoint, as lm-eval's own `dtype=auto` does, so both
        # entry points give the same numbers. Router math is fp32 whatever this is.
        torch_dtype = "auto"
    else:
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise EvaluationError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16, float16")
    verify_checkpoint_files(checkpoint)
    from maxscore.models.adapters import is_adapter_checkpoint, load_merged  # see is_checkpoint_dir

    model: Any
    try:
        if is_adapter_checkpoint(checkpoint):
            model = load_merged(checkpoint, dtype=torch_dtype)  # a LoRA run's checkpoint
        else:
            model = AutoModelForCausalLM.from_pretrained(
                str(checkpoint), dtype=torch_dtype, trust_remote_code=True
            )
        tokenizer = AutoTokenizer.from_pretrained(str(checkpoint), trust_remote_code=True)
    except (OSError, ValueError, SafetensorError, ImportError) as err:
        raise EvaluationError(f"cannot load checkpoint {checkpoint}: {err}") from err
    check_finite_weights(model, checkpoint)
    model.to(device)
    model.eval()
    if routing is not None:
        set_eval_routing(model, routing)
    return model, tokenizer


@dataclass
class ModelEvalResult:
    """lm-eval results of one model.

    Attributes:
        name: row label.
        checkpoint: evaluated checkpoint directory.
        routing: evaluation routing description (:func:`describe_routing`).
        metrics: ``{task: {metric: value}}`` with standard task names; lm-eval's
            ``"acc,none"`` keys become ``"acc"``, stderr as ``"acc_stderr"``.
        n_samples: ``{task: number of documents evaluated}``.
        task_info: ``{task: {"lm_eval_task", "bundled", "split", "num_fewshot"}}``.
        samples: per-document records (only when requested).
        validation: the training run's validation loss at this checkpoint's step, with its
            standard error (:func:`~maxscore.evaluation.results.checkpoint_validation`).
    """

    name: str
    checkpoint: str
    routing: dict[str, Any]
    metrics: dict[str, dict[str, float]]
    n_samples: dict[str, int]
    task_info: dict[str, dict[str, Any]]
    lm_eval_versions: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    dtype: str = ""
    samples: dict[str, list[dict[str, Any]]] | None = None
    validation: dict[str, Any] | None = None

    def to_dict(self, with_samples: bool = False) -> dict[str, Any]:
        out = {
            "name": self.name,
            "checkpoint": self.checkpoint,
            "routing": self.routing,
            "metrics": self.metrics,
            "n_samples": self.n_samples,
            "tasks": self.task_info,
            "lm_eval_versions": self.lm_eval_versions,
            "seconds": self.seconds,
            "dtype": self.dtype,
            "validation": self.validation,
        }
        if with_samples and self.samples is not None:
            out["samples"] = self.samples
        return out


def _clean_metrics(raw: dict[str, Any]) -> dict[str, float]:
    """``{"acc,none": 0.5, "acc_stderr,none": 0.1, "alias": ...}`` -> ``{"acc": 0.5, ...}``."""
    out: dict[str, float] = {}
    for key, value in raw.items():
        if not isinstance(value, int | float) or isinstance(value, bool):
            continue
        metric, _, filt = key.partition(",")
        if metric == "sample_len":  # a count lm-eval reports beside the metrics
            continue
        out[metric if filt in ("", "none") else f"{metric},{filt}"] = float(value)
    return out


@contextlib.contextmanager
def _quiet_lm_eval() -> Iterator[None]:
    """lm-eval as a library, without its command-line chatter.

    Its warnings address its own CLI's users (custom dataset kwargs, how a model was passed,
    chat templates; what matters to us is checked here and recorded in the results), and its
    environment probe runs ``git describe`` in the current folder, which prints ``fatal: not a
    git repository`` outside one: the probe runs with git's stderr silenced, recording the same
    hash or none.
    """
    import lm_eval.evaluator as lm_eval_evaluator
    import lm_eval.loggers.utils as lm_eval_utils

    def commit_hash() -> str | None:
        try:
            out = subprocess.run(
                ["git", "describe", "--always"], capture_output=True, check=True, text=True
            )
        except (OSError, subprocess.CalledProcessError):
            return None
        return out.stdout.strip() or None

    root = logging.getLogger("lm_eval")
    level = root.level
    modules = (lm_eval_utils, lm_eval_evaluator)  # the evaluator imported the probe by name
    probes = [module.get_git_commit_hash for module in modules]
    root.setLevel(logging.ERROR)
    for module in modules:
        module.get_git_commit_hash = commit_hash
    try:
        yield
    finally:
        root.setLevel(level)
        for module, probe in zip(modules, probes, strict=True):
            module.get_git_commit_hash = probe


def _task_manager(tasks: Sequence[ResolvedTask]) -> Any:
    """A TaskManager that knows the bundled tasks (and lm-eval's own, if any task needs them).

    Indexing lm-eval's thousands of built-in YAMLs takes tens of seconds, so it is skipped
    when every requested task is bundled.
    """
    from lm_eval.tasks import TaskManager  # on use (module docstring)

    return TaskManager(
        include_path=str(bundled_tasks_dir()),
        include_defaults=not all(t.bundled for t in tasks),
    )


def _wrap_data_errors(err: Exception, tasks: Sequence[ResolvedTask]) -> EvaluationError:
    """Turn lm-eval / datasets failures to fetch task data into one clear message."""
    online = [t.name for t in tasks if not t.bundled]
    cause: BaseException = err
    while cause.__cause__ is not None and not isinstance(cause, EvalDataUnavailableError):
        cause = cause.__cause__
    if isinstance(cause, EvalDataUnavailableError):
        return EvaluationError(str(cause))
    hint = ""
    if online:
        hint = (
            f" These tasks use lm-eval's own definitions and download their data from the "
            f"Hugging Face Hub: {', '.join(online)}"
            + (" (disabled here: HF_*_OFFLINE is set)" if hub_offline() else "")
            + "; offline, use the bundled tasks (--task-source bundled)."
        )
    return EvaluationError(f"task data unavailable: {type(err).__name__}: {err}.{hint}")


def evaluate_model(
    path: str | Path,
    tasks: list[str] | str,
    *,
    name: str | None = None,
    task_source: TaskSource = "auto",
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    batch_size: int | str = 1,
    device: str | None = None,
    dtype: str = "auto",
    routing: str | None = "causal",
    log_samples: bool = False,
    seed: int = 1234,
    bootstrap_iters: int = 1000,
) -> ModelEvalResult:
    """Evaluate one checkpoint (or the latest checkpoint of a run) with lm-eval.

    Args:
        path: checkpoint directory or run directory.
        tasks: task names (see :func:`maxscore.evaluation.registry.resolve_tasks`).
        name: row label (default: run or checkpoint directory name).
        task_source: ``auto`` / ``bundled`` / ``standard``.
        limit: documents per task (int) or fraction (float < 1), for quick checks.
        num_fewshot: few-shot examples (the paper: zero-shot, the tasks' default).
        batch_size: lm-eval batch size (int or ``"auto"``).
        device: torch device (default: cuda if available else cpu).
        dtype: ``auto`` (the checkpoint's saved dtype, like lm-eval), ``float32``, ``bfloat16``,
            ``float16``.
        routing: evaluation routing mode, ``causal`` (default: no token's experts depend on
            later tokens) or ``train`` (the training-time, possibly capacity-limited routing);
            ``None`` keeps what the checkpoint's config says.
        log_samples: keep per-document records (loglikelihoods, targets) in the result.
        seed: random seed passed to lm-eval (few-shot sampling, ``--limit`` order).
        bootstrap_iters: bootstrap iterations for stderr of non-mean metrics (perplexity).

    Raises:
        EvaluationError: bad checkpoint or unavailable task data.
        UnknownTaskError: unknown task name.
    """
    # On use (module docstring).
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    resolved_tasks = resolve_tasks(tasks, task_source)
    resolved = resolve_model_path(path, name)
    device = device or _default_device()
    model, tokenizer = load_model(resolved.checkpoint, device, dtype, routing)
    start = time.perf_counter()
    try:
        with _quiet_lm_eval():
            # backend="causal": our config class is not in transformers' causal-LM mapping,
            # which lm-eval otherwise uses to guess (and warns about).
            lm = HFLM(
                pretrained=model,
                backend="causal",
                tokenizer=tokenizer,
                batch_size=batch_size,
                device=device,
            )
            out = simple_evaluate(
                model=lm,
                tasks=[t.lm_eval_name for t in resolved_tasks],
                num_fewshot=num_fewshot,
                limit=limit,
                task_manager=_task_manager(resolved_tasks),
                log_samples=log_samples,
                bootstrap_iters=bootstrap_iters,
                random_seed=seed,
                numpy_random_seed=seed,
                torch_random_seed=seed,
                fewshot_random_seed=seed,
            )
    except EvaluationError:
        raise
    except (EvalDataUnavailableError, OSError, ConnectionError, FileNotFoundError) as err:
        raise _wrap_data_errors(err, resolved_tasks) from err
    except Exception as err:
        # datasets / huggingface_hub raise their own types when the Hub is unreachable.
        module = type(err).__module__
        if module.startswith(("datasets", "huggingface_hub", "requests", "urllib3", "httpx")):
            raise _wrap_data_errors(err, resolved_tasks) from err
        raise
    seconds = time.perf_counter() - start
    if out is None:  # non-zero ranks under accelerate return None
        raise EvaluationError("lm-eval returned no results (not rank 0?)")
    result = _collect(out, resolved, resolved_tasks, describe_routing(model), seconds, log_samples)
    result.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return result


def _collect(
    out: dict[str, Any],
    resolved: ResolvedModel,
    tasks: Sequence[ResolvedTask],
    routing: dict[str, Any],
    seconds: float,
    log_samples: bool,
) -> ModelEvalResult:
    metrics: dict[str, dict[str, float]] = {}
    n_samples: dict[str, int] = {}
    info: dict[str, dict[str, Any]] = {}
    configs = out.get("configs", {})
    for task in tasks:
        raw = out["results"].get(task.lm_eval_name)
        if raw is None:
            continue
        metrics[task.name] = _clean_metrics(raw)
        counts = out.get("n-samples", {}).get(task.lm_eval_name, {})
        n_samples[task.name] = int(counts.get("effective", counts.get("original", 0)))
        cfg = configs.get(task.lm_eval_name, {})
        info[task.name] = {
            "lm_eval_task": task.lm_eval_name,
            "bundled": task.bundled,
            "split": cfg.get("test_split") or cfg.get("validation_split"),
            "num_fewshot": cfg.get("num_fewshot", 0),
        }
    samples = None
    if log_samples:
        samples = {
            t.name: [_sample_record(s) for s in out.get("samples", {}).get(t.lm_eval_name, [])]
            for t in tasks
        }
    return ModelEvalResult(
        name=resolved.name,
        checkpoint=str(resolved.checkpoint),
        routing=routing,
        metrics=metrics,
        n_samples=n_samples,
        task_info=info,
        lm_eval_versions={k: v for k, v in out.get("versions", {}).items()},
        seconds=seconds,
        samples=samples,
        validation=checkpoint_validation(resolved.run_dir, resolved.checkpoint),
    )


def _sample_record(sample: dict[str, Any]) -> dict[str, Any]:
    """The JSON-safe part of one lm-eval sample: doc id, target, per-choice loglikelihoods."""
    loglikelihoods = [
        float(r[0]) for r in sample.get("filtered_resps", []) if isinstance(r, list | tuple)
    ]
    record: dict[str, Any] = {"doc_id": sample.get("doc_id"), "loglikelihoods": loglikelihoods}
    for key in ("target", "acc", "acc_norm", "perplexity"):
        if key in sample:
            value = sample[key]
            record[key] = value if isinstance(value, int | float | str) else str(value)
    return record
