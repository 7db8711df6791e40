"""Property tests of the Router over random sizes, presets and logit scales (hypothesis)."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from maxscore.routing import ROUTER_PRESETS, build_router
from maxscore.routing.strategies import ASSIGNMENT_STRATEGIES

PRESETS = sorted(name for name in ROUTER_PRESETS if name not in ("dense", "deepseek"))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    preset=st.sampled_from(PRESETS),
    e=st.integers(2, 9),
    k_frac=st.floats(0.0, 1.0),
    batch=st.integers(1, 3),
    seq=st.integers(1, 7),
    scale=st.sampled_from([0.0, 1.0, 30.0, 1e3]),
    skew=st.booleans(),
    training=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_router_invariants(
    preset: str,
    e: int,
    k_frac: float,
    batch: int,
    seq: int,
    scale: float,
    skew: bool,
    training: bool,
    seed: int,
) -> None:
    k = 1 + int(k_frac * (e - 1))
    torch.manual_seed(seed)
    router = build_router(preset, 6, e, k).train(training)
    h = scale * torch.randn(batch, seq, 6)
    if skew:  # every token prefers expert 0
        with torch.no_grad():
            router.gate.weight[0] = 5.0
        h = h.abs() + 1.0
    res = router(h)
    res2 = router(h)
    idx, w = res.expert_index, res.combine_weights
    spec = ASSIGNMENT_STRATEGIES[router.strategy_for_mode()[0]]
    assert idx.shape == (batch * seq, k if spec.token_choice else e)
    assert ((idx >= -1) & (idx < e)).all()
    valid = idx >= 0
    same = (idx.unsqueeze(-1) == idx.unsqueeze(-2)) & valid.unsqueeze(-1) & valid.unsqueeze(-2)
    assert same.sum(dim=(-1, -2)).eq(valid.sum(-1)).all(), "a token holds an expert twice"
    if spec.token_choice:
        assert valid.sum(-1).le(k).all()
    assert torch.isfinite(w).all() and (w[~valid] == 0).all()
    if res.capacity is not None:
        per_group = idx.reshape(res.num_groups, -1)
        for g in range(res.num_groups):
            counts = torch.bincount(per_group[g][per_group[g] >= 0], minlength=e)
            assert (counts <= res.capacity).all(), "expert over capacity"
    # The same input routes the same way: the forward never moves the DeepSeek-V3 bias.
    torch.testing.assert_close(res2.expert_index, idx, atol=0, rtol=0)
    assert all(torch.isfinite(v).all() for v in res.stats.values())
    assert torch.isfinite(res.aux_loss)
