"""Padding reaches every router: padded positions take no slot and count nowhere.

Two levels: each assignment strategy gives the real tokens of a padded group exactly what they
get when the padding is not there at all (same capacity), and the whole model's real-token
logits, losses and routing do not depend on what the padding holds, for every router preset, in
training and evaluation mode.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from maxscore.models import LlamaMoEConfig, LlamaMoEForCausalLM
from maxscore.moe import MoE
from maxscore.routing import ROUTER_PRESETS
from maxscore.routing.config import RouterConfig
from maxscore.routing.router import Router
from maxscore.routing.statistics import routing_statistics
from maxscore.routing.strategies import ASSIGNMENT_STRATEGIES

VOCAB = 64
PRESETS = sorted(ROUTER_PRESETS)
MOE_PRESETS = [name for name in PRESETS if name != "dense"]


# --------------------------------------------------------------------------------------------------
# strategies: padding takes no capacity
# --------------------------------------------------------------------------------------------------

CAPACITY_STRATEGIES = ["topk", "topk-reroute", "sinkhorn", "expert-choice", "min-cost-flow"]


@pytest.mark.parametrize("strategy", [*CAPACITY_STRATEGIES, "dropless", "group-limited"])
def test_strategy_gives_real_tokens_what_they_get_without_padding(strategy: str) -> None:
    torch.manual_seed(0)
    n, e, k = 24, 8, 2
    scores = torch.softmax(torch.randn(1, n, e) * 2, dim=-1)
    real = torch.ones(1, n, dtype=torch.bool)
    real[0, [1, 4, 5, 9, 17, 22, 23]] = False
    # Capacity of the padded group (c = k n / e = 6): without the padding it is ample enough
    # that the padding would take some of it.
    capacity = torch.full((e,), 6, dtype=torch.long)
    config = RouterConfig(
        strategy=strategy, flow_method="exact", num_expert_groups=4, topk_groups=2
    )
    spec = ASSIGNMENT_STRATEGIES[strategy]
    cap = capacity if spec.uses_capacity else None
    masked = spec.assign(scores, k, cap, config, token_mask=real)
    alone = spec.assign(scores[:, real[0]], k, cap, config)
    assert torch.equal(masked[0, real[0]], alone[0])
    assert bool((masked[0, ~real[0]] == -1).all()), "padding got an expert"
    # Padding content does not matter.
    noisy = scores.clone()
    noisy[0, ~real[0]] = torch.softmax(torch.randn(int((~real).sum()), e) * 5, dim=-1)
    assert torch.equal(spec.assign(noisy, k, cap, config, token_mask=real), masked)


def test_all_padding_group_is_empty_and_finite() -> None:
    router = Router(16, 4, 2, RouterConfig(operator="softmax", strategy="sinkhorn"))
    x = torch.randn(2, 6, 16)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1] = False
    result = router(x, mask)
    assert bool((result.expert_index.view(2, 6, -1)[1] == -1).all())
    assert torch.isfinite(result.aux_loss)
    assert torch.isfinite(result.combine_weights).all()


# --------------------------------------------------------------------------------------------------
# the model: real tokens independent of pad content, every preset, train and eval
# --------------------------------------------------------------------------------------------------


def _model(router: str, **router_config: Any) -> LlamaMoEForCausalLM:
    torch.manual_seed(0)
    if router in ("maxscore", "gshard-m"):
        router_config.setdefault("flow_method", "exact")
    config = LlamaMoEConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_experts=8,
        num_experts_per_tok=2,
        router=router,
        router_config=router_config or None,
        router_z_loss_coef=1e-3,
    )
    return LlamaMoEForCausalLM(config)


@pytest.mark.parametrize(
    ("strategy", "missed"), [("topk", "dropped"), ("topk-reroute", "rerouted")]
)
def test_statistics_count_real_tokens_only(strategy: str, missed: str) -> None:
    """A padded group's statistics equal those of its real tokens alone: padding, which has no
    expert, is neither a dropped nor a rerouted choice and adds to no mean."""
    torch.manual_seed(0)
    n, e, k = 24, 8, 2
    scores = torch.softmax(torch.randn(1, n, e) * 2, dim=-1)
    real = torch.ones(1, n, dtype=torch.bool)
    real[0, [1, 4, 5, 9, 17, 22, 23]] = False
    capacity = torch.full((e,), 3, dtype=torch.long)  # tight: some choices are missed
    config = RouterConfig(strategy=strategy)
    assign = ASSIGNMENT_STRATEGIES[strategy].assign
    masked = routing_statistics(
        scores, assign(scores, k, capacity, config, token_mask=real), capacity, k, token_mask=real
    )
    alone_scores = scores[:, real[0]]
    alone = routing_statistics(alone_scores, assign(alone_scores, k, capacity, config), capacity, k)
    assert set(masked) == set(alone)
    for key in masked:
        torch.testing.assert_close(masked[key], alone[key], rtol=0, atol=1e-6, msg=key)
    assert float(masked[f"{missed}_by_rank"].sum()) > 0  # the case is not trivial


def _batch(pad_seed: int) -> dict[str, Tensor]:
    """Two sequences of 12: the first right-padded (4 pads), the second left-padded (3)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 12), generator=gen)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, 8:] = 0
    mask[1, :3] = 0
    pad_gen = torch.Generator().manual_seed(pad_seed)
    ids = torch.where(mask.bool(), ids, torch.randint(0, VOCAB, (2, 12), generator=pad_gen))
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def _run(model: LlamaMoEForCausalLM, batch: dict[str, Tensor]) -> dict[str, Any]:
    routes: list[Tensor] = []

    def grab(module: torch.nn.Module, args: Any, output: Any) -> None:
        routes.append(output[1].expert_index.detach().clone())

    hooks = [m.register_forward_hook(grab) for m in model.modules() if isinstance(m, MoE)]
    try:
        out = model(**batch)
    finally:
        for hook in hooks:
            hook.remove()
    return {
        "out": out,
        "routes": routes,
        "stats": [{k: v.clone() for k, v in layer.items()} for layer in model.routing_statistics()],
    }


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("router", PRESETS)
def test_real_tokens_do_not_depend_on_padding(router: str, training: bool) -> None:
    model = _model(router)
    model.train(training)
    a, b = _batch(pad_seed=1), _batch(pad_seed=2)
    assert not torch.equal(a["input_ids"], b["input_ids"])
    real = a["attention_mask"].bool()
    ra, rb = _run(model, a), _run(model, b)
    torch.testing.assert_close(ra["out"].logits[real], rb["out"].logits[real], rtol=0, atol=1e-6)
    for name in ("loss", "lm_loss", "aux_loss", "z_loss"):
        va, vb = getattr(ra["out"], name), getattr(rb["out"], name)
        if va is not None:
            torch.testing.assert_close(va, vb, rtol=0, atol=1e-6, msg=name)
    flat = real.reshape(-1)
    for ia, ib in zip(ra["routes"], rb["routes"], strict=True):
        assert torch.equal(ia[flat], ib[flat]), "real tokens' experts depend on the padding"
        assert bool((ia[~flat] == -1).all()), "padding was given an expert"
    for sa, sb in zip(ra["stats"], rb["stats"], strict=True):
        for key in sa:
            torch.testing.assert_close(sa[key], sb[key], rtol=0, atol=1e-6, msg=key)


@pytest.mark.parametrize("router", ["gshard", "maxscore", "expert-choice", "sbase"])
def test_padding_takes_no_capacity_in_the_model(router: str) -> None:
    """The padded batch routes its real tokens as the same tokens alone would (same capacity).

    One sequence, right-padded: causal attention makes the real prefix's hidden states equal to
    the unpadded prefix's, and with the padding excluded the capacity strategy sees the same
    real tokens. The capacity is the padded group's in both runs (``min_capacity`` pins it).
    """
    model = _model(router, group="sequence", capacity_factor=1.0, min_capacity=3)
    model.train()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (1, 12), generator=gen)
    mask = torch.ones(1, 12, dtype=torch.long)
    mask[0, 6:] = 0
    padded = _run(model, {"input_ids": ids, "attention_mask": mask})
    alone = _run(model, {"input_ids": ids[:, :6]})
    for ip, ia in zip(padded["routes"], alone["routes"], strict=True):
        assert torch.equal(ip[:6], ia)
