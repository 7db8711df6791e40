"""Expert ranking (``maxscore.routing.ranking``) against a per-row Python reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from maxscore.routing.ranking import ranked_experts, top_experts


def reference_order(row: list[float]) -> list[int]:
    """Descending score, NaN first, ties by the lower index (a plain Python sort)."""
    return sorted(range(len(row)), key=lambda j: (not math.isnan(row[j]), -row[j], j))


def check(scores: torch.Tensor, k: int) -> None:
    order = ranked_experts(scores)
    top = top_experts(scores, k)
    for i, row in enumerate(scores.tolist()):
        expected = reference_order(row)
        assert order[i].tolist() == expected
        assert top[i].tolist() == expected[:k]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_ties_nan_and_infinities(k: int) -> None:
    nan, inf = float("nan"), float("inf")
    scores = torch.tensor(
        [
            [0.5, 0.5, 0.5, 0.5],
            [0.1, 0.9, 0.9, 0.2],
            [-inf, -inf, -inf, -inf],
            [nan, 0.3, nan, 0.3],
            [inf, 0.0, inf, -inf],
        ]
    )
    check(scores, k)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 6),
    e=st.integers(2, 9),
    k=st.integers(1, 4),
    levels=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_matches_reference_on_tied_rows(rows: int, e: int, k: int, levels: int, seed: int) -> None:
    """Few distinct values per row, so most rows have ties."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, levels, (rows, e), generator=g).float()
    check(scores, min(k, e))


def test_batched_shapes() -> None:
    scores = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0))
    assert top_experts(scores, 2).shape == (3, 5, 2)
    torch.testing.assert_close(top_experts(scores, 2), scores.topk(2, dim=-1).indices)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_top_experts_agrees_with_the_sort_in_every_float_dtype(dtype: torch.dtype, k: int) -> None:
    """The argmax path (k <= 4) and the sort path give the reference order, signed zeros,
    NaN, infinities and near-equal values included."""
    nan, inf = float("nan"), float("inf")
    g = torch.Generator().manual_seed(k)
    scores = torch.randint(-2, 3, (64, 6), generator=g).to(dtype) / 4
    scores[0] = torch.tensor([-0.0, 0.0, -0.0, 0.0, -1.0, 1.0])
    scores[1] = torch.tensor([nan, -inf, inf, nan, -0.0, 0.0])
    scores[2] = torch.tensor([-inf, -inf, -inf, -inf, -inf, -inf])
    scores[3] = torch.tensor([1.0, 1.0 + 1e-7, 1.0 - 1e-7, 1e-30, -1e-30, 0.0])
    scores = scores.to(dtype)
    for i, row in enumerate(scores.double().tolist()):
        assert top_experts(scores, k)[i].tolist() == reference_order(row)[:k], (i, row)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [2, 4, 6])
def test_cuda_ranking_matches_the_cpu(k: int) -> None:
    """CUDA's argmax and sort take the first maximum too: the same experts as on the CPU."""
    g = torch.Generator().manual_seed(k)
    scores = torch.randint(0, 4, (4096, 16), generator=g).float() / 3
    scores[::97, 3] = float("nan")
    expected = top_experts(scores, k)
    torch.testing.assert_close(top_experts(scores.cuda(), k).cpu(), expected)
    compiled = torch.compile(top_experts, fullgraph=True)
    torch.testing.assert_close(compiled(scores.cuda(), k).cpu(), expected)
