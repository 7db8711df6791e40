"""Instruction tuning: chat / prompt-completion records, the loss on the completion only,
packing that keeps examples apart, and LoRA adapters through peft (saved, resumed, merged on
export, loadable by plain transformers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from byo_helpers import (
    CHAT_TEMPLATE,
    family_model,
    save_chat_data,
    save_chat_tokenizer,
    save_family_checkpoint,
    save_text,
)
from maxscore.cli import main
from maxscore.models.convert import convert_model
from maxscore.training.config import ConfigError, TrainConfig
from maxscore.training.instruction_data import (
    IGNORE_INDEX,
    InstructionValidation,
    encode_example,
    pack_examples,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CHAT = {
    "messages": [
        {"role": "system", "content": "route tokens"},
        {"role": "user", "content": "the quick fox"},
        {"role": "assistant", "content": "a lazy dog"},
        {"role": "user", "content": "capacity"},
        {"role": "assistant", "content": "experts route"},
    ]
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return AutoTokenizer.from_pretrained(save_chat_tokenizer(tmp_path_factory.mktemp("tok")))


def _targets(tokenizer, example) -> str:
    return tokenizer.decode([t for t, y in zip(example.ids, example.labels) if y != IGNORE_INDEX])


def test_chat_loss_is_on_the_assistant_turns_only(tokenizer) -> None:
    example = encode_example(CHAT, "chat", tokenizer)
    # Each assistant turn with its end-of-turn marker; nothing of the system or user turns.
    assert _targets(tokenizer, example).split() == [
        "a",
        "lazy",
        "dog",
        "</s>",
        "experts",
        "rou",
        "t",
        "e",
        "</s>",
    ]
    assert (
        example.ids
        == tokenizer(
            tokenizer.apply_chat_template(CHAT["messages"], tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
    )
    everything = encode_example(CHAT, "chat", tokenizer, completion_only=False)
    assert everything.labels[0] == IGNORE_INDEX and everything.labels[1:] == everything.ids[1:]


def test_prompt_completion_loss_is_on_the_completion_and_eos(tokenizer) -> None:
    example = encode_example(
        {"prompt": "the fox ", "completion": "jumps"}, "prompt-completion", tokenizer
    )
    assert _targets(tokenizer, example) == "jump s </s>"
    conversational = {
        "prompt": [{"role": "user", "content": "capacity"}],
        "completion": [{"role": "assistant", "content": "experts route"}],
    }
    assert "experts" in _targets(
        tokenizer, encode_example(conversational, "prompt-completion", tokenizer)
    )


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    # Renders only the last message: a prefix of the conversation is not a prefix of its text.
    tokenizer.chat_template = "{{ messages[-1]['content'] }}"
    with pytest.raises(ConfigError, match="cannot be told apart"):
        encode_example(CHAT, "chat", tokenizer)


def test_packing_keeps_every_example_whole(tokenizer) -> None:
    examples = [
        encode_example({"prompt": "fox " * n, "completion": "dog"}, "prompt-completion", tokenizer)
        for n in (3, 9, 2, 6)
    ]
    packed = pack_examples(examples, seq_len=16, pad_id=0)
    for block in range(len(packed)):
        owners, positions = packed.examples[block], packed.position_ids[block]
        for index in owners.unique().tolist():
            where = (owners == index).nonzero().flatten()
            length = len(examples[index].ids)
            # contiguous, positions from 0, and only here (no example crosses blocks)
            assert where.tolist()[:length] == list(range(where[0], where[0] + length))
            assert positions[where[0] : where[0] + length].tolist() == list(range(length))
            assert (packed.examples[:block] != index).all()
    # Padding closes a block: positions restart, no targets.
    last = packed.input_ids.shape[1] - 1
    assert (packed.labels[:, -1] == IGNORE_INDEX).any() or packed.position_ids[0, last] == last


def test_packed_examples_give_the_logits_they_get_alone(tokenizer) -> None:
    """position_ids restarting per example keep attention and RoPE inside each example."""
    model = convert_model(family_model("qwen3_moe"), router="native").eval()
    examples = [
        encode_example(
            {"prompt": f"{n} the quick fox ", "completion": "jumps"}, "prompt-completion", tokenizer
        )
        for n in range(3)
    ]
    seq_len = sum(len(e.ids) for e in examples) + 3
    packed = pack_examples(examples, seq_len=seq_len, pad_id=0)
    assert len(packed) == 1
    with torch.no_grad():
        together = model(packed.input_ids, position_ids=packed.position_ids).logits[0]
        start = 0
        for example in examples:
            alone = model(torch.tensor([example.ids])).logits[0]
            diff = (together[start : start + len(example.ids)] - alone).abs().max().item()
            assert diff <= 1e-5
            start += len(example.ids)


def test_validation_counts_completion_tokens_only(tokenizer) -> None:
    from maxscore.training.validation_set import DocumentLosses

    examples = [
        encode_example(CHAT, "chat", tokenizer),
        encode_example({"prompt": "a ", "completion": "fox"}, "prompt-completion", tokenizer),
    ]
    dataset = InstructionValidation(pack_examples(examples, seq_len=64, pad_id=0))
    model = convert_model(family_model("qwen3_moe"), router="native").eval()
    losses = DocumentLosses()
    losses.reset(dataset.num_documents)
    item = dataset[0]
    batch = {k: v[None] for k, v in item.items() if k != "document_ids"}
    losses.add(model, batch, item["document_ids"][None])
    _, counts = losses.gather()
    assert counts == [sum(y != IGNORE_INDEX for y in e.labels) for e in examples]


def test_auto_detects_chat_and_refuses_mismatched_records(tmp_path: Path, tokenizer) -> None:
    from maxscore.training.data import build_training_data, load_instruction_splits

    chat = save_chat_data(tmp_path / "chat.jsonl")
    config = TrainConfig(dataset=str(chat), seq_len=64, batch_size=2)
    assert load_instruction_splits(config).data_format == "chat"
    data = build_training_data(config, tokenizer)
    assert set(data.train[0]) == {"input_ids", "labels", "position_ids"}
    text = tmp_path / "text.jsonl"
    text.write_text("\n".join(json.dumps({"text": f"doc {i}"}) for i in range(4)))
    assert load_instruction_splits(TrainConfig(dataset=str(text))) is None
    with pytest.raises(ConfigError, match=r"record 1 has no \['prompt', 'completion'\]"):
        build_training_data(
            TrainConfig(dataset=str(chat), data_format="prompt-completion", seq_len=64), tokenizer
        )


# --------------------------------------------------------------------------------------------------
# LoRA
# --------------------------------------------------------------------------------------------------


def test_lora_targets_adapt_what_they_name() -> None:
    from peft import get_peft_model

    from maxscore.models.adapters import lora_config

    model = convert_model(family_model("qwen2_moe"), router="maxscore")
    peft_model = get_peft_model(model, lora_config(["attention", "experts", "mlp", "router"], 4, 8))
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    for part in (
        "q_proj.lora_A",
        "o_proj.lora_B",
        "experts.lora_A",
        "shared_experts.up_proj.lora_A",
        "router.gate.modules_to_save",
    ):
        assert any(part in name for name in trainable), part
    assert not any("embed_tokens" in n or "norm" in n for n in trainable)
    with pytest.raises(ValueError, match="unknown LoRA target"):
        lora_config(["attn"], 4, 8)


def test_lora_without_peft_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from maxscore.training.lora import check_lora_options

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"pip install 'maxscore\[lora\]'"):
        check_lora_options(TrainConfig(lora=True), None)


def test_lora_fine_tuning_saves_resumes_and_exports(tmp_path: Path) -> None:
    """The worked example of docs/bring-your-own-moe.md, tiny: a converted Qwen3-MoE fine-tuned
    with MaxScore routing and LoRA on a chat file; adapter checkpoints; resume; export merged."""
    checkpoint = save_chat_tokenizer(save_family_checkpoint("qwen3_moe", tmp_path / "qwen"))
    args = [
        "train", "--model", str(checkpoint), "--router", "maxscore",
        "--dataset", str(save_chat_data(tmp_path / "chat.jsonl")), "--seq-len", "96",
        "--batch-size", "2", "--save-steps", "2", "--eval-steps", "2", "--lora", "--lora-r", "4",
        "--output-dir", str(tmp_path / "run"), "--quiet",
    ]  # fmt: skip
    assert main([*args, "--max-steps", "2"]) == 0
    run = tmp_path / "run"
    adapter = json.loads((run / "checkpoint-2" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str((run / "base").resolve())
    assert not (run / "checkpoint-2" / "model.safetensors").exists()  # the adapter only
    assert main([*args, "--max-steps", "4", "--resume"]) == 0

    from peft import PeftModel

    from maxscore.models import LlamaMoEForCausalLM
    from maxscore.models.adapters import load_merged

    adapted = PeftModel.from_pretrained(
        LlamaMoEForCausalLM.from_pretrained(run / "base"), str(run / "checkpoint-4")
    ).eval()
    merged = load_merged(run / "checkpoint-4").eval()
    ids = torch.randint(3, 90, (1, 12))
    with torch.no_grad():
        want = adapted(ids).logits
        assert (merged(ids).logits - want).abs().max().item() <= 1e-5
    lora_b = [p for n, p in adapted.named_parameters() if "lora_B" in n]
    assert any(p.abs().max() > 0 for p in lora_b)  # the adapters were trained
    # `maxscore eval RUN` finds the adapter checkpoint and evaluates the merged model.
    from maxscore.evaluation.runner import load_model, resolve_model_path

    resolved = resolve_model_path(run)
    assert resolved.checkpoint.name == "checkpoint-4"
    evaluated, _ = load_model(resolved.checkpoint, "cpu", routing=None)
    with torch.no_grad():
        assert (evaluated(ids).logits - want).abs().max().item() <= 1e-5

    assert main(["export", str(run / "checkpoint-4"), str(tmp_path / "out")]) == 0
    torch.save({"ids": ids, "want": want}, tmp_path / "want.pt")
    code = f"""
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "out")!r}).eval()
tokenizer = AutoTokenizer.from_pretrained({str(tmp_path / "out")!r})
assert not any(m.startswith("maxscore") for m in sys.modules)
data = torch.load({str(tmp_path / "want.pt")!r})
with torch.no_grad():
    diff = (model(data["ids"]).logits - data["want"]).abs().max().item()
prompt = tokenizer.apply_chat_template([{{"role": "user", "content": "the fox"}}], add_generation_prompt=True, return_dict=True, return_tensors="pt")
out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
print(type(model).__name__, diff, out.shape[1] - prompt["input_ids"].shape[1])
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False,
        env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    name, diff, new_tokens = result.stdout.split()
    assert name == "Qwen3MoeForCausalLM" and float(diff) <= 1e-5 and int(new_tokens) == 4


def test_text_data_is_unchanged_by_the_instruction_path(tmp_path: Path, tokenizer) -> None:
    from maxscore.training.data import build_training_data

    data = build_training_data(
        TrainConfig(dataset=str(save_text(tmp_path / "t.txt")), seq_len=16), tokenizer
    )
    assert set(data.train[0]) == {"input_ids", "labels"}
    assert CHAT_TEMPLATE  # the helper's template is what the chat tests render with
