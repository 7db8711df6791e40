#!/usr/bin/env bash
# Expert parallelism on a machine with GPUS GPUs (default: every GPU it has; 2 and 4 are the
# layouts the issue asks for), from the repository root, in under 7 minutes:
#   1. the GPU tests (tests/test_expert_parallel_gpu.py): expert-parallel training on GPUS GPUs
#      against 1 GPU for gshard, dropless and maxscore (100 steps), resume after a kill on
#      GPUS GPUs, DeepSpeed ZeRO-2 / ZeRO-3 on GPUS GPUs against DDP;
#   2. the benchmark (bench.py): base-2x64, compiled, tokens/s on one GPU (gshard on GPU 0 and
#      maxscore on GPU 1 at the same time) and with the experts over all GPUS GPUs (same micro-batch
#      per GPU), then the XL preset over all of them for its MFU.
# Each phase has a time limit (TOTAL_LIMIT seconds for the whole script, default 400); the
# benchmark writes its rows after every run, so a cut-off phase keeps what it measured.
# Files in $OUT (6): versions.txt, gpu_tests.txt (pytest), gpu_tests.json (measured loss gaps),
# gpu_test_runs.log (the test runs' output), bench.log, expert_parallel_<GPUS>gpu.json.
# DeepSpeed is not in the device image: wheels in .whl/ (git-ignored; README.md says which) are
# installed into /tmp/site when present, else the ZeRO tests are skipped.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# NVLink multicast stays off on these shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
GPUS=${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")}
[ "$GPUS" -ge 2 ] || { echo "needs 2 or more GPUs (GPUS=$GPUS)"; exit 1; }
mkdir -p "$OUT"
TOTAL=${TOTAL_LIMIT:-400}
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
  python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1
  git log -1 --format='commit %h %s' 2>/dev/null
  date -u +%Y-%m-%dT%H:%MZ
} > "$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"

say "1/3 GPU tests on $GPUS GPUs (about 2-3 minutes)"
MAXSCORE_GPU_TEST_GPUS=$GPUS MAXSCORE_GPU_REPORT="$OUT/gpu_tests.json" MAXSCORE_GPU_LOG="$OUT/gpu_test_runs.log" \
  timeout -s INT -k 20 "$(limit 200)" python3 -m pytest -q -p no:cacheprovider -m gpu -rA \
  tests/test_expert_parallel_gpu.py 2>&1 | tee "$OUT/gpu_tests.txt" | grep --line-buffered -E \
  "passed|failed|PASSED|FAILED|SKIPPED|ERROR|Error|assert"

B=/tmp/ep-bench
rm -rf "$B" && mkdir -p "$B"
COMMON=(--compile --steps "${STEPS:-30}" --warmup "${WARMUP:-15}" --output "$B")
say "2/3 benchmark, one GPU each: base-2x64 gshard on GPU 0, maxscore on GPU 1"
ONE=$(limit 110)
for pair in 0:gshard 1:maxscore; do
  CUDA_VISIBLE_DEVICES=${pair%%:*} timeout -k 10 "$ONE" python3 benchmarks/expert_parallel/bench.py \
    run --runs "base-2x64:${pair#*:}" --tag "one_gpu_${pair#*:}" "${COMMON[@]}" \
    > "$B/one_gpu_${pair#*:}.log" 2>&1 &
done
wait
grep -h -E "^\[" "$B"/one_gpu_*.log

say "3/3 benchmark, $GPUS GPUs, experts over all: base-2x64 gshard, maxscore; xl maxscore"
timeout -k 10 "$(limit 400)" torchrun --nproc-per-node "$GPUS" --master-port 29517 \
  benchmarks/expert_parallel/bench.py run --expert-parallel "$GPUS" --tag "ep$GPUS" "${COMMON[@]}" \
  --runs base-2x64:gshard,base-2x64:maxscore,xl:maxscore 2>&1 | tee "$B/ep$GPUS.log" \
  | grep --line-buffered -E "^\[|Error|error"

python3 benchmarks/expert_parallel/bench.py summarize "$B" --output "$OUT/expert_parallel_${GPUS}gpu.json"
for f in "$B"/*.log; do echo "===== $f"; tail -c 20000 "$f"; done > "$OUT/bench.log"
say "done"
