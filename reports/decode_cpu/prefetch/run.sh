#!/bin/bash
# Evidence (reports/README.md): ran at commit a20a957, the commit that added it; today's code may not run it.
# Rerun at that commit: reports/README.md "Rerunning a script" with c=a20a957 p=reports/decode_cpu/prefetch/run.sh
# A/B of the tiles with and without the next-tile prefetch: this tree's tiles.h against the one before it (b68ba79).
# Alternates the two builds for three rounds, because this shared machine's bandwidth drifts by 10-20% in minutes.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); root=$(cd "$here/../../.." && pwd); tmp=$(mktemp -d)
inc=$(python -c "import jax; print(jax.ffi.include_dir())")
mkdir -p "$tmp/old" && git -C "$root" show b68ba79:kernels/cpu/tiles.h > "$tmp/old/tiles.h"
g++ -O3 -march=native -std=c++17 -isystem "$inc" -I"$tmp/old" "$here/tiles_bench.cc" -o "$tmp/old_bench" -lpthread
g++ -O3 -march=native -std=c++17 -isystem "$inc" -I"$root/kernels/cpu" "$here/tiles_bench.cc" -o "$tmp/new_bench" -lpthread
for round in 1 2 3; do
  for v in old new; do
    echo "$v: $(for M in 1 2 3 5 8 13; do "$tmp/${v}_bench" $M; done | awk '{printf "%s %s ms | ", $1, $2}')"
  done
done
