#!/usr/bin/env bash
# One device call of the paper reproduction (one H100, up to 10 minutes): train and evaluate
# the pending runs of the plan that fit in DEADLINE seconds (default 540), then copy the small
# result files to $OUT. ONLY=router:seed,... restricts the call. Run directories live under
# runs/ on the machine: a run cut by the deadline resumes from its checkpoint in the next call
# while the machine is still held; results/ travels with the working tree, so finished stages
# are skipped. lm-eval must be installed on the machine (wheels carried) and its task data
# cached: set MAXSCORE_CACHE_DIR to a carried copy of ~/.cache/maxscore (MAXSCORE_NO_DOWNLOAD=1).
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 MAXSCORE_NO_DOWNLOAD=1
nvidia-smi --query-gpu=name --format=csv,noheader
python3 benchmarks/paper_reproduction/study.py run --deadline-s "${DEADLINE:-540}" \
  ${ONLY:+--only "$ONLY"} "$@"
python3 benchmarks/paper_reproduction/study.py plan
mkdir -p "$OUT" && cp -r benchmarks/paper_reproduction/results "$OUT/"
