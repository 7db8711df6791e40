"""What a training run measures and how it is written: one schema, one accumulator, one writer.

* :data:`METRICS_SCHEMA`: the fields of a line of ``<run>/metrics.jsonl``.
* :class:`TrainingMetrics`: the fields the trainer adds to its training logs. The aux loss of
  every micro-batch and the routing statistics of every optimizer step are summed on the device
  (no host synchronisation per step) and turned into log fields at logging steps, summed over
  all processes (DDP / DeepSpeed) then; ``t``, tokens, tokens/s and peak memory come with them.
* :class:`MetricsJsonlCallback`: appends every log to ``metrics.jsonl`` (process 0).
* :func:`format_log_line` (the console line), :func:`summarize_routing` (the end-of-run routing
  summary) and :func:`truncate_metrics` (a resumed run drops the lines after its checkpoint).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from maxscore.routing.schedule import TemperatureSchedule
from maxscore.training.distributed import unwrap
from maxscore.training.write_errors import append_text, reported_write

__all__ = [
    "METRICS_SCHEMA",
    "MetricsJsonlCallback",
    "TrainingMetrics",
    "find_temperature_schedule",
    "format_log_line",
    "mean_over_layers",
    "peak_memory_gb",
    "summarize_routing",
    "truncate_metrics",
]

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


def peak_memory_gb() -> float:
    """Peak CUDA memory allocated by this process, or its peak RSS without a GPU (GiB)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def find_temperature_schedule(model: Any) -> Any | None:
    """The first SoftTopk schedule module of ``model`` (all layers share the same value)."""
    for module in unwrap(model).modules():
        if isinstance(module, TemperatureSchedule):
            return module
    return None


class TrainingMetrics:
    """The fields the trainer adds to a training log, accumulated on the device between logs.

    :meth:`add_aux_loss` (each training micro-batch) and :meth:`add_routing` (each optimizer
    step: the last micro-batch's per-layer statistics) only add device tensors. At a logging
    step :meth:`log_fields` sums them over all processes (every process logs at the same steps)
    and writes ``aux_loss``, ``t``, ``dropped_rank{r}`` / ``rerouted_rank{r}``,
    ``load_imbalance``, ``unused_experts``, ``tokens``, ``tokens_per_s`` and ``peak_memory_gb``
    (:data:`METRICS_SCHEMA`); :attr:`last_routing` keeps that log's per-layer lists. Time spent
    outside training (evaluation, checkpoints) is reported with :meth:`pause` and left out of
    ``tokens_per_s``.
    """

    def __init__(self, tokens_per_step: int) -> None:
        self.tokens_per_step = tokens_per_step
        #: The per-layer routing lists of the last training log (``metrics.jsonl``'s ``routing``).
        self.last_routing: dict[str, Any] = {}
        self._aux_sum: torch.Tensor | None = None
        self._aux_count = 0
        self._routing_sum: list[dict[str, torch.Tensor]] | None = None
        self._routing_count = 0
        self._moe_layers: list[int] = []
        self._last_log_time: float | None = None
        self._last_log_step = 0
        self._paused_s = 0.0
        self._schedule: Any = None
        self._warned_layout = False

    def add_aux_loss(self, aux: torch.Tensor) -> None:
        """Add a training micro-batch's aux loss (as the model returns it) to the running sum."""
        aux = aux.detach().float()
        self._aux_sum = aux if self._aux_sum is None else self._aux_sum + aux
        self._aux_count += 1

    def add_routing(self, model: Any) -> None:
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

    def start_timer(self, step: int) -> None:
        """Mark the start of the timed training (the first tokens/s covers ``step + 1`` on)."""
        self._last_log_time = time.perf_counter()
        self._last_log_step = step

    def pause(self, seconds: float) -> None:
        """Leave ``seconds`` spent outside training out of the next ``tokens_per_s``."""
        self._paused_s += seconds

    def log_fields(self, logs: dict[str, float], model: Any, step: int, device: Any) -> None:
        """Add this training log's fields to ``logs`` (``step``: the optimizer step; ``device``:
        where the all-reduce runs when nothing has been accumulated)."""
        self._all_reduce(device)
        if self._aux_sum is not None and self._aux_count:
            logs["aux_loss"] = float(self._aux_sum / self._aux_count)
            self._aux_sum, self._aux_count = None, 0
        if self._schedule is None:
            self._schedule = find_temperature_schedule(model) or False
        if self._schedule:
            logs["t"] = float(self._schedule.value())
        routing = self._pop_routing()
        self.last_routing = routing
        if routing:
            for name in ("dropped", "rerouted"):
                per_layer = routing.get(f"{name}_by_rank")
                for rank, value in enumerate(mean_over_layers(per_layer) if per_layer else []):
                    logs[f"{name}_rank{rank + 1}"] = value
            for key in ("load_imbalance", "unused_experts"):
                values = routing.get(key)
                if values:
                    logs[key] = float(sum(values) / len(values))
        now = time.perf_counter()
        logs["tokens"] = step * self.tokens_per_step
        if self._last_log_time is not None and step > self._last_log_step:
            elapsed = max(now - self._last_log_time - self._paused_s, 1e-9)
            logs["tokens_per_s"] = (step - self._last_log_step) * self.tokens_per_step / elapsed
        self._last_log_time, self._last_log_step, self._paused_s = now, step, 0.0
        logs["peak_memory_gb"] = peak_memory_gb()

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

    def _all_reduce(self, device: Any) -> None:
        """Sum the aux-loss and routing accumulators (and their counts) over all processes.

        Called at logging time only (every process logs at the same steps), so the training
        steps themselves never synchronise. Afterwards every process holds the global sums and
        counts, and the means logged by :meth:`log_fields` are the same everywhere: the mean
        over all processes' steps (with equal step counts, the mean of the per-process means).
        One small all-reduce checks that all processes hold accumulators of the same layout
        first; where they do not (which the training loop never produces), the local values are
        logged and a warning is printed rather than risking a mismatched collective.
        """
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
        layers = self._routing_sum or []
        slots = [(i, key) for i, layer in enumerate(layers) for key in sorted(layer)]
        parts = [layers[i][key].reshape(-1) for i, key in slots]
        if self._aux_sum is not None:
            parts.append(self._aux_sum.reshape(-1))
        device = parts[0].device if parts else device
        numel = sum(part.numel() for part in parts)
        has_aux = float(self._aux_sum is not None)
        layout = torch.tensor(
            [numel, -numel, has_aux, -has_aux], device=device, dtype=torch.float64
        )
        dist.all_reduce(layout, op=dist.ReduceOp.MAX)
        if layout[0].item() != -layout[1].item() or layout[2].item() != -layout[3].item():
            if not self._warned_layout:
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


class MetricsJsonlCallback(TrainerCallback):
    """Append every log to ``<run>/metrics.jsonl`` (process 0 only), with the routing lists of
    ``metrics`` in training logs."""

    def __init__(self, path: Path, metrics: TrainingMetrics | None = None) -> None:
        self.path = path
        self.metrics = metrics

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
        if record["type"] == "train" and self.metrics is not None:
            routing = self.metrics.last_routing
            if routing:
                record["routing"] = routing
        # A full disk or a read-only folder ends the run with one line (write_errors.py).
        append_text(self.path, json.dumps(record) + "\n", "the training metrics", self.path.parent)
        return control


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


def truncate_metrics(path: Path, last_step: int) -> None:
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
    # Into a new file, then renamed over the old one: a full disk here keeps the old file.
    fresh = path.with_name(f".{path.name}.truncated")
    with reported_write("the training metrics", path, path.parent):
        try:
            fresh.write_text("".join(line + "\n" for line in kept))
            os.replace(fresh, path)
        finally:
            fresh.unlink(missing_ok=True)


def mean_over_layers(per_layer: list[list[float]]) -> list[float]:
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
            by_rank = mean_over_layers(per_layer)
            out[f"{name}_by_rank"] = by_rank
            # The share of all k slots of all tokens.
            out[name] = sum(by_rank) / len(by_rank)
    for key in ("load_imbalance", "unused_experts"):
        values = routing.get(key)
        if values:
            out[key] = sum(values) / len(values)
    return out
