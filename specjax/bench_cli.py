"""`specjax bench`: methods x temperatures over a prompt file; table, JSON and Markdown out."""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from specjax import bench
from specjax.config import SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", required=True, help="Spec-Bench question.jsonl, a prompt JSONL or a text file")
    p.add_argument("--methods", nargs="+", default=["plain", "ngram", "suffix", "draft_model"],
                   help="'plain', packaged method names (ngram, suffix, draft_model, ...) or YAML paths")
    p.add_argument("--per-category", type=int, default=None, help="first N prompts of each category")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("-n", "--max-new-tokens", type=int, default=128)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--all-turns", action="store_true", help="run multi-turn questions as a conversation")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default="bench-results", help="output directory (JSON + Markdown + PNG)")
    p.add_argument("--peers", nargs="*", default=[],
                   help="peer engines run greedily on the same prompts: transformers, transformers-prompt-lookup, "
                        "transformers-assisted, llama.cpp, llama.cpp-prompt-lookup")
    p.add_argument("--peer-draft", default=None, help="HF draft directory for transformers-assisted")


def _jsonable(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    raise TypeError(type(x))


def _run_peers(args, prompts, results) -> None:
    from specjax.peers import PeerUnavailable, make_runner

    for name in args.peers:
        try:
            runner = make_runner(name, args.model, assistant_dir=args.peer_draft)
        except PeerUnavailable as e:
            print(f"peer {name} skipped: {e}", file=sys.stderr)
            continue
        print(f"running peer {name}", file=sys.stderr)
        results[f"peer:{name}"] = runner(prompts, args.max_new_tokens)
        base = name.split("-")[0]
        if name != base and f"peer:{base}" in results:
            same = [a["token_ids"] == b["token_ids"] for a, b in zip(results[f"peer:{base}"], results[f"peer:{name}"])]
            print(f"peer {name}: greedy output identical to its own plain greedy on {sum(same)}/{len(same)} prompts",
                  file=sys.stderr)


def run(args) -> int:
    from specjax.api import LLM

    prompts = bench.load_prompts(args.dataset, per_category=args.per_category, limit=args.limit)
    methods = [bench.method_from_name(m) for m in args.methods]
    if methods[0][0] != "plain":
        methods.insert(0, ("plain", None))
    llm = LLM(args.model, args.dtype)
    os.makedirs(args.out, exist_ok=True)
    report = {"environment": bench.environment(llm), "dataset": os.path.abspath(args.dataset),
              "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "runs": {}}
    md = [f"# specjax benchmark: {llm.model_spec}, {len(prompts)} prompts, {args.max_new_tokens} new tokens, batch 1\n",
          f"Command: `specjax bench {' '.join(sys.argv[2:])}`\n",
          "Environment: " + ", ".join(f"{k} {v}" for k, v in report["environment"].items()) + "\n"]
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    for temp in args.temperatures:
        sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=temp, seed=args.seed)
        results = {}
        for label, spec in methods:
            bar = tqdm(total=len(prompts), desc=f"T={temp} {label}", file=sys.stderr) if tqdm else None

            def tick(rec, bar=bar):
                if bar:
                    bar.update(1)
                    bar.set_postfix(tok_s=f"{rec['new_tokens'] / rec['time']:.1f}")

            results[label] = bench.run_requests(llm, prompts, spec, sp, args.all_turns, tick)
            if bar:
                bar.close()
            if temp == 0 and label != "plain":
                same = [a["token_ids"] == b["token_ids"] for a, b in zip(results["plain"], results[label])]
                print(f"{label}: greedy output identical to plain on {sum(same)}/{len(same)} prompts", file=sys.stderr)
        if temp == 0:
            _run_peers(args, prompts, results)
        summary = bench.summarize(results)
        title = f"T={temp}" + (" (greedy)" if temp == 0 else "")
        bench.print_table(summary, title)
        md.append(bench.markdown(summary, title))
        for png in bench.plot(summary, os.path.join(args.out, f"T{temp:g}"), title):
            md.append(f"![{os.path.basename(png)}]({os.path.basename(png)})\n")
        report["runs"][str(temp)] = {"summary": summary, "records": results}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(report, f, indent=1, default=_jsonable)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write("\n".join(md))
    print(f"wrote {args.out}/results.json and {args.out}/report.md", file=sys.stderr)
    return 0
