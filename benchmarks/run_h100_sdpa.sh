#!/usr/bin/env bash
# One device call on one H100 (sixth session): SDPA backends at the Base attention shape
# (sdpa_backends.py), then Base training (run_h100_throughput.sh) of gshard with PyTorch's
# default backend order and of gshard and maxscore with flash attention first.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
timeout 90 python3 benchmarks/sdpa_backends.py --out "$OUT" 2>&1 | grep -E "^\||Error"
ROUTERS=gshard TAG=compile_b128_h100_260steps_s6_sdpa_default bash benchmarks/run_h100_throughput.sh
ROUTERS=gshard,maxscore TAG=compile_b128_h100_260steps_s6_sdpa_flash \
  bash benchmarks/run_h100_throughput.sh --sdpa-backend flash
