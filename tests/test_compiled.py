"""``call_compiled``: the compiled function where it works, the exact eager one where it cannot."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from maxscore import compiled


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@pytest.fixture
def counting_compile(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """torch.compile with a backend that counts its compiles and runs the traced graph as is
    (no code generation: fast on a CPU), and a fresh compile cache."""
    compiles: list[int] = []
    real = torch.compile

    def backend(gm: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        compiles.append(1)
        return gm.forward

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": backend}))
    monkeypatch.setattr(compiled, "_COMPILED", {})
    monkeypatch.setattr(compiled, "_FAILED", set())
    monkeypatch.setattr(compiled, "_AT_LIMIT", set())
    torch._dynamo.reset()
    yield compiles
    torch._dynamo.reset()


def test_past_the_recompile_limit_new_variants_run_eagerly_and_old_ones_stay_compiled(
    counting_compile: list[int],
) -> None:
    """Ten dtypes need ten compiled variants, two more than torch.compile's limit: the last two
    run eagerly (right values, one warning), the function is not given up, and the variants
    compiled before still run compiled."""
    dtypes = [
        torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
        torch.int32, torch.int16, torch.int8, torch.uint8, torch.complex64,
    ]  # fmt: skip
    limit = torch._dynamo.config.recompile_limit
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for dtype in dtypes:
            x = torch.arange(6).to(dtype)
            assert torch.equal(compiled.call_compiled("double", _double, x), x * 2)
    assert len(counting_compile) == limit < len(dtypes)
    assert "double" in compiled._AT_LIMIT and "double" not in compiled._FAILED
    assert sum("recompile limit" in str(w.message) for w in caught) == 1
    compiles = len(counting_compile)
    x = torch.arange(6).to(dtypes[0])
    assert torch.equal(compiled.call_compiled("double", _double, x), x * 2)
    assert len(counting_compile) == compiles  # served by its compiled variant, no new compile


def test_a_compiler_failure_falls_back_to_eager_for_good(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled, "_COMPILED", {"broken": lambda x: 1 / 0})
    monkeypatch.setattr(compiled, "_FAILED", set())
    x = torch.ones(3)
    with pytest.warns(RuntimeWarning, match="torch.compile failed"):
        assert torch.equal(compiled.call_compiled("broken", _double, x), x * 2)
    assert "broken" in compiled._FAILED
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(compiled.call_compiled("broken", _double, x), x * 2)
    assert not caught  # eager from now on, without a second warning
