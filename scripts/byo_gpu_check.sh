#!/usr/bin/env bash
# Bring-your-own-MoE check on a GPU machine: a tiny random Qwen3-MoE made on the fly (no
# download) is fine-tuned with MaxScore routing and LoRA on a chat file (converted on load),
# resumed, exported to the Qwen3-MoE format, reloaded with plain transformers and asked to
# generate; then the attention kernels are compared on the GPU. One PASS / FAIL / SKIP line per
# check; the exit status is the number of FAILs.
#
# usage: scripts/byo_gpu_check.sh [WORKDIR]      (run from the repository root, maxscore installed)
#        BYO_DEVICE=cpu scripts/byo_gpu_check.sh  (a dry run of the same steps on the CPU)
set -u
export BYO_DEVICE="${BYO_DEVICE:-cuda}"
WORK="${1:-$(mktemp -d -t maxscore-byo-XXXX)}"
mkdir -p "$WORK"
PY="${PYTHON:-python}"
FAILS=0
LOG="$WORK/log.txt"
: >"$LOG"

report() {  # report NAME STATUS [DETAIL]
    printf '%-4s %s%s\n' "$2" "$1" "${3:+  ($3)}"
    [ "$2" = FAIL ] && FAILS=$((FAILS + 1))
    return 0
}

run_step() {  # run_step NAME COMMAND...: PASS on exit status 0, else FAIL with the log's tail
    local name="$1"
    shift
    if "$@" >>"$LOG" 2>&1; then
        report "$name" PASS
    else
        report "$name" FAIL "see $LOG: $(tail -n 1 "$LOG")"
    fi
}

echo "maxscore bring-your-own-MoE GPU check in $WORK"
if [ "$BYO_DEVICE" = cuda ]; then
    "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.cuda.get_device_name())" \
        >>"$LOG" 2>&1 && report "cuda GPU visible" PASS || report "cuda GPU visible" FAIL "no GPU"
fi

# 1. A tiny random Qwen3-MoE (4 layers, 8 experts, top-2), a BPE tokenizer with a ChatML
#    template, and a local chat file.
run_step "make tiny Qwen3-MoE, tokenizer and chat.jsonl" "$PY" - "$WORK" <<'EOF'
import json, sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3MoeConfig

work = Path(sys.argv[1])
pairs = [
    ("What does a router do?", "It sends each token to a few experts."),
    ("What is expert capacity?", "The most tokens one expert takes in a group."),
    ("What is MaxScore?", "Routing as a maximum-score flow with SoftTopk weights."),
    ("Why balance the load?", "So that no expert drops the tokens it cannot take."),
]
text = " ".join(q + " " + a for q, a in pairs) * 20
tok = Tokenizer(models.BPE(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(
    [text],
    trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"], show_progress=False),
)
fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>")
fast.chat_template = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
torch.manual_seed(0)
config = Qwen3MoeConfig(
    vocab_size=len(fast), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
    pad_token_id=fast.pad_token_id, eos_token_id=fast.eos_token_id, bos_token_id=None,
)
AutoModelForCausalLM.from_config(config).save_pretrained(work / "qwen3-moe")
fast.save_pretrained(work / "qwen3-moe")
with open(work / "chat.jsonl", "w") as f:
    for i in range(400):
        q, a = pairs[i % len(pairs)]
        f.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n")
EOF

# 2. Fine-tune: MaxScore routing on the converted model, loss on the assistant turns, LoRA.
TRAIN=(-m maxscore train --model "$WORK/qwen3-moe" --router maxscore --dataset "$WORK/chat.jsonl"
       --seq-len 128 --batch-size 16 --lr 1e-3 --save-steps 20 --eval-steps 20 --lora --lora-r 8
       --output-dir "$WORK/run" --quiet)
run_step "train MaxScore + LoRA on chat.jsonl (20 steps)" "$PY" "${TRAIN[@]}" --max-steps 20
run_step "adapter checkpoint written the standard way" test -f "$WORK/run/checkpoint-20/adapter_config.json"
run_step "resume to 40 steps" "$PY" "${TRAIN[@]}" --max-steps 40 --resume
run_step "loss fell (first vs last logged)" "$PY" - "$WORK/run/metrics.jsonl" <<'EOF'
import json, sys
losses = [r["loss"] for r in map(json.loads, open(sys.argv[1])) if "loss" in r and r.get("type") != "final"]
print("train loss", losses[0], "->", losses[-1])
assert losses[-1] < losses[0], losses
EOF

# 3. Export (the adapter merged) and reload with transformers alone; logits against the merged
#    maxscore model, then generation.
run_step "export to the Qwen3-MoE format" "$PY" -m maxscore export "$WORK/run/checkpoint-40" "$WORK/exported"
run_step "merged maxscore model's logits" "$PY" - "$WORK" <<'EOF'
import os, sys
from pathlib import Path

import torch

from maxscore.models.adapters import load_merged

work, device = Path(sys.argv[1]), os.environ["BYO_DEVICE"]
torch.backends.cuda.matmul.allow_tf32 = False
model = load_merged(work / "run" / "checkpoint-40", dtype=torch.float32).to(device).eval()
ids = torch.randint(4, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1)).to(device)
with torch.no_grad():
    torch.save({"ids": ids.cpu(), "logits": model(ids).logits.float().cpu()}, work / "merged_logits.pt")
EOF
run_step "plain transformers loads the export, same logits, generates" env -u PYTHONPATH "$PY" - "$WORK" <<'EOF'
import os, sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

work, device = Path(sys.argv[1]), os.environ["BYO_DEVICE"]
torch.backends.cuda.matmul.allow_tf32 = False
model = AutoModelForCausalLM.from_pretrained(work / "exported", dtype=torch.float32).to(device).eval()
assert type(model).__name__ == "Qwen3MoeForCausalLM", type(model).__name__
assert not any(m.startswith("maxscore") for m in sys.modules), "maxscore was imported"
want = torch.load(work / "merged_logits.pt")
with torch.no_grad():
    diff = (model(want["ids"].to(device)).logits.float().cpu() - want["logits"]).abs().max().item()
print("max |logit diff| export vs merged:", diff)
assert diff <= 1e-3, diff
tokenizer = AutoTokenizer.from_pretrained(work / "exported")
prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What does a router do?"}],
                                       add_generation_prompt=True, return_dict=True, return_tensors="pt").to(device)
out = model.generate(**prompt, max_new_tokens=16, do_sample=False)
print("generated:", repr(tokenizer.decode(out[0][prompt["input_ids"].shape[1]:])))
EOF

# 4. Attention kernels on the GPU against SDPA: eager and flex in fp32, flash-attention in bf16
#    (it has no fp32 kernel; bf16 rounding differs between kernels by a few 1e-2 in the logits).
for kernel in eager flex_attention flash_attention_2; do
    if [ "$kernel" = flash_attention_2 ] && { [ "$BYO_DEVICE" != cuda ] || ! "$PY" -c "import flash_attn" >/dev/null 2>&1; }; then
        report "attention $kernel vs sdpa" SKIP "needs a CUDA GPU and flash-attn"
        continue
    fi
    run_step "attention $kernel vs sdpa (padding, sliding layer)" "$PY" - "$kernel" <<'EOF'
import os, sys

import torch

from maxscore.models import LlamaMoEConfig, LlamaMoEForCausalLM

kernel, device = sys.argv[1], os.environ["BYO_DEVICE"]
torch.manual_seed(0)
config = LlamaMoEConfig(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, num_experts=4, router="dropless", sliding_window=16,
                        layer_types=["sliding_attention", "full_attention"])
flash = kernel.startswith("flash")
torch.backends.cuda.matmul.allow_tf32 = False
dtype, tolerance = (torch.bfloat16, 1e-1) if flash else (torch.float32, 1e-4)
model = LlamaMoEForCausalLM(config).to(device, dtype).eval()
ids = torch.randint(0, 256, (2, 64), device=device)
mask = torch.ones_like(ids)
mask[1, :5] = 0
with torch.no_grad():
    model.set_attn_implementation("sdpa")
    want = model(ids, attention_mask=mask).logits.float()
    model.set_attn_implementation(kernel)
    got = model(ids, attention_mask=mask).logits.float()
diff = (got - want)[mask.bool()].abs().max().item()
print(kernel, "max |logit diff| vs sdpa:", diff)
assert diff <= tolerance, (diff, tolerance)
EOF
done

# 5. The repository's GPU-marked tests of these features, where the checkout is here.
if [ -f tests/test_hf_conventions.py ]; then
    run_step "pytest GPU tests (attention kernels)" "$PY" -m pytest -q -m gpu tests/test_hf_conventions.py
fi

echo "$FAILS failure(s); log: $LOG"
exit "$FAILS"
