"""Routing statistics of a checkpoint, measured by running it on validation data.

``metrics.jsonl`` holds the statistics of the *training* batches at log time; this module
measures a saved model instead: it rebuilds the run's validation blocks (same dataset,
tokenizer and sequence length as training) and averages ``model.routing_statistics()`` over
them. By default it uses the training routing (``routing="train"``), because drop rates and
load over capacity only mean something when capacity is enforced; ``routing="causal"`` measures
what evaluation sees.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from maxscore.analysis.runs import LAYER_STAT_KEYS, RoutingSnapshot, RunData, RunError
from maxscore.data.config import DataConfig
from maxscore.data.packing import pack_documents
from maxscore.data.sources import load_text_splits
from maxscore.evaluation.runner import load_model


def validation_blocks(run: RunData, tokenizer: Any, max_blocks: int) -> Any:
    """``[N, seq_len]`` token blocks of the run's validation split (as training built them)."""
    train_cfg = run.config.get("train")
    if not isinstance(train_cfg, dict):
        raise RunError(f"{run.path}/config.json has no 'train' section; cannot rebuild its data")
    config = DataConfig.of(train_cfg)
    splits = load_text_splits(config)
    blocks = pack_documents(splits.validation, tokenizer, config.seq_len, max_blocks=max_blocks)
    if len(blocks) == 0:
        raise RunError(
            f"the validation split of {run.path} gives no block of {config.seq_len} tokens"
        )
    return blocks


def checkpoint_snapshot(
    run: RunData,
    checkpoint: Path,
    *,
    max_blocks: int = 8,
    batch_size: int = 4,
    routing: str = "train",
    device: str | None = None,
    blocks: Any = None,
) -> RoutingSnapshot:
    """Average per-layer routing statistics of ``checkpoint`` over validation blocks.

    Args:
        run: the run the checkpoint belongs to (its config says which data to use).
        checkpoint: model directory.
        max_blocks: validation blocks to run (each ``seq_len`` tokens).
        batch_size: blocks per forward pass (matters for ``group="batch"`` routers).
        routing: ``"train"`` (capacity-limited training routing, the default) or ``"causal"``.
        device: torch device (default: cuda if available).
        blocks: token blocks to use instead of the run's validation split (tests).
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model(checkpoint, device, "auto", routing)
    if not hasattr(model, "routing_statistics"):
        raise RunError(f"{checkpoint} is not a maxscore MoE model (no routing_statistics())")
    if blocks is None:
        blocks = validation_blocks(run, tokenizer, max_blocks)
    blocks = blocks[:max_blocks]
    sums: list[dict[str, Any]] | None = None
    layers: list[int] = []
    weight_total = 0
    with torch.no_grad():
        for start in range(0, len(blocks), batch_size):
            batch = blocks[start : start + batch_size].to(device)
            model(input_ids=batch)
            per_layer = model.routing_statistics()
            layers = [i for i, stats in enumerate(per_layer) if stats]
            current = [
                {k: stats[k].detach().double().cpu() for k in LAYER_STAT_KEYS if k in stats}
                for stats in per_layer
                if stats
            ]
            # Weight each batch by its number of sequences so a short last batch counts less.
            weight = int(batch.shape[0])
            if sums is None:
                sums = [{k: v * weight for k, v in layer.items()} for layer in current]
            else:
                for acc, layer in zip(sums, current, strict=True):
                    for key, value in layer.items():
                        acc[key] = acc[key] + value * weight
            weight_total += weight
    if not sums:
        raise RunError(f"{checkpoint} has no MoE layer to analyse (dense model?)")
    stats = {
        key: [(layer[key] / weight_total).tolist() for layer in sums]
        for key in LAYER_STAT_KEYS
        if key in sums[0]
    }
    return RoutingSnapshot(
        layers,
        stats,
        f"checkpoint {checkpoint.name}, {len(blocks)} validation blocks, {routing} routing",
        None,
    )
