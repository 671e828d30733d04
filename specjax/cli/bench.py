"""`specjax bench`: methods x temperatures over a prompt file; table, JSON and Markdown out.

Batch 1 always runs (per-prompt records, the latency figures and the greedy reference); `--batch-sizes` adds
throughput runs at larger batches and `--profile-prompts` a draft-vs-verify timing pass per speculative method.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from specjax.cli.common import add_model_flags, make_llm, model_config
from specjax.config import SamplingParams
from specjax.tools import bench, report


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
    add_model_flags(p, backend=True)
    p.add_argument("--out", default="bench-results", help="output directory (JSON + Markdown + PNG)")
    p.add_argument("--peers", nargs="*", default=[],
                   help="peer engines run greedily on the same prompts: transformers, transformers-prompt-lookup, "
                        "transformers-assisted, llama.cpp, llama.cpp-prompt-lookup")
    p.add_argument("--peer-draft", default=None, help="HF draft directory for transformers-assisted")
    p.add_argument("--batch-sizes", type=_positive_int, nargs="+", default=[1],
                   help="batch sizes; each size > 1 adds a throughput run (tokens/s against batch size)")
    p.add_argument("--reps", type=_positive_int, default=1,
                   help="timed runs of every generation (per prompt at batch 1, per call at larger batch sizes); "
                        "the fastest is kept, the least disturbed by anything else running on the machine")
    p.add_argument("--profile-prompts", type=_non_negative_int, default=4,
                   help="prompts of the draft-vs-verify timing pass per speculative method (0 disables)")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be >= 1")
    return v


def _non_negative_int(text: str) -> int:
    if text.strip() == "0":
        return 0
    return _positive_int(text)


def _jsonable(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    raise TypeError(type(x))


def _run_peers(args, prompts, results, checkpoint=None) -> None:
    """Run each requested peer in its own process (`specjax.tools.peers.run_isolated`): a peer that is missing or dies
    is reported and skipped, and the methods measured so far are kept."""
    from specjax.tools.peers import PeerFailed, PeerUnavailable, run_isolated

    for name in args.peers:
        print(f"running peer {name}", file=sys.stderr)
        try:
            results[f"peer:{name}"] = run_isolated(name, args.model, prompts, args.max_new_tokens,
                                                   assistant_dir=args.peer_draft)
        except (PeerUnavailable, PeerFailed) as e:
            print(f"peer {name} skipped: {e}", file=sys.stderr)
            continue
        if checkpoint:
            checkpoint()
        base = name.split("-")[0]
        if name != base and f"peer:{base}" in results:
            same = [a["token_ids"] == b["token_ids"] for a, b in zip(results[f"peer:{base}"], results[f"peer:{name}"])]
            print(f"peer {name}: greedy output identical to its own plain greedy on {sum(same)}/{len(same)} prompts",
                  file=sys.stderr)


def _methods(names: list[str]) -> list[tuple[str, object, str]]:
    """(label, SpeculativeConfig or None, name as given), plain first; labels made unique.

    The first plain runs first: it is the baseline of every speedup and greedy check. A later plain in `names`
    keeps its place and runs again (label plain#2, ...): its "speedup" is how far this machine drifted between the
    two plain runs, the noise level of the methods measured in between."""
    methods = [(*bench.method_from_name(n), n) for n in names]
    first = next((m for m in methods if m[0] == "plain"), ("plain", None, "plain"))
    rest = list(methods)
    if first in rest:
        rest.remove(first)
    methods = [first] + rest
    seen: dict[str, int] = {}
    out = []
    for label, spec, name in methods:
        seen[label] = seen.get(label, 0) + 1
        out.append((label if seen[label] == 1 else f"{label}#{seen[label]}", spec, name))
    return out


def _release(llm) -> None:
    """Drop the compiled programs and drafters of the method just measured. Every (method, bucket) compiles its
    own 30-layer loop; kept all together they exhausted the 24 GB of the CI-sized machine mid-run."""
    import jax

    llm.runtime.clear()
    jax.clear_caches()


def _batch1(args, llm, prompts, methods, sp, tqdm, results: dict, checkpoint=None) -> dict:
    """Fill `results` with {label: per-prompt records} at batch 1, with the greedy-equality check against plain;
    `checkpoint()` runs after each method."""
    for label, spec, _ in methods:
        bar = tqdm(total=len(prompts), desc=f"T={sp.temperature} {label}", file=sys.stderr) if tqdm else None

        def tick(rec, bar=bar):
            if bar:
                bar.update(1)
                bar.set_postfix(tok_s=f"{rec['new_tokens'] / rec['time']:.1f}")

        results[label] = bench.run_requests(llm, prompts, spec, sp, args.all_turns, tick, reps=args.reps)
        _release(llm)
        if bar:
            bar.close()
        if sp.temperature == 0 and label != "plain":
            same = [a["token_ids"] == b["token_ids"] for a, b in zip(results["plain"], results[label])]
            for r, ok in zip(results[label], same):
                r["identical_to_plain"] = ok
            print(f"{label}: greedy output identical to plain on {sum(same)}/{len(same)} prompts", file=sys.stderr)
        if checkpoint:
            checkpoint()
    return results


def _throughput(args, llm, prompts, methods, sp, results) -> dict:
    """{label: {batch: figures}}; batch 1 comes from the per-prompt run (all turns with --all-turns, where the
    batched runs take first turns only)."""
    table: dict[str, dict] = {}
    for label, spec, _ in methods:
        table[label] = {"1": bench.batch1_figures(results[label])}
        for b in sorted(set(args.batch_sizes) - {1}):
            fig, token_ids = bench.run_throughput(llm, prompts, spec, sp, b, reps=args.reps)
            _release(llm)
            if sp.temperature == 0:
                fig["greedy_equal_to_batch1"] = bench.greedy_equal(results[label], token_ids)
                fig["greedy_equal_to_plain_batch1"] = bench.greedy_equal(results["plain"], token_ids)
                if not fig["greedy_equal_to_batch1"]:
                    print(f"WARNING: {label}: greedy output at batch {b} differs from batch 1", file=sys.stderr)
            print(f"T={sp.temperature} {label} batch {b}: {fig['tokens_per_s']:.1f} tok/s", file=sys.stderr)
            table[label][str(b)] = fig
    return table


def _profile(args, llm, prompts, methods, sp) -> dict:
    """{label: draft/verify figures} for each speculative method over the first --profile-prompts prompts."""
    out = {}
    if llm.backend == "neuron" and args.profile_prompts > 0:
        # runners.speculative's host-stepped loop runs the default program, not the Neuron one being benchmarked
        print("draft/verify profile skipped: it does not run the Neuron program", file=sys.stderr)
        return out
    for label, spec, _ in methods:
        if spec is not None and args.profile_prompts > 0:
            out[label] = bench.run_profile(llm, prompts[:args.profile_prompts], spec, sp)
    return out


def run(args) -> int:
    cfg = model_config(args)
    args.model = cfg.model.model  # the peers run the same model
    prompts = bench.load_prompts(args.dataset, per_category=args.per_category, limit=args.limit)
    methods = _methods(args.methods)
    llm = make_llm(cfg)
    os.makedirs(args.out, exist_ok=True)
    doc = {"environment": bench.environment(llm), "dataset": os.path.abspath(args.dataset),
              "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "batch_sizes": args.batch_sizes,
              "reps": args.reps, "methods": {label: bench.method_info(name, spec) for label, spec, name in methods},
              "runs": {}, "throughput": {}, "profile": {}}
    md = [f"# specjax benchmark: {llm.model_spec}, {len(prompts)} prompts, {args.max_new_tokens} new tokens, "
          f"batch sizes {' '.join(map(str, args.batch_sizes))}"
          + (f", fastest of {args.reps} runs of every generation" if args.reps > 1 else "") + "\n",
          f"Command: `specjax bench {' '.join(sys.argv[2:])}`\n",
          "Environment: " + ", ".join(f"{k} {v}" for k, v in doc["environment"].items()) + "\n"]
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    partial = os.path.join(args.out, "results.partial.json")

    def checkpoint() -> None:
        # Everything measured so far, rewritten after each method: a run that dies later keeps it.
        tmp = partial + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, default=_jsonable)
        os.replace(tmp, partial)

    for temp in args.temperatures:
        sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=temp, seed=args.seed)
        results: dict = {}
        doc["runs"][str(temp)] = {"records": results}
        _batch1(args, llm, prompts, methods, sp, tqdm, results, checkpoint)
        if temp == 0:
            _run_peers(args, prompts, results, checkpoint)
        summary = bench.summarize(results)
        title = f"T={temp}" + (" (greedy)" if temp == 0 else "")
        report.print_table(summary, title)
        md.append(report.markdown(summary, title))
        for png in report.plot(summary, os.path.join(args.out, f"T{temp:g}"), title):
            md.append(f"![{os.path.basename(png)}]({os.path.basename(png)})\n")
        doc["runs"][str(temp)] = {"summary": summary, "records": results}
        checkpoint()
        if any(b > 1 for b in args.batch_sizes):
            table = _throughput(args, llm, prompts, methods, sp, results)
            doc["throughput"][str(temp)] = table
            md.append(report.throughput_markdown(table, title))
            if args.all_turns:
                md.append("With --all-turns, batch 1 covers every turn; larger batches run first turns only.\n")
            print(report.throughput_markdown(table, title), file=sys.stderr)
            for png in report.plot_throughput(table, os.path.join(args.out, f"T{temp:g}_throughput.png"), title):
                md.append(f"![{os.path.basename(png)}]({os.path.basename(png)})\n")
        profile = _profile(args, llm, prompts, methods, sp)
        if profile:
            doc["profile"][str(temp)] = profile
            md.append(report.profile_markdown(profile, title))
            print(report.profile_markdown(profile, title), file=sys.stderr)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(doc, f, indent=1, default=_jsonable)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write("\n".join(md))
    if os.path.exists(partial):
        os.remove(partial)
    print(f"wrote {args.out}/results.json and {args.out}/report.md", file=sys.stderr)
    return 0
