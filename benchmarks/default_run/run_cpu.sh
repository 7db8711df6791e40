#!/usr/bin/env bash
# The default job, `maxscore train` with no arguments (tiny preset + maxscore router on the
# embedded corpus), on two CPU cores with any GPU hidden, timed from the command to the summary.
# From the repository root; results go to $OUT: default_run.log (the console output and the
# wall time) and default_run_summary.json (the run's summary.json).
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PIN=""
if command -v taskset > /dev/null; then PIN="taskset -c ${CORES:-0,1}"; fi
lscpu | grep -E "Model name|^CPU\(s\)" > "$OUT/default_run.log"
RUN=$(mktemp -d)/default-run
start=$(date +%s.%N)
(cd /tmp && CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=2 timeout "${LIMIT:-600}" $PIN python3 -m maxscore.cli \
  train --output-dir "$RUN" >> "$OUT/default_run.log" 2>&1)
rc=$?
wall=$(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$start" "$(date +%s.%N)")
echo "exit $rc wall_s $wall pinned='$PIN'" >> "$OUT/default_run.log"
tr '\r' '\n' < "$OUT/default_run.log" | grep -vE "it/s\]|^\s*$" | tail -22
cp "$RUN/summary.json" "$OUT/default_run_summary.json" 2>/dev/null || true
