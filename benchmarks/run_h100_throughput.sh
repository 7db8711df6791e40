#!/usr/bin/env bash
# One device call on one H100 (the top tables of train_throughput.md): Base training throughput
# of ROUTERS (default the four of the issue) over a few hundred steps, micro-batch 128 x 1. 260
# optimizer steps each, the last 100 timed: by then the routers have left the collapsed state of
# the first steps (GShard drops ~66% of choices at steps 12-32, ~9% at steps 160-260), whose
# emptier expert buffers make GShard's steps cheaper than in real training. Extra arguments go
# to train_throughput.py (e.g. --sdpa-backend flash); results go to $OUT, tagged TAG.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 470 python3 benchmarks/train_throughput.py throughput \
  --routers "${ROUTERS:-gshard,maxscore,dropless,dense}" --steps 260 --warmup 160 --compile \
  --batch-size 128 --output "$OUT" --tag "${TAG:-compile_b128_h100_260steps}" "$@" \
  2>&1 | grep -E "^\||Error"
