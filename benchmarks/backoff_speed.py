"""Backed-off speed: every speculative method forced into back-off for a whole generation, against plain decoding.

    python benchmarks/backoff_speed.py [--model smollm2-135m] [--quantization gguf] [--methods ngram suffix ...]
                                       [--draft PATH] [--prompts 6] [--new-tokens 96] [--batch 1] [--rounds 2]

A speculative loop whose back-off has turned speculation off must decode at plain speed: the issue's target is
within 3%. Each method runs with a break-even no drafter reaches and every row starting backed off (gain 0,
probes never due), so every step is the back-off's plain step, through the method's own loop (the fused device
loop, or the host loop of suffix decoding); greedy, Spec-Bench prompts (first turns, round-robin over
categories). Plain decoding runs first and last (and between rounds); each setting keeps its fastest round.
Prints tokens/s (decode only, prefill excluded) and the ratio to the mean of the plain runs, and checks that
no method verified a step and that every output equals plain greedy.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

DEFAULT_METHODS = ("ngram", "suffix", "draft_model", "draft_model_lookup", "medusa", "eagle", "eagle3")
SPEC_BENCH = "/work/shared/data/spec_bench/question.jsonl"


def method_config(name: str, draft: str | None):
    from specjax.config import SpeculativeConfig, load_run_config

    if name == "draft_model":
        return SpeculativeConfig(method="draft_model", model=draft or "assets/smollm2-135m-draft")
    if name == "draft_model_lookup":
        return SpeculativeConfig(method="draft_model", model=draft or "assets/smollm2-135m-draft", lookup_tokens=6)
    return load_run_config(f"methods/{name}").speculative


def load_prompts(n: int) -> list[str]:
    by_cat: dict[str, list[str]] = {}
    with open(SPEC_BENCH) as f:
        for line in f:
            q = json.loads(line)
            by_cat.setdefault(q["category"], []).append(q["turns"][0])
    out, rank = [], 0
    while len(out) < n:
        for qs in by_cat.values():
            if rank < len(qs) and len(out) < n:
                out.append(qs[rank])
        rank += 1
    return out


def backed_off_variant(llm, spec, batch: int):
    """The SpecVariant of `spec` with speculation off from the first step to the last: break-even 1e9 (so no
    verify pays), gains seeded 0 (every row starts backed off) and probes never due."""
    from specjax.backoff import Adaptive
    from specjax.runners.speculative import SpecVariant, drafter_for

    drafter, dparams = drafter_for(llm, spec)
    rule = Adaptive(min_gain=1e9, probe_every=2 ** 24, max_gap_factor=1, carry_prior=True)
    key = (spec, batch)
    llm.runtime.break_even[key] = 1e9
    llm.runtime.gain_priors[key] = 0.0
    return SpecVariant(llm, drafter, dparams, adaptive=rule, spec=spec)


def run(llm, prompts, sp, batch: int, variant=None):
    """(decode tokens/s over all prompts, outputs) at `batch` prompts per call."""
    from specjax.runners.base import generate

    outs = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        ids = [llm.encode_prompt(p, True) for p in chunk]
        if variant is None:
            outs += llm.generate(chunk, sp, None, chat=True)
        else:
            llm.runtime.gain_priors[(variant.spec, batch)] = 0.0
            outs += generate(llm, chunk, ids, [sp] * len(chunk), variant)
    seconds = sum(max(o.metrics.total_time - o.metrics.time_to_first_token for o in outs[i:i + batch])
                  for i in range(0, len(outs), batch))
    tokens = sum(o.metrics.new_tokens - 1 for o in outs)
    return tokens / seconds, outs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--draft", default=None, help="draft model for draft_model (default: the shipped SmolLM2 draft)")
    ap.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS))
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from specjax.api import LLM
    from specjax.config import SamplingParams

    llm = LLM(a.model, dtype=a.dtype, quantization=a.quantization)
    sp = SamplingParams(temperature=0.0, max_new_tokens=a.new_tokens, ignore_eos=True)
    prompts = load_prompts(a.prompts)
    variants = {}
    for m in a.methods:
        try:
            variants[m] = backed_off_variant(llm, method_config(m, a.draft), a.batch)
        except Exception as e:  # a method this model has no drafter for (heads are shipped for SmolLM2 only)
            print(f"{m}: skipped ({type(e).__name__}: {e})", file=sys.stderr)
    # Warm-up: every program compiled before anything is timed.
    _, ref = run(llm, prompts, sp, a.batch)
    for v in variants.values():
        run(llm, prompts, sp, a.batch, v)
    best = {"plain": 0.0} | {m: 0.0 for m in variants}
    plain_runs = []
    failures = []
    for r in range(a.rounds):
        tps, _ = run(llm, prompts, sp, a.batch)
        plain_runs.append(tps)
        for m, v in variants.items():
            tps, outs = run(llm, prompts, sp, a.batch, v)
            best[m] = max(best[m], tps)
            verified = sum(o.metrics.verify_steps or 0 for o in outs)
            if verified:
                failures.append(f"{m}: {verified} verify steps (back-off was not total)")
            if [o.token_ids for o in outs] != [o.token_ids for o in ref]:
                failures.append(f"{m}: output differs from plain greedy")
    tps, _ = run(llm, prompts, sp, a.batch)
    plain_runs.append(tps)
    plain = sum(plain_runs) / len(plain_runs)
    print(f"{a.model} ({a.quantization or a.dtype}), batch {a.batch}, {len(prompts)} prompts x {a.new_tokens} "
          f"tokens, greedy; plain runs (first .. last): {', '.join(f'{t:.1f}' for t in plain_runs)} tok/s")
    print(f"{'method':<20} {'tok/s':>8} {'x plain':>8}")
    result = {"plain_runs": plain_runs, "methods": {}}
    for m in variants:
        print(f"{m:<20} {best[m]:>8.1f} {best[m] / plain:>8.3f}")
        result["methods"][m] = {"tokens_per_s": best[m], "ratio": best[m] / plain}
    for f in failures:
        print("FAIL:", f)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result | {"args": vars(a), "failures": failures}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
