#!/usr/bin/env bash
# Paired before/after benchmark of the "One house" refactor: the code before it (a checkout of BEFORE in a
# worktree, its own venv that borrows this venv's dependencies) and after it, back to back, each with plain first
# and last. Usage: bash reports/house_refactor/run.sh BEFORE_COMMIT OUT_DIR [AFTER_COMMIT] (from the repository
# root). Without AFTER_COMMIT the "after" run is this checkout; with it, a worktree of that commit (so that the
# checkout can change while it runs).
set -euo pipefail
BEFORE=${1:-7457634}
OUT=${2:-reports/house_refactor}
ROOT=$(pwd)
DATA=$ROOT/reports/spec_bench_cpu/spec_bench_13.jsonl
if [ ! -d /tmp/wt_before ]; then git worktree add -q /tmp/wt_before "$BEFORE"; fi
if [ ! -x /tmp/vb/bin/specjax ]; then
  python3 -m venv /tmp/vb && /tmp/vb/bin/pip install -q --no-deps -e /tmp/wt_before
  "$ROOT/.venv/bin/python" -c "import site; print(site.getsitepackages()[0])" \
    > "$(/tmp/vb/bin/python -c 'import site; print(site.getsitepackages()[0])')/zz_deps.pth"
fi
AFTER=${3:-}
AFTER_BIN="$ROOT/.venv/bin/specjax"
if [ -n "$AFTER" ]; then
  if [ ! -d /tmp/wt_after ]; then git worktree add -q /tmp/wt_after "$AFTER"; fi
  if [ ! -x /tmp/va/bin/specjax ]; then
    python3 -m venv /tmp/va && /tmp/va/bin/pip install -q --no-deps -e /tmp/wt_after
    "$ROOT/.venv/bin/python" -c "import site; print(site.getsitepackages()[0])" \
      > "$(/tmp/va/bin/python -c 'import site; print(site.getsitepackages()[0])')/zz_deps.pth"
  fi
  AFTER_BIN=/tmp/va/bin/specjax
fi
ARGS="--dataset $DATA --methods plain ngram eagle3 plain --temperatures 0 --profile-prompts 0"
date -u +"before start %H:%M:%S"
(cd /tmp && /tmp/vb/bin/specjax bench $ARGS --out "$ROOT/$OUT/before") > "$OUT/before.log" 2>&1
date -u +"after start %H:%M:%S"
(cd /tmp && "$AFTER_BIN" bench $ARGS --out "$ROOT/$OUT/after") > "$OUT/after.log" 2>&1
date -u +"done %H:%M:%S"
"$ROOT/.venv/bin/python" reports/house_refactor/compare.py "$OUT/before/results.json" "$OUT/after/results.json"
