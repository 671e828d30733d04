"""The int8 KV cache (`specjax.kv_cache`, `LLM(kv_cache_dtype="int8")`): per-token, per-head scales, the round trip
bound, order-independent appends, speculative decoding exact over it, close to the float cache, no retrace per
request, the memory preflight's count, and the refusals where it does not run.

A tiny random Llama in a Hugging Face directory (byte tokenizer), loaded by `LLM` itself, so the option goes
through the constructor, the runners' buckets and the engines as a user's would.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import save_hf_model, tiny_config, tiny_params
from specjax import kv_cache, memory
from specjax.api import LLM
from specjax.buckets import make_buckets
from specjax.config import ConfigError, SamplingParams, SpeculativeConfig, load_run_config
from specjax.models.llama import forward

NEW = 24
# Ragged lengths, with repeats for the n-gram drafter to find.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 40, 41], [9, 10, 11, 12, 13, 14, 9, 10, 11, 12, 13, 14, 9, 10]]


pytestmark = pytest.mark.usefixtures("fast_xla_compiles")


@pytest.fixture(scope="module")
def model():
    config = tiny_config(vocab_size=262, architecture="LlamaForCausalLM")
    return config, tiny_params(config, seed=11)


@pytest.fixture(scope="module")
def model_dir(model, tmp_path_factory):
    return save_hf_model(tmp_path_factory.mktemp("tiny-int8"), *model)


@pytest.fixture(scope="module")
def llm8(model_dir):
    return LLM(model_dir, kv_cache_dtype="int8")


@pytest.fixture(scope="module")
def llm32(model_dir):
    return LLM(model_dir)


def greedy(llm, prompts, spec=None, new: int = NEW):
    outs = llm.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True), spec or {"method": None})
    return [o.outputs[0].token_ids for o in outs], outs


# ------------------------------------------------------------------------------------------------ the cache


def test_write_then_dequantize_is_within_half_a_scale():
    rng = np.random.default_rng(0)
    B, T, H, D, S = 2, 5, 3, 16, 12
    # Per-token magnitudes over four orders, and one all-zero head vector (its scale must not divide by zero).
    x = rng.standard_normal((B, T, H, D)) * 10.0 ** rng.uniform(-2, 2, (B, T, H, 1))
    x[0, 1, 2] = 0.0
    k_new, v_new = jnp.asarray(x, jnp.float32), jnp.asarray(-2 * x, jnp.float32)
    cache = kv_cache.init_cache(1, B, S, H, D, kv_dtype="int8")
    assert cache.quantized and cache.k[0].dtype == jnp.int8 and cache.k_scale[0].shape == (B, H, S)
    lengths = jnp.asarray([0, 4], jnp.int32)
    ck, cv, (ks, vs) = kv_cache.write_kv(cache.k[0], cache.v[0], k_new, v_new, lengths, cache.scales(0))
    for c, s, new in ((ck, ks, k_new), (cv, vs, v_new)):
        for b in range(B):
            at = slice(int(lengths[b]), int(lengths[b]) + T)
            scale = np.asarray(s[b, :, at]).T  # [T, H]
            want = np.abs(np.asarray(new[b])).max(-1) / 127
            np.testing.assert_allclose(scale, np.where(want > 0, want, 1.0), rtol=1e-6)
            back = np.asarray(kv_cache.dequantize(c, s, jnp.float32)[b, :, at]).transpose(1, 0, 2)  # [T, H, D]
            err = np.abs(back - np.asarray(new[b]))
            assert np.all(err <= scale[..., None] / 2 * (1 + 1e-5) + 1e-12)
            assert np.abs(np.asarray(c[b], np.int32)).max() <= 127
    assert np.all(np.asarray(ck[0, 2, 1]) == 0)  # the zero vector stays zero
    # as_stored: the values a cache reads back, without a cache.
    back = kv_cache.dequantize(ck, ks, jnp.float32)[0, :, :T].transpose(1, 0, 2)
    np.testing.assert_array_equal(np.asarray(kv_cache.as_stored(k_new, True)[0]), np.asarray(back))
    assert kv_cache.as_stored(k_new, False) is k_new


def test_appending_one_token_at_a_time_stores_the_same_bytes_and_overflow_is_dropped():
    rng = np.random.default_rng(1)
    L, B, T, H, D, S = 2, 2, 6, 2, 8, 8
    new = tuple(tuple(jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32) for _ in range(L))
                for _ in range(2))
    base = jnp.asarray([0, 5], jnp.int32)  # row 1 has room for 3 of the 6: the rest fall past the capacity
    empty = kv_cache.init_cache(L, B, S, H, D, kv_dtype="int8")
    at_once = kv_cache.write_path(empty, new, base)
    one_by_one = empty
    for t in range(T):
        step = tuple(tuple(a[:, t:t + 1] for a in layers) for layers in new)
        one_by_one = kv_cache.write_path(one_by_one, step, base + t)
    # Any order: the last token first.
    backwards = empty
    for t in reversed(range(T)):
        backwards = kv_cache.write_path(backwards, tuple(tuple(a[:, t:t + 1] for a in layers) for layers in new),
                                        base + t)
    for other in (one_by_one, backwards):
        for f in ("k", "v", "k_scale", "v_scale"):
            for a, b in zip(getattr(at_once, f), getattr(other, f)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert at_once.k[0].shape == (B, H, S, D) and at_once.k_scale[0].shape == (B, H, S)
    q, s = kv_cache.quantize(new[0][0])
    np.testing.assert_array_equal(np.asarray(at_once.k[0][1, :, 5:]), np.asarray(q[1, :3]).transpose(1, 0, 2))
    np.testing.assert_array_equal(np.asarray(at_once.k_scale[0][1, :, 5:]), np.asarray(s[1, :3]).T)
    np.testing.assert_array_equal(np.asarray(at_once.k[0][1, :, :5]), 0)  # slots below the base untouched
    assert np.all(np.asarray(at_once.k_scale[0][0, :, T:]) == 0)  # row 0: slots past its tokens untouched


def test_float_cache_is_unchanged_and_kv_dtype_is_checked():
    cache = kv_cache.init_cache(2, 1, 4, 2, 8, jnp.bfloat16)
    assert not cache.quantized and cache.k_scale == () and cache.k[1].dtype == jnp.bfloat16
    k = jnp.ones((1, 2, 2, 8), jnp.float32)
    assert len(kv_cache.write_kv(cache.k[0], cache.v[0], k, k, cache.lengths)) == 2
    with pytest.raises(ConfigError, match="unknown kv_cache_dtype 'fp8'"):
        kv_cache.init_cache(2, 1, 4, 2, 8, kv_dtype="fp8")


def test_int8_prefill_logits_are_close_to_float(model):
    config, params = model
    rng = np.random.default_rng(2)
    B, T = 2, 40
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (B, T)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    run = jax.jit(forward, static_argnames=("config",))
    logits = {}
    for kv in (None, "int8"):
        cache = kv_cache.init_cache(config.num_layers, B, 64, config.num_kv_heads, config.head_dim, kv_dtype=kv)
        out = run(params, config, tokens, pos, cache)
        logits[kv] = np.asarray(out.logits)
        assert out.cache.quantized == (kv == "int8")
    # Loose bounds (this tiny model's attention is sharp, which amplifies the rounding): errors of a few percent
    # of the logits' spread at most, the same argmax almost everywhere. Not zero: the block's own tokens are
    # attended to as the cache holds them.
    err, spread = np.abs(logits["int8"] - logits[None]), logits[None].std()
    assert 0 < err.mean() < 0.02 * spread and err.max() < 0.15 * spread, (err.mean(), err.max(), spread)
    assert np.mean(logits["int8"].argmax(-1) == logits[None].argmax(-1)) >= 0.95


def test_int8_block_attends_as_token_by_token(model):
    """What keeps speculation exact: a block of new tokens in one forward (a verified chain, a prefill) gives the
    logits of the same tokens forwarded one at a time over the int8 cache (plain decoding), and stores the same
    entries."""
    config, params = model
    rng = np.random.default_rng(3)
    B, P, T = 2, 12, 5
    run = jax.jit(forward, static_argnames=("config",))
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (B, P + T)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(P + T, dtype=jnp.int32), (B, P + T))
    cache = kv_cache.init_cache(config.num_layers, B, 32, config.num_kv_heads, config.head_dim, kv_dtype="int8")
    prompt = run(params, config, tokens[:, :P], pos[:, :P], cache).cache._replace(lengths=jnp.full((B,), P, jnp.int32))
    block = run(params, config, tokens[:, P:], pos[:, P:], prompt)
    one, steps = prompt, []
    for t in range(P, P + T):
        out = run(params, config, tokens[:, t:t + 1], pos[:, t:t + 1], one)
        steps.append(out.logits[:, 0])
        one = out.cache._replace(lengths=one.lengths + 1)
    np.testing.assert_allclose(np.stack(steps, 1), np.asarray(block.logits), atol=1e-4)
    for a, b in zip(block.cache.k + block.cache.v, one.k + one.v):  # int8 codes at most one step apart
        assert np.abs(np.asarray(a, np.int32) - np.asarray(b, np.int32)).max() <= 1
    for a, b in zip(block.cache.k_scale + block.cache.v_scale, one.k_scale + one.v_scale):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5)


# ------------------------------------------------------------------------------------------------ generation


def test_engines_allocate_the_int8_cache(llm8, llm32):
    from specjax.runners.plain import PlainVariant

    for llm, dtype in ((llm8, jnp.int8), (llm32, jnp.float32)):
        v = PlainVariant(llm)
        b = v.buckets(3, 14, NEW, 4)
        assert b.kv_dtype == llm.kv_cache_dtype
        shapes = v.state_shapes(b, llm.sampling_arrays([SamplingParams()] * b.batch, b.batch, b.num_stop))
        assert shapes.cache.k[0].dtype == dtype and len(shapes.cache.k_scale) == (2 if dtype == jnp.int8 else 0)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_int8_greedy_speculative_equals_int8_plain(llm8, model_dir, method):
    spec = {"ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, adaptive=False),
            "draft_model": SpeculativeConfig(method="draft_model", model=model_dir, num_speculative_tokens=3,
                                             adaptive=False)}[method]
    for prompts in (PROMPTS[:1], PROMPTS):  # batch 1, and a ragged batch of 3
        plain, _ = greedy(llm8, prompts)
        fast, outs = greedy(llm8, prompts, spec)
        assert fast == plain
        assert all(o.metrics.verify_steps > 0 for o in outs)  # every row verified drafts
        if method == "draft_model":  # a copy of the target: its drafts are mostly accepted
            assert sum(o.metrics.accepted for o in outs) > 0


def test_int8_greedy_mostly_agrees_with_float(llm8, llm32):
    """Free-running outputs part at the first near-tie and never meet again, so the comparison is teacher-forced:
    along the float32 greedy output, the int8 model's most likely next token (its logprobs' rank 1, scored over
    an int8 cache) is float32's at most positions. The outputs start the same."""
    toks32, _ = greedy(llm32, PROMPTS)
    toks8, _ = greedy(llm8, PROMPTS)
    assert all(a[:2] == b[:2] for a, b in zip(toks8, toks32))
    sp = SamplingParams(max_tokens=NEW, logprobs=1)
    ranks = [lp[t].rank for ids, toks in zip(PROMPTS, toks32)
             for t, lp in zip(toks, llm8.score_logprobs(ids, toks, sp)[1])]
    assert len(ranks) == NEW * len(PROMPTS) and np.mean(np.asarray(ranks) == 1) >= 0.9, ranks


def test_int8_queued_rows_equal_one_batch(llm8, monkeypatch):
    """Past max_num_seqs the rows run through the serving engine's slot programs: they carry the int8 cache."""
    whole, _ = greedy(llm8, PROMPTS)
    monkeypatch.setattr(llm8, "max_num_seqs", 2)
    assert greedy(llm8, PROMPTS)[0] == whole


def test_int8_requests_in_one_bucket_never_retrace(llm8, trace_counter):
    counts = trace_counter
    jax.clear_caches()  # so the first call must trace, whatever ran earlier in this module
    greedy(llm8, [PROMPTS[0], PROMPTS[2]], new=10)
    assert dict(counts) == {"prefill": 1, "decode": 1}
    sp = [SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True),
          SamplingParams(max_tokens=3, ignore_eos=True)]
    outs = llm8.generate([PROMPTS[1], [7] * 16], sp)
    assert [len(o.outputs[0].token_ids) for o in outs] == [16, 3]
    assert dict(counts) == {"prefill": 1, "decode": 1}, "an int8 request in the same bucket traced again"


# ------------------------------------------------------------------------------------------------ memory, options


def test_preflight_counts_int8_entries_and_scales():
    from specjax.models.llama import LlamaConfig

    # SmolLM2-135M's layout (30 layers, 3 KV heads of 64), without its weights.
    smollm2 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                          num_kv_heads=3, head_dim=64)
    assert memory.kv_token_bytes(smollm2, 4) == 2 * 30 * 3 * 64 * 4
    assert memory.kv_token_bytes(smollm2, 4, "int8") == 2 * 30 * 3 * (64 + 4)
    b32, b8 = make_buckets(4, 512, 512), make_buckets(4, 512, 512, kv_dtype="int8")
    e32, e8 = memory.estimate(smollm2, b32, 4), memory.estimate(smollm2, b8, 4)
    assert e8.kv_cache == 4 * b8.capacity * memory.kv_token_bytes(smollm2, 4, "int8")
    assert e8.kv_cache < e32.kv_cache / 3 and e8.total < e32.total
    with pytest.raises(memory.ResourceError, match=r"30 layers, int8\)"):
        memory.preflight(smollm2, b8, 4, available=2 ** 20)


def test_int8_is_refused_where_it_does_not_run(model_dir):
    with pytest.raises(ConfigError, match="not under the Neuron policy"):
        LLM(model_dir, backend="neuron", kv_cache_dtype="int8")
    with pytest.raises(ConfigError, match="does not run over a device mesh"):
        LLM(model_dir, mesh="data=1", kv_cache_dtype="int8")
    with pytest.raises(ConfigError, match=r"unknown kv_cache_dtype 'fp8'.*'int8'"):
        LLM(model_dir, kv_cache_dtype="fp8")


def test_config_and_cli_carry_the_option(monkeypatch):
    from specjax import api
    from specjax.cli.common import make_llm

    cfg = load_run_config(overrides=["model.kv_cache_dtype=int8"])
    assert cfg.model.kv_cache_dtype == "int8"
    seen = {}
    monkeypatch.setattr(api, "LLM", lambda *a, **k: seen.update(k))
    make_llm(cfg)
    assert seen["kv_cache_dtype"] == "int8"
    with pytest.raises(ConfigError):
        load_run_config(overrides=["model.kv_cache_dtype=fp8"])

