"""Record a training run's routing decisions, step by step, and compare two runs' records.

:class:`RoutingTrace` is a ``TrainerCallback``: during the first ``steps`` optimizer steps it
keeps every MoE layer's ``expert_index`` (``[T, k]``, ``-1`` where a choice was dropped) and
gate logits of each training forward, and the step's ``input_ids``; at the end of training every
process writes its own file (``routing_rank<R>.pt``). :func:`load_global` joins the files of the
processes of one run in rank order, which is the global batch's order (rank ``r`` trains on
sequences ``r*b .. (r+1)*b - 1`` of each global batch of the Trainer's sharded sampler; the
recorded ``input_ids`` let :func:`compare` check that instead of assuming it).

:func:`compare` tells, per step, how many tokens were routed to a different set of experts in
two runs (a layout against another: expert parallelism against one process) and, for those,
how close the reference's choice was to a tie (the gap between the logits on either side of the
top-k boundary): a routing that differs only on near-ties is a rounding flip, one that differs
on clear choices is a bug. Reading tensors back to the host here is fine: this is a diagnostic,
run on tiny models.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import TrainerCallback

__all__ = ["RoutingTrace", "compare", "load_global", "topk_margin"]


class RoutingTrace(TrainerCallback):
    """Keep the routing of the first ``steps`` optimizer steps; write it to ``folder``.

    ``logits_steps``: the steps whose gate logits are kept too (their near-tie margins).
    """

    def __init__(self, folder: str | Path, steps: int, logits_steps: int = 1) -> None:
        self.folder = Path(folder)
        self.steps = steps
        self.logits_steps = logits_steps
        self.records: dict[int, dict[str, Any]] = {}
        self._current: dict[str, Any] = {"layers": {}, "input_ids": []}
        self._step = 1
        self._handles: list[Any] = []

    def _recording(self, module: torch.nn.Module) -> bool:
        return module.training and self._step <= self.steps

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from maxscore.moe import MoE

        model = kwargs["model"]
        self._step = state.global_step + 1
        for name, module in model.named_modules():
            if isinstance(module, MoE):
                self._handles.append(module.register_forward_hook(self._layer_hook(name)))
        self._handles.append(model.register_forward_pre_hook(self._inputs_hook, with_kwargs=True))

    def _layer_hook(self, name: str) -> Any:
        def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            if not self._recording(module):
                return
            result = output[1]
            entry = {"expert_index": result.expert_index.detach().to(torch.int16).cpu()}
            if self._step <= self.logits_steps:
                entry["logits"] = result.logits.detach().float().cpu()
            # A layer runs twice in a step under activation checkpointing; the first is kept.
            self._current["layers"].setdefault(name, entry)

        return hook

    def _inputs_hook(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self._recording(module) and ids is not None and not self._current["input_ids"]:
            self._current["input_ids"].append(ids.detach().cpu())

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._step <= self.steps:
            ids = self._current["input_ids"]
            self.records[state.global_step] = {
                "layers": self._current["layers"],
                "input_ids": ids[0] if ids else None,
            }
        self._current = {"layers": {}, "input_ids": []}
        self._step = state.global_step + 1

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.folder.mkdir(parents=True, exist_ok=True)
        rank = int(args.process_index)
        torch.save(self.records, self.folder / f"routing_rank{rank}.pt")


def load_global(folder: str | Path) -> dict[int, dict[str, Any]]:
    """Every process's record of one run joined along the token axis in rank order."""
    files = sorted(
        Path(folder).glob("routing_rank*.pt"),
        key=lambda p: int(p.stem.removeprefix("routing_rank")),
    )
    if not files:
        raise FileNotFoundError(f"no routing_rank*.pt in {folder}")
    parts = [torch.load(f, weights_only=False) for f in files]
    steps = sorted(set.intersection(*(set(p) for p in parts)))
    joined: dict[int, dict[str, Any]] = {}
    for step in steps:
        layers: dict[str, dict[str, Tensor]] = {}
        for name in parts[0][step]["layers"]:
            keys = parts[0][step]["layers"][name].keys()
            layers[name] = {
                key: torch.cat([p[step]["layers"][name][key] for p in parts]) for key in keys
            }
        ids = [p[step]["input_ids"] for p in parts]
        joined[step] = {
            "layers": layers,
            "input_ids": torch.cat(ids) if all(i is not None for i in ids) else None,
        }
    return joined


def topk_margin(logits: Tensor, k: int) -> Tensor:
    """``[T]``: how far each token's ordered top-k choice is from a tie: the smallest gap between
    consecutive logits among its k + 1 largest (0 for an exact tie). A swap of the first and
    second choice matters too: GShard queues every token's first choice before any second one."""
    top = logits.topk(min(k + 1, logits.shape[-1]), dim=-1).values
    return (top[:, :-1] - top[:, 1:]).min(dim=-1).values


def _expert_sets(index: Tensor) -> Tensor:
    return index.sort(dim=-1).values


def compare(
    reference: dict[int, dict[str, Any]],
    other: dict[int, dict[str, Any]],
    steps: Sequence[int] | None = None,
    near_tie: float = 1e-4,
) -> dict[int, dict[str, Any]]:
    """Per step: the tokens (over all layers) whose expert sets differ between the two runs.

    Each step's row: ``tokens`` (token-layer pairs compared), ``differing`` (with a different
    expert set after drops), ``same_inputs`` (both runs trained on the same sequences). Where
    both runs' logits were kept: ``choice_flips`` (tokens whose ordered top-k experts by logit
    differ: a flipped choice, whether or not drops hid it), ``near_ties`` (those of them whose top-k choice was within
    ``near_tie`` of a tie in the reference), ``max_margin_flipped`` (the largest such margin;
    ``None`` when no choice flipped); the other differing tokens chose the same experts and were
    dropped differently (an earlier token's flip moved an expert's queue).

    The top-k by logit is the token-choice routers' choice before capacity (GShard, dropless);
    for a flow router (maxscore) it is only a hint, its assignment is not a top-k.
    """
    rows: dict[int, dict[str, Any]] = {}
    for step in steps or sorted(set(reference) & set(other)):
        ref, oth = reference[step], other[step]
        same_inputs = None
        if ref["input_ids"] is not None and oth["input_ids"] is not None:
            same_inputs = bool(torch.equal(ref["input_ids"], oth["input_ids"]))
        tokens = differing = flips = near = 0
        margins: list[float] = []
        with_logits = True
        for name, layer in ref["layers"].items():
            a, b = layer["expert_index"], oth["layers"][name]["expert_index"]
            if a.shape != b.shape:
                raise ValueError(f"step {step}, {name}: {tuple(a.shape)} vs {tuple(b.shape)}")
            diff = (_expert_sets(a) != _expert_sets(b)).any(dim=-1)
            tokens += a.shape[0]
            differing += int(diff.sum())
            if "logits" not in layer or "logits" not in oth["layers"][name]:
                with_logits = False
                continue
            k = a.shape[-1]
            la, lb = layer["logits"], oth["layers"][name]["logits"]
            # The ordered top-k: every flipped choice counts, also a swap of a token's first and
            # second expert or a flip whose slots were dropped in both runs (its expert set is
            # then the same, but the experts' queues behind it are not).
            choice_a = la.topk(k, dim=-1).indices
            choice_b = lb.topk(k, dim=-1).indices
            flipped = (choice_a != choice_b).any(dim=-1)
            flips += int(flipped.sum())
            if bool(flipped.any()):
                margin = topk_margin(la, k)[flipped]
                near += int((margin <= near_tie).sum())
                margins.append(float(margin.max()))
        row: dict[str, Any] = {
            "tokens": tokens,
            "differing": differing,
            "same_inputs": same_inputs,
        }
        if with_logits:
            row.update(
                choice_flips=flips,
                near_ties=near,
                max_margin_flipped=max(margins) if margins else None,
            )
        rows[step] = row
    return rows
