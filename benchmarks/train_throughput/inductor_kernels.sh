#!/usr/bin/env bash
# On one GPU, from the repository root: what torch.compile generated for a Base training step,
# and how fast each of its kernels runs alone (inductor's own per-kernel benchmark: ms, GB moved, GB/s).
# Trains ROUTER (default gshard) for a few compiled steps with TORCHINDUCTOR_BENCHMARK_KERNEL=1,
# then runs every generated wrapper module with `-k`. Results: $OUT/inductor_kernels_<router>.txt
# and the generated code as $OUT/inductor_code_<router>.tar.gz.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
ROUTER=${1:-gshard}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_$ROUTER TORCHINDUCTOR_BENCHMARK_KERNEL=1
rm -rf "$TORCHINDUCTOR_CACHE_DIR"
timeout 300 python3 benchmarks/train_throughput/train_throughput.py throughput --routers "$ROUTER" --steps 24 \
  --warmup 16 --compile --batch-size 128 --output /tmp/bench_$ROUTER 2>&1 | grep -E "^\||Error"
report=$OUT/inductor_kernels_$ROUTER.txt
for f in $(grep -l compiled_module_main -r "$TORCHINDUCTOR_CACHE_DIR" --include='*.py'); do
  echo "=== $f ($(grep -c '^def triton_\|^triton_.* = async_compile' "$f") kernels)" >>"$report"
  timeout 120 python3 "$f" -k >>"$report" 2>&1
done
(cd "$TORCHINDUCTOR_CACHE_DIR" && find . -name "*.py" | tar czf "$OUT/inductor_code_$ROUTER.tar.gz" -T -)
