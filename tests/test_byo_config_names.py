"""Every configuration name the Llama-MoE config meets is honoured or refused with the reason.

Other families' names map onto our fields (and read back under their own name), names of
features the model does not implement are refused unless they hold the harmless value, unknown
keys are refused on every path (constructor, ``from_pretrained``, ``--model-option`` with a
checkpoint), ``output_attentions`` works or says what to do, and ``router="native"`` on a
checkpoint converted from no family is refused instead of keeping the trained router.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from byo_helpers import LLAMA3_ROPE, family_model
from maxscore.models import LlamaMoEConfig, LlamaMoEForCausalLM
from maxscore.models.config_names import FOREIGN_NAMES
from maxscore.models.convert import ConversionError, convert_model, load_pretrained
from maxscore.training.config import ConfigError, TrainConfig

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

_TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def _config(**kwargs: object) -> LlamaMoEConfig:
    return LlamaMoEConfig(**{**_TINY, "router": "dropless", **kwargs})


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({"norm_topk_prob": True}, {"router_config.normalize_weights": True}),
        ({"norm_topk_prob": False}, {"router_config.normalize_weights": False}),
        ({"num_local_experts": 4}, {"num_experts": 4}),
        ({"n_routed_experts": 6}, {"num_experts": 6}),
        ({"mlp_only_layers": [2, 1]}, {"dense_layers": [1, 2]}),
        ({"decoder_sparse_step": 2}, {"first_k_dense": 1, "moe_layer_freq": 2}),
        ({"qkv_bias": True}, {"attention_qkv_bias": True, "attention_output_bias": False}),
        ({"attention_bias": True}, {"attention_qkv_bias": True, "attention_output_bias": True}),
        ({"use_sliding_window": False, "sliding_window": 4096}, {"sliding_window": None}),
        ({"router_jitter_noise": 0.0, "hidden_act": "silu", "mlp_bias": False}, {}),
        ({"pretraining_tp": 2}, {}),
    ],
)
def test_other_families_names_are_honoured(given: dict, expected: dict) -> None:
    config = _config(**given)
    for path, value in expected.items():
        if path.startswith("router_config."):
            assert getattr(config.router_config, path.split(".", 1)[1]) == value
        else:
            assert getattr(config, path) == value, path
    # Read back under the family's own name (code written for that family works).
    # (use_sliding_window reads the window, pretraining_tp reads 1, mlp_only_layers sorted.)
    readable = set(FOREIGN_NAMES) - {"use_sliding_window", "pretraining_tp", "mlp_only_layers"}
    for name, value in given.items():
        if name in readable and FOREIGN_NAMES[name].read is not None:
            assert getattr(config, name) == value
    # Nothing is stored under the other family's name (config.json holds our fields only).
    assert not set(given) & set(FOREIGN_NAMES) & set(config.to_dict())


def test_decoder_sparse_step_gives_qwens_layout() -> None:
    config = _config(decoder_sparse_step=2, mlp_only_layers=[3])
    # Qwen: layer i is MoE iff (i + 1) % step == 0 and i is not in mlp_only_layers.
    assert [config.is_moe_layer(i) for i in range(4)] == [False, True, False, False]


@pytest.mark.parametrize(
    ("given", "reason"),
    [
        ({"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
        ({"hidden_act": "gelu"}, "SwiGLU"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"sliding_window": 8, "max_window_layers": 2}, "give layer_types"),
        ({"decoder_sparse_step": 0}, "positive integer"),
        ({"bogus_key": 1}, r"unknown Llama-MoE config key\(s\) \['bogus_key'\]"),
        ({"rope_scaling": {"rope_type": "llama3"}}, "Missing required keys"),
        ({"rope_parameters": {"rope_type": "warp"}}, "unknown rope_type"),
        ({"layer_types": ["full_attention"]}, "one of"),
        ({"layer_types": ["sliding_attention"] * 4}, "no sliding_window"),
    ],
)
def test_what_cannot_be_honoured_is_refused_with_the_reason(given: dict, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        _config(**given)


def test_rope_scaling_is_read_into_rope_parameters(tmp_path: Path) -> None:
    scaling = dict(LLAMA3_ROPE)
    config = _config(rope_scaling=scaling)
    assert config.rope_parameters == scaling
    assert config.rope_theta == 500000.0
    config.rope_theta = 1000.0  # one setting under two names
    assert config.rope_parameters["rope_theta"] == 1000.0
    config.save_pretrained(tmp_path)
    assert LlamaMoEConfig.from_pretrained(tmp_path).rope_parameters["rope_type"] == "llama3"


def test_from_pretrained_honours_other_families_names(tmp_path: Path) -> None:
    _config(num_experts=8).save_pretrained(tmp_path)
    config = LlamaMoEConfig.from_pretrained(tmp_path, num_local_experts=4, norm_topk_prob=True)
    assert config.num_experts == 4
    assert config.router_config.normalize_weights is True
    with pytest.raises(ValueError, match=r"unknown Llama-MoE config key\(s\) \['bogus_key'\]"):
        LlamaMoEConfig.from_pretrained(tmp_path, bogus_key=1)
    with pytest.raises(ValueError, match="bogus_key"):
        AutoConfig.from_pretrained(tmp_path, bogus_key=1)


# --------------------------------------------------------------------------------------------------
# checkpoints: --model-option, router="native"
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def maxscore_checkpoint(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    LlamaMoEForCausalLM(_config(num_experts=4, router="gshard")).save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_unknown_model_option_with_a_checkpoint_is_refused(maxscore_checkpoint: Path) -> None:
    from maxscore.training.pretrained import pretrained_model_config

    config = TrainConfig(model=str(maxscore_checkpoint), model_overrides={"bogus_key": 1})
    with pytest.raises(ConfigError, match="unknown model option 'bogus_key'"):
        pretrained_model_config(config)
    with pytest.raises(ConversionError, match="bogus_key"):
        load_pretrained(str(maxscore_checkpoint), bogus_key=1)


def test_model_options_with_a_checkpoint_are_honoured(maxscore_checkpoint: Path) -> None:
    from maxscore.training.pretrained import pretrained_model_config

    config = TrainConfig(
        model=str(maxscore_checkpoint),
        router="gshard",
        model_overrides={"norm_topk_prob": True, "eval_routing": "train"},
    )
    model_config = pretrained_model_config(config)
    assert model_config.router_config.normalize_weights is True
    assert model_config.router_config.eval_routing == "train"
    model = load_pretrained(str(maxscore_checkpoint), norm_topk_prob=True)
    assert model.config.router_config.normalize_weights is True


def test_native_router_on_a_checkpoint_of_no_family_is_refused(maxscore_checkpoint: Path) -> None:
    from maxscore.training.pretrained import pretrained_model_config

    with pytest.raises(ConversionError, match="pass a router preset instead"):
        load_pretrained(str(maxscore_checkpoint), router="native")
    with pytest.raises(ConfigError, match="converted from a Hugging Face MoE family"):
        pretrained_model_config(TrainConfig(model=str(maxscore_checkpoint), router="native"))


def test_native_router_on_a_converted_checkpoint_is_the_familys(tmp_path: Path) -> None:
    """A maxscore checkpoint of a converted Qwen3-MoE, trained with gshard: ``native`` gives
    the family's routing back (dropless, its weighting and aux loss), not the trained router."""
    trained = convert_model(
        family_model("qwen3_moe"), router="gshard", router_config={"capacity_factor": 1.5}
    )
    trained.save_pretrained(tmp_path / "ckpt")
    native = load_pretrained(str(tmp_path / "ckpt"), router="native").config.router_config
    want = convert_model(family_model("qwen3_moe"), router="native").config.router_config
    assert native == want
    assert native.strategy == "dropless" and native.normalize_weights is True


# --------------------------------------------------------------------------------------------------
# output_attentions
# --------------------------------------------------------------------------------------------------


def test_output_attentions_returns_the_weights_with_eager(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = LlamaMoEForCausalLM(_config(num_experts=4)).eval()
    model.set_attn_implementation("eager")
    ids = torch.randint(0, 64, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    out = model(ids, attention_mask=mask, output_attentions=True)
    assert len(out.attentions) == 4
    for weights in out.attentions:
        assert weights.shape == (2, 4, 6, 6)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 6))
        assert weights[0].triu(1).abs().max() == 0  # causal
        assert weights[1, :, 2:, :2].abs().max() == 0  # padding gets no weight
    assert model(ids).attentions is None


def test_output_attentions_with_another_kernel_says_what_to_do() -> None:
    model = LlamaMoEForCausalLM(_config(num_experts=4)).eval()
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="attn_implementation='eager'"):
        model(torch.zeros(1, 4, dtype=torch.long), output_attentions=True)
