#!/usr/bin/env bash
# Base training throughput on one GPU, from the repository root: ROUTERS (default gshard,
# maxscore, dropless, dense) trained one after the other, micro-batch 128 x 1, 260 optimizer
# steps each, the last 100 timed. By step 160 the routers have left the collapsed state of the
# first steps (GShard drops ~66% of its choices at steps 12-32, ~9% at steps 160-260), whose
# emptier expert buffers make GShard's steps cheaper than in real training. Extra arguments go
# to train_throughput.py (e.g. --sdpa-backend flash); results go to $OUT, tagged TAG.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout "${LIMIT:-590}" python3 benchmarks/train_throughput/train_throughput.py throughput \
  --routers "${ROUTERS:-gshard,maxscore,dropless,dense}" --steps 260 --warmup 160 --compile \
  --batch-size 128 --output "$OUT" --tag "${TAG:-compile_b128}" "$@" \
  2>&1 | grep -E "^\||Error"
