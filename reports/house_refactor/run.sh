#!/usr/bin/env bash
# Paired before/after benchmark of the "One house" refactor: the code before it (a checkout of BEFORE in a
# worktree, its own venv that borrows this venv's dependencies) and after it, back to back, each with plain first
# and last. Usage: bash reports/house_refactor/run.sh BEFORE_COMMIT OUT_DIR (from the repository root).
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
ARGS="--dataset $DATA --methods plain ngram eagle3 plain --temperatures 0 --profile-prompts 0"
date -u +"before start %H:%M:%S"
(cd /tmp && /tmp/vb/bin/specjax bench $ARGS --out "$ROOT/$OUT/before") > "$OUT/before.log" 2>&1
date -u +"after start %H:%M:%S"
"$ROOT/.venv/bin/specjax" bench $ARGS --out "$ROOT/$OUT/after" > "$OUT/after.log" 2>&1
date -u +"done %H:%M:%S"
"$ROOT/.venv/bin/python" reports/house_refactor/compare.py "$OUT/before/results.json" "$OUT/after/results.json"
