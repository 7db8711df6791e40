#!/usr/bin/env bash
# One device call on one H100 (sixth session, train_throughput.md top section): the GPU tests of
# the changed code (compiled == eager, clipping inside fused AdamW, dispatch kernels), then
# run_h100_throughput.sh for ROUTERS (default gshard,maxscore). Results go to $OUT.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
timeout 170 python3 -m pytest -q -p no:cacheprovider -rf --tb=short -m gpu tests/test_model.py \
  tests/test_training.py tests/test_moe_layer.py >"$OUT/gpu_tests.txt" 2>&1
timeout 60 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/test_moe_layer.py \
  -k "sum_slot or key_positions or autocast_dtype" >>"$OUT/gpu_tests.txt" 2>&1
grep -E "passed|failed|^FAILED" "$OUT/gpu_tests.txt"
ROUTERS=${ROUTERS:-gshard,maxscore} TAG=${TAG:-compile_b128_h100_260steps_s6} \
  bash benchmarks/run_h100_throughput.sh
