"""The GPU speed options: ``--fused-loss`` (liger-kernel's fused linear cross-entropy) and
``--precision fp8`` (torchao float8 training of the dense linear layers).

On a CPU the wiring is tested: the fused loss with a pure-torch stand-in for liger's function
(same definition: ``hidden @ weight.T``, cross-entropy over the non-ignored targets), the
refusals, and which layers fp8 converts. The ``gpu`` tests run the real kernels.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from maxscore.models import LlamaMoEForCausalLM, get_model_config
from maxscore.training import ConfigError, TrainConfig
from maxscore.training.fused_loss import check_fused_loss, enable_fused_loss
from maxscore.training.option_checks import check_float8_options
from maxscore.training.precision import (
    apply_float8,
    autocast_dtype,
    float8_module_filter,
    resolve_precision,
)

VOCAB = 128
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None


def tiny(router: str = "gshard", **overrides: Any) -> LlamaMoEForCausalLM:
    torch.manual_seed(0)
    return LlamaMoEForCausalLM(
        get_model_config("tiny", router=router, vocab_size=VOCAB, **overrides)
    )


def batch(size: int = 2, length: int = 16) -> dict[str, Tensor]:
    """Token ids with some ``-100`` labels and left padding in the second sequence."""
    ids = torch.randint(0, VOCAB, (size, length), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, 3:6] = -100
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def reference_liger(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    ignore_index: int,
    reduction: str,
    accum_dtype: torch.dtype | None = None,
) -> Tensor:
    """liger's ``liger_fused_linear_cross_entropy`` as its definition: fp32 cross-entropy of
    ``input @ weight.T``, mean over the targets that are not ``ignore_index``."""
    assert reduction == "mean" and accum_dtype == torch.float32
    logits = (input @ weight.T).float()
    return F.cross_entropy(logits, target, ignore_index=ignore_index)


@pytest.fixture
def stand_in_liger(monkeypatch: pytest.MonkeyPatch) -> None:
    """``liger_kernel.transformers.functional`` replaced by :func:`reference_liger`."""
    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = reference_liger  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(
        sys.modules, "liger_kernel.transformers", types.ModuleType("liger_kernel.transformers")
    )
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", functional)


# --------------------------------------------------------------------------------------------------
# fused loss: the model's switch
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("router", ["gshard", "dense"])
def test_fused_loss_equals_the_unfused_loss_and_gradients(
    stand_in_liger: None, router: str
) -> None:
    """Same shift, same ``-100`` / padding ignore, same mean, same router losses: the training
    loss and every gradient agree with the unfused model's; no logits are returned."""
    inputs = batch()
    plain, fused = tiny(router), tiny(router)
    fused.use_fused_linear_cross_entropy()
    plain.train()
    fused.train()
    torch.manual_seed(2)  # the same random draws in both forwards (GShard's second expert)
    out_plain = plain(**inputs)
    torch.manual_seed(2)
    out_fused = fused(**inputs)
    assert out_fused.logits is None
    assert out_plain.logits is not None
    torch.testing.assert_close(out_fused.lm_loss, out_plain.lm_loss)
    torch.testing.assert_close(out_fused.loss, out_plain.loss)
    if router != "dense":
        assert out_fused.aux_loss is not None
        torch.testing.assert_close(out_fused.aux_loss, out_plain.aux_loss)
        assert not torch.equal(out_fused.loss, out_fused.lm_loss)  # router losses added
    out_plain.loss.backward()
    out_fused.loss.backward()
    grads = dict(fused.named_parameters())
    for name, param in plain.named_parameters():
        if param.grad is None:
            assert grads[name].grad is None, name
            continue
        torch.testing.assert_close(grads[name].grad, param.grad, msg=name)


def test_fused_loss_keeps_logits_in_evaluation_and_without_labels(stand_in_liger: None) -> None:
    """Evaluation-mode forwards (the Trainer's evaluation, generation) and forwards without
    labels compute the logits as before; evaluation loss is the unfused loss."""
    inputs = batch()
    plain, fused = tiny(), tiny()
    fused.use_fused_linear_cross_entropy()
    fused.train()
    no_labels = fused(input_ids=inputs["input_ids"])
    assert no_labels.logits is not None and no_labels.loss is None
    plain.eval()
    fused.eval()
    with torch.no_grad():
        expected, got = plain(**inputs), fused(**inputs)
    assert got.logits is not None
    torch.testing.assert_close(got.logits, expected.logits)
    torch.testing.assert_close(got.loss, expected.loss)
    generated = fused.generate(inputs["input_ids"][:1, :4], max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, 7)


def test_fused_loss_switch_is_not_saved(stand_in_liger: None, tmp_path: Path) -> None:
    """The switch lives on the model object: config.json is the same with it, and a model
    loaded from the checkpoint computes logits as usual."""
    fused = tiny()
    fused.use_fused_linear_cross_entropy()
    fused.save_pretrained(tmp_path)
    text = (tmp_path / "config.json").read_text()
    assert "fused" not in text
    loaded = LlamaMoEForCausalLM.from_pretrained(tmp_path)
    assert loaded.fused_linear_cross_entropy is False
    loaded.train()
    assert loaded(**batch()).logits is not None


def test_fused_loss_without_liger_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model switched on without liger-kernel fails naming the missing module (the training
    run refuses earlier, in check_fused_loss)."""
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    model = tiny()
    model.use_fused_linear_cross_entropy()
    model.train()
    with pytest.raises(ImportError, match=r"needs liger-kernel: pip install 'maxscore\[speed\]'"):
        model(**batch())


# --------------------------------------------------------------------------------------------------
# fused loss: the training option
# --------------------------------------------------------------------------------------------------


def test_fused_loss_refused_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="--fused-loss runs liger-kernel's Triton kernels, which"):
        check_fused_loss(TrainConfig(fused_loss=True))
    check_fused_loss(TrainConfig())  # off: nothing to check


def _not_installed(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """Make ``importlib.util.find_spec`` report ``package`` as not installed."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == package else real_find_spec(name, *a),
    )


def test_fused_loss_refused_without_liger(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _not_installed(monkeypatch, "liger_kernel")
    with pytest.raises(ConfigError, match=r"pip install 'maxscore\[speed\]'"):
        check_fused_loss(TrainConfig(fused_loss=True))


def test_fused_loss_refused_with_zero3(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="ZeRO-3"):
        check_fused_loss(TrainConfig(fused_loss=True, deepspeed="zero3"))


def test_fused_loss_refused_for_other_models() -> None:
    with pytest.raises(ConfigError, match="Llama-MoE"):
        enable_fused_loss(torch.nn.Linear(2, 2))
    model = tiny()
    enable_fused_loss(model)
    assert model.fused_linear_cross_entropy


def test_train_refuses_fused_loss_on_cpu_before_anything_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from maxscore.training import prepare

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="--fused-loss"):
        prepare(TrainConfig(fused_loss=True, output_dir=str(tmp_path / "run")))
    assert not (tmp_path / "run").exists()


def test_speed_flags_are_generated() -> None:
    """``--fused-loss`` and ``--precision fp8`` come from the config's fields."""
    from maxscore.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["train", "--fused-loss", "--precision", "fp8"])
    assert args.fused_loss is True
    assert args.precision == "fp8"
    with pytest.raises(ConfigError, match="precision"):
        TrainConfig(precision="fp4")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# fp8
# --------------------------------------------------------------------------------------------------


def test_fp8_refused_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="precision fp8 needs a CUDA GPU"):
        resolve_precision("fp8")


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (7, 5)])
def test_fp8_refused_below_compute_capability_8_9(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    with pytest.raises(
        ConfigError, match=r"fp8 needs an H100/H200/Ada GPU \(compute capability 8\.9\+\)"
    ):
        resolve_precision("fp8")


def test_fp8_refused_without_torchao(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    _not_installed(monkeypatch, "torchao")
    with pytest.raises(ConfigError, match=r"needs torchao.*pip install 'maxscore\[speed\]'"):
        resolve_precision("fp8")


@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed")
@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0)])
def test_fp8_accepted_on_sm89_and_later(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    assert resolve_precision("fp8") == "fp8"
    assert autocast_dtype("fp8") == torch.bfloat16  # the Trainer's bf16 autocast
    assert autocast_dtype("fp32") is None


@pytest.mark.parametrize(
    ("overrides", "flag"),
    [
        ({"lora": True}, "--lora"),
        ({"deepspeed": "zero2"}, "--deepspeed"),
        ({"fsdp": True}, "--fsdp"),
    ],
)
def test_fp8_refused_with_untested_combinations(overrides: dict[str, Any], flag: str) -> None:
    with pytest.raises(ConfigError, match=f"--precision fp8 does not combine with {flag}"):
        check_float8_options(TrainConfig(precision="fp8", **overrides))
    check_float8_options(TrainConfig(precision="bf16", **overrides))


def _speed_test_model() -> LlamaMoEForCausalLM:
    """A tiny model with every kind of linear layer: a dense first layer, shared experts with
    their gate, routers, the LM head, and one projection whose width is not a multiple of 16."""
    return tiny(
        first_k_dense=1,
        num_hidden_layers=2,
        num_shared_experts=1,
        shared_expert_gate=True,
    )


EXPECTED_FLOAT8 = [
    "model.layers.0.self_attn.q_proj",
    "model.layers.0.self_attn.k_proj",
    "model.layers.0.self_attn.v_proj",
    "model.layers.0.self_attn.o_proj",
    "model.layers.0.mlp.gate_proj",
    "model.layers.0.mlp.up_proj",
    "model.layers.0.mlp.down_proj",
    "model.layers.1.self_attn.q_proj",
    "model.layers.1.self_attn.k_proj",
    "model.layers.1.self_attn.v_proj",
    "model.layers.1.self_attn.o_proj",
    "model.layers.1.mlp.shared_experts.gate_proj",
    "model.layers.1.mlp.shared_experts.up_proj",
    "model.layers.1.mlp.shared_experts.down_proj",
]


def test_float8_filter_picks_the_dense_projections_only() -> None:
    """Attention projections, dense and shared-expert SwiGLUs; not the LM head, the router
    gates, the shared-expert gate, nor a layer whose width is not a multiple of 16."""
    model = _speed_test_model()
    chosen = [name for name, module in model.named_modules() if float8_module_filter(module, name)]
    assert chosen == EXPECTED_FLOAT8
    odd = torch.nn.Linear(128, 24)
    assert not float8_module_filter(odd, "model.layers.0.mlp.up_proj")
    assert not float8_module_filter(torch.nn.Linear(128, 128), "lm_head")
    assert not float8_module_filter(torch.nn.Linear(128, 16), "model.layers.1.mlp.router.gate")


@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed")
def test_apply_float8_keeps_the_state_dict() -> None:
    """Float8Linear keeps ``weight`` as an ordinary parameter: after conversion the state dict
    has the same keys, shapes, dtypes and values (checkpoints and exports do not change); the
    routed experts, routers and LM head are untouched."""
    from torchao.float8.float8_linear import Float8Linear

    model = _speed_test_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    converted = apply_float8(model)
    assert converted == EXPECTED_FLOAT8
    modules = dict(model.named_modules())
    assert all(isinstance(modules[name], Float8Linear) for name in converted)
    assert not isinstance(model.lm_head, Float8Linear)
    assert not isinstance(modules["model.layers.1.mlp.router.gate"], Float8Linear)
    after = model.state_dict()
    assert list(after) == list(before)
    for key, value in after.items():
        assert type(value) is torch.Tensor, key
        assert value.dtype == before[key].dtype, key
        torch.testing.assert_close(value, before[key], msg=key)


def test_apply_speed_options_is_what_the_run_applies() -> None:
    """One function turns both options on (the trainer and the benchmarks call it)."""
    from maxscore.training.model_build import apply_speed_options

    model = tiny()
    apply_speed_options(model, TrainConfig(), "bf16")
    assert not model.fused_linear_cross_entropy
    apply_speed_options(model, TrainConfig(fused_loss=True), "bf16")
    assert model.fused_linear_cross_entropy
    if HAS_TORCHAO:
        from torchao.float8.float8_linear import Float8Linear

        apply_speed_options(model, TrainConfig(), "fp8")
        assert isinstance(model.model.layers[0].self_attn.q_proj, Float8Linear)


@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed")
def test_a_training_run_with_both_options_end_to_end_on_cpu(
    stand_in_liger: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The whole ``train`` path with ``fused_loss`` and ``fp8``, on a CPU: the GPU checks are
    bypassed, liger's function is the pure-torch stand-in and torchao's float8 matmuls run
    emulated under bf16 autocast. The Trainer trains on logits-free outputs, evaluates with
    logits, and the checkpoint holds the usual fp32 tensors and no trace of either option."""
    from safetensors.torch import load_file
    from torchao.float8.float8_linear import Float8Linear
    from transformers import TrainerCallback

    from maxscore.training import run as run_module
    from maxscore.training import train

    monkeypatch.setattr(run_module, "resolve_precision", lambda precision: precision)
    monkeypatch.setattr(run_module, "check_fused_loss", lambda config: None)
    seen: dict[str, Any] = {}

    class Inspect(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            model = kwargs["model"]
            seen["fused"] = model.fused_linear_cross_entropy
            seen["float8"] = sorted(
                name for name, m in model.named_modules() if isinstance(m, Float8Linear)
            )
            seen["bf16"] = args.bf16

    config = TrainConfig(
        model="tiny",
        model_overrides={
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_experts": 4,
        },
        router="gshard",
        seq_len=16,
        batch_size=2,
        max_steps=3,
        eval_steps=0,
        save_steps=0,
        logging_steps=1,
        max_eval_blocks=2,
        report_to="none",
        quiet=True,
        output_dir=str(tmp_path / "run"),
        precision="fp8",
        fused_loss=True,
    )
    result = train(config, callbacks=[Inspect()])
    assert seen["fused"] is True
    assert seen["bf16"] is True
    assert seen["float8"] == [f"model.layers.0.self_attn.{p}_proj" for p in ("k", "o", "q", "v")]
    assert result.train_loss is not None and math.isfinite(result.train_loss)
    assert result.eval_loss is not None and math.isfinite(result.eval_loss)
    resolved = json.loads((result.run_dir / "config.json").read_text())
    assert resolved["resolved"]["precision"] == "fp8"
    assert resolved["train"]["fused_loss"] is True
    checkpoint = result.final_checkpoint
    assert checkpoint is not None
    assert "fused" not in (checkpoint / "config.json").read_text()
    weights = load_file(str(checkpoint / "model.safetensors"))
    expected = LlamaMoEForCausalLM.from_pretrained(checkpoint).state_dict()
    assert set(weights) == set(expected)
    for key, value in weights.items():
        assert value.dtype == expected[key].dtype, key
        if value.is_floating_point():
            assert value.dtype == torch.float32, key


# --------------------------------------------------------------------------------------------------
# GPU: the real kernels
# --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_LIGER, reason="liger-kernel is not installed")
@pytest.mark.parametrize("router", ["gshard", "maxscore"])
def test_liger_fused_loss_matches_unfused_on_gpu(router: str) -> None:
    """liger's kernel under bf16 autocast: loss and gradients of the fused and unfused model
    agree to bf16 rounding (relative 1e-3 on the loss)."""
    # 128 positions: torch 2.11's cuDNN attention returns NaN query gradients with a mask at
    # lengths of 64 mod 128 where a row is fully masked (left padding), fused loss or not.
    inputs = {k: v.cuda() for k, v in batch(4, 128).items()}
    plain, fused = tiny(router).cuda(), tiny(router).cuda()
    fused.use_fused_linear_cross_entropy()
    plain.train()
    fused.train()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        torch.manual_seed(2)
        out_plain = plain(**inputs)
        torch.manual_seed(2)
        out_fused = fused(**inputs)
    assert out_fused.logits is None
    torch.testing.assert_close(out_fused.lm_loss, out_plain.lm_loss, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(out_fused.loss, out_plain.loss, rtol=1e-3, atol=1e-4)
    out_plain.loss.backward()
    out_fused.loss.backward()
    grads = dict(fused.named_parameters())
    for name, param in plain.named_parameters():
        if param.grad is None:
            continue
        got = grads[name].grad
        assert got is not None, name
        scale = param.grad.abs().max().clamp_min(1e-6)
        assert (got - param.grad).abs().max() / scale < 2e-2, name


def _gpu_train_config(tmp_path: Path, **overrides: Any) -> TrainConfig:
    settings: dict[str, Any] = {
        "model": "tiny",
        "model_overrides": {"num_hidden_layers": 2, "first_k_dense": 1, "num_shared_experts": 1},
        "router": "gshard",
        "seq_len": 64,
        "batch_size": 4,
        "max_steps": 6,
        "eval_steps": 0,
        "save_steps": 0,
        "logging_steps": 2,
        "max_eval_blocks": 2,
        "report_to": "none",
        "quiet": True,
        "output_dir": str(tmp_path / "run"),
        "lr": 1e-3,
    }
    return TrainConfig(**{**settings, **overrides})


def _is_sm89_or_later() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_LIGER, reason="liger-kernel is not installed")
def test_train_with_fused_loss_on_gpu(tmp_path: Path) -> None:
    """``maxscore train --fused-loss``: trains, evaluates (with logits) and saves a checkpoint
    whose config has no trace of the option."""
    from maxscore.training import train

    result = train(_gpu_train_config(tmp_path, fused_loss=True, precision="bf16"))
    assert result.train_loss is not None and torch.isfinite(torch.tensor(result.train_loss))
    assert result.eval_loss is not None
    assert result.final_checkpoint is not None
    assert "fused" not in (result.final_checkpoint / "config.json").read_text()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed")
@pytest.mark.skipif(not _is_sm89_or_later(), reason="fp8 needs compute capability 8.9+")
@pytest.mark.parametrize("compile", [False, True])
def test_train_with_fp8_on_gpu(tmp_path: Path, compile: bool) -> None:
    """``--precision fp8`` trains a few steps with a finite, falling loss; the checkpoint holds
    plain fp32 tensors under the usual keys and loads into an unconverted model."""
    from safetensors.torch import load_file

    from maxscore.training import train

    result = train(_gpu_train_config(tmp_path, precision="fp8", compile=compile, max_steps=10))
    assert result.train_loss is not None and torch.isfinite(torch.tensor(result.train_loss))
    assert result.eval_loss is not None and math.isfinite(result.eval_loss)
    checkpoint = result.final_checkpoint
    assert checkpoint is not None
    weights = load_file(str(checkpoint / "model.safetensors"))
    assert all(v.dtype == torch.float32 for v in weights.values() if v.is_floating_point())
    plain = LlamaMoEForCausalLM.from_pretrained(checkpoint)
    assert set(plain.state_dict()) == set(weights)
