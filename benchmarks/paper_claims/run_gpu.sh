#!/usr/bin/env bash
# One device call of the paper-claims study: PER_DEVICE workers on every GPU take the next pending
# (arm, seed) until the queue is empty or DEADLINE seconds (default 480) have passed; a run
# starts only while it can finish. With TIMING=1 the flow solver's group timing is measured first
# (group_timing.py); GPU_TESTS=1 runs the deterministic-mode GPU tests and DETERMINISM=1
# benchmarks/determinism/measure.py beside the study on GPU 0; DETERMINISTIC=1 trains with
# --deterministic (one mode per results folder). The results folder (results/raw/*, study.json,
# group_timing.json) goes to $OUT as results.tar.gz: unpack it into benchmarks/paper_claims/ and
# run `claims_study.py report`. PER_DEVICE=3 on an H200 (three small runs share a card).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 MAXSCORE_NO_DOWNLOAD=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/claims_out}
STUDY=benchmarks/paper_claims
RUNS=${RUNS:-/tmp/runs/paper_claims}
mkdir -p "$OUT" "$RUNS" "$STUDY/results"
start=$(date +%s)
{
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>&1
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
} | tee -a "$OUT/status.txt"
if [ "${TIMING:-0}" = 1 ]; then
  timeout 120 python3 "$STUDY/group_timing.py" --output "$STUDY/results" 2>&1 | tail -30 | tee -a "$OUT/status.txt"
fi
# DETERMINISTIC=1 starts (or continues) a study in deterministic mode: keep one mode per
# results folder (study.json records it).
DET_FLAG=${DETERMINISTIC:+--deterministic}
if [ "${GPU_TESTS:-0}" = 1 ]; then  # the deterministic-mode GPU tests, beside the study on GPU 0
  CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_deterministic.py \
    > "$OUT/gpu_tests.txt" 2>&1 &
fi
if [ "${DETERMINISM:-0}" = 1 ]; then  # same-seed reruns and their speed, beside the study on GPU 0
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/determinism/measure.py --output "$OUT/determinism.json" \
    --workdir /tmp/runs/determinism > "$OUT/determinism.log" 2>&1 &
fi
DEVICES=${DEVICES:-$(python3 -c "import torch; n = torch.cuda.device_count(); print(','.join(f'cuda:{i}' for i in range(n)) or 'cpu')")}
left=$(( ${DEADLINE:-480} - ($(date +%s) - start) ))
echo "devices $DEVICES x ${PER_DEVICE:-2} workers, $left s for the study" | tee -a "$OUT/status.txt"
timeout -k 10 "$(( left + 90 ))" python3 "$STUDY/claims_study.py" run --devices "$DEVICES" \
  --per-device "${PER_DEVICE:-2}" --deadline-s "$left" --runs-dir "$RUNS" --results-dir "$STUDY/results" \
  $DET_FLAG ${ARMS:+--arms "$ARMS"} 2>&1 | tee -a "$OUT/status.txt"
rc=${PIPESTATUS[0]}
wait
echo "exit $rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/status.txt"
python3 "$STUDY/claims_study.py" plan --results-dir "$STUDY/results" 2>&1 | tee -a "$OUT/status.txt"
tar -czf "$OUT/results.tar.gz" -C "$STUDY" results
tail -n 40 "$RUNS"/worker-*.log > "$OUT/worker_tails.txt" 2>/dev/null
cat "$RUNS"/queue/*.failed > "$OUT/failures.txt" 2>/dev/null
ls -la "$OUT"
