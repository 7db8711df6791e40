#!/usr/bin/env bash
# One device call on a single H100: the Base-preset training throughput of four routers, and, in
# parallel on two pinned CPU cores with the GPU hidden, the default `maxscore train` (to time the
# "few minutes on a 2-core CPU" main job on an otherwise idle machine). Results go to $OUT.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip list 2>/dev/null | grep -iE "^(torch|transformers|accelerate|datasets|tensorboard|safetensors|tokenizers|deepspeed) " > "$OUT/pip.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/pip.txt"
( cd /tmp && CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=2 taskset -c 0,1 /usr/bin/time -v \
    python3 -m maxscore.cli train --output-dir /tmp/default-run > "$OUT/default_run.log" 2>&1 ) &
CPU_JOB=$!
taskset -c 2-15 python3 benchmarks/train_throughput.py throughput \
    --routers "${ROUTERS:-gshard,maxscore,dropless,dense}" --steps "${STEPS:-60}" \
    --warmup "${WARMUP:-15}" --batch-size "${BATCH:-32}" --output "$OUT" 2>&1 \
    | grep -vE "Writing model shards|^\s*$" | tail -40
wait $CPU_JOB
tail -25 "$OUT/default_run.log" | tr '\r' '\n' | grep -vE "it/s\]|^\s*$" | tail -25
cp /tmp/default-run/summary.json "$OUT/default_run_summary.json" 2>/dev/null || true
