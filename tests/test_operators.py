"""Affinity operators (paper Table 2 and the SoftTopk equation) against hand-computed values.

Most cases use logits ``log([1, 2, 3, 4])`` so that ``Softmax = [0.1, 0.2, 0.3, 0.4]`` exactly and
every expected value below is a short fraction worked out by hand (SoftKmax, whose rounds feed
logits through ``exp`` again, was evaluated with a separate numpy script).
"""

from __future__ import annotations

import math

import pytest
import torch

from maxscore.routing.operators import (
    AFFINITY_OPERATORS,
    get_operator,
    gradtopk_affinity,
    itertopk_affinity,
    relu_affinity,
    sigmoid_affinity,
    softkmax_affinity,
    softmax_affinity,
    softtopk_affinity,
)

X = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))  # softmax = [.1, .2, .3, .4]


def close(
    actual: torch.Tensor, expected: list[float] | list[list[float]], tol: float = 1e-5
) -> None:
    torch.testing.assert_close(
        actual, torch.tensor(expected, dtype=actual.dtype), atol=tol, rtol=tol
    )


def test_softmax() -> None:
    close(softmax_affinity(X, 2, 0.0), [[0.1, 0.2, 0.3, 0.4]])


def test_sigmoid() -> None:
    # sigmoid(log a) = a / (1 + a)
    close(sigmoid_affinity(X, 2, 0.0), [[1 / 2, 2 / 3, 3 / 4, 4 / 5]])


def test_relu() -> None:
    close(relu_affinity(torch.tensor([[-1.0, 0.0, 2.5]]), 1, 0.0), [[0.0, 0.0, 2.5]])


def test_softtopk_k2() -> None:
    # rank 1 (0.4) keeps its weight; every other entry gets (1 + t) = 4 times its softmax
    close(softtopk_affinity(X, 2, 3.0), [[0.4, 0.8, 1.2, 0.4]])


def test_softtopk_k3() -> None:
    # t = 0.5: rank 1 x1, rank 2 (0.3) x1.5, ranks 3 and 4 x(1 + 2t) = 2
    close(softtopk_affinity(X, 3, 0.5), [[0.2, 0.4, 0.45, 0.4]])
    # t = 2: multipliers 1, 3, 5, 5
    close(softtopk_affinity(X, 3, 2.0), [[0.5, 1.0, 0.9, 0.4]])


def test_softtopk_unsorted_input_and_tensor_t() -> None:
    # same values, permuted columns; t given as a 0-dim tensor (what the schedule returns)
    x = torch.log(torch.tensor([[3.0, 1.0, 4.0, 2.0]]))
    close(softtopk_affinity(x, 3, torch.tensor(0.5)), [[0.45, 0.2, 0.4, 0.4]])


def test_softtopk_t0_and_k1_is_softmax() -> None:
    close(softtopk_affinity(X, 2, 0.0), [[0.1, 0.2, 0.3, 0.4]])
    close(softtopk_affinity(X, 1, 5.0), [[0.1, 0.2, 0.3, 0.4]])


def test_softtopk_gradient_flows_through_softmax_only() -> None:
    x = X.clone().requires_grad_(True)
    softtopk_affinity(x, 2, 3.0)[0, 0].backward()
    # d(4 p0)/dx = 4 p0 (delta - p) = 4 * 0.1 * ([1,0,0,0] - p)
    close(x.grad, [[0.4 * 0.9, -0.4 * 0.2, -0.4 * 0.3, -0.4 * 0.4]])


def test_gradtopk() -> None:
    # y2 = 2 p(1-p) / sum p(1-p); p(1-p) = [.09, .16, .21, .24], sum .7
    close(gradtopk_affinity(X, 2, 0.0), [[0.18 / 0.7, 0.32 / 0.7, 0.42 / 0.7, 0.48 / 0.7]])
    # y3 = 3 p(1-y2) / sum; p(1-y2) = [.52, .76, .84, .88] / 7, sum 3/7
    close(gradtopk_affinity(X, 3, 0.0), [[0.52, 0.76, 0.84, 0.88]])
    close(gradtopk_affinity(X, 1, 0.0), [[0.1, 0.2, 0.3, 0.4]])


def test_itertopk() -> None:
    # y2 = p + p(1-p)/sum = [16, 30, 42, 52] / 70
    close(itertopk_affinity(X, 2, 0.0), [[8 / 35, 3 / 7, 3 / 5, 26 / 35]])
    # rooms 1 - y2 = [27, 20, 14, 9] / 35; p * room ~ [27, 40, 42, 36] (sum 145)
    expected = [8 / 35 + 27 / 145, 3 / 7 + 40 / 145, 3 / 5 + 42 / 145, 26 / 35 + 36 / 145]
    close(itertopk_affinity(X, 3, 0.0), [expected])


def test_softkmax() -> None:
    # y2 = p + softmax((1 - p) * x), evaluated independently with numpy
    close(softkmax_affinity(X, 2, 0.0), [[0.23896287, 0.4419484, 0.59983591, 0.71925283]])
    close(softkmax_affinity(X, 3, 0.0), [[0.42077437, 0.70962576, 0.88203016, 0.98756971]])


def test_extreme_logits_limits() -> None:
    # One logit 100 above the rest: for k = 2 the exact limit of GradTopk and IterTopk is
    # [1, 1/2, 1/2] (the top expert saturates, the remaining unit of mass splits evenly). A naive
    # fp32 evaluation of 1 - softmax underflows here.
    x = torch.tensor([[100.0, 0.0, 0.0]])
    close(gradtopk_affinity(x, 2, 0.0), [[1.0, 0.5, 0.5]])
    close(itertopk_affinity(x, 2, 0.0), [[1.0, 0.5, 0.5]])
    for name, op in AFFINITY_OPERATORS.items():
        for logits in (
            torch.tensor([[1e4, -1e4, 0.0, 0.0]]),
            torch.tensor([[-1e4, -1e4, -1e4, -1e4]]),
            torch.zeros(1, 4),
        ):
            for k in (1, 2, 4):
                y = op(logits, k, 3.0)
                assert torch.isfinite(y).all(), (name, logits, k)
                assert (y >= 0).all(), (name, logits, k)


@pytest.mark.parametrize("name", ["softkmax", "itertopk", "gradtopk"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_iterative_operators_sum_to_k(name: str, k: int) -> None:
    torch.manual_seed(0)
    y = AFFINITY_OPERATORS[name](3 * torch.randn(5, 7, 4), k, 0.0)
    close(y.sum(-1), torch.full((5, 7), float(k)).tolist())


def test_half_precision_logits_computed_in_fp32() -> None:
    for op in AFFINITY_OPERATORS.values():
        assert op(X.bfloat16(), 2, 1.0).dtype == torch.float32
        assert op(X.double(), 2, 1.0).dtype == torch.float64


def test_bad_k_and_unknown_name() -> None:
    with pytest.raises(ValueError, match="k"):
        softtopk_affinity(X, 5, 1.0)
    with pytest.raises(ValueError, match="k"):
        gradtopk_affinity(X, 0, 1.0)
    with pytest.raises(ValueError, match="unknown affinity operator"):
        get_operator("softmaxx")
    assert get_operator("softtopk") is softtopk_affinity


def test_batched_leading_dims() -> None:
    x = X.expand(2, 3, 4)
    y = softtopk_affinity(x, 2, 3.0)
    assert y.shape == (2, 3, 4)
    close(y[1, 2:3], [[0.4, 0.8, 1.2, 0.4]])
    assert math.isclose(float(y.sum()), 6 * 2.8, rel_tol=1e-5)


@pytest.mark.parametrize("name", sorted(AFFINITY_OPERATORS))
@pytest.mark.parametrize("k", [1, 2, 3])
def test_operator_gradcheck_float64(name: str, k: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    if name == "relu":
        x = (x.detach() + torch.sign(x.detach()) * 0.1).requires_grad_(True)  # away from the kink
    op = AFFINITY_OPERATORS[name]
    assert torch.autograd.gradcheck(lambda v: op(v, k, 1.5), (x,), eps=1e-6, atol=1e-5)


def test_gradtopk_matches_table_recursion_literally() -> None:
    # Table 2 as printed: g^(m) = x + log(e^{z^(m-1)} - e^{g^(m-1)}),
    # z^(m) = log sum_j e^{g^(m)_j} - log m, y^(m) = e^{g^(m) - z^(m)}; g^(0) = -inf, z^(0) = 0.
    torch.manual_seed(3)
    x = torch.randn(6, 5, dtype=torch.float64)
    g = torch.full_like(x, float("-inf"))
    z = torch.zeros(6, 1, dtype=torch.float64)
    for m in range(1, 5):
        g = x + torch.log(torch.exp(z) - torch.exp(g))
        z = torch.logsumexp(g, dim=-1, keepdim=True) - math.log(m)
        torch.testing.assert_close(gradtopk_affinity(x, m, 0.0), torch.exp(g - z))


def test_softkmax_and_itertopk_match_table_recursion_literally() -> None:
    torch.manual_seed(4)
    x = torch.randn(6, 5, dtype=torch.float64)
    y_soft = torch.zeros_like(x)
    y_iter = torch.zeros_like(x)
    for m in range(1, 3):  # k <= 2: rooms stay >= 0, so no clamping is involved
        y_soft = y_soft + torch.softmax((1 - y_soft) * x, dim=-1)
        w = (1 - y_iter) * torch.exp(x)
        y_iter = y_iter + w / w.sum(-1, keepdim=True)
        torch.testing.assert_close(softkmax_affinity(x, m, 0.0), y_soft)
        torch.testing.assert_close(itertopk_affinity(x, m, 0.0), y_iter)
