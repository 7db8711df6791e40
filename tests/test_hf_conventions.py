"""Hugging Face conventions: ``attn_implementation`` goes through transformers' attention
interface (eager / sdpa / flex / flash, switchable after loading), ``--report-to``
passes trackers through to the Trainer (offline: the trackers need not be installed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from byo_helpers import save_text
from maxscore.models import LlamaMoEConfig, LlamaMoEForCausalLM
from maxscore.training import reporting
from maxscore.training.config import ConfigError, TrainConfig


def _config(**kwargs: object) -> LlamaMoEConfig:
    return LlamaMoEConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        router="dropless",
        **kwargs,
    )


@pytest.mark.parametrize("extra", [{}, {"sliding_window": 3}, {"qk_norm": "head"}])
def test_eager_attention_matches_sdpa(tmp_path: Path, extra: dict) -> None:
    torch.manual_seed(0)
    LlamaMoEForCausalLM(_config(**extra)).save_pretrained(tmp_path)
    eager = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    sdpa = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert eager.config._attn_implementation == "eager"
    ids = torch.randint(0, 64, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": mask}):
            a, b = eager(ids, **kwargs).logits, sdpa(ids, **kwargs).logits
            real = kwargs.get("attention_mask", torch.ones_like(ids)).bool()
            torch.testing.assert_close(a[real], b[real], rtol=0, atol=1e-5)
    # Generation with a KV cache runs through the eager path too.
    out = eager.generate(ids[:1], max_new_tokens=3, do_sample=False)
    ref = sdpa.generate(ids[:1], max_new_tokens=3, do_sample=False)
    assert torch.equal(out, ref)


def _logits_against_sdpa(tmp_path: Path, implementation: str, device: str = "cpu") -> float:
    """Largest |logit| difference over real tokens between ``implementation`` and SDPA, with
    left padding and a sliding window in one of two layers."""
    torch.manual_seed(0)
    config = _config(sliding_window=3, layer_types=["sliding_attention", "full_attention"])
    LlamaMoEForCausalLM(config).save_pretrained(tmp_path)
    dtype = torch.bfloat16 if implementation.startswith("flash") else torch.float32
    models = [
        AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=name, dtype=dtype)
        .to(device)
        .eval()
        for name in (implementation, "sdpa")
    ]
    ids = torch.randint(0, 64, (2, 9), device=device)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with torch.no_grad():
        a, b = (model(ids, attention_mask=mask).logits.float() for model in models)
    return (a - b)[mask.bool()].abs().max().item()


def test_attention_kernel_switches_after_loading(tmp_path: Path) -> None:
    """Attention goes through transformers' interface: set_attn_implementation switches it,
    and a kernel that is not registered is refused at the forward with the registered ones."""
    model = LlamaMoEForCausalLM(_config()).eval()
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"
    ids = torch.zeros(1, 4, dtype=torch.long)
    assert model(ids, output_attentions=True).attentions is not None
    model.config._attn_implementation = "no_such_kernel"
    with pytest.raises(ValueError, match="not a registered attention kernel"):
        model(ids)


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("flash_attn") is not None, reason="flash-attn installed"
)
def test_flash_attention_without_its_package_is_refused(tmp_path: Path) -> None:
    LlamaMoEForCausalLM(_config()).save_pretrained(tmp_path)
    with pytest.raises(ImportError, match="FlashAttention2"):
        AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="flash_attention_2")


@pytest.mark.slow
def test_flex_attention_matches_sdpa(tmp_path: Path) -> None:
    """flex_attention (compiled by inductor; a minute on a CPU) with its BlockMask."""
    assert _logits_against_sdpa(tmp_path, "flex_attention") <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(
    __import__("importlib").util.find_spec("flash_attn") is None, reason="needs flash-attn"
)
def test_flash_attention_matches_sdpa_on_a_gpu(tmp_path: Path) -> None:
    assert _logits_against_sdpa(tmp_path, "flash_attention_2", device="cuda") <= 5e-2


# --------------------------------------------------------------------------------------------------
# --report-to
# --------------------------------------------------------------------------------------------------


def test_report_to_names_are_validated() -> None:
    assert reporting.parse_report_to("wandb, tensorboard") == ["wandb", "tensorboard"]
    assert reporting.parse_report_to("all") == ["all"]
    with pytest.raises(ConfigError, match="stand alone"):
        TrainConfig(report_to="auto,wandb")
    with pytest.raises(ConfigError, match="not tracker names"):
        TrainConfig(report_to="wandb;mlflow")
    TrainConfig(report_to="neptunium")  # the form only: nothing imported yet
    with pytest.raises(ConfigError, match=r"unknown report_to tracker\(s\) \['neptunium'\]"):
        reporting.check_report_to("neptunium")


def test_every_integration_of_the_trainer_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    monkeypatch.setattr(reporting, "tracker_installed", lambda name: True)
    for name in INTEGRATION_TO_CALLBACK:
        reporting.check_report_to(name)
    reporting.check_report_to(",".join(INTEGRATION_TO_CALLBACK))
    for value in ("all", "auto", "none"):
        reporting.check_report_to(value)


def test_trackers_pass_through_and_tensorboard_stays_ours() -> None:
    from transformers.integrations import get_available_reporting_integrations

    assert reporting.trainer_report_to("wandb,mlflow,tensorboard") == ["wandb", "mlflow"]
    assert reporting.trainer_report_to("tensorboard") == ["none"]
    assert reporting.trainer_report_to("auto") == ["none"]
    installed = [n for n in get_available_reporting_integrations() if n != "tensorboard"]
    assert reporting.trainer_report_to("all") == (installed or ["none"])
    assert reporting.wants_tensorboard("wandb,tensorboard") == "required"
    assert reporting.wants_tensorboard("auto") == "if-installed"
    assert reporting.wants_tensorboard("all") == "if-installed"
    assert reporting.wants_tensorboard("trackio") == "no"


@pytest.mark.parametrize("tracker", ["wandb", "mlflow", "trackio", "azure_ml"])
def test_missing_tracker_is_refused_with_the_package_to_install(
    tracker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reporting, "tracker_installed", lambda name: False)
    package = reporting.TRACKER_PACKAGES.get(tracker, tracker)
    with pytest.raises(ConfigError, match=f"pip install {package}"):
        reporting.check_report_to(tracker)


def test_training_arguments_get_the_trackers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prepare() accepts an installed tracker and the Trainer's arguments carry it."""
    from maxscore.training.run import prepare, training_arguments

    monkeypatch.setattr(reporting, "tracker_installed", lambda name: True)
    config = TrainConfig(
        model="tiny",
        model_overrides={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2},
        dataset=str(save_text(tmp_path / "data.txt")),
        seq_len=16,
        batch_size=2,
        max_steps=2,
        report_to="mlflow",
        output_dir=str(tmp_path / "run"),
    )
    args = training_arguments(prepare(config))
    assert args.report_to == ["mlflow"]
