"""What each cheap-draft variant buys: draft cost per drafted token in target-step units, and acceptance.

    python benchmarks/draft_cost.py [--model smollm2-135m] [--quantization gguf] [--draft assets/smollm2-135m-draft]
        [--variants float32 bfloat16 gguf int8 int4 vocab:8192 vocab:4096 pmin:0.5] [--gamma 4] [--prompts 4]
        [--new-tokens 64]

Variants of the draft model (`speculative_config` fields; the target stays as loaded): `float32` / `bfloat16`
(dtype), `gguf` (a GGUF draft's blocks as stored, native CPU kernels), `int8` / `int4` (requantized, LM head
included), `vocab:N` (LM head trimmed to the N most frequent target tokens), `pmin:P` (adaptive chain length);
joined with '+' they combine (`int4+vocab:8192`). For each: one propose of gamma tokens timed alone after a
prefill (fastest of 5), divided by gamma and by the target's plain decode step (timed in the generation loop,
greedy, the same prompts), and the acceptance over the prompts at batch 1 (greedy, back-off off): accepted /
drafted (alpha) and tokens per verify step (tau). A variant the draft cannot take (gguf on a safetensors draft)
is reported as skipped. Quiet machine for figures; `--new-tokens 8 --prompts 1` is a smoke run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

SPEC_BENCH = "/work/shared/data/spec_bench/question.jsonl"


def variant_config(base, name: str):
    kw = {}
    for part in name.split("+"):
        kind, _, arg = part.partition(":")
        if kind in ("float32", "bfloat16"):
            kw["dtype"] = kind
        elif kind in ("gguf", "int8", "int4"):
            kw["quantization"] = kind
        elif kind == "vocab":
            kw["draft_vocab_size"] = int(arg)
        elif kind == "pmin":
            kw["p_min"] = float(arg)
        else:
            raise SystemExit(f"unknown variant part {part!r}: float32, bfloat16, gguf, int8, int4, vocab:N, pmin:P")
    return dataclasses.replace(base, **kw)


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


def plain_step_seconds(llm, prompts, sp) -> float:
    llm.generate(prompts[:1], sp, None, chat=True)  # compiles
    best = float("inf")
    for _ in range(2):
        outs = llm.generate(prompts, sp, None, chat=True)
        t = sum(o.metrics.total_time - o.metrics.time_to_first_token for o in outs)
        best = min(best, t / max(1, sum(o.metrics.new_tokens - 1 for o in outs)))
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--draft", default="assets/smollm2-135m-draft")
    ap.add_argument("--variants", nargs="+", default=["float32", "bfloat16", "gguf", "int8", "int4", "vocab:8192",
                                                      "vocab:4096", "int4+vocab:8192", "pmin:0.5"])
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from specjax.api import LLM
    from specjax.config import SamplingParams, SpeculativeConfig
    from specjax.errors import SpecjaxError
    from specjax.tools.tune import measure_acceptance, measure_draft_cost

    llm = LLM(a.model, dtype=a.dtype, quantization=a.quantization)
    sp = SamplingParams(temperature=0.0, max_new_tokens=a.new_tokens, ignore_eos=True)
    prompts = load_prompts(a.prompts)
    plain_s = plain_step_seconds(llm, prompts, sp)
    base = SpeculativeConfig(method="draft_model", model=a.draft, num_speculative_tokens=a.gamma, adaptive=False)
    first = llm.encode_prompt(prompts[0], True)
    print(f"target {a.model} ({a.quantization or a.dtype}): plain step {1000 * plain_s:.2f} ms; draft {a.draft}, "
          f"gamma {a.gamma}, {len(prompts)} prompts x {a.new_tokens} tokens, greedy")
    print(f"{'variant':<22} {'propose ms':>10} {'per token':>10} {'x target':>9} {'alpha':>6} {'tau':>5}")
    rows = {}
    for name in a.variants:
        spec = variant_config(base, name)
        try:
            propose = measure_draft_cost(llm, spec, first)
            acc = measure_acceptance(llm, spec, prompts, sp, a.gamma)
        except SpecjaxError as e:
            print(f"{name:<22} skipped: {e}")
            rows[name] = {"skipped": str(e)}
            continue
        per = propose / a.gamma
        rows[name] = {"propose_s": propose, "per_token_s": per, "target_steps": per / plain_s, "alpha": acc.alpha,
                      "tau": acc.expected_tokens}
        print(f"{name:<22} {1000 * propose:>10.2f} {1000 * per:>10.2f} {per / plain_s:>9.3f} {acc.alpha:>6.3f} "
              f"{acc.expected_tokens:>5.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "plain_step_s": plain_s, "variants": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
