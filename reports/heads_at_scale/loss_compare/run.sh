#!/usr/bin/env bash
# KL / TV / hybrid, one run each from the same start: the shipped EAGLE-3 head (trained with KL on blocks 0-7),
# continued for the same steps on corpus blocks 8 and later (answers it never saw), with the features those blocks
# recorded at generation time. Then the held-out table (table.py). Usage: bash run.sh STEPS BLOCKS (e.g. 48 8:14)
set -euo pipefail
cd "$(dirname "$0")/../../.."
steps=${1:-48}
blocks=${2:-8:}
for loss in kl tv hybrid; do
  python -m specjax.train.eagle --kind eagle3 --corpus data/smollm2-135m/responses --corpus-blocks "$blocks" \
    --features recorded --init-head specjax/assets/smollm2-135m-eagle3 --out "runs/loss-$loss" --loss "$loss" \
    --steps "$steps" --batch 8 --bucket 64 --max-len 512 --lr 0.0005 --warmup 8 --unroll 5 \
    --eval-every "$steps" --eval-batches 16 --checkpoint-every 16 --seed 0
done
python reports/heads_at_scale/loss_compare/table.py runs/loss-kl runs/loss-tv runs/loss-hybrid \
  > reports/heads_at_scale/loss_compare/table.md
cat reports/heads_at_scale/loss_compare/table.md
