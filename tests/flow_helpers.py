"""Helpers shared by the tests of the min-cost-flow solvers (Eq. 7-8): instances, the constraints
of Eq. 7, gaps to the exact optimum of Eq. 8 and CUDA graphs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import numpy as np
import pytest
import torch

from maxscore.routing.flow import flow_objective
from maxscore.routing.flow.exact import solve_exact
from maxscore.routing.flow.global_cuda import StartPrices
from maxscore.routing.flow.global_solver import solve_global

# The global solver's targets: relative gap to the exact optimum, median and worst over a set of
# instances (the slow tests check them over 100).
MEDIAN_GAP = 1e-5
WORST_GAP = 1e-3


def instances(
    seed: int, count: int, n: int, e: int, bias_std: float, device: str = "cpu"
) -> torch.Tensor:
    """Softmax affinities of N(0, 1) logits plus a per-expert bias of std ``bias_std``."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(count, n, e, generator=gen) + bias_std * torch.randn(
        count, 1, e, generator=gen
    )
    return torch.softmax(logits, dim=-1).to(device)


def near_tied(seed: int, count: int, n: int, e: int, noise: float) -> torch.Tensor:
    """Every token's row one shared vector plus small noise: what a router produces early in
    training, the hardest inputs for the solver."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, 1, e, generator=gen) + noise * torch.randn(count, n, e, generator=gen)
    return torch.softmax(logits, -1)


def family_instances(family: str, seed: int, count: int, n: int, e: int) -> torch.Tensor:
    """The tests' input families: "near-tied" (noise 0.03), "skewed" (per-expert bias of std 1)
    or "random" (no bias)."""
    if family == "near-tied":
        return near_tied(seed, count, n, e, 0.03)
    return instances(seed, count, n, e, 1.0 if family == "skewed" else 0.0)


def one_hot(seed: int, count: int, n: int, e: int) -> torch.Tensor:
    """Every token preferring expert 0 by far (its logit raised by 8; the benchmarks' "one-hot"
    family)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(count, n, e, generator=gen)
    logits[..., 0] += 8.0
    return torch.softmax(logits, -1)


REAL_SCORES = Path(__file__).resolve().parent / "data" / "router_scores.npz"


def real_router_scores(key: str) -> torch.Tensor:
    """Two routing groups (``[2, 512, e]``) of the selection scores a MaxScore router passed to
    the solver in training: the last MoE layer of ``base`` (``key="e16_k2"``) and of
    ``base-2x64`` (``"e64_k2"``) after 200 compiled bf16 steps on the embedded corpus
    (micro-batch 64 x 512), captured by ``benchmarks/flow_solver/real_scores.py``'s recording."""
    with np.load(REAL_SCORES) as data:
        return torch.from_numpy(data[key].copy())


# (name, n, e, k, capacities): ties, one popular expert (also of zero capacity), n < e, unequal,
# zero and above-n capacities, k = e and k = e - 1.
ADVERSARIAL = [
    ("ties-all-equal", 64, 8, 2, [16] * 8),
    ("identical-rows", 64, 8, 2, [16] * 8),
    ("one-expert-preferred", 128, 8, 2, [32] * 8),
    ("n-less-than-e", 5, 16, 2, [1] * 16),
    ("unequal-capacities", 100, 6, 2, [0, 100, 10, 30, 40, 20]),
    ("k-equals-e", 40, 4, 4, [40] * 4),
    ("k-equals-e-minus-1", 40, 4, 3, [30] * 4),
    ("k-1-tight", 64, 8, 1, [8] * 8),
    ("capacity-above-n", 20, 4, 2, [50, 50, 0, 0]),
    ("zero-capacity-popular", 64, 8, 2, [0, 24, 24, 24, 24, 24, 4, 4]),
]


def adversarial_affinities(name: str, n: int, e: int) -> torch.Tensor:
    """Two groups of the affinities of :data:`ADVERSARIAL` case ``name``."""
    gen = torch.Generator().manual_seed(11)
    if name == "ties-all-equal":
        return torch.full((2, n, e), 1.0 / e)
    if name == "identical-rows":
        return torch.softmax(torch.randn(2, 1, e, generator=gen), -1).expand(2, n, e).contiguous()
    if name in ("one-expert-preferred", "zero-capacity-popular"):
        logits = torch.randn(2, n, e, generator=gen)
        logits[..., 0] += 8.0
        return torch.softmax(logits, -1)
    return torch.softmax(3 * torch.randn(2, n, e, generator=gen), -1)


def check_constraints(index: torch.Tensor, k: int, capacity: torch.Tensor, e: int) -> None:
    """Eq. 7 exactly: k distinct experts per token (when capacity allows), loads <= capacity."""
    index, capacity = index.cpu(), capacity.cpu()
    groups, n, slots = index.shape
    assert slots == k and index.dtype == torch.long
    assert bool(((index >= -1) & (index < e)).all())
    valid = index >= 0
    counts = torch.zeros(groups, n, e + 1, dtype=torch.long)
    counts.scatter_add_(-1, torch.where(valid, index, e), torch.ones_like(index))
    assert int(counts[..., :e].max()) <= 1, "an expert appears twice in a token"
    loads = counts[..., :e].sum(1)
    assert bool((loads <= capacity).all()), f"load above capacity: {loads} vs {capacity}"
    if int(torch.minimum(capacity, torch.tensor(n)).sum()) >= n * k:
        assert bool(valid.all()), "an empty slot although capacity allows a full assignment"


def check_first_bids(
    affinities: torch.Tensor,
    start: StartPrices,
    k: int,
    capacity: torch.Tensor,
    token_mask: torch.Tensor | None = None,
) -> float:
    """The prices' kernel's first bids (``start``, CPU tensors) against their
    definition, computed here in float32 on the written prices and duals: a real token whose
    reduced affinities ``A_tj - p_j`` over the experts with capacity have exactly ``k`` above its
    dual lists those experts in ascending order, each with ``A_tj - w`` (``w``: the best of the
    rest, which must exist), bit for bit; every other real token has -1 in every entry. Returns
    the share of real tokens listed."""
    a = affinities.float()
    groups, n, e = a.shape
    open_e = (capacity.expand(groups, e) > 0)[:, None, :]
    reduced = a - start.prices[:, None, :]
    above = open_e & (reduced > start.duals[..., None])
    rest = torch.where(open_e & ~above, reduced, float("-inf")).amax(-1)
    listed = (above.sum(-1) == k) & (rest > float("-inf"))
    real = torch.ones(groups, n, dtype=torch.bool) if token_mask is None else token_mask
    # each token's experts above its dual in ascending order (the others after them)
    order = torch.where(above, torch.arange(e), e).sort(-1).values[..., :k].clamp(max=e - 1)
    values = a.gather(-1, order) - rest[..., None]
    expected = torch.where(listed[..., None], order, -1).int()
    assert torch.equal(start.first_experts[real], expected[real])
    assert torch.equal(start.first_values[listed & real], values[listed & real])
    return float(listed[real].float().mean())


def optimality_gaps(
    affinities: torch.Tensor, index: torch.Tensor, k: int, capacity: torch.Tensor
) -> np.ndarray:
    """``(OPT - objective) / OPT`` per group, OPT from the exact solver (CPU tensors in)."""
    opt = flow_objective(affinities, solve_exact(affinities, k, capacity))
    got = flow_objective(affinities, index.cpu())
    return ((opt - got) / opt.abs().clamp_min(1e-12)).numpy()


@contextmanager
def no_host_sync() -> Iterator[None]:
    """Turn any host synchronisation inside the block into an error."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


class GraphRun(NamedTuple):
    """What :func:`graph_run` ran and captured."""

    eager: torch.Tensor  # fn(x), eager
    again: torch.Tensor  # fn(x) again, with host synchronisation turned into an error
    static_in: torch.Tensor  # the graph's input (a copy of x)
    static_out: torch.Tensor  # the graph's output (checked equal to ``eager`` after a replay)
    graph: torch.cuda.CUDAGraph


def graph_run(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> GraphRun:
    """``fn(x)`` eagerly, again without host sync, and captured in a CUDA graph (after a warm-up
    on a side stream) whose replay must give the eager result."""
    eager = fn(x)
    with no_host_sync():
        again = fn(x)
    static_in = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(static_in)  # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn(static_in)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager), "graph replay differs from the eager call"
    return GraphRun(eager, again, static_in, static_out, graph)


def emulator() -> ModuleType:
    """The CPU block emulator of the CUDA kernels (``cuda_emulated``); skips the test where g++
    cannot build it."""
    cuda_emulated = pytest.importorskip("cuda_emulated")
    if not cuda_emulated.compiler_available():
        pytest.skip("needs g++ with C++20 <barrier> for the CUDA block emulator")
    return cuda_emulated


def solve_reference(affinities: torch.Tensor, k: int, capacity: torch.Tensor, **kw) -> torch.Tensor:
    """The global solver's NumPy backend."""
    return solve_global(affinities, k, capacity, backend="reference", **kw)


def overfilled_slots(a: np.ndarray, prices: np.ndarray, k: int, c: int) -> int:
    """Slots by which each token's top-k experts at ``prices`` overfill capacity ``c``."""
    top = np.argsort(-(a - prices), axis=1, kind="stable")[:, :k]
    loads = np.bincount(top.ravel(), minlength=a.shape[1])
    return int(np.maximum(loads - c, 0).sum())
