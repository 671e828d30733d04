"""The int8 KV cache on the real model (SmolLM2-135M GGUF). Apart from tests/test_kv_int8.py because that module
compiles with most XLA optimisations off, while exactness is claimed for the programs users run: plain steps and
verify blocks share one summation order there, and an int8 cache turns any last-bit difference of a key into a
different code."""
from __future__ import annotations

import pytest

from specjax.api import LLM
from specjax.config import SamplingParams, load_run_config


@pytest.mark.slow
def test_real_model_greedy_speculation_over_an_int8_cache_equals_plain():
    """SmolLM2-135M: n-gram and EAGLE-3 over the int8 cache give plain decoding's tokens over the same cache."""
    llm = LLM("smollm2-135m", kv_cache_dtype="int8")
    prompts = [[{"role": "user", "content": p}] for p in (
        "Write a short poem about the sea.", "Explain what a hash table is in two sentences.",
        "List the first ten prime numbers, separated by commas, then repeat the list.")]
    sp = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.chat(prompts, sp)]
    for spec in ({"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
                 load_run_config("methods/eagle3").speculative):
        outs = llm.chat(prompts, sp, speculative_config=spec)
        assert [o.outputs[0].token_ids for o in outs] == plain
        assert sum(o.metrics.accepted or 0 for o in outs) > 0
    assert all(len(t) == 48 for t in plain)
