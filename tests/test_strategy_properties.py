"""Property tests (hypothesis) of every registered assignment strategy.

Random and adversarial inputs: all-equal scores (ties everywhere), every token preferring one
expert, few tokens (n < e), n*k not divisible by e, k = e, unequal / zero / ample capacities,
extreme logits (+-1e4), groups of one token. Properties: indices in [-1, e), no token holding
one expert twice, at most k experts per token (token choice), expert-choice slots j in {j, -1},
no expert over capacity in any group (capacity strategies), every slot filled (dropless
strategies), determinism for equal inputs. "min-cost-flow" is checked with every solver in
``maxscore.routing.flow.FLOW_SOLVERS`` (picked up when flow/ is present).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from maxscore.routing.config import RouterConfig
from maxscore.routing.strategies import ASSIGNMENT_STRATEGIES, StrategySpec


def _flow_solvers() -> dict | None:
    try:
        from maxscore.routing.flow import FLOW_SOLVERS
    except ImportError:
        return None
    return FLOW_SOLVERS


FLOW_SOLVERS = _flow_solvers()
FLOW_METHODS = sorted(FLOW_SOLVERS) if FLOW_SOLVERS is not None else []
EXACT_FLOW_METHODS = [m for m in FLOW_METHODS if getattr(FLOW_SOLVERS[m], "exact", False)]
LOCAL_STRATEGIES = sorted(set(ASSIGNMENT_STRATEGIES) - {"min-cost-flow"})

PROPERTY_SETTINGS = settings(
    max_examples=50,
    deadline=None,
    derandomize=True,  # reproducible CI; the case generator already covers the adversarial kinds
    suppress_health_check=[HealthCheck.too_slow],
)
# Flow solvers are heavier (the exact one is a CPU reference); fewer examples keep the suite fast.
FLOW_SETTINGS = settings(PROPERTY_SETTINGS, max_examples=25)

SCORE_KINDS = ["random", "softmax", "ties", "one-expert", "extreme", "integers", "mixed-inf"]
CAPACITY_KINDS = ["gshard", "unequal", "zero", "ample", "tight"]


def make_scores(kind: str, shape: tuple[int, int, int], gen: torch.Generator) -> torch.Tensor:
    _, _, e = shape
    if kind == "random":
        return torch.randn(shape, generator=gen) * 3
    if kind == "softmax":
        return torch.randn(shape, generator=gen).softmax(-1)
    if kind == "ties":
        return torch.full(shape, 0.25)
    if kind == "one-expert":
        # Every token prefers the same expert by a wide margin.
        favourite = int(torch.randint(0, e, (), generator=gen))
        scores = torch.randn(shape, generator=gen) * 0.1
        scores[..., favourite] += 5.0
        return scores
    if kind == "extreme":
        signs = torch.randint(0, 2, shape, generator=gen).float() * 2 - 1
        return signs * 1e4
    if kind == "integers":
        return torch.randint(0, 3, shape, generator=gen).float()
    if kind == "mixed-inf":
        # Extreme finite logits next to ordinary ones (softmax of these saturates to 0 / 1).
        scores = torch.randn(shape, generator=gen)
        mask = torch.rand(shape, generator=gen) < 0.3
        return torch.where(mask, scores.sign() * 1e4, scores)
    raise AssertionError(kind)


def make_capacity(kind: str, n: int, e: int, k: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "gshard":  # ceil(k*n/e), capacity factor 1 (paper Sec. 2.2)
        return torch.full((e,), math.ceil(k * n / e), dtype=torch.long)
    if kind == "unequal":
        return torch.randint(0, n * k + 1, (e,), generator=gen)
    if kind == "zero":
        return torch.zeros(e, dtype=torch.long)
    if kind == "ample":
        return torch.full((e,), n, dtype=torch.long)
    if kind == "tight":  # total capacity below n*k
        return torch.full((e,), max(0, (k * n) // e - 1), dtype=torch.long)
    raise AssertionError(kind)


@st.composite
def routing_cases(draw: st.DrawFn, max_n: int = 12, max_e: int = 8) -> dict:
    g = draw(st.integers(1, 3))
    n = draw(st.integers(1, max_n))
    e = draw(st.integers(1, max_e))
    k = draw(st.sampled_from(sorted({1, e, *range(1, min(e, 4) + 1)})))
    score_kind = draw(st.sampled_from(SCORE_KINDS))
    capacity_kind = draw(st.sampled_from(CAPACITY_KINDS))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    # Group-limited routing: a divisor of e as the number of expert groups, and enough kept
    # groups to hold k experts.
    divisors = [d for d in range(1, e + 1) if e % d == 0]
    groups = draw(st.sampled_from(divisors))
    size = e // groups
    keep = draw(st.integers(math.ceil(k / size), groups))
    return {
        "scores": make_scores(score_kind, (g, n, e), gen),
        "k": k,
        "capacity": make_capacity(capacity_kind, n, e, k, gen),
        "config": RouterConfig(
            drop_policy=draw(st.sampled_from(["position", "score"])),
            num_expert_groups=groups,
            topk_groups=keep,
            sinkhorn_iterations=draw(st.sampled_from([0, 1, 8])),
        ),
        "kinds": (score_kind, capacity_kind),
    }


def check_assignment(spec: StrategySpec, case: dict, out: torch.Tensor) -> None:
    """The structural guarantees every strategy makes (module docstring of strategies.py)."""
    scores, k, cap = case["scores"], case["k"], case["capacity"]
    g, n, e = scores.shape
    assert out.dtype == torch.long
    assert out.shape == (g, n, spec.num_slots(k, e))
    assert bool(((out >= -1) & (out < e)).all()), "index out of [-1, e)"
    # Count how often each expert appears in a token's slots.
    held = torch.nn.functional.one_hot(out + 1, e + 1)[..., 1:].sum(-2)  # [G, n, e]
    assert int(held.max()) <= 1, "a token holds the same expert twice"
    if spec.token_choice:
        assert int((out >= 0).sum(-1).max()) <= k
    else:
        experts = torch.arange(e).expand_as(out)
        assert bool(((out == -1) | (out == experts)).all()), "expert-choice slot j holds not j"
    load = held.sum(1)  # [G, e]
    if spec.uses_capacity:
        assert bool((load <= cap.clamp(min=0)).all()), f"over capacity: {load} > {cap}"
    else:
        assert bool((out >= 0).all()), "a dropless strategy left a slot empty"


def run_twice(spec: StrategySpec, case: dict) -> torch.Tensor:
    args = (case["k"], case["capacity"] if spec.uses_capacity else None, case["config"])
    out = spec.assign(case["scores"].clone(), *args)
    again = spec.assign(case["scores"].clone(), *args)
    assert torch.equal(out, again), "not deterministic for equal inputs"
    return out


@pytest.mark.parametrize("name", LOCAL_STRATEGIES)
@PROPERTY_SETTINGS
@given(case=routing_cases())
def test_strategy_properties(name: str, case: dict) -> None:
    spec = ASSIGNMENT_STRATEGIES[name]
    out = run_twice(spec, case)
    check_assignment(spec, case, out)


@pytest.mark.parametrize("name", LOCAL_STRATEGIES)
@PROPERTY_SETTINGS
@given(case=routing_cases())
def test_capacity_ignored_or_required(name: str, case: dict) -> None:
    """Capacity-free strategies give the same answer with or without a capacity tensor."""
    spec = ASSIGNMENT_STRATEGIES[name]
    if spec.uses_capacity:
        return
    with_cap = spec.assign(case["scores"], case["k"], case["capacity"], case["config"])
    without = spec.assign(case["scores"], case["k"], None, case["config"])
    assert torch.equal(with_cap, without)


@PROPERTY_SETTINGS
@given(case=routing_cases())
def test_topk_kept_slots_are_the_tokens_choices(case: dict) -> None:
    """Slot r of top-k holds the token's r-th choice or -1; dropless is top-k without drops."""
    scores, k, cap, cfg = case["scores"], case["k"], case["capacity"], case["config"]
    out = ASSIGNMENT_STRATEGIES["topk"].assign(scores, k, cap, cfg)
    full = ASSIGNMENT_STRATEGIES["dropless"].assign(scores, k, None, cfg)
    assert bool(((out == -1) | (out == full)).all())
    # Capacity factor large enough: nothing dropped.
    ample = torch.full_like(cap, scores.shape[1])
    assert torch.equal(ASSIGNMENT_STRATEGIES["topk"].assign(scores, k, ample, cfg), full)


@PROPERTY_SETTINGS
@given(case=routing_cases())
def test_reroute_keeps_topk_and_only_adds(case: dict) -> None:
    """Rerouting never removes a top-k slot; it fills dropped slots only."""
    scores, k, cap, cfg = case["scores"], case["k"], case["capacity"], case["config"]
    base = ASSIGNMENT_STRATEGIES["topk"].assign(scores, k, cap, cfg)
    rerouted = ASSIGNMENT_STRATEGIES["topk-reroute"].assign(scores, k, cap, cfg)
    kept = base >= 0
    assert torch.equal(rerouted[kept], base[kept])
    # Greedy fixed point: a slot still empty means every expert the token lacks is full.
    e = scores.shape[-1]
    held = torch.nn.functional.one_hot(rerouted + 1, e + 1)[..., 1:].sum(-2).bool()
    load = held.sum(1)
    spare = (cap - load) > 0  # [G, e]
    has_empty = (rerouted < 0).any(-1)  # [G, n]
    open_choice = (~held & spare[:, None, :]).any(-1)
    assert not bool((has_empty & open_choice).any()), "a dropped slot could still be placed"


@PROPERTY_SETTINGS
@given(case=routing_cases())
def test_expert_choice_fills_each_expert_to_capacity(case: dict) -> None:
    scores, k, cap, cfg = case["scores"], case["k"], case["capacity"], case["config"]
    out = ASSIGNMENT_STRATEGIES["expert-choice"].assign(scores, k, cap, cfg)
    load = (out >= 0).sum(1)  # [G, e]
    assert torch.equal(load, cap.clamp(0, scores.shape[1]).expand_as(load))


# ------------------------------------------------------------------------------- min-cost-flow


def _run_flow(method: str, case: dict) -> torch.Tensor:
    spec = ASSIGNMENT_STRATEGIES["min-cost-flow"]
    cfg = replace(case["config"], flow_method=method)
    try:
        out = spec.assign(case["scores"].clone(), case["k"], case["capacity"], cfg)
    except NotImplementedError as exc:  # e.g. a GPU-only solver on CPU
        pytest.skip(f"flow method {method!r} not available here: {exc}")
    again = spec.assign(case["scores"].clone(), case["k"], case["capacity"], cfg)
    assert torch.equal(out, again), f"{method}: not deterministic for equal inputs"
    return out


@pytest.mark.skipif(FLOW_SOLVERS is None, reason="maxscore.routing.flow not present yet")
@pytest.mark.parametrize("method", FLOW_METHODS or ["<none>"])
@settings(FLOW_SETTINGS, max_examples=8)
@given(case=routing_cases())
def test_min_cost_flow_properties(method: str, case: dict) -> None:
    """Quick pass over every registered solver (iterative GPU solvers are slow on a CPU)."""
    out = _run_flow(method, case)
    check_assignment(ASSIGNMENT_STRATEGIES["min-cost-flow"], case, out)


@pytest.mark.slow
@pytest.mark.skipif(FLOW_SOLVERS is None, reason="maxscore.routing.flow not present yet")
@pytest.mark.parametrize("method", FLOW_METHODS or ["<none>"])
@settings(PROPERTY_SETTINGS, max_examples=100)
@given(case=routing_cases())
def test_min_cost_flow_properties_many_examples(method: str, case: dict) -> None:
    out = _run_flow(method, case)
    check_assignment(ASSIGNMENT_STRATEGIES["min-cost-flow"], case, out)


@pytest.mark.skipif(not EXACT_FLOW_METHODS, reason="no exact flow solver registered yet")
@pytest.mark.parametrize("method", EXACT_FLOW_METHODS or ["<none>"])
@FLOW_SETTINGS
@given(case=routing_cases())
def test_min_cost_flow_exact_is_a_maximum_flow(method: str, case: dict) -> None:
    """With too little capacity the exact solver still places as many slots as possible.

    In the complete token-expert graph the maximum flow is ``min(n*k, sum_j min(c_j, n))``
    (a cut either takes all source edges or all sink edges; capacities above n are unusable).
    """
    out = _run_flow(method, case)
    n, k, cap = case["scores"].shape[1], case["k"], case["capacity"]
    max_flow = min(n * k, int(cap.clamp(0, n).sum()))
    assert ((out >= 0).sum((1, 2)) == max_flow).all()


# ------------------------------------------------------------------------------ named corners

CORNERS = {
    # (G, n, e, k, score kind, capacity kind)
    "n<e": (2, 3, 8, 2, "random", "gshard"),
    "nk-not-divisible": (2, 7, 4, 3, "random", "gshard"),
    "k=e": (2, 5, 4, 4, "random", "gshard"),
    "all-equal": (2, 9, 4, 2, "ties", "gshard"),
    "one-expert": (3, 16, 4, 2, "one-expert", "gshard"),
    "extreme": (2, 10, 5, 2, "extreme", "unequal"),
    "single-token": (4, 1, 6, 2, "random", "gshard"),
    "single-expert": (2, 5, 1, 1, "random", "tight"),
    "zero-capacity": (2, 5, 3, 2, "random", "zero"),
}


@pytest.mark.parametrize("corner", sorted(CORNERS))
@pytest.mark.parametrize("name", sorted(ASSIGNMENT_STRATEGIES))
def test_named_corner_cases(name: str, corner: str) -> None:
    g, n, e, k, score_kind, cap_kind = CORNERS[corner]
    gen = torch.Generator().manual_seed(0)
    case = {
        "scores": make_scores(score_kind, (g, n, e), gen),
        "k": k,
        "capacity": make_capacity(cap_kind, n, e, k, gen),
        "config": RouterConfig(),
    }
    spec = ASSIGNMENT_STRATEGIES[name]
    if name == "min-cost-flow":
        if FLOW_SOLVERS is None:
            pytest.skip("maxscore.routing.flow not present yet")
        for method in FLOW_METHODS:
            check_assignment(spec, case, _run_flow(method, case))
        return
    check_assignment(spec, case, run_twice(spec, case))


@pytest.mark.parametrize("name", LOCAL_STRATEGIES)
def test_non_finite_scores_still_give_a_valid_assignment(name: str) -> None:
    """NaN / inf scores make the ranking meaningless but never break the guarantees."""
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(3, 9, 4, generator=gen)
    special = torch.tensor([float("nan"), float("inf"), float("-inf")])
    mask = torch.rand(scores.shape, generator=gen) < 0.4
    picks = special[torch.randint(0, 3, scores.shape, generator=gen)]
    case = {
        "scores": torch.where(mask, picks, scores),
        "k": 2,
        "capacity": torch.tensor([3, 0, 5, 2]),
        "config": RouterConfig(num_expert_groups=2, topk_groups=1),
    }
    spec = ASSIGNMENT_STRATEGIES[name]
    check_assignment(spec, case, run_twice(spec, case))


@pytest.mark.slow
@pytest.mark.parametrize("name", LOCAL_STRATEGIES)
def test_paper_sized_groups(name: str) -> None:
    """The paper's shapes (n = 512, e = 16, k = 2 and e = 64, k = 6) on skewed logits."""
    for e, k in ((16, 2), (64, 6)):
        gen = torch.Generator().manual_seed(e)
        bias = torch.randn(e, generator=gen)
        scores = (torch.randn(2, 512, e, generator=gen) + bias).softmax(-1)
        case = {
            "scores": scores,
            "k": k,
            "capacity": torch.full((e,), math.ceil(k * 512 / e)),
            "config": RouterConfig(
                num_expert_groups=8 if e == 64 else 1, topk_groups=3 if e == 64 else 1
            ),
        }
        spec = ASSIGNMENT_STRATEGIES[name]
        check_assignment(spec, case, run_twice(spec, case))


@pytest.mark.parametrize("method", FLOW_METHODS)
def test_flow_solvers_return_slots_in_decreasing_score_order(method: str) -> None:
    """The flow registry's contract that the min-cost-flow strategy relies on (no re-sort)."""
    torch.manual_seed(3)
    scores = torch.softmax(torch.randn(3, 40, 8) + torch.randn(8), dim=-1)
    scores[0, :5] = 0.125  # ties
    capacity = torch.full((8,), 10, dtype=torch.long)
    assert FLOW_SOLVERS is not None
    idx = FLOW_SOLVERS[method].solve(scores, 2, capacity)
    valid = idx >= 0
    slot_score = torch.where(valid, scores.gather(2, idx.clamp(min=0)), -torch.inf)
    assert bool((slot_score[..., :-1] >= slot_score[..., 1:]).all())
    assert not bool((~valid[..., :-1] & valid[..., 1:]).any())  # empty slots last
    ties = (slot_score[..., :-1] == slot_score[..., 1:]) & valid[..., 1:]
    assert bool((idx[..., :-1] < idx[..., 1:])[ties].all())  # ties: lower expert first
