#!/usr/bin/env bash
# This study's device call, on a machine with 4 GPUs (about 9 minutes): GPU 0 times the solver
# (bench.py --timing), runs the GPU tests of the solver and measures the gaps (bench.py --gaps;
# then with a quarter more capacity than demand, the synthetic families);
# GPUs 1-3 train each model preset with maxscore and with its baseline router, one after the
# other on the same GPU, and time the steps after the routers have left their collapsed start
# (STEPS steps, the last STEPS - WARMUP timed); GPU 1 then times the solver on the scores of a
# real router after 200 training steps (real_scores.py). Every part stops at DEADLINE seconds
# (default 520); the results go to $OUT as flow_solver.tar.gz (unpack into
# benchmarks/flow_solver/). To compare the kernels with an earlier commit's, run
# assignment_fingerprint.py against both checkouts (its docstring).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 MAXSCORE_NO_DOWNLOAD=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1
OUT=${OUT:-/tmp/flow_out}
RES=$OUT/flow_solver
DEADLINE=${DEADLINE:-520}
STEPS=${STEPS:-300}
WARMUP=${WARMUP:-260}
mkdir -p "$RES"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$RES/status.txt"
train() {  # GPU, tag, runs
  CUDA_VISIBLE_DEVICES=$1 timeout -k 10 "$DEADLINE" python3 benchmarks/expert_parallel/bench.py run \
    --compile --steps "$STEPS" --warmup "$WARMUP" --output "$RES" --tag "$2" --runs "$3" \
    --runs-dir "/tmp/flow-runs-$1" > "$RES/$2.log" 2>&1
}
solver() {
  export CUDA_VISIBLE_DEVICES=0
  timeout -k 10 "$DEADLINE" bash -c "
    python3 benchmarks/flow_solver/bench.py --timing --reps 20 --out '$RES/timing' > '$RES/timing.log' 2>&1
    python3 -m pytest -q -m gpu tests/test_flow_global.py > '$RES/gpu_tests.txt' 2>&1
    python3 benchmarks/flow_solver/bench.py --gaps --out '$RES/gaps' > '$RES/gaps.log' 2>&1
    python3 benchmarks/flow_solver/bench.py --gaps --capacity-factor 1.25 --router-steps 0 \
      --out '$RES/gaps_spare' > '$RES/gaps_spare.log' 2>&1"
}
solver &
real_scores() {  # the solver on the scores of a real router after 200 training steps
  CUDA_VISIBLE_DEVICES=$1 timeout -k 10 "$2" python3 benchmarks/flow_solver/real_scores.py \
    --steps 200 --out "$RES/real_scores" > "$RES/real_scores.log" 2>&1
}
start=$(date +%s)
{ train 1 throughput_gpu1 "base-8x128:gshard,base-8x128:maxscore"
  real_scores 1 $((DEADLINE - $(date +%s) + start)); } &
train 2 throughput_gpu2 "base-2x64:gshard,base-2x64:maxscore,base-2x32:gshard,base-2x32:maxscore" &
train 3 throughput_gpu3 "deepseek-base:deepseek,deepseek-base:maxscore,base:gshard,base:maxscore" &
wait
tar -czf "$OUT/flow_solver.tar.gz" -C "$OUT" flow_solver
ls -la "$RES" "$RES"/* | head -40
