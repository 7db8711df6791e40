#!/usr/bin/env bash
# One device call on one H100 (sixth session): SDPA backends at the Base attention shape
# (sdpa_backends.py), then Base training (260 steps, 160-260 timed, micro-batch 128) of gshard
# with PyTorch's default backend order and of gshard and maxscore with flash attention first.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 90 python3 benchmarks/sdpa_backends.py --out "$OUT" 2>&1 | grep -E "^\||Error"
common=(--steps 260 --warmup 160 --compile --batch-size 128 --output "$OUT")
timeout 130 python3 benchmarks/train_throughput.py throughput --routers gshard "${common[@]}" \
  --tag compile_b128_h100_260steps_s6_sdpa_default 2>&1 | grep -E "^\||Error"
timeout 250 python3 benchmarks/train_throughput.py throughput --routers gshard,maxscore \
  --sdpa-backend flash "${common[@]}" --tag compile_b128_h100_260steps_s6_sdpa_flash 2>&1 \
  | grep -E "^\||Error"
