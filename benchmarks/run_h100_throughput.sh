#!/usr/bin/env bash
# One device call on one H100 (session 4, the top tables of train_throughput.md): Base training
# throughput of four routers, micro-batch 128 x 1 (gshard again at the end: drift) and 64 x 2, then
# as much of the GPU test suite as the call's time allows. Results go to $OUT.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 benchmarks/train_throughput.py throughput --routers gshard,maxscore,dropless,dense,gshard \
  --steps 32 --warmup 12 --compile --batch-size 128 --output "$OUT" --tag compile_b128_h100 2>&1 | grep -E "^\|"
timeout 150 python3 benchmarks/train_throughput.py throughput --routers gshard,maxscore,dropless,dense \
  --steps 36 --warmup 12 --compile --batch-size 64 --grad-accum 2 --output "$OUT" --tag compile_h100 2>&1 | grep -E "^\|"
timeout 235 python3 -m pytest -q -m gpu --runslow tests -p no:cacheprovider -x 2>&1 | tail -4
