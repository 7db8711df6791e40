"""Expert parallelism of one MoE layer on 2 and 4 CPU processes (gloo).

Every process holds ``e / P`` experts and routes its own slice of a global batch; the outputs,
the input gradients, the experts' and the router's gradients and the aux loss must equal those
of the whole layer on one process given the whole batch (with the same routing groups: a
preset that routes the micro-batch as one group gets groups of one process's tokens).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed_helpers import spawn_gloo
from maxscore.moe import MoE
from maxscore.moe.expert_parallel import ExpertParallel, shard_moe_experts
from maxscore.routing.presets import ROUTER_PRESETS

HIDDEN, EXPERTS, TOP_K = 16, 8, 2
BATCH_PER_RANK, SEQ = 2, 8

ALL_PRESETS = tuple(name for name in ROUTER_PRESETS if name != "dense")


def _reference_overrides(preset: str) -> dict[str, object]:
    """Routing groups of one process's tokens where the preset routes the whole micro-batch."""
    if ROUTER_PRESETS[preset].config.group == "batch":
        return {"group": "tokens", "group_size": BATCH_PER_RANK * SEQ}
    return {}


def _layers(preset: str, same_groups: bool = True, **overrides: object) -> tuple[MoE, MoE]:
    """The whole layer and, with the same weights, this process's expert-parallel shard of it.

    ``same_groups``: the whole layer, given every process's tokens, routes them in the groups the
    processes route (one group per process's micro-batch where the preset says ``batch``).
    """
    torch.manual_seed(0)
    groups = _reference_overrides(preset) if same_groups else {}
    whole = MoE(HIDDEN, EXPERTS, TOP_K, router=preset, **overrides, **groups)
    torch.manual_seed(0)
    sharded = MoE(HIDDEN, EXPERTS, TOP_K, router=preset, **overrides)
    sharded.load_state_dict(whole.state_dict())
    shard_moe_experts(sharded, ExpertParallel.of_group(dist.group.WORLD, EXPERTS))
    return whole, sharded


def _check_training_step(rank: int, world: int, preset: str) -> None:
    whole, sharded = _layers(preset)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(world * BATCH_PER_RANK, SEQ, HIDDEN, generator=generator)
    cotangent = torch.randn(x.shape, generator=generator)
    mine = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)

    x_all = x.clone().requires_grad_()
    y_all, r_all = whole(x_all)
    # The per-process aux losses are means over their groups: their sum is `world` times the
    # whole batch's mean.
    ((y_all * cotangent).sum() + world * r_all.aux_loss).backward()

    x_mine = x[mine].clone().requires_grad_()
    y_mine, r_mine = sharded(x_mine)
    ((y_mine * cotangent[mine]).sum() + r_mine.aux_loss).backward()

    tol = {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(y_mine, y_all[mine], **tol, msg=f"{preset}: outputs")
    torch.testing.assert_close(x_mine.grad, x_all.grad[mine], **tol, msg=f"{preset}: d input")
    part = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
    for name in ("gate_up", "down"):
        got = getattr(sharded.experts, name).grad
        want = getattr(whole.experts, name).grad[part]
        torch.testing.assert_close(got, want, **tol, msg=f"{preset}: d {name}")
    # The router is replicated: its gradient is the sum of the processes' local gradients.
    gate = sharded.router.gate.weight.grad.clone()
    dist.all_reduce(gate)
    torch.testing.assert_close(gate, whole.router.gate.weight.grad, **tol, msg=f"{preset}: d gate")
    aux = r_mine.aux_loss.detach().clone()
    dist.all_reduce(aux)
    torch.testing.assert_close(aux / world, r_all.aux_loss.detach(), **tol, msg=f"{preset}: aux")


def _training_steps(rank: int, world: int, presets: tuple[str, ...]) -> None:
    for preset in presets:
        _check_training_step(rank, world, preset)


def _evaluation(rank: int, world: int, preset: str, eval_routing: str) -> None:
    """Eval mode with a different batch size on every process (causal routing: the grouped
    path; eval_routing='train': padded buffers of different sizes)."""
    whole, sharded = _layers(preset, same_groups=False, eval_routing=eval_routing)
    whole.eval()
    sharded.eval()
    generator = torch.Generator().manual_seed(2 + rank)
    x = torch.randn(rank + 1, SEQ, HIDDEN, generator=generator)
    with torch.no_grad():
        reference, _ = whole(x)
        y, _ = sharded(x)
    torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-6)


def test_every_router_preset_on_two_processes_matches_one() -> None:
    """Every router preset, experts over 2 gloo processes: outputs, input / expert / router
    gradients and aux loss equal the whole layer's on one process (about 10 s)."""
    spawn_gloo(_training_steps, 2, ALL_PRESETS)


def test_gshard_dropless_maxscore_on_four_processes_match_one() -> None:
    """The same check with the experts over 4 processes (2 experts each; about 15 s)."""
    spawn_gloo(_training_steps, 4, ("gshard", "dropless", "maxscore"))


@pytest.mark.parametrize(("preset", "eval_routing"), [("gshard", "causal"), ("maxscore", "train")])
def test_expert_parallel_evaluation_with_uneven_batches(preset: str, eval_routing: str) -> None:
    spawn_gloo(_evaluation, 2, preset, eval_routing)


def test_expert_parallel_layout_errors() -> None:
    group = object()
    with pytest.raises(ValueError, match="divisible by 3"):
        ExpertParallel(group, 3, 0, EXPERTS)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outside"):
        ExpertParallel(group, 2, 2, EXPERTS)  # type: ignore[arg-type]
    layer = MoE(HIDDEN, EXPERTS, TOP_K, router="gshard")
    with pytest.raises(ValueError, match="4 experts"):
        shard_moe_experts(layer, ExpertParallel(group, 2, 0, 4))  # type: ignore[arg-type]
