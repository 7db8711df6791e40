#!/usr/bin/env bash
# One device call on a single H100 or H200 (the 2026-11-26 results came from an H200): the Base-preset
# training throughput of four routers (compiled and eager; ~8 min), and, in
# parallel on two pinned CPU cores with the GPU hidden, the default `maxscore train` (to time the
# "few minutes on a 2-core CPU" main job on an otherwise idle machine). Results go to $OUT.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip list 2>/dev/null | grep -iE "^(torch|transformers|accelerate|datasets|tensorboard|safetensors|tokenizers|deepspeed) " > "$OUT/env.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/env.txt"
lscpu | grep -E "Model name|^CPU\(s\)" >> "$OUT/env.txt"
PIN_CPU=""; PIN_GPU=""
if command -v taskset > /dev/null; then PIN_CPU="taskset -c 0,1"; PIN_GPU="taskset -c 2-15"; fi
(
  cd /tmp && start=$(date +%s)
  CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=2 timeout ${CPU_LIMIT:-330} $PIN_CPU python3 -m maxscore.cli train \
      --output-dir /tmp/default-run > "$OUT/default_run.log" 2>&1
  echo "exit $? wall_s $(( $(date +%s) - start )) pinned='$PIN_CPU'" >> "$OUT/default_run.log"
) &
CPU_JOB=$!
# The tables of train_throughput.md: compiled (64 x 2 and 128 x 1) and eager (64 x 2).
for variant in "compile:--compile --batch-size 64 --grad-accum 2" \
               "compile_b128:--compile --batch-size 128 --grad-accum 1" \
               "eager:--batch-size 64 --grad-accum 2"; do
  $PIN_GPU python3 benchmarks/train_throughput.py throughput \
      --routers "${ROUTERS:-gshard,maxscore,dropless,dense}" --steps "${STEPS:-40}" \
      --warmup "${WARMUP:-12}" --tag "${variant%%:*}" ${variant#*:} --output "$OUT" 2>&1 \
      | grep -vE "Writing model shards|^\s*$" | tail -12
done
wait $CPU_JOB
tr '\r' '\n' < "$OUT/default_run.log" | grep -vE "it/s\]|^\s*$" | tail -22
cp /tmp/default-run/summary.json "$OUT/default_run_summary.json" 2>/dev/null || true
