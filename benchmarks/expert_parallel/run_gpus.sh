#!/usr/bin/env bash
# Expert parallelism on a machine with GPUS GPUs (default: every GPU it has; 2, 4 or 8),
# from the repository root, in one call of about 9 minutes (TOTAL_LIMIT seconds, default 530):
#   1. tests, two pytest sessions side by side (about 4 minutes):
#      * tests/test_expert_parallel_gpu.py: --expert-parallel GPUS against 1 GPU for gshard,
#        dropless and maxscore (100 steps; routing decisions recorded and compared, a perturbed
#        one-GPU control beside them), resume after SIGKILL, DeepSpeed ZeRO-2 / ZeRO-3 against
#        DDP on GPUS GPUs (skipped with a line in versions.txt when deepspeed does not import);
#      * tests/test_expert_parallel_layouts.py: dp 2 x ep GPUS/2 with FSDP2 against 1 GPU (ep 2
#        on 2 GPUs), the same run from two torchrun agents (--nnodes 2, static rendezvous) and
#        resumed by two agents (c10d rendezvous), checkpoints resharded GPUS -> GPUS/2 -> 1;
#   2. the steady-state benchmark (bench.py sweep) in the time left (about 4.5 minutes):
#      base-2x64 and base-8x128, gshard and maxscore, compiled, bf16, micro-batch 64 x 512 per
#      GPU, on 1 GPU (four runs side by side, one GPU each), on all GPUS (the two routers of a
#      preset in one process group), then on the counts between. Cut to fit: WARMUP=50 steps
#      (not 200) before 30 timed ones; a run is only started with EXPECTED_S (60) seconds left
#      per run, the others are listed as skipped (on 4 GPUs expect 1 GPU and 4 GPUs for
#      base-2x64, base-8x128 on 4 GPUs if its compilation is quick, the 2-GPU runs not).
# PHASES=tests or PHASES=bench runs one part (then the bench has the whole time:
# WARMUP=200 STEPS=240 PHASES=bench TOTAL_LIMIT=590 is the steady-state grid in a call of its
# own, still without some 2-GPU runs on 4 GPUs). PRESETS (default base-2x64,base-8x128) picks the
# benchmark's presets, e.g. one preset a call; report.py joins several calls' folders.
# Files in $OUT: versions.txt, gpu_tests.{txt,json,log} and layout_tests.{txt,json,log} (pytest
# output, measured gaps, every launch's output), expert_parallel_<GPUS>gpu[_<presets>].json (every benchmark
# row, the scaling table, skipped runs), bench.log. The tables of the README come from these
# files: python3 benchmarks/expert_parallel/report.py $OUT --write (see README.md).
# DeepSpeed is not in the device image: wheels in .whl/ (git-ignored; README.md says which) are
# installed into /tmp/site when present.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# NVLink multicast stays off on these shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
GPUS=${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")}
[ "$GPUS" -ge 2 ] && [ $((GPUS % 2)) -eq 0 ] || { echo "needs an even number of GPUs >= 2 (GPUS=$GPUS)"; exit 1; }
PHASES=${PHASES:-tests,bench}
mkdir -p "$OUT"
TOTAL=${TOTAL_LIMIT:-530}
say() { echo "[$(date -u +%H:%M:%S) +${SECONDS}s] $*"; }
# The time left for a phase: its own cap, or what the whole script has left.
limit() { local left=$((TOTAL - SECONDS)); echo $((left < $1 ? (left > 10 ? left : 10) : $1)); }

if ! python3 -c "import deepspeed" > /dev/null 2>&1 && ls .whl/*.whl > /dev/null 2>&1; then
  say "installing the carried wheels into /tmp/site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl 2>&1 | tail -3
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, accelerate; print('python', __import__('platform').python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'gpus', torch.cuda.device_count())"
  python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>/dev/null \
    || echo "deepspeed: not importable, the ZeRO-2 / ZeRO-3 tests are skipped"
  git log -1 --format='commit %h %s' 2>/dev/null
  date -u +%Y-%m-%dT%H:%MZ
} > "$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"

if [[ $PHASES == *tests* ]]; then
  say "1/2 tests on $GPUS GPUs, two sessions side by side (about 4 minutes)"
  CAP=$(limit 230)
  MAXSCORE_GPU_TEST_GPUS=$GPUS MAXSCORE_GPU_REPORT="$OUT/gpu_tests.json" \
    MAXSCORE_GPU_LOG="$OUT/gpu_tests.log" timeout -s INT -k 20 "$CAP" \
    python3 -m pytest -q -p no:cacheprovider -m gpu -rA tests/test_expert_parallel_gpu.py \
    > "$OUT/gpu_tests.txt" 2>&1 &
  MAXSCORE_LAYOUT_GPUS=$GPUS MAXSCORE_LAYOUT_REPORT="$OUT/layout_tests.json" \
    MAXSCORE_LAYOUT_LOG="$OUT/layout_tests.log" timeout -s INT -k 20 "$CAP" \
    python3 -m pytest -q -p no:cacheprovider -m gpu -rA tests/test_expert_parallel_layouts.py \
    > "$OUT/layout_tests.txt" 2>&1 &
  wait
  grep -h -E "passed|failed|PASSED|FAILED|SKIPPED|XFAIL|ERROR|Error" \
    "$OUT/gpu_tests.txt" "$OUT/layout_tests.txt" | grep -v "^E " | head -40
fi

if [[ $PHASES == *bench* ]]; then
  B=/tmp/ep-bench
  rm -rf "$B" && mkdir -p "$B"
  COUNTS=1,2
  [ "$GPUS" -ge 4 ] && COUNTS=1,2,4
  [ "$GPUS" -ge 8 ] && COUNTS=1,2,4,8
  PRESETS=${PRESETS:-base-2x64,base-8x128}
  RUNS=$(echo "$PRESETS" | tr ',' '\n' | sed 's/.*/&:gshard,&:maxscore/' | paste -sd, -)
  NAME=expert_parallel_${GPUS}gpu
  [ "$PRESETS" = base-2x64,base-8x128 ] || NAME=${NAME}_$(echo "$PRESETS" | tr ',' '_')
  DEADLINE=$(( TOTAL - SECONDS - 15 ))
  say "2/2 benchmark on 1..$GPUS GPUs (GPU counts $COUNTS), ${DEADLINE}s left"
  python3 benchmarks/expert_parallel/bench.py sweep --gpus "$GPUS" --gpu-counts "$COUNTS" \
    --runs "$RUNS" \
    --compile --steps "${STEPS:-80}" --warmup "${WARMUP:-50}" --output "$B" \
    --deadline "$DEADLINE" --expected-s "${EXPECTED_S:-60}" 2>&1 | tee "$B/sweep.log"
  python3 benchmarks/expert_parallel/bench.py summarize "$B" \
    --output "$OUT/$NAME.json"
  for f in "$B"/*.log; do echo "===== $f"; tail -c 20000 "$f"; done > "$OUT/bench.log"
fi
say "done"
