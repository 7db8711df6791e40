#!/usr/bin/env bash
# Packs what the study's lm-eval stage needs on a device machine that cannot reach a registry:
# lm-eval 0.4.13 and the packages it imports that the device image lacks, as CPython 3.12
# manylinux wheels, and the bundled tasks' documents (the cache that `maxscore eval` fills), into
# .whl/lmeval/ (git-ignored; about 25 MB). Run it once from the repository root on a machine
# with registry access and maxscore's `eval` extra installed; then carry `.whl/lmeval` in the
# device call: run_gpu.sh installs the wheels of the packages the machine does not have into
# /tmp/site and unpacks the documents into $MAXSCORE_CACHE_DIR.
# The image must already hold torch, transformers, accelerate, numpy, pandas and pyarrow (pyarrow
# alone would be ~40 MB): run_gpu.sh says so in status.txt when one is missing.
set -euo pipefail
DEST=.whl/lmeval
mkdir -p "$DEST"
PY="--python-version 3.12 --implementation cp --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any"
# lm-eval and what it imports (sacrebleu, datasets and evaluate included), pure or small, at the
# versions installed here (the ones the tests ran with).
NAMES="lm_eval datasets evaluate dill multiprocess xxhash fsspec sacrebleu portalocker colorama
  tabulate lxml regex nltk absl-py six click joblib defusedxml pytablewriter typepy mbstrdecoder chardet
  tcolorpy tabledata dataproperty pathvalidate more-itertools sortedcontainers"
# shellcheck disable=SC2086
WHEELS=$(python3 -c "import importlib.metadata as m, sys; print(' '.join(f'{n}=={m.version(n)}' for n in sys.argv[1:]))" $NAMES)
rm -f "$DEST"/*.whl
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps $PY -d "$DEST" $WHEELS
# Published as source only (pure Python): built here.
python3 -m pip wheel -q --no-deps -w "$DEST" word2number==1.1 sqlitedict==2.1.0 rouge-score==0.1.2
# The documents of the eight bundled tasks (fetched and converted on first use).
python3 -c "from maxscore.evaluation.data import ensure_task_data; ensure_task_data()"
CACHE=$(python3 -c "from maxscore.evaluation.data import cache_dir; print(cache_dir())")
tar -czf "$DEST/eval_data.tgz" -C "$CACHE" eval_data
du -sh "$DEST"
