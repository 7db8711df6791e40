"""Gradient clipping folded into the fused AdamW step (``maxscore.training.clipping``) against
``torch.nn.utils.clip_grad_norm_`` followed by the same step."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from maxscore.training.clipping import clip_grad_norm_in_fused_adam, fused_adam


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _set_grads(model: torch.nn.Module, scale: float) -> None:
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * scale


@pytest.mark.parametrize("scale", [10.0, 1e-3])  # clipping active / inactive
def test_fused_clipping_equals_clip_grad_norm_then_step(scale: float) -> None:
    reference, folded = _model(), _model()
    folded.load_state_dict(copy.deepcopy(reference.state_dict()))
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.1, fused=True)
    opt_fold = torch.optim.AdamW(folded.parameters(), lr=0.1, weight_decay=0.1, fused=True)
    for _ in range(3):
        _set_grads(reference, scale)
        _set_grads(folded, scale)
        norm_ref = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        clipped = [p.grad.clone() for p in reference.parameters()]
        opt_ref.step()
        norm = clip_grad_norm_in_fused_adam(opt_fold, folded.parameters(), 1.0)
        opt_fold.step()
        torch.testing.assert_close(norm, norm_ref)
        for p, q, g in zip(reference.parameters(), folded.parameters(), clipped, strict=True):
            torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(q.grad, g, rtol=1e-6, atol=1e-9)  # left clipped


def test_fused_adam_detection_and_bad_max_norm() -> None:
    params = list(_model().parameters())
    fused = torch.optim.AdamW(params, fused=True)
    assert fused_adam(fused) is fused
    assert fused_adam(SimpleNamespace(optimizer=fused)) is fused  # accelerate's wrapper
    assert fused_adam(torch.optim.AdamW(params)) is None  # foreach / for-loop AdamW
    assert fused_adam(torch.optim.SGD(params, lr=0.1)) is None
    with pytest.raises(ValueError, match="max_norm must be positive"):
        clip_grad_norm_in_fused_adam(fused, params, 0.0)
