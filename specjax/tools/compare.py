"""`specjax compare`: one config on several backends / devices / attention implementations, or several methods,
side by side, with greedy outputs cross-checked for equality.

A target is `platform[:attention_impl]`, e.g. `cpu`, `cpu:lse_merge`, `gpu:pallas`, `tpu`, `neuron`. Platforms
that are not present are reported and skipped (on this project's CI only `cpu` and the Neuron policy on CPU
exist). Timing excludes compilation (every target runs the prompts once untimed first).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import jax

from specjax.tools import bench
from specjax.config import SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", required=True)
    p.add_argument("--per-category", type=int, default=None)
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("-n", "--max-new-tokens", type=int, default=64)
    p.add_argument("--targets", nargs="+", default=["cpu"], help="platform[:attention_impl], e.g. cpu cpu:lse_merge gpu tpu neuron")
    p.add_argument("--methods", nargs="+", default=["plain"], help="plain, ngram, suffix, draft_model, ... (packaged names or YAML)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default="compare-results")


def _device_context(platform: str):
    if platform == "neuron":
        return contextlib.nullcontext(), None
    try:
        devices = jax.devices(platform)
    except RuntimeError:
        return None, f"platform {platform!r} is not present on this machine"
    return jax.default_device(devices[0]), None


def run(args) -> int:
    from specjax.api import LLM

    prompts = bench.load_prompts(args.dataset, per_category=args.per_category, limit=args.limit)
    methods = [bench.method_from_name(m) for m in args.methods]
    sp = SamplingParams(max_new_tokens=args.max_new_tokens)
    rows = []
    outputs: dict[tuple[str, str], list] = {}
    for target in args.targets:
        platform, _, impl = target.partition(":")
        ctx, why = _device_context(platform)
        if ctx is None:
            print(f"{target}: skipped ({why})", file=sys.stderr)
            continue
        with ctx:
            llm = LLM(args.model, args.dtype, backend=platform, attention_impl=impl or "auto")
            for label, spec in methods:
                msgs = [[{"role": "user", "content": p.turns[0]}] for p in prompts]
                llm.generate(msgs[:1], sp, spec)  # compile
                toks, secs, ids = 0, 0.0, []
                for m in msgs:
                    t = time.perf_counter()
                    o = llm.generate([m], sp, spec)[0]
                    secs += time.perf_counter() - t
                    toks += o.metrics.new_tokens
                    ids.append(o.token_ids)
                outputs[(target, label)] = ids
                rows.append({"target": target, "method": label, "tokens_per_s": toks / secs, "new_tokens": toks,
                             "lossy": bool(spec is not None and spec.is_lossy)})
                print(f"{target:>16} {label:>20}: {toks / secs:7.1f} tok/s", file=sys.stderr)
    ref_key = next(iter(outputs), None)
    for r in rows:
        key = (r["target"], r["method"])
        r["greedy_equal_to_first"] = outputs[key] == outputs[ref_key] if ref_key else None
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compare.json"), "w") as f:
        json.dump({"environment": {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()]},
                   "prompts": len(prompts), "rows": rows, "reference": list(ref_key) if ref_key else None}, f, indent=1)
    print(f"\n| target | method | tok/s | greedy output equal to {ref_key} |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['target']} | {r['method']} | {r['tokens_per_s']:.1f} | {r['greedy_equal_to_first']} |")
    _plot(rows, os.path.join(args.out, "compare.png"))
    return 0 if all(r["greedy_equal_to_first"] for r in rows) else 1


def _plot(rows, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(max(5, len(rows) * 0.8), 3.5))
    ax.bar(range(len(rows)), [r["tokens_per_s"] for r in rows])
    ax.set_xticks(range(len(rows)), [f"{r['target']}\n{r['method']}" for r in rows], fontsize=7)
    ax.set_ylabel("tokens/s (batch 1, greedy)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
