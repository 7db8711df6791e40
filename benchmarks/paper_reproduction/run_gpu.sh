#!/usr/bin/env bash
# The study's ONE device call (the `one-call` profile of study_plan.py): on a machine with N GPUs
# (two H100s: about 8 minutes), one worker process per GPU takes the next pending (router, seed)
# of the queue (the claims first) and trains it, until the queue is empty or DEADLINE seconds
# (default 480) have passed; a run starts only while it can finish. Then the small result files
# go to $OUT as results.tar.gz (unpack into benchmarks/paper_reproduction/, then
# `study.py report`), logs.tar.gz (worker logs, the queue's claims and failures) and status.txt.
# PROFILE=full runs the full study instead (resumable calls; lm-eval needs its wheels and data).
# Arguments go to `study.py run`: `--retrain-for-eval` also trains again, and evaluates, the runs
# of earlier calls whose lm-eval is missing (their checkpoints stayed on those machines).
# Chained calls: every call leaves a copy of the results in $RUNS/kept-results/ (ignored by git,
# so it stays on the machine while the machine is held); a call made with RESTORE=1 on the same
# machine first takes those results back (the working tree it was copied from lacks the last
# call's), then evaluates from the checkpoints that call left, e.g. the train-routing lm-eval
# that did not fit in a 10-minute call. On a fresh machine RESTORE=1 stops with a message.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 MAXSCORE_NO_DOWNLOAD=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/study_out}
STUDY=benchmarks/paper_reproduction
RUNS=${RUNS:-runs/paper_reproduction}
RESULTS=${RESULTS:-$STUDY/results}
mkdir -p "$OUT" "$RUNS"
start=$(date +%s)
KEPT=$RUNS/kept-results/$(basename "$RESULTS")
if [ "${RESTORE:-0}" = 1 ]; then
  if [ ! -d "$KEPT" ]; then
    echo "RESTORE=1: no $KEPT here (a fresh machine, not the previous call's): nothing to do" | tee "$OUT/status.txt"
    exit 3
  fi
  cp -r "$KEPT/." "$RESULTS/" && echo "restored the previous call's results from $KEPT" | tee "$OUT/status.txt"
fi
{
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>&1
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
} | tee -a "$OUT/status.txt"
# lm-eval (full profile): the wheels and task documents lmeval_wheels.sh packs into .whl/lmeval,
# when carried here; only the packages the image lacks are installed (into /tmp/site).
if [ "${PROFILE:-one-call}" = full ] && ! python3 -c "import lm_eval" 2>/dev/null && ls .whl/lmeval/*.whl > /dev/null 2>&1; then
  missing=$(python3 - .whl/lmeval/*.whl <<'PY'
import importlib.metadata, re, sys
for path in sys.argv[1:]:
    name = re.split(r"-\d", path.rsplit("/", 1)[-1], maxsplit=1)[0]
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        print(path)
PY
)
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $missing 2>&1 | tail -3
  export PYTHONPATH=$PYTHONPATH:/tmp/site
  export MAXSCORE_CACHE_DIR=${MAXSCORE_CACHE_DIR:-/tmp/maxscore-cache}
  mkdir -p "$MAXSCORE_CACHE_DIR" && tar -xzf .whl/lmeval/eval_data.tgz -C "$MAXSCORE_CACHE_DIR"
fi
DEVICES=${DEVICES:-$(python3 -c "import torch; n = torch.cuda.device_count(); print(','.join(f'cuda:{i}' for i in range(n)) or 'cpu')")}
EVAL_FLAG=--no-eval
if [ "${PROFILE:-one-call}" = full ] && python3 -c "import importlib.metadata as m, lm_eval.evaluator, lm_eval.models.huggingface, datasets; print('lm-eval', m.version('lm_eval'), 'datasets', datasets.__version__)" >> "$OUT/status.txt" 2>/dev/null; then EVAL_FLAG=; fi
echo "devices $DEVICES, profile ${PROFILE:-one-call}, deadline ${DEADLINE:-480} s ${EVAL_FLAG}" | tee -a "$OUT/status.txt"
timeout -k 10 "$(( ${DEADLINE:-480} + 45 ))" python3 "$STUDY/study.py" --profile "${PROFILE:-one-call}" \
  run --devices "$DEVICES" --deadline-s "${DEADLINE:-480}" --runs-dir "$RUNS" --results-dir "$RESULTS" \
  $EVAL_FLAG ${ONLY:+--only "$ONLY"} "$@" 2>&1 | tee -a "$OUT/status.txt"
echo "exit ${PIPESTATUS[0]} after $(( $(date +%s) - start )) s" | tee -a "$OUT/status.txt"
python3 "$STUDY/study.py" plan --results-dir "$RESULTS" 2>&1 | tee -a "$OUT/status.txt"
rm -rf "$KEPT" && mkdir -p "$(dirname "$KEPT")" && cp -r "$RESULTS" "$KEPT"
tar -czf "$OUT/results.tar.gz" -C "$RESULTS/.." "$(basename "$RESULTS")"
tar -czf "$OUT/logs.tar.gz" -C "$RUNS" --exclude=./kept-results --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' .
ls -la "$OUT"
