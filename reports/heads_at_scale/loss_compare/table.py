"""Held-out table of loss-comparison runs: python table.py RUN_DIR... (reads each run's metrics.jsonl)."""
import json
import os
import sys


def rows(run):
    recs = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    evals = [r for r in recs if r["kind"] == "eval"]
    train = [r for r in recs if r["kind"] == "train"]
    return evals[0], evals[-1], train


def fmt(xs):
    return " / ".join(f"{x:.3f}" for x in xs[:4])


print("| run | steps | top-1 steps 1-4 (T=0) | alpha_2-4 | chain tau T=0 | accept steps 1-4 (T=1) | chain tau T=1 |"
      " train s/step |")
print("|---|---|---|---|---|---|---|---|")
for i, run in enumerate(sys.argv[1:]):
    first, last, train = rows(run)
    if i == 0:
        print(f"| start (step 0) | 0 | {fmt(first['top1'])} | {fmt(first['alpha'][1:])} | {first['tau_chain']:.3f} | "
              f"{fmt(first.get('accept_t1', []))} | {first.get('tau_chain_t1', float('nan')):.3f} | |")
    secs = train[-1]["seconds"] / max(len(train), 1)
    print(f"| {os.path.basename(run)} | {last['step']} | {fmt(last['top1'])} | {fmt(last['alpha'][1:])} | "
          f"{last['tau_chain']:.3f} | {fmt(last.get('accept_t1', []))} | {last.get('tau_chain_t1', float('nan')):.3f} | "
          f"{secs:.1f} |")
