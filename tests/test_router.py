"""The Router module: fp32 gate, gradients, presets, NaN handling, bad input, causal eval, bias."""

from __future__ import annotations

import copy
from dataclasses import FrozenInstanceError, replace
from types import SimpleNamespace

import pytest
import torch
from torch.func import functional_call

import maxscore.compiled
from maxscore.routing import (
    ROUTER_PRESETS,
    Router,
    RouterConfig,
    advance_routers,
    build_router,
    load_balancing_loss,
    register_router_step_hook,
    resolve_router,
    router_z_loss,
)
from maxscore.routing.flow.choice import FlowChoice, choose_flow_solver
from maxscore.routing.router import LOGIT_BOUND
from maxscore.routing.statistics import STAT_KEYS, LazyRoutingStatistics, routing_statistics
from maxscore.routing.strategies import ASSIGNMENT_STRATEGIES

ROUTED_PRESETS = [name for name in ROUTER_PRESETS if name != "dense"]


def assert_valid(result, e: int, k: int, token_choice: bool = True) -> None:
    """Structural guarantees of any routing result."""
    idx, w = result.expert_index, result.combine_weights
    assert idx.dtype == torch.long and w.dtype == torch.float32
    assert idx.shape == w.shape
    assert ((idx >= -1) & (idx < e)).all()
    assert torch.isfinite(w).all()
    assert (w[idx < 0] == 0).all()
    if token_choice:
        assert idx.shape[1] == k
    # no token holds the same expert twice
    valid = idx >= 0
    same = (idx.unsqueeze(-1) == idx.unsqueeze(-2)) & valid.unsqueeze(-1) & valid.unsqueeze(-2)
    assert same.sum(dim=(-1, -2)).eq(valid.sum(-1)).all()
    if result.capacity is not None:
        t = idx.shape[0]
        per_group = idx.reshape(result.num_groups, t // result.num_groups, -1)
        for g in range(result.num_groups):
            counts = torch.bincount(per_group[g][per_group[g] >= 0], minlength=e)
            assert (counts <= result.capacity).all()


def make(preset: str, d: int = 8, e: int = 16, k: int = 2, **kw) -> Router:
    torch.manual_seed(0)
    return build_router(preset, d, e, k, **kw)


# ---------------------------------------------------------------------------------------------
# gate precision


def test_gate_matmul_is_fp32_under_bf16_input_and_autocast() -> None:
    router = make("gshard")
    h = torch.randn(2, 5, 8).bfloat16()
    ref = h.float() @ router.gate.weight.float().T
    res = router(h)
    assert res.logits.dtype == torch.float32 and res.affinities.dtype == torch.float32
    torch.testing.assert_close(res.logits, ref.reshape(10, 16), atol=0, rtol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        res2 = router(h)
    assert res2.logits.dtype == torch.float32
    torch.testing.assert_close(res2.logits, ref.reshape(10, 16), atol=0, rtol=0)
    assert res2.combine_weights.dtype == torch.float32


def test_model_cast_to_bf16_still_routes_in_fp32() -> None:
    router = make("maxscore-i").to(torch.bfloat16)
    res = router(torch.randn(2, 4, 8, dtype=torch.bfloat16))
    assert res.logits.dtype == torch.float32 and res.combine_weights.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# gradients


@pytest.mark.parametrize("preset", ["dropless", "gshard-s", "deepseek-v3"])
def test_gradcheck_combine_weights_wrt_gate(preset: str) -> None:
    torch.manual_seed(0)
    router = build_router(preset, 3, 4, 2, router_dtype=torch.float64, compute_stats=False)
    router.schedule.advance(5_000)  # SoftTopk t = 2.5, a non-trivial multiplier
    hidden = torch.randn(1, 3, 3, dtype=torch.float64)
    weight = router.gate.weight.detach().double().clone().requires_grad_(True)

    def combine(w: torch.Tensor) -> torch.Tensor:
        return functional_call(router, {"gate.weight": w}, (hidden,)).combine_weights

    assert torch.autograd.gradcheck(combine, (weight,), eps=1e-6, atol=1e-5)


def test_aux_and_z_loss_scaled_and_differentiable() -> None:
    router = make("gshard", z_loss_coef=1e-3)
    h = torch.randn(2, 6, 8)
    res = router(h)
    a = res.affinities.reshape(1, 12, 16)
    i = res.expert_index.reshape(1, 12, 2)
    assert float(res.aux_loss.detach()) == pytest.approx(
        1e-2 * float(load_balancing_loss(a, i, "gshard").detach())
    )
    assert float(res.z_loss.detach()) == pytest.approx(
        1e-3 * float(router_z_loss(res.logits).detach())
    )
    (res.aux_loss + res.z_loss + res.combine_weights.sum()).backward()
    assert router.gate.weight.grad is not None and router.gate.weight.grad.abs().sum() > 0
    off = make("gshard", aux_loss="none")(h)
    assert float(off.aux_loss) == 0.0 and float(off.z_loss) == 0.0


# ---------------------------------------------------------------------------------------------
# presets


@pytest.mark.parametrize("preset", ROUTED_PRESETS)
@pytest.mark.parametrize("training", [True, False])
def test_every_preset_builds_and_routes_with_fewer_tokens_than_experts(
    preset: str, training: bool
) -> None:
    e, k = 16, 2
    router = make(preset, e=e, k=k).train(training)
    res = router(torch.randn(2, 5, 8))  # n = 5 (or 10) tokens per group < e = 16
    spec = ASSIGNMENT_STRATEGIES[router.strategy_for_mode()[0]]
    assert_valid(res, e, k, token_choice=spec.token_choice)
    assert res.expert_index.shape[0] == 10
    assert set(res.stats) == set(STAT_KEYS)
    assert torch.isfinite(res.aux_loss) and torch.isfinite(res.z_loss)
    cfg = ROUTER_PRESETS[preset].config
    assert res.num_groups == (2 if cfg.group == "sequence" else 1)


def test_preset_table_matches_paper() -> None:
    names = {"dense", "gshard", "gshard-i", "gshard-s", "gshard-m", "sbase", "expert-choice"}
    names |= {"dropless", "deepseek", "maxscore-i", "maxscore", "deepseek-v3"}
    assert names <= set(ROUTER_PRESETS)
    ms = resolve_router("maxscore")
    assert (ms.operator, ms.strategy, ms.group) == ("softtopk", "min-cost-flow", "sequence")
    assert resolve_router("gshard").group == "batch"
    for name in ("maxscore", "gshard-m"):
        assert resolve_router(name).flow_method == "auto"
    assert resolve_router("deepseek").aux_loss_coef == 1e-3
    assert resolve_router("gshard").aux_loss_coef == 1e-2
    v3 = resolve_router("deepseek-v3")
    assert v3.operator == "sigmoid" and v3.normalize_weights and v3.bias_update_rate > 0
    # resolved configs are frozen: an override makes a new one, the preset stays as it was
    c = resolve_router("maxscore", {"capacity_factor": 2.0})
    with pytest.raises(FrozenInstanceError):
        c.temperature.start = 99.0  # type: ignore[misc]
    assert resolve_router("maxscore").capacity_factor == 1.0
    assert c.capacity_factor == 2.0


def test_flow_method_auto_is_chosen_in_one_place() -> None:
    """flow_method="auto": the exact solver on the CPU; on a GPU the global solver, with its CUDA
    kernel when the kernel takes the shape, else its host reference (a stand-in GPU tensor)."""
    cpu = torch.rand(2, 8, 4)
    assert choose_flow_solver("auto", cpu, 2) == FlowChoice("exact")
    assert choose_flow_solver("global", cpu, 2) == FlowChoice("global", "reference")
    assert choose_flow_solver("two-stage-sinkhorn", cpu, 2) == FlowChoice("two-stage-sinkhorn")
    gpu = SimpleNamespace(is_cuda=True, dim=lambda: 3, shape=(2, 8, 4))
    assert choose_flow_solver("auto", gpu, 2).method == "global"  # type: ignore[arg-type]


def test_dense_preset_has_no_router() -> None:
    with pytest.raises(ValueError, match="dense"):
        build_router("dense", 8, 16, 2)


def test_router_accepts_config_object_and_2d_input() -> None:
    router = Router(8, 4, 1, RouterConfig(operator="softmax", strategy="dropless"))
    res = router(torch.randn(7, 8))
    assert res.expert_index.shape == (7, 1) and res.num_groups == 1 and res.capacity is None


def test_groups_and_capacity() -> None:
    h = torch.randn(4, 8, 8)
    res = make("gshard", e=4, k=2, group="tokens", group_size=16)(h)
    assert res.num_groups == 2 and res.capacity.tolist() == [8] * 4
    res = make("gshard", e=4, k=2, capacity_factor=1.5)(h)  # batch group: n = 32
    assert res.num_groups == 1 and res.capacity.tolist() == [24] * 4
    with pytest.raises(ValueError, match="multiple of the group size"):
        make("gshard", e=4, k=2, group="tokens", group_size=5)(h)


def test_normalize_weights() -> None:
    res = make("dropless", normalize_weights=True)(torch.randn(2, 4, 8))
    torch.testing.assert_close(res.combine_weights.sum(-1), torch.ones(8))


# ---------------------------------------------------------------------------------------------
# non-finite logits and bad input


@pytest.mark.parametrize("preset", ["gshard", "maxscore-i", "maxscore", "expert-choice", "sbase"])
def test_nan_and_inf_logits_give_valid_assignment(preset: str) -> None:
    router = make(preset, e=8)
    h = torch.randn(2, 6, 8)
    h[0, 1] = float("nan")  # every logit of this token NaN
    h[1, 2, 0] = float("inf")  # +-inf logits
    res = router(h)
    spec = ASSIGNMENT_STRATEGIES[router.config.strategy]
    assert_valid(res, 8, 2, token_choice=spec.token_choice)
    assert torch.isfinite(res.logits).all() and res.logits.abs().max() <= LOGIT_BOUND
    assert torch.isfinite(res.affinities).all()
    assert torch.isfinite(res.aux_loss) and all(torch.isfinite(v).all() for v in res.stats.values())
    # NaN logits are routed as zeros: that token's logits are exactly 0
    assert (res.logits[1] == 0).all()


def test_check_finite_raises() -> None:
    router = make("gshard", check_finite=True)
    h = torch.randn(1, 4, 8)
    router(h)  # finite: fine
    h[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        router(h)


def test_bad_input_errors() -> None:
    router = make("gshard")
    with pytest.raises(ValueError, match="hidden size 7"):
        router(torch.randn(2, 3, 7))
    with pytest.raises(ValueError, match="floating-point"):
        router(torch.ones(2, 3, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="shape"):
        router(torch.randn(2, 3, 4, 8))
    with pytest.raises(ValueError, match="top_k=5 exceeds num_experts=4"):
        build_router("gshard", 8, 4, 5)
    with pytest.raises(ValueError, match="top_k"):
        build_router("gshard", 8, 4, 0)
    with pytest.raises(ValueError, match="unknown router preset"):
        build_router("maxscor", 8, 4, 2)
    with pytest.raises(ValueError, match="unknown router option"):
        build_router("gshard", 8, 4, 2, capacity_factr=1.0)
    with pytest.raises(ValueError, match="unknown affinity operator"):
        build_router("gshard", 8, 4, 2, operator="softmaxx")
    with pytest.raises(ValueError, match="unknown assignment strategy"):
        build_router("gshard", 8, 4, 2, strategy="top2")
    with pytest.raises(ValueError, match="not divisible by num_expert_groups"):
        build_router("deepseek", 8, 12, 2)
    with pytest.raises(ValueError, match="fewer than top_k"):
        build_router("deepseek", 8, 16, 8)
    with pytest.raises(ValueError, match="capacity_factor"):
        build_router("gshard", 8, 4, 2, capacity_factor=0.0)
    with pytest.raises(ValueError, match="router_dtype"):
        build_router("gshard", 8, 4, 2, router_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bias_update_rate"):
        build_router("deepseek-v3", 8, 4, 2, bias_update_rate=-1.0)
    with pytest.raises(ValueError, match="unknown flow_method"):
        build_router("maxscore", 8, 4, 2, flow_method="nope")
    with pytest.raises(TypeError, match="build_router"):
        Router(8, 4, 2, "gshard")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# causal evaluation


@pytest.mark.parametrize("preset", ROUTED_PRESETS)
def test_eval_routing_is_causal(preset: str) -> None:
    router = make(preset, e=8, k=2).eval()
    torch.manual_seed(1)
    h = torch.randn(2, 12, 8)
    cut = 5
    h2 = h.clone()
    h2[:, cut:] = 10 * torch.randn(2, 12 - cut, 8)  # change every future token
    r1 = router(h).expert_index.reshape(2, 12, -1)
    r2 = router(h2).expert_index.reshape(2, 12, -1)
    torch.testing.assert_close(r1[:, :cut], r2[:, :cut], atol=0, rtol=0)
    w1 = router(h).combine_weights.reshape(2, 12, -1)
    w2 = router(h2).combine_weights.reshape(2, 12, -1)
    torch.testing.assert_close(w1[:, :cut], w2[:, :cut], atol=0, rtol=0)
    if not ASSIGNMENT_STRATEGIES[router.config.strategy].causal:
        assert router.strategy_for_mode()[0] == "dropless"


def test_eval_routing_train_keeps_capacity() -> None:
    router = make("gshard", eval_routing="train").eval()
    assert router.strategy_for_mode()[0] == "topk"
    assert router(torch.randn(2, 4, 8)).capacity is not None
    assert make("gshard").eval()(torch.randn(2, 4, 8)).capacity is None


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3 balancing bias


def skewed_v3_router() -> Router:
    router = make("deepseek-v3", d=4, e=4, k=1, bias_update_rate=0.1)
    with torch.no_grad():
        router.gate.weight.zero_()
        router.gate.weight[0] = 1.0  # hidden of all-ones -> every token prefers expert 0
    return router


def test_v3_bias_sign_lowers_overloaded_experts() -> None:
    router = skewed_v3_router()
    h = torch.ones(1, 8, 4)
    res = router(h)
    assert (res.expert_index[:, 0] == 0).all()
    # the bias is constant within an optimizer step; the load is accumulated
    assert (router.expert_bias == 0).all()
    torch.testing.assert_close(router.expert_load, torch.tensor([8.0, 0.0, 0.0, 0.0]))
    router(h)  # a second micro-batch of the same step
    assert (router.expert_bias == 0).all()
    router.advance_schedule()  # optimizer step
    router(h)
    # load [16, 0, 0, 0] > mean for expert 0: it goes DOWN, the idle ones up, once per step
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.1, 0.1, 0.1, 0.1]))
    torch.testing.assert_close(router.expert_load, torch.tensor([8.0, 0.0, 0.0, 0.0]))
    assert router.expert_bias.dtype == torch.float32
    # the bias steers selection only; weights stay the sigmoid affinities (renormalised, k = 1)
    torch.testing.assert_close(res.combine_weights, torch.ones(8, 1))
    router.update_expert_bias()  # explicit update consumes the pending load
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.2, 0.2, 0.2, 0.2]))
    assert (router.expert_load == 0).all()


def test_v3_forward_never_moves_the_bias() -> None:
    """The forward is a function of its inputs (and the bias): only a step end moves the bias."""
    router = skewed_v3_router()
    h = torch.ones(1, 8, 4)
    first = router(h)
    for _ in range(3):  # micro-batches of one optimizer step
        again = router(h)
        torch.testing.assert_close(again.expert_index, first.expert_index, atol=0, rtol=0)
        assert (router.expert_bias == 0).all()
    torch.testing.assert_close(router.expert_load, torch.tensor([32.0, 0.0, 0.0, 0.0]))


def test_v3_bias_moves_from_an_optimizer_step_hook() -> None:
    """A loop of one's own: register_router_step_hook advances the routers after each step."""
    router = skewed_v3_router()
    layer = torch.nn.Sequential(router)
    optimizer = torch.optim.SGD(router.parameters(), lr=0.0)
    handle = register_router_step_hook(optimizer, layer)
    router(torch.ones(1, 8, 4))
    assert (router.expert_bias == 0).all()
    optimizer.step()
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.1, 0.1, 0.1, 0.1]))
    assert (router.expert_load == 0).all() and int(router.schedule.step) == 1
    handle.remove()
    router(torch.ones(1, 8, 4))
    optimizer.step()  # detached: nothing moves
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.1, 0.1, 0.1, 0.1]))
    advance_routers(layer)  # what the hook did, by hand
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.2, 0.2, 0.2, 0.2]))


def test_v3_bias_not_updated_in_eval() -> None:
    router = skewed_v3_router()
    h = torch.ones(1, 8, 4)
    router.eval()
    router(h)
    router.advance_schedule()
    router(h)
    assert (router.expert_bias == 0).all() and (router.expert_load == 0).all()


def test_v3_bias_constant_under_activation_checkpointing() -> None:
    from torch.utils.checkpoint import checkpoint

    router = skewed_v3_router()
    with torch.no_grad():
        router.gate.weight.add_(0.1 * torch.randn(4, 4))
    h = torch.ones(2, 8, 4) + 0.1 * torch.randn(2, 8, 4)
    for _ in range(3):
        for reentrant in (False, True):
            hh = h.clone().requires_grad_(True)
            out = checkpoint(lambda x: router(x).combine_weights, hh, use_reentrant=reentrant)
            bias = router.expert_bias.clone()
            out.sum().backward()  # recomputes the forward: same step, same bias
            torch.testing.assert_close(router.expert_bias, bias, atol=0, rtol=0)
        router.advance_schedule()
    assert router.expert_bias.abs().sum() > 0
    # one update per optimizer step (three steps), each at most one rate step
    assert router.expert_bias.abs().max() <= 0.1 * 3 + 1e-6


def test_v3_bias_changes_selection() -> None:
    router = skewed_v3_router()
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([-10.0, 0.0, 5.0, 0.0]))
    res = router.eval()(torch.ones(1, 3, 4))
    assert (res.expert_index == 2).all()


def test_v3_bias_stays_fp32_after_bf16_cast_and_round_trips() -> None:
    router = skewed_v3_router()
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([1e-4, 1.0 + 1e-6, -3.0, 0.5]))
    before = router.expert_bias.clone()
    router.to(torch.bfloat16)
    assert router.gate.weight.dtype == torch.bfloat16
    assert router.expert_bias.dtype == torch.float32
    torch.testing.assert_close(router.expert_bias, before, atol=0, rtol=0)  # no precision lost
    router.half().float().bfloat16()
    assert router.expert_bias.dtype == torch.float32
    router(torch.ones(1, 8, 4, dtype=torch.bfloat16))
    assert router.expert_bias.dtype == torch.float32
    assert router.expert_load.dtype == torch.float32
    clone = skewed_v3_router()
    clone.load_state_dict(copy.deepcopy(router.state_dict()))
    torch.testing.assert_close(clone.expert_bias, router.expert_bias)
    torch.testing.assert_close(clone.expert_load, router.expert_load)  # resume mid-step


def test_state_dict_keys_stable_and_schedule_saved() -> None:
    a = make("maxscore")
    b = make("gshard")
    keys = {"gate.weight", "schedule.step", "expert_bias", "expert_load", "expert_load_step"}
    assert set(a.state_dict()) == set(b.state_dict()) == keys
    a.advance_schedule(123)
    b.load_state_dict(a.state_dict())
    assert int(b.schedule.step) == 123
    # softtopk reads t from the schedule
    assert float(a.temperature()) == pytest.approx(3.0 * (1 - 123 / 30_000))


# ---------------------------------------------------------------------------------------------
# launch-overhead measures: lazy statistics, cached t and capacity


@pytest.mark.parametrize("preset", ["maxscore", "gshard", "dropless", "expert-choice"])
def test_statistics_are_lazy_and_equal_the_eager_ones(preset: str) -> None:
    router = make(preset)
    res = router(torch.randn(2, 12, 8))
    assert isinstance(res.stats, LazyRoutingStatistics) and not res.stats.computed
    assert set(res.stats) == set(STAT_KEYS) and len(res.stats) == len(STAT_KEYS)
    assert "tokens_per_expert" in res.stats and not res.stats.computed  # keys cost nothing
    g = res.num_groups
    expected = routing_statistics(
        res.affinities.reshape(g, -1, 16),
        res.expert_index.reshape(g, -1, res.expert_index.shape[-1]),
        res.capacity,
        2,
        # Choice ranks come from the selection scores: the softmax for every preset here
        # (SoftTopk at t = 0 is the softmax).
        rank_scores=torch.softmax(res.logits.reshape(g, -1, 16), dim=-1),
    )
    got = dict(res.stats)
    assert res.stats.computed and set(got) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0)
        assert not got[key].requires_grad
    extra = res.stats.with_extra(aux_loss=res.aux_loss.detach())
    assert (
        set(extra) == {*STAT_KEYS, "aux_loss"} and extra["load_imbalance"] is got["load_imbalance"]
    )
    with pytest.raises(KeyError):
        res.stats["nope"]
    assert build_router("gshard", 8, 16, 2, compute_stats=False)(torch.randn(2, 4, 8)).stats == {}


def test_cached_temperature_follows_the_schedule() -> None:
    router = make("maxscore")
    h = torch.randn(2, 6, 8)
    logits = router.gate(h).reshape(2, 6, 16)

    def expected() -> torch.Tensor:
        return router.operator(logits, 2, router.schedule.value()).reshape(12, 16)

    torch.testing.assert_close(router(h).affinities, expected(), rtol=0, atol=0)
    router.advance_schedule(10_000)  # t: 3 -> 2
    torch.testing.assert_close(router(h).affinities, expected(), rtol=0, atol=0)
    other = make("maxscore")
    other.advance_schedule(20_000)
    router.load_state_dict(other.state_dict())  # copy_ into the step buffer
    torch.testing.assert_close(router(h).affinities, expected(), rtol=0, atol=0)
    router.schedule.step.fill_(0)
    torch.testing.assert_close(router(h).affinities, expected(), rtol=0, atol=0)
    router.schedule.config = replace(router.schedule.config, start=5.0)  # part of the cache key
    torch.testing.assert_close(router(h).affinities, expected(), rtol=0, atol=0)
    router.to(torch.float64)  # new buffers after a cast
    torch.testing.assert_close(
        router(h.double()).affinities.float(), expected(), rtol=1e-6, atol=1e-6
    )


def test_inference_mode_does_not_poison_cached_tensors() -> None:
    router = make("maxscore")
    h = torch.randn(2, 6, 8)
    with torch.inference_mode():
        ref = router(h)
    res = router(h)  # training forward after an inference-mode one: backward must work
    (res.combine_weights.sum() + res.aux_loss).backward()
    assert router.gate.weight.grad is not None
    torch.testing.assert_close(res.combine_weights.detach(), ref.combine_weights.clone())
    assert res.capacity is not None and int(res.capacity[0]) == 1  # ceil(2 * 6 / 16)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ROUTED_PRESETS)
def test_forward_has_no_host_sync_on_gpu(preset: str) -> None:
    router = make(preset, d=32, e=16, k=2).cuda()
    h = torch.randn(4, 64, 32, device="cuda", dtype=torch.bfloat16)
    for training in (True, False):
        router.train(training)
        # warm-up (lazy initialisation may sync once; compiling the statistics does)
        dict(router(h).stats)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            res = router(h)
            router.advance_schedule()
            res.combine_weights.sum().backward()
            dict(res.stats)  # the (lazy) statistics are sync-free too
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert_valid(res, 16, 2, token_choice=res.expert_index.shape[1] == 2)
    # the statistics checked are the compiled ones training uses, not an eager fallback
    assert "routing_statistics" not in maxscore.compiled._FAILED


@pytest.mark.parametrize("preset", ["gshard-s", "maxscore", "maxscore-i"])
def test_softtopk_boost_shapes_weights_not_selection(preset: str) -> None:
    """With room for everyone, SoftTopk routers pick each token's top-k logits, even at t = 3
    where the boosted non-top-1 affinities (x4) exceed the top-1's; the weights carry the boost."""
    torch.manual_seed(0)
    router = build_router(preset, 8, 6, 2, capacity_factor=6.0)
    router.train()
    res = router(torch.randn(3, 10, 8) * 0.01)  # near-uniform logits: the case boosting flips
    chosen = res.expert_index.sort(dim=-1).values
    expected = res.logits.topk(2, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(chosen, expected)
    probs = torch.softmax(res.logits, dim=-1)
    top = res.logits.argmax(dim=-1, keepdim=True)
    boost = torch.where(res.expert_index == top, 1.0, 1.0 + 3.0)  # t = 3 at step 0
    torch.testing.assert_close(res.combine_weights, probs.gather(-1, res.expert_index) * boost)
    assert float(res.stats["dropped_by_rank"].sum()) == 0.0
    assert float(res.stats["rerouted_by_rank"].sum()) == 0.0


def _bias_update_on_rank(rank: int, store_path: str, out_path: str) -> None:
    import torch.distributed as dist

    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        router = build_router("deepseek-v3", 8, 4, 2)
        # Rank 0 overloads expert 0 a little, rank 1 overloads expert 3 a lot: globally,
        # experts 3 and 0 are above the mean load, 1 and 2 below.
        loads = [[4.0, 2.0, 1.0, 1.0], [1.0, 0.0, 1.0, 6.0]]
        router.expert_load.copy_(torch.tensor(loads[rank]))
        router.update_expert_bias()
        torch.save(router.expert_bias, f"{out_path}.{rank}")
    finally:
        dist.destroy_process_group()


def test_deepseek_v3_bias_update_sums_loads_over_data_parallel_ranks(tmp_path) -> None:
    """Two gloo ranks with different local loads apply the same, global bias update."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "bias")
    mp.spawn(_bias_update_on_rank, args=(str(tmp_path / "store"), out), nprocs=2, join=True)
    rate = resolve_router("deepseek-v3").bias_update_rate
    expected = torch.tensor([-rate, rate, rate, -rate])  # global load [5, 2, 2, 7], mean 4
    for rank in range(2):
        torch.testing.assert_close(torch.load(f"{out}.{rank}"), expected)
