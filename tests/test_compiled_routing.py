"""MaxScore's routing traces into one compiled graph: nothing on its path breaks ``torch.compile``.

The flow solver's backend is chosen from the CUDA toolchain (NVRTC), which dynamo cannot trace; a
graph break there splits every compiled MoE layer and (after dynamo gives up on the frame) runs
the layer eagerly, costing the GPU most of its busy time in a compiled training step. So the
backend is chosen inside the solver's opaque operator, and the traced path decides only the
solver, from the device.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from maxscore.moe.layer import MoE
from maxscore.routing.flow import global_cuda
from maxscore.routing.resolve import resolve_router


def _toolchain_must_not_be_asked(*args: object, **kwargs: object) -> bool:
    raise AssertionError("the traced routing path asked the CUDA toolchain")


@pytest.mark.parametrize("flow_method", ["auto", "global"])
def test_the_traced_path_never_asks_the_cuda_toolchain(
    flow_method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    router = resolve_router("maxscore", {"flow_method": flow_method})
    moe = MoE(64, 8, 2, intermediate_size=64, router=router)
    # The backend is chosen inside the solver's operator; stub it there so the check covers only
    # what the router's (traced) code calls.
    from maxscore.routing.flow import global_solver

    calls: list[int] = []
    real = global_solver.choose_flow_solver

    def inside_the_operator(*args: object, **kwargs: object) -> object:
        calls.append(1)
        with monkeypatch.context() as inner:
            inner.setattr(global_cuda, "supported", real_supported)
            return real(*args, **kwargs)

    real_supported = global_cuda.supported
    monkeypatch.setattr(global_cuda, "supported", _toolchain_must_not_be_asked)
    monkeypatch.setattr(global_solver, "choose_flow_solver", inside_the_operator)
    y, _ = moe(torch.randn(2, 16, 64))
    assert torch.isfinite(y).all()
    assert calls == ([1] if flow_method == "global" else [])


# (DropLess is left out: its fp32 grouped experts loop over the experts outside the graph by
# design, moe/dispatch.py; routing is what this checks.)
@pytest.mark.gpu
@pytest.mark.parametrize("router", ["maxscore", "gshard"])
def test_an_moe_layer_compiles_without_graph_breaks_on_gpu(router: str) -> None:
    torch.manual_seed(0)
    moe = MoE(128, 16, 2, intermediate_size=256, router=router).cuda()
    x = torch.randn(4, 64, 128, device="cuda")
    explained = torch._dynamo.explain(moe)(x)
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
