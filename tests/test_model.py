"""Tests of the Llama-MoE model on the tiny preset, CPU, fp32."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM

import maxscore
from maxscore.models import LlamaMoEConfig, LlamaMoEForCausalLM, get_model_config

VOCAB = 128


def tiny(router: str = "gshard", **overrides: Any) -> LlamaMoEForCausalLM:
    """A seeded tiny model with a small vocabulary (fast on a CPU).

    Flow routers use the exact CPU solver here: on a CPU it is much faster than the default GPU
    solver, and these tests are about the model, not the solver.
    """
    torch.manual_seed(0)
    if router in ("maxscore", "gshard-m"):
        overrides["router_config"] = {"flow_method": "exact", **overrides.get("router_config", {})}
    return LlamaMoEForCausalLM(
        get_model_config("tiny", router=router, vocab_size=VOCAB, **overrides)
    )


def tokens(batch: int = 2, length: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------------


def test_registered_with_auto_classes() -> None:
    config = AutoConfig.for_model(
        "maxscore_llama_moe",
        vocab_size=VOCAB,
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=1,
        router="gshard",
    )
    assert isinstance(config, LlamaMoEConfig)
    model = AutoModelForCausalLM.from_config(config)
    assert isinstance(model, maxscore.LlamaMoEForCausalLM)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"router": "no-such-router"}, "unknown router preset"),
        ({"num_experts": 4, "num_experts_per_tok": 5}, "cannot exceed num_experts"),
        ({"hidden_size": 130, "num_attention_heads": 4}, "not divisible by num_attention_heads"),
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, "multiple of"),
        ({"eval_routing": "sometimes"}, "eval_routing"),
        ({"router_config": {"no_such_field": 1}}, "no_such_field"),
        ({"first_k_dense": 99}, "first_k_dense"),
        ({"output_router_logits": "yes"}, "output_router_logits must be true or false"),
    ],
)
def test_config_validation(kwargs: dict, message: str) -> None:
    base = {"vocab_size": VOCAB, "hidden_size": 64, "num_attention_heads": 4, "router": "gshard"}
    with pytest.raises(ValueError, match=message):
        LlamaMoEConfig(**{**base, **kwargs})


def test_config_resolves_router_and_round_trips() -> None:
    config = get_model_config(
        "tiny",
        router="gshard",
        vocab_size=VOCAB,
        router_aux_loss_coef=0.05,
        router_config={"capacity_factor": 1.5, "aux_loss_coef": 0.9},
    )
    # The explicit HF-style coefficient wins; the preset is resolved into a full, saved dict.
    assert config.router_config.aux_loss_coef == 0.05
    assert config.router_config.capacity_factor == 1.5
    assert config.router_config.strategy == "topk"
    assert config.moe_intermediate_size == 4 * 128 // 2
    again = LlamaMoEConfig.from_dict(config.to_dict())
    assert again.router_config == config.router_config
    assert isinstance(config.to_dict()["router_config"], dict)
    dense = get_model_config("tiny", router="dense", vocab_size=VOCAB)
    assert dense.is_dense and not any(dense.is_moe_layer(i) for i in range(4))


def test_router_settings_live_in_router_config_alone() -> None:
    """eval_routing and the coefficients are views of the one resolved router config."""
    config = get_model_config(
        "tiny", router="gshard", vocab_size=VOCAB, router_config={"eval_routing": "train"}
    )
    assert config.eval_routing == "train"  # a router_config setting is no longer overwritten
    saved = config.to_dict()
    assert not {"eval_routing", "router_aux_loss_coef", "router_z_loss_coef"} & set(saved)
    config.router_aux_loss_coef = 0.2
    assert config.router_config.aux_loss_coef == 0.2
    config.router_aux_loss_coef = None  # back to the preset's
    assert config.router_aux_loss_coef == 1e-2
    before = config.router_config
    assert config.router_aux_loss_coef == 1e-2
    assert config.router_config is before  # the getter changes nothing
    with pytest.raises(ValueError, match="eval_routing"):
        config.eval_routing = "sometimes"
    with pytest.raises(AttributeError, match="from_pretrained"):  # resolved once, when made
        config.router = "dropless"
    # A config written with the settings at the top level as well still loads, the top level
    # winning as it did then.
    legacy = {**saved, "eval_routing": "causal", "router_aux_loss_coef": 0.03}
    old = LlamaMoEConfig.from_dict(legacy)
    assert (old.eval_routing, old.router_config.aux_loss_coef) == ("causal", 0.03)


# --------------------------------------------------------------------------------------------------
# forward, loss, statistics
# --------------------------------------------------------------------------------------------------


def test_loss_includes_router_losses_and_router_logits() -> None:
    model = tiny(router_z_loss_coef=1e-3)
    x = tokens()
    labels = x.clone()
    labels[0, :3] = -100
    out = model(x, labels=labels, output_router_logits=True)
    logits = out.logits
    expected_lm = F.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB).float(), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    torch.testing.assert_close(out.lm_loss, expected_lm)
    assert out.aux_loss > 0 and out.z_loss > 0
    torch.testing.assert_close(out.loss, out.lm_loss + out.aux_loss + out.z_loss)
    assert len(out.router_logits) == 4
    assert out.router_logits[0].shape == (2 * 16, 8)
    # The aux loss must reach the gates.
    out.aux_loss.backward()
    assert model.model.layers[0].mlp.router.gate.weight.grad.abs().sum() > 0

    # Eval mode: the loss is the LM loss alone (clean perplexity); padding is ignored in the loss.
    model.eval()
    mask = torch.ones_like(x)
    mask[1, -4:] = 0
    out = model(x, attention_mask=mask, labels=x)
    masked = x.clone()
    masked[1, -4:] = -100
    torch.testing.assert_close(out.loss, model(x, attention_mask=mask, labels=masked).lm_loss)
    assert out.router_logits is None


def test_advancing_the_model_moves_deepseek_v3_biases_once_per_step() -> None:
    model = tiny("deepseek-v3").train()
    routers = [layer.mlp.router for layer in model.model.layers if layer.is_moe]
    model(tokens())
    assert all((r.expert_bias == 0).all() and r.expert_load.sum() > 0 for r in routers)
    model.advance_router_schedule()
    for router in routers:
        assert router.expert_bias.abs().sum() > 0 and (router.expert_load == 0).all()
        assert int(router.schedule.step) == 1


def test_routing_statistics_and_schedule() -> None:
    model = tiny(router="maxscore", first_k_dense=1)
    model(tokens())
    stats = model.routing_statistics()
    assert len(stats) == 4 and stats[0] == {}
    for layer_stats in stats[1:]:
        assert {"dropped_by_rank", "rerouted_by_rank", "tokens_per_expert", "aux_loss"} <= set(
            layer_stats
        )
        assert all(not v.requires_grad for v in layer_stats.values())
    model.advance_router_schedule(3)
    steps = [b for name, b in model.named_buffers() if name.endswith("schedule.step")]
    assert len(steps) == 3 and all(int(s) == 3 for s in steps)


def test_left_padding_matches_unpadded() -> None:
    """Positions come from the attention mask, so left padding does not change real logits."""
    model = tiny().eval()
    x = tokens(1, 10)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), x], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(x)], dim=1)
    with torch.no_grad():
        ref = model(x).logits
        out = model(padded, attention_mask=mask).logits
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:, 3:], ref, atol=1e-5, rtol=1e-5)


def test_default_positions_skip_the_packed_sequence_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers checks given position ids for packed sequences with a host sync; the model's
    own default positions are one sequence per row, so a training forward must not pay for it.
    Positions the caller passes still reach the check (and its block-diagonal mask)."""
    import transformers.masking_utils as masking

    calls: list[Tensor] = []
    original = masking.find_packed_sequence_indices

    def recording(position_ids: Tensor) -> Tensor | None:
        calls.append(position_ids)
        return original(position_ids)

    monkeypatch.setattr(masking, "find_packed_sequence_indices", recording)
    model = tiny()
    x = tokens(2, 12)
    model(x, labels=x)
    assert calls == []
    packed = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]] * 2)
    model.eval()  # causal routing: a token's experts do not depend on other tokens
    with torch.no_grad():
        out = model(x, position_ids=packed, use_cache=False).logits
        second = model(x[:, 6:], use_cache=False).logits  # the second packed document on its own
    assert len(calls) == 1
    torch.testing.assert_close(out[:, 6:], second, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# causal evaluation: no token's output depends on later tokens
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("router", ["gshard", "maxscore", "expert-choice", "sbase"])
def test_causal_eval_routing_does_not_leak(router: str) -> None:
    # A tight capacity makes the training routing drop tokens, so leaks would show.
    model = tiny(router, router_config={"capacity_factor": 0.5}).eval()
    x = tokens(2, 24)
    cut = 12
    y = x.clone()
    y[:, cut:] = tokens(2, 24 - cut, seed=7)
    with torch.no_grad():
        a, b = model(x).logits, model(y).logits
    # Not bit-exact: the expert matmuls see different row counts (other blocking, ~3e-7); a
    # routing leak moves these logits by > 1e-2 (see the next test).
    torch.testing.assert_close(a[:, :cut], b[:, :cut], atol=1e-5, rtol=0)


@pytest.mark.parametrize("router", ["gshard", "maxscore", "expert-choice"])
def test_train_routing_in_eval_can_leak(router: str) -> None:
    """With eval_routing="train" the capacity routing lets future tokens change earlier logits."""
    causal = tiny(router, router_config={"capacity_factor": 0.5})
    leaky = tiny(router, router_config={"capacity_factor": 0.5}, eval_routing="train")
    leaky.load_state_dict(causal.state_dict())
    leaky.eval()
    x = tokens(2, 24)
    cut = 12
    y = x.clone()
    y[:, cut:] = tokens(2, 24 - cut, seed=7)
    with torch.no_grad():
        a, b = leaky(x).logits, leaky(y).logits
    assert (a[:, :cut] - b[:, :cut]).abs().max() > 1e-3


# --------------------------------------------------------------------------------------------------
# save / load
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """A saved tiny maxscore model with an advanced schedule, its inputs and eval logits."""
    path = tmp_path_factory.mktemp("ckpt")
    model = tiny("maxscore")
    model.advance_router_schedule(7)
    model.eval()
    x = tokens()
    with torch.no_grad():
        logits = model(x).logits
    model.save_pretrained(path)
    torch.save({"x": x, "logits": logits}, path / "expected.pt")
    return path, x, logits


def test_save_load_round_trip_exact(saved: tuple[Path, torch.Tensor, torch.Tensor]) -> None:
    path, x, logits = saved
    assert (path / "model.safetensors").exists()
    assert (path / "modeling_llama_moe.py").exists() and (
        path / "configuration_llama_moe.py"
    ).exists()
    auto_map = json.loads((path / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForCausalLM"] == "modeling_llama_moe.LlamaMoEForCausalLM"
    for loader in (LlamaMoEForCausalLM, AutoModelForCausalLM):
        model = loader.from_pretrained(path).eval()
        assert isinstance(model, LlamaMoEForCausalLM)
        steps = [b for name, b in model.named_buffers() if name.endswith("schedule.step")]
        assert steps and all(int(s) == 7 for s in steps)
        with torch.no_grad():
            assert torch.equal(model(x).logits, logits)


def test_from_pretrained_can_request_train_routing(
    saved: tuple[Path, torch.Tensor, torch.Tensor],
) -> None:
    path, _, _ = saved
    model = LlamaMoEForCausalLM.from_pretrained(path, eval_routing="train")
    assert model.model.layers[0].mlp.router.config.eval_routing == "train"
    assert model.config.router_config.eval_routing == "train"


def test_trust_remote_code_in_fresh_process(saved: tuple[Path, torch.Tensor, torch.Tensor]) -> None:
    """The checkpoint loads through its own code copy, without importing maxscore first."""
    path, _, _ = saved
    script = textwrap.dedent(
        f"""
        import sys, torch
        from transformers import AutoModelForCausalLM
        assert "maxscore" not in sys.modules
        model = AutoModelForCausalLM.from_pretrained({str(path)!r}, trust_remote_code=True)
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        expected = torch.load({str(path / "expected.pt")!r})
        with torch.no_grad():
            assert torch.equal(model(expected["x"]).logits, expected["logits"])
        print("OK")
        """
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        # Where transformers copies the checkpoint's code; keep it out of the user's cache.
        "HF_MODULES_CACHE": str(path.parent / "hf_modules"),
    }
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


# --------------------------------------------------------------------------------------------------
# generation and gradient checkpointing
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_generate_with_cache_equals_without(kv_heads: int) -> None:
    """Greedy decoding with the KV cache (and grouped-query attention) equals full recompute."""
    model = tiny("maxscore", num_key_value_heads=kv_heads).eval()
    prompt = tokens(2, 6)
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0  # left padding in the second row
    kwargs = {"attention_mask": mask, "max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with_cache = model.generate(prompt, use_cache=True, **kwargs)
    without = model.generate(prompt, use_cache=False, **kwargs)
    assert with_cache.shape == (2, 14)
    assert torch.equal(with_cache, without)


@pytest.mark.parametrize(("router", "use_reentrant"), [("maxscore", False), ("gshard", True)])
def test_gradient_checkpointing_same_loss_and_grads(router: str, use_reentrant: bool) -> None:
    """Recomputation reproduces the routing, so loss, router losses and grads are unchanged."""
    x = tokens()
    results = []
    for checkpointing in (False, True):
        model = tiny(router, router_z_loss_coef=1e-3).train()
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": use_reentrant})
        out = model(x, labels=x)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.loss.detach(), out.aux_loss.detach(), grads))
    (loss_a, aux_a, grads_a), (loss_b, aux_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b, atol=0, rtol=0)
    torch.testing.assert_close(aux_a, aux_b, atol=0, rtol=0)
    assert grads_a.keys() == grads_b.keys()
    assert any("router.gate" in name for name in grads_b)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=1e-6, rtol=1e-5, msg=name)


def _compiled_vs_eager(
    device: str, router: str, dtype: torch.dtype, checkpointing: bool = False
) -> None:
    """``compile_layers`` gives the eager loss and gradients (router gate included)."""
    x = tokens(batch=2, length=32).to(device)
    results = []
    for compiled in (False, True):
        model = tiny(router, num_hidden_layers=2).to(device).train()
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        if compiled:
            model.compile_layers()
        with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
            out = model(x, labels=x)
        out.loss.backward()
        grads = {
            n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None
        }
        results.append((out.loss.detach().float(), grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    # fp32 on a GPU: inductor's fused kernels sum in another order than eager's (atomic adds,
    # vocabulary reductions) and a near-tied routing choice may flip; measured up to 4e-4 of the
    # largest gradient on an H200. A wrong gradient is off by its own size.
    tol = (1e-5 if device == "cpu" else 1e-3) if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(loss_a, loss_b, atol=tol, rtol=tol)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        if "router.gate" in name:
            assert grads_b[name].abs().max() > 0, f"{name}: no gradient through the compiled layer"
        scale = float(grads_a[name].abs().max()) + 1e-12
        err = float((grads_a[name] - grads_b[name]).abs().max())
        assert err <= tol * scale + 1e-7, f"{name}: compiled grad differs by {err} (max {scale})"


@pytest.mark.parametrize("router", ["maxscore", pytest.param("gshard", marks=pytest.mark.slow)])
def test_compile_layers_matches_eager_cpu(router: str) -> None:
    _compiled_vs_eager("cpu", router, torch.float32)


def test_compiled_grouped_experts_do_not_recompile_as_loads_change() -> None:
    """On the CPU the grouped experts loop over the experts with offsets read on the host: that
    loop runs outside the compiled graph, so new expert loads (new slice shapes) compile nothing
    (traced, its slices' shapes recompiled every step until torch.compile's limit)."""
    from torch._dynamo.utils import counters

    model = tiny("dropless", num_hidden_layers=2).train()
    model.compile_layers()
    frames = []
    for seed in range(3):
        x = tokens(batch=2, length=32, seed=seed)
        model(x, labels=x).loss.backward()
        frames.append(counters["frames"]["total"])
    assert frames[1:] == frames[:1] * 2, f"compiled frames after each step: {frames}"


@pytest.mark.slow
def test_compile_layers_with_gradient_checkpointing_cpu() -> None:
    """The paper recipe's combination: activation checkpointing around compiled layers."""
    _compiled_vs_eager("cpu", "maxscore", torch.float32, checkpointing=True)


@pytest.mark.gpu
@pytest.mark.parametrize("router", ["maxscore", "gshard", "dropless"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compile_layers_matches_eager_gpu(router: str, dtype: torch.dtype) -> None:
    _compiled_vs_eager("cuda", router, dtype)


def test_batch_not_filling_whole_token_groups_gives_the_first_groups_unchanged() -> None:
    # Routing groups of 2 sequences and a batch of 3 (the last validation batch): the first two
    # sequences' logits do not depend on the third, which is routed beside a masked sequence.
    model = tiny("gshard", router_config={"group": "tokens", "group_size": 32}).eval()
    ids = tokens(batch=3, length=16)
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
        first = model(ids[:2]).logits
    torch.testing.assert_close(out.logits[:2], first)
    assert all(logits.shape[0] == 3 * 16 for logits in out.router_logits)
