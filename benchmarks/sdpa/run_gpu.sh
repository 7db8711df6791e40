#!/usr/bin/env bash
# On one GPU, from the repository root: SDPA backends at the Base attention shape
# (sdpa_backends.py), then Base training (../train_throughput/run_gpu.sh) of gshard with
# PyTorch's default backend order and of gshard and maxscore with flash attention first.
# Results go to $OUT.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 90 python3 benchmarks/sdpa/sdpa_backends.py --out "$OUT" 2>&1 | grep -E "^\||Error"
ROUTERS=gshard TAG=train_base_default_order bash benchmarks/train_throughput/run_gpu.sh
ROUTERS=gshard,maxscore TAG=train_base_flash_first \
  bash benchmarks/train_throughput/run_gpu.sh --sdpa-backend flash
