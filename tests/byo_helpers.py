"""Tiny random checkpoints of each supported Hugging Face MoE family, built locally (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    PreTrainedModel,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

VOCAB = 96

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


#: Llama-3.x RoPE scaling with a short original context (16 positions), so that a batch of a
#: few dozen tokens reaches its scaled part.
LLAMA3_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 500000.0,
}

#: Per family: its config class and the tiny settings exercising its special features.
_FAMILIES: dict[str, tuple[type, dict[str, Any]]] = {
    "mixtral": (
        MixtralConfig,
        {"intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "qwen2_moe": (
        Qwen2MoeConfig,
        {
            "intermediate_size": 48,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 24,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1],
            "norm_topk_prob": False,
            "qkv_bias": True,
        },
    ),
    "qwen3_moe": (
        Qwen3MoeConfig,
        {
            "head_dim": 12,
            "intermediate_size": 48,
            "moe_intermediate_size": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 2,
            "norm_topk_prob": True,
            "attention_bias": True,
        },
    ),
    "olmoe": (
        OlmoeConfig,
        {
            "intermediate_size": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "clip_qkv": 0.6,
            "attention_bias": True,
        },
    ),
    "llama": (LlamaConfig, {"intermediate_size": 48}),
    "mistral": (MistralConfig, {"intermediate_size": 48, "sliding_window": None}),
    "qwen3": (Qwen3Config, {"head_dim": 12, "intermediate_size": 48, "attention_bias": True}),
}


def family_config(family: str, **overrides: Any) -> Any:
    """A tiny config of ``family`` exercising its special features (norms, biases, layouts);
    ``overrides`` go to the constructor (so derived settings such as ``layer_types`` follow)."""
    config_class, settings = _FAMILIES[family]
    return config_class(**{**_COMMON, **settings, **overrides})


def family_model(family: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A randomly initialised fp32 model of ``family`` in eval mode.

    Biases and norm weights are randomised too (transformers initialises them to 0 / 1, which
    would hide a missing or misplaced one).
    """
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, **overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    return model.eval()


def save_family_checkpoint(family: str, path: Path, seed: int = 0, **overrides: Any) -> Path:
    """``family_model(...)`` saved with ``save_pretrained`` (the family's own format)."""
    family_model(family, seed, **overrides).save_pretrained(path)
    return path


def batch(length: int = 10, size: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (size, length), generator=torch.Generator().manual_seed(seed))


TEXT = (
    "the quick brown fox jumps over the lazy dog. a mixture of experts routes every token to "
    "a few experts; capacity limits how many tokens an expert takes. "
) * 40


def save_tiny_tokenizer(path: Path) -> Path:
    """A character-level BPE tokenizer of at most ``VOCAB`` tokens (trained offline, in ms).

    Special tokens ``<pad>``, ``<s>``, ``</s>`` get ids 0, 1, 2, as the family configs say.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>", "<unk>"], show_progress=False
    )
    tokenizer.train_from_iterator([TEXT], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    fast.save_pretrained(path)
    return path


#: A ChatML-style template (as Qwen's), so chat records render offline with the tiny tokenizer.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def save_chat_tokenizer(path: Path) -> Path:
    """:func:`save_tiny_tokenizer` with :data:`CHAT_TEMPLATE` (written as chat_template.jinja)."""
    from transformers import AutoTokenizer

    save_tiny_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def save_chat_data(path: Path, records: int = 64) -> Path:
    """A local chat dataset: ``messages`` records of a user question and an assistant answer."""
    lines = [line for line in TEXT.split(". ") if line]
    with path.open("w") as handle:
        for i in range(records):
            question, answer = lines[i % len(lines)], lines[(i + 1) % len(lines)]
            messages = [
                {"role": "user", "content": f"{i} {question}"},
                {"role": "assistant", "content": answer},
            ]
            handle.write(json.dumps({"messages": messages}) + "\n")
    return path


def save_text(path: Path) -> Path:
    """A small local text dataset (one document per line)."""
    lines = [line for line in TEXT.split(". ") if line] * 4
    path.write_text("\n\n".join(f"{i} {line}" for i, line in enumerate(lines)) + "\n")
    return path
