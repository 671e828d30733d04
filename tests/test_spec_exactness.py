"""Greedy speculative decoding equals plain greedy decoding, token for token, on the real model (slow).

SmolLM2-135M-Instruct (float32) on 40 Spec-Bench prompts (first turn, chat template; the first three of every
category, then a fourth in category order), 128 new tokens, at batch 1 and batch 4 (10 batches of 4, prompts
grouped by length), for every drafter: n-gram (gamma 4), suffix decoding (8 nodes, host-side trees), a
draft model (the target's own GGUF file loaded as the draft; the shipped draft in specjax/assets, and its cheap
variants: p_min 0.5, a 4096-token trimmed vocabulary, int4 requantized, n-gram lookup merged in), and the tree
methods with the heads shipped in specjax/assets and the trees of configs/methods/{medusa,eagle,eagle3}.yaml,
and eagle3_lookup.yaml (the EAGLE-3 tree with an n-gram lookup branch merged in).

Speculation runs without the adaptive back-off, so every step verifies a proposal. The engine entry points are
called directly with two shape buckets per batch size (prompts padded to 128 or 1024 tokens, KV caches of 384
or 1280 slots), so each drafter compiles two loops per batch size instead of one per power-of-two prompt length.

A divergence is explained by the target's top-2 logit gap at the first differing position (one forward over
prompt + common prefix): a gap <= 1e-4 is a numerical tie (two tokens equally likely up to rounding; reported as
a warning), anything larger fails with the prompt id, position and gap. SPECJAX_EXACT_PROMPTS=n runs only the
first n prompts, SPECJAX_EXACT_NEW=k decodes k tokens, SPECJAX_EXACT_METHODS=a,b and SPECJAX_EXACT_BATCHES=4 select
parametrizations (CI runs a reduced configuration within its time limit; the full one is the default).
SPECJAX_EXACT_SETTING picks the target's weights: float32 (the default), bfloat16, or a quantization of
`LLM(quantization=...)` (int8, int4, gguf, w8a8), optionally with `+kv8` for the int8 KV cache; speculation is then
compared with plain decoding of the same quantized target (heads and drafts stay as shipped).
SPECJAX_EXACT_MODEL names another target (e.g. qwen2.5-coder-1.5b with SPECJAX_EXACT_SETTING=gguf: its K-quant
blocks as stored), and the method draft_named drafts with the model SPECJAX_EXACT_DRAFT names (default
qwen2.5-coder-0.5b); draft_self and the shipped heads and draft belong to SmolLM2 and are skipped for other targets.
"""
from __future__ import annotations

import json
import os
import time
import warnings

import numpy as np
import pytest

from specjax.buckets import Buckets
from specjax.runners.speculative import drafter_for
from specjax.config import SamplingParams, SpeculativeConfig

from conftest import SPEC_BENCH
from spec_helpers import first_divergence, last_logits, outputs, run_plain, run_spec, run_suffix, top2_gap

pytestmark = pytest.mark.slow

MAX_NEW = int(os.environ.get("SPECJAX_EXACT_NEW", "128"))
N_PROMPTS = int(os.environ.get("SPECJAX_EXACT_PROMPTS", "40"))
# CI runs a smaller configuration (see .ci/run); unset, the test is the full one the issue asks for.
ONLY_METHODS = [m for m in os.environ.get("SPECJAX_EXACT_METHODS", "").split(",") if m]
ONLY_BATCHES = [int(b) for b in os.environ.get("SPECJAX_EXACT_BATCHES", "").split(",") if b]
SETTING = os.environ.get("SPECJAX_EXACT_SETTING", "float32")
# The target and, for the method draft_named, the draft model, by any name the resolver takes.
MODEL = os.environ.get("SPECJAX_EXACT_MODEL", "smollm2-135m")
DRAFT = os.environ.get("SPECJAX_EXACT_DRAFT", "qwen2.5-coder-0.5b")
TIE_GAP = 1e-4
WIDTHS = (128, 1024)  # prompt buckets; the KV capacity of each is the next multiple of 128 that fits
MAX_NODES = 33  # verify slots reserved beyond prompt + MAX_NEW (EAGLE's default tree: 32 drafted + the root)
SHIPPED_DRAFT = "assets/smollm2-135m-draft"
# adaptive chain length, a trimmed vocabulary, every matrix requantized to int4, n-gram lookup merged in
CHEAP_DRAFTS = {"draft_pmin": dict(p_min=0.5), "draft_trim": dict(draft_vocab_size=4096),
                "draft_int4": dict(quantization="int4"), "draft_lookup": dict(lookup_tokens=6)}
_T0 = time.perf_counter()


def shipped_draft_path() -> str | None:
    import specjax

    path = os.path.join(os.path.dirname(os.path.abspath(specjax.__file__)), SHIPPED_DRAFT)
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def speculative_config(method: str) -> SpeculativeConfig | None:
    from specjax.models.loading import resolve_model

    if method == "ngram":
        return SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    if method == "suffix":
        return SpeculativeConfig(method="suffix", num_speculative_tokens=8)
    if method == "draft_self":
        return SpeculativeConfig(method="draft_model", model=resolve_model("smollm2-135m").path,
                                 num_speculative_tokens=4)
    if method == "draft_named":
        return SpeculativeConfig(method="draft_model", model=DRAFT, num_speculative_tokens=4)
    if method == "draft_shipped":
        path = shipped_draft_path()
        return None if path is None else SpeculativeConfig(method="draft_model", model=path,
                                                            num_speculative_tokens=4)
    if method in CHEAP_DRAFTS:
        # the draft's cheap variants (specjax.drafters.draft_model): the shipped draft for SmolLM2, the named draft
        # (SPECJAX_EXACT_DRAFT) for another target
        path = shipped_draft_path() if MODEL == "smollm2-135m" else DRAFT
        return None if path is None else SpeculativeConfig(method="draft_model", model=path,
                                                            num_speculative_tokens=4, **CHEAP_DRAFTS[method])
    if method in ("medusa", "eagle", "eagle3", "eagle3_lookup"):
        # the heads shipped for SmolLM2 with the trees of configs/methods/<method>.yaml
        return shipped_heads_config(method)
    raise AssertionError(method)


def shipped_heads_config(method: str) -> SpeculativeConfig | None:
    import specjax
    from specjax.config import load_run_config

    spec = load_run_config(f"methods/{method}").speculative
    path = os.path.join(os.path.dirname(os.path.abspath(specjax.__file__)), spec.model)
    return spec if os.path.isfile(os.path.join(path, "config.json")) else None


@pytest.fixture(scope="module")
def llm():
    from specjax.api import LLM

    weights, _, kv = SETTING.partition("+")
    if kv not in ("", "kv8"):
        raise AssertionError(f"SPECJAX_EXACT_SETTING={SETTING!r}: the only suffix is '+kv8'")
    dtype = "bfloat16" if weights == "bfloat16" else "float32"
    quantization = None if weights in ("float32", "bfloat16") else weights
    print(f"\ntest_spec_exactness: target {SETTING} (dtype {dtype}, quantization {quantization}, "
          f"KV cache {'int8' if kv else dtype})")
    return LLM(MODEL, dtype=dtype, quantization=quantization, kv_cache_dtype="int8" if kv else None)


@pytest.fixture(scope="module")
def prompts(llm):
    """[(question_id, category, token ids)]: round-robin over categories in file order (the first prompt of
    each category, then the second, ...), N_PROMPTS in all."""
    if not os.path.exists(SPEC_BENCH):
        pytest.skip(f"Spec-Bench questions not found at {SPEC_BENCH}")
    by_cat: dict[str, list] = {}
    with open(SPEC_BENCH) as f:
        for line in f:
            q = json.loads(line)
            by_cat.setdefault(q["category"], []).append(q)
    chosen, rank = [], 0
    while len(chosen) < N_PROMPTS:
        for qs in by_cat.values():
            if rank < len(qs) and len(chosen) < N_PROMPTS:
                chosen.append(qs[rank])
        rank += 1
    out = [(q["question_id"], q["category"], llm.encode_prompt(q["turns"][0], chat=True)) for q in chosen]
    assert max(len(ids) for _, _, ids in out) <= WIDTHS[-1]
    return out


def batches(prompts, batch: int) -> list[list[int]]:
    """Prompt indices per call: one each at batch 1; at batch > 1 grouped by length (fewer long paddings)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i][2])) if batch > 1 else range(len(prompts))
    order = list(order)
    return [order[i:i + batch] for i in range(0, len(order), batch)]


def decode_all(llm, prompts, batch: int, method: str | None):
    """Greedy outputs {prompt index: (tokens, finish code)} and summed stats, for every prompt."""
    drafter = dparams = None
    if method is not None:
        drafter, dparams = drafter_for(llm, speculative_config(method))
        assert drafter.tree.num_nodes <= MAX_NODES
    results, stats = {}, dict(verify_steps=0, plain_steps=0, drafted=0, accepted=0)
    suffix_index = None
    for chunk in batches(prompts, batch):
        ids = [prompts[i][2] for i in chunk]
        width = next(w for w in WIDTHS if max(map(len, ids)) <= w)
        buckets = Buckets(batch, width, MAX_NEW, -(-(width + MAX_NEW + MAX_NODES) // 128) * 128,
                                 kv_dtype=llm.kv_cache_dtype)
        sampling = llm.sampling_arrays([SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)] * len(ids),
                                       batch, buckets.num_stop)
        if method is None:
            dec = run_plain(llm.params, llm.config, buckets, ids, sampling)
        else:
            if method == "suffix":
                state, suffix_index = run_suffix(llm.params, llm.config, drafter, buckets, ids, sampling,
                                                 suffix_index)
            else:
                state = run_spec(llm.params, llm.config, dparams, drafter, buckets, ids, sampling)
            dec = state.dec
            for k in stats:
                stats[k] += int(np.asarray(getattr(state.stats, k))[:len(ids)].sum())
        toks, finish = outputs(dec, len(ids))
        for i, t, f in zip(chunk, toks, finish):
            results[i] = (t, int(f))
    return results, stats


@pytest.fixture(scope="module")
def plain(llm, prompts):
    """Plain greedy outputs per batch size, computed once."""
    cache = {}

    def get(batch: int):
        if batch not in cache:
            t = time.perf_counter()
            cache[batch] = decode_all(llm, prompts, batch, None)[0]
            print(f"\nplain greedy, batch {batch}: {len(prompts)} prompts in {time.perf_counter() - t:.0f} s")
        return cache[batch]

    return get


@pytest.fixture(scope="module", autouse=True)
def total_time():
    yield
    print(f"\ntest_spec_exactness: {time.perf_counter() - _T0:.0f} s in total")


def explain(llm, prompts, i: int, ref, got) -> tuple[bool, str]:
    """(is a numerical tie, description) of the first divergence between plain `ref` and speculative `got`."""
    qid, cat, ids = prompts[i]
    (rt, rf), (gt, gf) = ref, got
    k = first_divergence(gt, rt)
    if k is None:
        return False, f"prompt {qid} ({cat}): same tokens but finish {gf} != {rf}"
    if k >= min(len(rt), len(gt)):
        return False, (f"prompt {qid} ({cat}): speculative output has {len(gt)} tokens, plain {len(rt)} "
                       f"(finish {gf} vs {rf}); the shorter is a prefix of the longer")
    logits = last_logits(llm.params, llm.config, list(ids) + list(rt[:k]))
    gap = top2_gap(logits)
    top2 = np.argsort(logits)[-2:][::-1].tolist()
    return gap <= TIE_GAP, (f"prompt {qid} ({cat}) position {k}: plain {rt[k]} vs speculative {gt[k]}, target "
                            f"top-2 {top2} with logit gap {gap:.4g}")


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_self", "draft_shipped", "draft_named", "medusa",
                                    "eagle", "eagle3", "eagle3_lookup", *CHEAP_DRAFTS])
def test_greedy_speculative_equals_plain(llm, prompts, plain, method, batch):
    if (ONLY_METHODS and method not in ONLY_METHODS) or (ONLY_BATCHES and batch not in ONLY_BATCHES):
        pytest.skip("not in SPECJAX_EXACT_METHODS / SPECJAX_EXACT_BATCHES")
    if MODEL != "smollm2-135m" and method in ("draft_self", "draft_shipped", "medusa", "eagle", "eagle3",
                                               "eagle3_lookup"):
        pytest.skip(f"{method} drafts with SmolLM2's own file or heads; the target is {MODEL}")
    if method == "draft_named" and MODEL == "smollm2-135m":
        pytest.skip("draft_named drafts for another target (SPECJAX_EXACT_MODEL)")
    if speculative_config(method) is None:
        pytest.skip(f"no shipped draft or head for {method} in specjax/assets")
    ref = plain(batch)
    t = time.perf_counter()
    got, stats = decode_all(llm, prompts, batch, method)
    seconds = time.perf_counter() - t
    ties, failures = [], []
    for i in ref:
        if got[i] != ref[i]:
            tie, text = explain(llm, prompts, i, ref[i], got[i])
            (ties if tie else failures).append(text)
    steps = stats["verify_steps"] + stats["plain_steps"]
    tokens = sum(len(got[i][0]) for i in got)
    rate = stats["accepted"] / max(1, stats["drafted"])
    print(f"\n{method}, batch {batch}: {len(prompts)} prompts, {tokens} tokens in {seconds:.0f} s; "
          f"{(tokens - len(got)) / max(1, steps):.2f} tokens per target forward, acceptance {rate:.3f}, "
          f"{len(ties)} ties, {len(failures)} divergences")
    for text in ties:
        warnings.warn(f"{method}, batch {batch}: numerical tie tolerated: {text}")
    assert not failures, f"{method}, batch {batch}: speculative != plain greedy:\n" + "\n".join(failures)
    assert stats["accepted"] > 0, f"{method}: no draft token was ever accepted, nothing was verified"
    if method == "draft_self":
        # the draft is the target itself: only rounding differences between the draft's one-token forwards
        # and the verify forward can reject a token
        assert rate > 0.9, f"self-draft acceptance {rate:.3f}: the draft's cache or positions are off"
