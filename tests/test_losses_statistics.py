"""Load-balancing loss, z-loss, routing statistics, groups and capacity: hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from maxscore.routing.config import RouterConfig
from maxscore.routing.groups import expert_capacity, split_into_groups
from maxscore.routing.losses import assignment_matrix, load_balancing_loss, router_z_loss
from maxscore.routing.statistics import STAT_KEYS, dropped_and_rerouted, routing_statistics

# n = 2 tokens, e = 2 experts; both tokens' top-1 is expert 0
A = torch.tensor([[[0.7, 0.3], [0.6, 0.4]]])
IDX = torch.tensor([[[0, 1], [1, -1]]])  # token 1 lost a slot


def test_gshard_loss_by_hand() -> None:
    # mean A = [.65, .35]; top-1 fractions f = [1, 0]; L = e * sum = 2 * .65
    assert float(load_balancing_loss(A, IDX, "gshard")) == pytest.approx(1.3)


def test_eq9_loss_by_hand() -> None:
    # P = [[1, 1], [0, 1]] -> mean P = [.5, 1]; L = (1/2) * (.65 * .5 + .35 * 1)
    assert float(load_balancing_loss(A, IDX, "eq9")) == pytest.approx(0.3375)


def test_loss_is_averaged_over_groups_and_none_is_zero() -> None:
    a2 = torch.tensor([[[0.5, 0.5], [0.5, 0.5]]])  # gshard: 2 * (.5 * 1) = 1 (argmax ties -> 0)
    both_a = torch.cat([A, a2])
    both_i = torch.cat([IDX, torch.tensor([[[0, 1], [0, 1]]])])
    assert float(load_balancing_loss(both_a, both_i, "gshard")) == pytest.approx((1.3 + 1.0) / 2)
    # eq9 of group 2: (1/2) * (.5 * 1 + .5 * 1) = .5
    assert float(load_balancing_loss(both_a, both_i, "eq9")) == pytest.approx((0.3375 + 0.5) / 2)
    assert float(load_balancing_loss(A, IDX, "none")) == 0.0
    # 2-D input is one group
    assert float(load_balancing_loss(A[0], IDX[0], "gshard")) == pytest.approx(1.3)


def test_scale_relation_at_perfect_balance() -> None:
    # e = 4, k = 2, n = 4, uniform affinities, every expert gets 2 tokens, top-1 balanced
    e, k = 4, 2
    a = torch.eye(4).mul(0.01).add(0.99 / 4).unsqueeze(0)  # argmax of token i is expert i
    idx = torch.tensor([[[0, 1], [1, 2], [2, 3], [3, 0]]])
    gshard = float(load_balancing_loss(a, idx, "gshard"))
    eq9 = float(load_balancing_loss(a, idx, "eq9"))
    assert gshard == pytest.approx(1.0, rel=1e-5)
    assert eq9 == pytest.approx(k / e**2, rel=1e-5)


def test_loss_gradient_reaches_affinities() -> None:
    a = A.clone().requires_grad_(True)
    load_balancing_loss(a, IDX, "gshard").backward()
    # dL/dA_ij = e * f_j / n = 2 * [1, 0] / 2
    torch.testing.assert_close(a.grad, torch.tensor([[[1.0, 0.0], [1.0, 0.0]]]))


@pytest.mark.parametrize("ties", [False, True])
def test_gshard_gather_form_equals_one_hot_form(ties: bool) -> None:
    """The gather form of the GShard loss equals e · sum_j mean_i(A_ij) · f_j (one-hot f)."""
    torch.manual_seed(0)
    a = torch.rand(3, 40, 8)
    if ties:  # rounded affinities: many ties, argmax takes the lower index
        a = (a * 4).round() / 4
    a.requires_grad_(True)
    idx = torch.randint(-1, 8, (3, 40, 2))
    top1 = torch.nn.functional.one_hot(a.detach().argmax(-1), 8).float()
    reference = (8 * (a.mean(dim=1) * top1.mean(dim=1)).sum(dim=-1)).mean()
    (grad_ref,) = torch.autograd.grad(reference, a)
    loss = load_balancing_loss(a, idx, "gshard")
    (grad,) = torch.autograd.grad(loss, a)
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(grad, grad_ref)
    torch.testing.assert_close(load_balancing_loss(a, idx, "gshard", scale=0.01), 0.01 * loss)
    eq9 = load_balancing_loss(a, idx, "eq9")
    torch.testing.assert_close(load_balancing_loss(a, idx, "eq9", scale=0.5), 0.5 * eq9)


def test_router_z_loss_by_hand() -> None:
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    # logsumexp = log 2, log 4
    expected = (math.log(2) ** 2 + math.log(4) ** 2) / 2
    assert float(router_z_loss(logits)) == pytest.approx(expected)


def test_assignment_matrix() -> None:
    p = assignment_matrix(IDX, 2, torch.float32)
    torch.testing.assert_close(p, torch.tensor([[[1.0, 1.0], [0.0, 1.0]]]))


# statistics: n = 4, e = 3, k = 2
SA = torch.tensor([[[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.2, 0.7, 0.1], [0.1, 0.2, 0.7]]])
SIDX = torch.tensor([[[0, 1], [0, -1], [1, -1], [2, 1]]])


def test_statistics_by_hand() -> None:
    s = routing_statistics(SA, SIDX, torch.tensor([2, 3, 2]), k=2)
    assert set(s) == set(STAT_KEYS)
    # 1st choices all kept; 2nd choices of tokens 1 (expert 1) and 2 (expert 0) dropped
    torch.testing.assert_close(s["dropped_by_rank"], torch.tensor([0.0, 0.5]))
    torch.testing.assert_close(s["rerouted_by_rank"], torch.tensor([0.0, 0.0]))
    torch.testing.assert_close(s["tokens_per_expert"], torch.tensor([2.0, 3.0, 1.0]))
    torch.testing.assert_close(s["load_over_capacity"], torch.tensor([1.0, 1.0, 0.5]))
    assert float(s["unused_experts"]) == 0.0
    assert float(s["load_imbalance"]) == pytest.approx(1.5)
    torch.testing.assert_close(s["mean_affinity_by_rank"], torch.tensor([0.625, 0.275]))
    for v in s.values():
        assert v.dtype == torch.float32


def test_statistics_dropless_reference_capacity_and_groups() -> None:
    s = routing_statistics(SA, SIDX, None, k=2)
    # reference capacity k n / e = 8/3
    torch.testing.assert_close(s["load_over_capacity"], torch.tensor([0.75, 1.125, 0.375]))
    a = torch.cat([SA, SA])
    idx = torch.cat([SIDX, torch.tensor([[[0, -1]] * 4])])  # group 2: all on expert 0
    s = routing_statistics(a, idx, torch.tensor([2, 3, 2]), k=2)
    torch.testing.assert_close(s["tokens_per_expert"], torch.tensor([3.0, 1.5, 0.5]))
    assert float(s["unused_experts"]) == pytest.approx(1.0)  # (0 + 2) / 2
    assert float(s["load_imbalance"]) == pytest.approx((1.5 + 3.0) / 2)
    # group 2 (every token on expert 0 only): token 2 (choices 1, 0) keeps its 2nd choice and
    # loses its 1st, a drop; token 3 (choices 2, 1) misses both and holds one substitute, so its
    # 1st choice is rerouted and its 2nd dropped; tokens 0 and 1 lose their 2nd choice.
    torch.testing.assert_close(s["dropped_by_rank"], torch.tensor([1 / 8, 5 / 8]))
    torch.testing.assert_close(s["rerouted_by_rank"], torch.tensor([1 / 8, 0.0]))


def test_statistics_expert_choice_slots_and_empty_group() -> None:
    # S = e slots (expert choice); a group where nothing is assigned must not give NaN
    idx = torch.full((1, 4, 3), -1)
    s = routing_statistics(SA, idx, torch.tensor([2, 2, 2]), k=2)
    torch.testing.assert_close(s["dropped_by_rank"], torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(s["rerouted_by_rank"], torch.tensor([0.0, 0.0]))
    assert float(s["unused_experts"]) == 3.0
    assert all(torch.isfinite(v).all() for v in s.values())


def test_dropped_and_rerouted_split_the_missed_choices_in_rank_order() -> None:
    """GShard-I style: a dropped 2nd choice re-served by the 3rd is a reroute, not a drop; a
    token with more experts than k (expert choice) has every miss rerouted."""
    # n = 3 tokens, e = 4, k = 2; choices by affinity: token 0: 0, 1; token 1: 1, 2; token 2: 3, 2
    a = torch.tensor([[[0.5, 0.3, 0.15, 0.05], [0.1, 0.6, 0.2, 0.1], [0.1, 0.1, 0.3, 0.5]]])
    idx = torch.tensor([[[0, 2], [0, 3], [3, -1]]])  # token 1 holds two substitutes
    s = routing_statistics(a, idx, None, k=2)
    torch.testing.assert_close(s["dropped_by_rank"], torch.tensor([0.0, 1 / 3]))
    torch.testing.assert_close(s["rerouted_by_rank"], torch.tensor([1 / 3, 2 / 3]))
    kept = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]])
    dropped, rerouted = dropped_and_rerouted(kept, torch.tensor([3.0, 1.0, 0.0]))
    assert dropped.tolist() == [[0.0, 0.0], [0.0, 1.0], [1.0, 0.0]]
    assert rerouted.tolist() == [[0.0, 1.0], [1.0, 0.0], [0.0, 0.0]]


def test_expert_capacity() -> None:
    assert expert_capacity(512, 16, 2, 1.0, 1) == 64
    assert expert_capacity(10, 4, 2, 1.0, 1) == 5
    assert expert_capacity(10, 3, 2, 1.0, 1) == 7  # ceil(20 / 3)
    assert expert_capacity(25, 10, 2, 1.2, 1) == 6  # 1.2 * 5 = 6.000000000000001 -> 6
    assert expert_capacity(4, 16, 2, 1.0, 1) == 1  # n < e
    assert expert_capacity(4, 16, 2, 1.0, 3) == 3  # min_capacity
    assert expert_capacity(4, 2, 2, 4.0, 1) == 4  # never more than n
    with pytest.raises(ValueError):
        expert_capacity(0, 4, 2)


@pytest.mark.parametrize("factor", [1.0, 1.25, 1.2])
def test_expert_capacity_is_exact_in_a_shape_generic_compiled_graph(factor: float) -> None:
    """With a symbolic group size (torch.compile's graph after a second batch size) the capacity
    is the same integer as eagerly; a float formula would trace to 1,921 for n = 15,360."""
    torch._dynamo.reset()

    def capacity_of(x: torch.Tensor) -> torch.Tensor:
        return torch.full((16,), expert_capacity(x.shape[0], 16, 2, factor, 1))

    compiled = torch.compile(capacity_of, dynamic=True, fullgraph=True)
    for n in (32768, 15360, 8704, 25, 7):
        expected = expert_capacity(n, 16, 2, factor, 1)
        assert int(compiled(torch.zeros(n))[0]) == expected, n
    # the exact rational rule: ceil(factor * k * n / e), no float rounding up
    assert expert_capacity(15360, 16, 2, 1.0, 1) == 1920
    assert expert_capacity(50, 10, 2, 1.2, 1) == 12


def test_split_into_groups() -> None:
    x = torch.arange(2 * 6).reshape(2, 6)
    assert split_into_groups(x, RouterConfig(group="sequence")).shape == (2, 6)
    assert split_into_groups(x, RouterConfig(group="batch")).shape == (1, 12)
    g = split_into_groups(x, RouterConfig(group="tokens", group_size=4))
    assert g.shape == (3, 4) and g[1].tolist() == [4, 5, 6, 7]
    assert split_into_groups(x.unsqueeze(-1), RouterConfig(group="tokens", group_size=3)).shape == (
        4,
        3,
        1,
    )
    with pytest.raises(ValueError, match="multiple of the group size"):
        split_into_groups(x, RouterConfig(group="tokens", group_size=5))


@pytest.mark.gpu
@pytest.mark.parametrize("capacity", [None, 40])
def test_compiled_gpu_statistics_equal_the_eager_ones(capacity: int | None) -> None:
    """On CUDA the lazy statistics run through torch.compile: same values as eager."""
    from maxscore import compiled
    from maxscore.routing.statistics import LazyRoutingStatistics

    # A fresh compile cache: earlier tests of this process may have used up the variants
    # torch.compile allows one function, and this test must see the compiled statistics.
    torch._dynamo.reset()
    compiled._AT_LIMIT.discard("routing_statistics")
    gen = torch.Generator().manual_seed(0)
    affinities = torch.rand(4, 64, 8, generator=gen).softmax(-1).cuda()
    index = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(256)]).view(4, 64, 2)
    index[torch.rand(4, 64, 2, generator=gen) < 0.2] = -1
    cap = None if capacity is None else torch.full((8,), capacity).cuda()
    lazy = LazyRoutingStatistics(affinities, index.cuda(), cap, 2)
    eager = routing_statistics(affinities, index.cuda(), cap, 2)
    for key in STAT_KEYS:
        torch.testing.assert_close(lazy[key], eager[key])
    assert "routing_statistics" not in compiled._FAILED, "fell back to the eager statistics"
    assert "routing_statistics" not in compiled._AT_LIMIT, "ran eagerly past the recompile limit"
