"""The draft-model drafter's cheap variants, on tiny random models (fast): each equals plain greedy output token
for token at batch 4 (ragged prompts) and batch 1, and the mechanics behind it are checked directly.

* p_min: the chain stops at the first drafted token whose draft probability (softmax of the draft's logits,
  computed here by an independent full forward over the drafted chain) is below p_min; the rest is invalid.
  p_min is traced: a second value compiles no new loop.
* A trimmed vocabulary (`trim_vocab`): drafted tokens stay inside the kept ids and q is zero elsewhere.
* A requantized draft (int4, every matrix and the LM head).
* Draft model + lookup (`DraftWithLookup`): lookup rows propose the n-gram chain with one-hot q, the others the
  draft chain; after steps that accepted looked-up tokens, the draft's next proposal equals that of a fresh
  draft prefilled on the same history (the accepted lookup tokens entered through the first forward).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import spec_engine
from specjax.config import SpeculativeConfig
from specjax.drafters.draft_model import DraftModelDrafter, trim_vocab
from specjax.drafters.ngram import NgramDrafter
from specjax.drafters.with_lookup import DraftWithLookup
from specjax.errors import SpecjaxError
from specjax.kv_cache import init_cache
from specjax.models import quant
from specjax.models.llama import forward, fuse_projections

from spec_helpers import make_sampling, outputs, run_plain, run_spec, tiny_buckets, tiny_config, tiny_params

V = 64
BATCH = 4
MAX_NEW = 32
BUCKETS = tiny_buckets(BATCH, prompt_len=16, max_new=MAX_NEW, extra=16)
BUCKETS1 = tiny_buckets(1, prompt_len=16, max_new=MAX_NEW, extra=16)
PROMPTS = [
    [7, 3, 9, 12, 40],
    [1, 2, 3, 4, 5, 6, 1, 2],
    [33, 17, 50, 2, 61, 8, 8, 19, 44, 5, 21],
    [9, 9, 10, 11, 9, 9, 10, 11, 9, 9, 10, 11, 9, 9],
]
KEEP = np.arange(0, V, 2)[:24].tolist() + [1, 3, 5, 9, 11]  # 29 of 64 ids, in no particular order


@pytest.fixture(scope="module")
def target():
    config = tiny_config(V)
    return config, tiny_params(config, seed=0)


@pytest.fixture(scope="module")
def draft(target):
    """A one-layer draft sharing the target's embedding and head: it agrees with the target often enough that
    chains are accepted, and not always."""
    tcfg, tparams = target
    config = tiny_config(V, num_layers=1)
    params = tiny_params(config, seed=1)
    params["embed"], params["lm_head"] = tparams["embed"], tparams["lm_head"]
    return config, params


@pytest.fixture(scope="module")
def plain(target):
    config, params = target
    return {b: outputs(run_plain(params, config, bk, PROMPTS[:b], make_sampling(b, max_new=MAX_NEW)), b)[0]
            for b, bk in ((BATCH, BUCKETS), (1, BUCKETS1))}


def variants(draft) -> dict:
    """name -> (drafter, dparams) for every cheap variant."""
    dcfg, dp = draft
    base = DraftModelDrafter(dcfg, 4, V)
    fused = fuse_projections(dp)
    trimmed, d2t = trim_vocab(fused, None, KEEP)
    int4 = quant.quantize_params(fuse_projections(dp), "int4", lm_head=True)
    return {
        "p_min": (base, {"params": fused, "p_min": jnp.float32(0.2)}),
        "trimmed": (base, {"params": trimmed, "d2t": d2t, "p_min": jnp.float32(0.0)}),
        "int4": (base, {"params": int4, "p_min": jnp.float32(0.0)}),
        "lookup": (DraftWithLookup.around(base, NgramDrafter(3, 1, 3)), {"params": fused, "p_min": jnp.float32(0.0)}),
    }


@pytest.mark.parametrize("batch", [BATCH, 1])
@pytest.mark.parametrize("name", ["p_min", "trimmed", "int4", "lookup"])
def test_cheap_draft_variants_equal_plain_greedy(target, draft, plain, name, batch):
    config, params = target
    drafter, dparams = variants(draft)[name]
    buckets = BUCKETS if batch == BATCH else BUCKETS1
    state = run_spec(params, config, dparams, drafter, buckets, PROMPTS[:batch], make_sampling(batch, max_new=MAX_NEW))
    got, _ = outputs(state.dec, batch)
    for i, (g, w) in enumerate(zip(got, plain[batch])):
        assert g == w, f"{name}, batch {batch}, row {i}: speculative {g} != plain {w}"
    acc, dr = np.asarray(state.stats.accepted).sum(), np.asarray(state.stats.drafted).sum()
    assert acc > 0, f"{name}: nothing accepted, nothing tested"
    if name == "p_min":
        steps = np.asarray(state.stats.verify_steps).sum()
        assert dr < 4 * steps, "p_min cut no chain short: the masking is untested"


def draft_probs(dcfg, dp, seq) -> np.ndarray:
    """Softmax of the draft's logits after every position of `seq` [T, V], one full forward (no cache reuse)."""
    T = len(seq)
    cache = init_cache(dcfg.num_layers, 1, T, dcfg.num_kv_heads, dcfg.head_dim)
    out = forward(dp, dcfg, jnp.asarray([seq], jnp.int32), jnp.arange(T)[None], cache)
    return np.asarray(jax.nn.softmax(out.logits[0].astype(jnp.float32), axis=-1))


@pytest.mark.parametrize("p_min", [0.1, 0.2, 0.3])
def test_p_min_cuts_the_chain_at_the_first_unlikely_token(target, draft, p_min):
    """Greedy rows: node k + 1 is valid iff every drafted token up to it has draft probability >= p_min."""
    config, params = target
    dcfg, dp = draft
    drafter = DraftModelDrafter(dcfg, 6, V)
    sampling = make_sampling(BATCH, max_new=MAX_NEW)
    state = run_spec(params, config, {"params": dp}, drafter, BUCKETS, PROMPTS, sampling, max_steps=2)
    full, _ = spec_engine.propose_jit({"params": dp, "p_min": jnp.float32(0.0)}, drafter, state, sampling)
    cut, _ = spec_engine.propose_jit({"params": dp, "p_min": jnp.float32(p_min)}, drafter, state, sampling)
    assert np.asarray(full.valid).all()
    hist, hlen = np.asarray(state.history), np.asarray(state.prompt_lens + state.dec.num_new)
    cuts = 0
    for b in range(BATCH):
        chain_ = np.asarray(full.tokens[b, 1:]).tolist()
        seq = hist[b, :hlen[b]].tolist() + chain_
        probs = draft_probs(dcfg, dp, seq)
        conf = [probs[hlen[b] - 1 + k, t] for k, t in enumerate(chain_)]
        want = np.cumprod(np.asarray(conf) >= p_min).astype(bool)
        np.testing.assert_array_equal(np.asarray(cut.valid[b, 1:]), want, err_msg=f"row {b}, conf {conf}")
        cuts += int(not want.all())
        np.testing.assert_array_equal(np.asarray(cut.tokens[b, 1:])[want], np.asarray(chain_)[want])
    if p_min == 0.2:
        assert cuts > 0, "no chain was cut: pick another p_min"


def test_p_min_is_traced_a_new_value_compiles_nothing(target, draft):
    config, params = target
    dcfg, dp = draft
    drafter = DraftModelDrafter(dcfg, 4, V)
    fused = fuse_projections(dp)
    sampling = make_sampling(BATCH, max_new=8)
    run_spec(params, config, {"params": fused, "p_min": jnp.float32(0.1)}, drafter, BUCKETS, PROMPTS, sampling)
    size = spec_engine.spec_loop._cache_size()
    for p in (0.3, 0.9):
        run_spec(params, config, {"params": fused, "p_min": jnp.float32(p)}, drafter, BUCKETS, PROMPTS, sampling)
    assert spec_engine.spec_loop._cache_size() == size, "a new p_min compiled a new speculative loop"


def test_configs_differing_in_p_min_share_one_drafter(target, draft, tmp_path):
    from spec_helpers import save_hf_llama, tiny_llm
    from specjax.runners.speculative import drafter_for

    dcfg, dp = draft
    path = save_hf_llama(str(tmp_path / "draft"), dcfg, dp)
    llm = tiny_llm(*target)
    d1, p1 = drafter_for(llm, SpeculativeConfig(method="draft_model", model=path, p_min=0.3))
    d2, p2 = drafter_for(llm, SpeculativeConfig(method="draft_model", model=path, p_min=0.7))
    assert d1 == d2 and hash(d1) == hash(d2), "a p_min change must not change the static drafter"
    assert p1["params"] is p2["params"], "the weights were loaded twice"
    assert float(p1["p_min"]) == pytest.approx(0.3) and float(p2["p_min"]) == pytest.approx(0.7)


def test_trimmed_draft_proposes_only_kept_ids(target, draft):
    config, params = target
    drafter, dparams = variants(draft)["trimmed"]
    sampling = make_sampling(BATCH, temperature=1.0, seed=[1, 2, 3, 4], max_new=MAX_NEW)
    state = run_spec(params, config, dparams, drafter, BUCKETS, PROMPTS, sampling, max_steps=3)
    prop, _ = spec_engine.propose_jit(dparams, drafter, state, sampling)
    assert set(np.asarray(prop.tokens[:, 1:]).ravel().tolist()) <= set(KEEP)
    q = np.asarray(prop.q[:, :-1])
    outside = np.setdiff1d(np.arange(V), KEEP)
    assert np.all(q[..., outside] == 0) and np.allclose(q.sum(-1), 1, atol=1e-5)


def test_trim_vocab_keeps_a_quantized_heads_rows(draft):
    dcfg, dp = draft
    qp = quant.quantize_params(fuse_projections(dp), "int8", lm_head=True)
    trimmed, d2t = trim_vocab(qp, None, KEEP)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, dcfg.hidden_size)), jnp.float32)
    from specjax.models.llama import lm_head

    np.testing.assert_allclose(np.asarray(lm_head(trimmed, x)), np.asarray(lm_head(qp, x))[:, np.asarray(d2t)],
                               rtol=1e-5, atol=1e-5)
    assert sorted(np.asarray(d2t).tolist()) == sorted(KEEP)


def test_merged_lookup_rows_propose_the_lookup_chain_with_one_hot_q(target, draft):
    config, params = target
    drafter, dparams = variants(draft)["lookup"]
    sampling = make_sampling(BATCH, temperature=1.0, seed=[1, 2, 3, 4], max_new=MAX_NEW)
    state = run_spec(params, config, dparams, drafter, BUCKETS, PROMPTS, sampling, max_steps=2)
    from specjax.spec_engine import context

    ctx = context(state, sampling)
    look, _ = drafter.lookup.propose({}, (), ctx)
    prop, _ = spec_engine.propose_jit(dparams, drafter, state, sampling)
    hit = np.asarray(look.valid[:, 1])
    assert hit.any() and not hit.all(), f"rows hit {hit}: the test needs both kinds"
    for b in np.flatnonzero(hit):
        n = int(np.asarray(look.valid[b]).sum())
        np.testing.assert_array_equal(np.asarray(prop.tokens[b, :n]), np.asarray(look.tokens[b, :n]))
        q = np.asarray(prop.q[b, :n - 1])
        np.testing.assert_array_equal(q.argmax(-1), np.asarray(look.tokens[b, 1:n]))
        assert np.all(q.max(-1) == 1.0)


def test_merged_drafter_cache_after_lookup_acceptances_equals_a_fresh_prefill(target, draft):
    """Rows that accepted looked-up tokens: those never went through the draft, and its next first forward
    (window lookup_tokens + 2) takes them in: the next proposal equals a freshly prefilled draft's."""
    config, params = target
    drafter, dparams = variants(draft)["lookup"]
    sampling = make_sampling(BATCH, max_new=MAX_NEW)
    state = run_spec(params, config, dparams, drafter, BUCKETS, PROMPTS, sampling, max_steps=5)
    assert np.asarray(state.stats.accepted).sum() > 0
    L = np.asarray(state.dec.cache.lengths)
    got, _ = spec_engine.propose_jit(dparams, drafter, state, sampling)
    fresh = drafter.init(dparams, params, state.history, jnp.asarray(L), BUCKETS.capacity)
    want, _ = spec_engine.propose_jit(dparams, drafter, state._replace(dstate=fresh), sampling)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.q), np.asarray(want.q), atol=2e-5)


def test_speculating_draft_needs_no_catch_up_forward(target, draft):
    """While speculating, every committed token but the last two is already in the draft cache after a step, so
    the catch-up loop before the first forward (window 2) runs no iteration: the accepted tokens and the bonus
    enter the draft in that first forward."""
    config, params = target
    dcfg, dp = draft
    drafter = DraftModelDrafter(dcfg, 4, V)
    sampling = make_sampling(BATCH, temperature=1.0, seed=[5, 6, 7, 8], max_new=MAX_NEW)
    for steps in (1, 2, 4):
        state = run_spec(params, config, {"params": dp}, drafter, BUCKETS, PROMPTS, sampling, max_steps=steps)
        L = np.asarray(state.dec.cache.lengths)
        synced = np.minimum(np.asarray(state.dstate.lengths), np.maximum(L - 1, 0))
        assert np.all(synced >= L - (drafter.window - 1)), (steps, synced, L)


def test_config_checks():
    with pytest.raises(SpecjaxError, match="p_min"):
        SpeculativeConfig(method="draft_model", model="x", p_min=1.0)
    with pytest.raises(SpecjaxError, match="p_min"):
        SpeculativeConfig(method="ngram", p_min=0.5)
    with pytest.raises(SpecjaxError, match="quantization"):
        SpeculativeConfig(method="ngram", quantization="int4")
    with pytest.raises(SpecjaxError, match="draft_vocab_size"):
        SpeculativeConfig(method="suffix", draft_vocab_size=100)
    spec = SpeculativeConfig.from_user({"method": "draft_model", "model": "x", "quantization": "int4",
                                        "dtype": "bfloat16", "draft_vocab_size": 8192, "p_min": 0.6,
                                        "lookup_tokens": 6})
    assert (spec.quantization, spec.dtype, spec.draft_vocab_size, spec.p_min) == ("int4", "bfloat16", 8192, 0.6)


def test_ranked_vocab_files_are_shipped_for_both_model_families():
    from specjax.drafters.draft_vocab import DraftVocabError, ranked_ids

    for V_, eos in ((49152, 2), (151936, 151645)):  # SmolLM2 <|im_end|>, Qwen2.5 <|im_end|>
        ids = ranked_ids(V_, 4096)
        assert len(set(ids.tolist())) == 4096 and ids.max() < V_
        assert eos in ids[:8].tolist(), "the end-of-turn token must lead the list"
    with pytest.raises(DraftVocabError, match="12345"):
        ranked_ids(12345, 10)
    with pytest.raises(DraftVocabError, match="draft_vocab_size"):
        ranked_ids(49152, 10 ** 6)
