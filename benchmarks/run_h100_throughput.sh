#!/usr/bin/env bash
# One device call on one H100 (fifth session, the top table of train_throughput.md): Base training
# throughput of four routers over a few hundred steps, micro-batch 128 x 1. 260 optimizer steps
# each, the last 100 timed: by then the routers have left the collapsed state of the first steps
# (GShard drops ~66% of choices at steps 12-32, ~9% at steps 160-260), whose emptier expert
# buffers make GShard's steps cheaper than in real training. Results go to $OUT.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 470 python3 benchmarks/train_throughput.py throughput --routers gshard,maxscore,dropless,dense \
  --steps 260 --warmup 160 --compile --batch-size 128 --output "$OUT" --tag "${TAG:-compile_b128_h100_260steps}" \
  2>&1 | grep -E "^\||Error"
