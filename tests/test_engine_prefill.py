"""Chunked per-row prefill (Buckets.prefill_chunk): each row prefilled alone, C tokens at a time, only as far as its
own prompt goes. It must compute what the whole-prompt prefill computes (the cache a row's decoding reads, the
first token, the target features a drafter reads), skip inactive rows, and make batched generation equal to
one prompt at a time."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import save_hf_model, tiny_config, tiny_params
from specjax import engine
from specjax.buckets import Buckets, PREFILL_CHUNK, make_buckets
from specjax.api import LLM
from specjax.requests import pad_prompts
from specjax.config import SamplingParams
from specjax.sampling import SamplingArrays

CFG = tiny_config(max_position_embeddings=1024)
PARAMS = tiny_params(CFG, seed=5)


def _sampling(B):
    return SamplingArrays(jnp.zeros(B), jnp.zeros(B, jnp.int32), jnp.ones(B), jnp.zeros(B, jnp.uint32),
                          jnp.full((B,), 8, jnp.int32), jnp.full((B, 4), -1, jnp.int32))


@functools.partial(jax.jit, static_argnames=("buckets", "features"))
def _prefill(buckets, tokens, lens, active, sampling, features):
    return engine.prefill_core(PARAMS, CFG, buckets, tokens, lens, active, sampling, features)


@pytest.mark.parametrize("chunk", [16, 32])
def test_chunked_prefill_matches_the_whole_prompt(chunk):
    rng = np.random.default_rng(0)
    lens = [5, 37, 64, 16]  # shorter than a chunk, several chunks plus a bit, exactly P, exactly one chunk
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in lens]
    whole = Buckets(batch=5, prompt_len=64, max_new=16, capacity=128)
    chunked = dataclasses.replace(whole, prefill_chunk=chunk)
    tokens, lens_a, active = pad_prompts(prompts, 5, 64)  # row 4 is an inactive padding row
    features = ("final", 0)
    ref, ref_feats = _prefill(whole, tokens, lens_a, active, _sampling(5), features)
    got, got_feats = _prefill(chunked, tokens, lens_a, active, _sampling(5), features)

    np.testing.assert_array_equal(np.asarray(got.last_token)[:4], np.asarray(ref.last_token)[:4])
    np.testing.assert_array_equal(np.asarray(got.cache.lengths)[:4], lens)
    np.testing.assert_array_equal(np.asarray(got.finish), np.asarray(ref.finish))
    assert int(np.asarray(got.finish)[4]) == engine.FINISH_LENGTH  # the padding row starts finished
    for layer in range(CFG.num_layers):
        for name in ("k", "v"):
            g = np.asarray(getattr(got.cache, name)[layer])
            r = np.asarray(getattr(ref.cache, name)[layer])
            for b, n in enumerate(lens):  # every committed slot of every row; slots past a row's length are free
                np.testing.assert_allclose(g[b, :, :n], r[b, :, :n], rtol=1e-5, atol=1e-5,
                                           err_msg=f"{name}{layer} row {b}")
    for b, n in enumerate(lens):
        np.testing.assert_allclose(np.asarray(got_feats)[b, :n], np.asarray(ref_feats)[b, :n], rtol=1e-5, atol=1e-5)


def test_make_buckets_chunks_only_long_prompt_buckets():
    assert make_buckets(4, 100, 32).prefill_chunk == 0
    long = make_buckets(4, 300, 32)
    assert long.prompt_len == 512 and long.prefill_chunk == PREFILL_CHUNK
    assert long.prompt_len % long.prefill_chunk == 0


def test_chunk_must_divide_the_prompt_bucket():
    b = Buckets(batch=1, prompt_len=64, max_new=16, capacity=128, prefill_chunk=24)
    tokens, lens, active = pad_prompts([[1, 2, 3]], 1, 64)
    with pytest.raises(ValueError, match="not a multiple of the prefill chunk"):
        _prefill(b, tokens, lens, active, _sampling(1), ())


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    cfg = tiny_config(vocab_size=262, architecture="LlamaForCausalLM", max_position_embeddings=1024)
    return LLM(save_hf_model(tmp_path_factory.mktemp("tiny-prefill"), cfg, tiny_params(cfg, seed=3)))


def test_batched_generation_with_a_long_prompt_equals_one_at_a_time(llm):
    """A 400-token prompt puts the batch in a chunked bucket (512 > PREFILL_CHUNK); the short rows are prefilled
    as far as their own length, and every row decodes exactly as it does alone (greedy and sampled)."""
    prompts = ["lorem ipsum dolor sit amet " * 15, "short one", "a prompt of middling length, " * 4]
    assert len(llm.encode_prompt(prompts[0], False)) > PREFILL_CHUNK
    for sp in (SamplingParams(max_new_tokens=12, ignore_eos=True),
               SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.9, seed=4)):
        together = llm.generate(prompts, sp)
        alone = [llm.generate([p], sp)[0] for p in prompts]
        assert [o.token_ids for o in together] == [o.token_ids for o in alone]
