#!/bin/bash
# Evidence (reports/README.md): ran at commit 2538579, the commit that added it; today's code may not run it.
# Rerun at that commit: reports/README.md "Rerunning a script" with c=2538579 p=reports/decode_cpu/read_ceiling/run.sh
# The read ceiling of a float32 decode step on this machine: alternates, three rounds, a plain decode step of
# SmolLM2-135M (batch 1, 256 new tokens, median of 3 timed loops; step_ms.py) with the time two threads take to
# read the same 540 MB linearly (read_probe.cc, 4 KB and 2 MB pages), because the machine's bandwidth drifts by
# 10-20% in minutes. Run from anywhere with the venv active.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); tmp=$(mktemp -d)
g++ -O2 -mavx2 -std=c++17 "$here/read_probe.cc" -o "$tmp/read_probe" -lpthread
for round in 1 2 3; do
  echo "round $round"
  "$tmp/read_probe"
  "$tmp/read_probe" huge
  python "$here/step_ms.py"
done
