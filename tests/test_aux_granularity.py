"""The load-balancing loss at the granularity the user picks: routing group, sequence,
micro-batch, or the global batch (data-parallel ranks and gradient accumulation)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.checkpoint import checkpoint

from distributed_helpers import free_port
from maxscore.routing.config import RouterConfig
from maxscore.routing.losses import load_balancing_loss
from maxscore.routing.router import Router

E, K, D, COEF = 4, 2, 8, 0.1


def _router(granularity: str, group: str = "sequence") -> Router:
    torch.manual_seed(0)
    config = RouterConfig(
        operator="softmax",
        strategy="dropless",
        group=group,
        aux_loss_coef=COEF,
        aux_loss_granularity=granularity,
    )
    return Router(D, E, K, config)


def _reference(router: Router, x: torch.Tensor) -> torch.Tensor:
    """The GShard loss over all of ``x``'s tokens as one group (x: [T, D])."""
    probs = torch.softmax(x @ router.gate.weight.T, dim=-1)[None]
    idx = probs.topk(K, dim=-1).indices
    return load_balancing_loss(probs, idx, "gshard", scale=COEF)


def test_sequence_and_micro_batch_granularities() -> None:
    x = torch.randn(3, 5, D)
    seq = _router("sequence", group="batch")
    want = torch.stack([_reference(seq, x[b]) for b in range(3)]).mean()
    torch.testing.assert_close(seq(x).aux_loss, want)
    batch = _router("micro-batch")
    torch.testing.assert_close(batch(x).aux_loss, _reference(batch, x.reshape(-1, D)))
    # "group" follows the routing group: per sequence here, as before.
    torch.testing.assert_close(_router("group")(x).aux_loss, want)


def test_padding_counts_at_no_granularity() -> None:
    x = torch.randn(2, 6, D)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, 4:] = False
    for granularity in ("group", "sequence", "micro-batch", "global"):
        router = _router(granularity)
        other = x.clone()
        other[0, 4:] = torch.randn(2, D) * 3
        torch.testing.assert_close(router(x, mask).aux_loss, router(other, mask).aux_loss)
    seq = _router("sequence")
    want = (_reference(seq, x[0, :4]) + _reference(seq, x[1])) / 2
    torch.testing.assert_close(seq(x, mask).aux_loss, want)


def test_global_granularity_accumulates_over_the_micro_batches_of_a_step() -> None:
    router = _router("global").train()
    a, b = torch.randn(2, 5, D), torch.randn(2, 5, D)
    first = router(a).aux_loss
    torch.testing.assert_close(first, _reference(router, a.reshape(-1, D)))  # nothing before it
    second = router(b).aux_loss
    # f over both micro-batches, mean affinities over the second one only.
    logits = torch.cat([a, b]).reshape(-1, D) @ router.gate.weight.T
    top1 = logits.argmax(-1)
    f = torch.bincount(top1, minlength=E).float() / top1.numel()
    p_b = torch.softmax(b.reshape(-1, D) @ router.gate.weight.T, -1).mean(0)
    torch.testing.assert_close(second, COEF * E * (f * p_b).sum())
    # A new optimizer step starts a new accumulation.
    router.advance_schedule()
    torch.testing.assert_close(router(b).aux_loss, _reference(router, b.reshape(-1, D)))
    # Evaluation measures the micro-batch alone and leaves the step's loads alone.
    router.eval()
    torch.testing.assert_close(router(a).aux_loss, _reference(router, a.reshape(-1, D)))


def test_global_granularity_under_activation_checkpointing_counts_each_micro_batch_once() -> None:
    x = torch.randn(2, 5, D, requires_grad=True)
    plain = _router("global").train()
    ref_loss = plain(x).aux_loss
    (ref_grad,) = torch.autograd.grad(ref_loss, plain.gate.weight)
    ckpt = _router("global").train()
    loss = checkpoint(lambda h: ckpt(h).aux_loss, x, use_reentrant=False)
    (grad,) = torch.autograd.grad(loss, ckpt.gate.weight)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad)
    torch.testing.assert_close(ckpt.aux_load, plain.aux_load)  # added once, not twice


def _rank_main(rank: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        router = _router("global").train()  # same seed: same gate weights on both ranks
        torch.manual_seed(100 + rank)
        x = torch.randn(2, 5, D)
        results[rank] = (router(x).aux_loss.item(), x)
    finally:
        dist.destroy_process_group()


def test_global_granularity_sums_loads_over_data_parallel_ranks() -> None:
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_rank_main, args=(free_port(), results), nprocs=2, join=True)
    router = _router("global")
    xs = [results[r][1].reshape(-1, D) for r in range(2)]
    logits = torch.cat(xs) @ router.gate.weight.T
    f = torch.bincount(logits.argmax(-1), minlength=E).float() / logits.shape[0]
    for rank in range(2):
        p = torch.softmax(xs[rank] @ router.gate.weight.T, -1).mean(0)
        assert results[rank][0] == pytest.approx((COEF * E * (f * p).sum()).item(), rel=1e-5)
