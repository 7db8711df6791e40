#!/usr/bin/env bash
# On a machine with 2 GPUs, from the repository root: the same training (tiny preset, maxscore
# router, seq 512, global batch 32 sequences, 300 steps) on 1 GPU with micro-batch 32 and on
# 2 GPUs (torchrun, DDP) with micro-batch 16 each, then their loss curves compared
# (ddp_report.py). Results go to $OUT.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# NVLink multicast stays off on these shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STEPS=${STEPS:-300}
COMMON="--model ${MODEL:-tiny} --router maxscore --seq-len ${SEQ:-512} --max-steps $STEPS --logging-steps ${LOG:-10} ${EXTRA:-}
  --eval-steps 100 --save-steps 0 --no-save-final --max-eval-blocks 32 --quiet --report-to none"
cd /tmp
CUDA_VISIBLE_DEVICES=0 python3 -m maxscore.cli train $COMMON --batch-size 32 \
    --output-dir /tmp/ddp-single 2>&1 | grep -vE "Writing model shards|^\s*$" | tail -12
torchrun --nproc-per-node 2 -m maxscore.cli train $COMMON --batch-size 16 \
    --output-dir /tmp/ddp-two 2>&1 | grep -vE "Writing model shards|^\s*$" | tail -12
cd - > /dev/null
python3 benchmarks/ddp/ddp_report.py --single /tmp/ddp-single --ddp /tmp/ddp-two \
    --output "$OUT" --note "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x2, \
torch $(python3 -c 'import torch; print(torch.__version__)'), ${MODEL:-tiny} preset + maxscore \
router, seq 512, global batch 32 sequences (1 GPU x 32 vs 2 GPUs x 16, DDP via torchrun), \
$STEPS steps, bf16, same seed and data order; $(date -u +%Y-%m-%dT%H:%MZ)."
cp /tmp/ddp-single/metrics.jsonl "$OUT/ddp_single_gpu_metrics.jsonl"
cp /tmp/ddp-two/metrics.jsonl "$OUT/ddp_two_gpu_metrics.jsonl"
