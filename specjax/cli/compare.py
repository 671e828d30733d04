"""`specjax compare`: one config on several backends / devices / attention implementations, or several methods,
side by side, with greedy outputs cross-checked for equality (the runs are `specjax.tools.compare`).

Writes compare.json and compare.png to --out, prints a Markdown table, and exits 1 when any greedy output differs
from the first target's.
"""
from __future__ import annotations

import argparse
import json
import os

import jax

from specjax.config import SamplingParams
from specjax.tools import bench, compare, report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", required=True)
    p.add_argument("--per-category", type=int, default=None)
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("-n", "--max-new-tokens", type=int, default=64)
    p.add_argument("--targets", nargs="+", default=["cpu"],
                   help="platform[:attention_impl], e.g. cpu cpu:lse_merge gpu tpu neuron")
    p.add_argument("--methods", nargs="+", default=["plain"],
                   help="plain, ngram, suffix, draft_model, ... (packaged names or YAML)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default="compare-results")


def run(args) -> int:
    prompts = bench.load_prompts(args.dataset, per_category=args.per_category, limit=args.limit)
    methods = [bench.method_from_name(m) for m in args.methods]
    sp = SamplingParams(max_new_tokens=args.max_new_tokens)
    rows, ref_key = compare.run_targets(args.model, args.dtype, prompts, args.targets, methods, sp)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compare.json"), "w") as f:
        json.dump({"environment": {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()]},
                   "prompts": len(prompts), "rows": rows, "reference": list(ref_key) if ref_key else None}, f, indent=1)
    print(f"\n| target | method | tok/s | greedy output equal to {ref_key} |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['target']} | {r['method']} | {r['tokens_per_s']:.1f} | {r['greedy_equal_to_first']} |")
    report.plot_compare(rows, os.path.join(args.out, "compare.png"))
    return 0 if all(r["greedy_equal_to_first"] for r in rows) else 1
