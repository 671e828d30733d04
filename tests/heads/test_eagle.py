"""EAGLE heads: drafter, dynamic trees, file formats, training (tiny random models). The shipped heads on the real
model are checked by tests/test_spec_exactness.py.

* Greedy exactness: speculative output through spec_prefill/spec_loop equals plain greedy output (dynamic tree
  and top-1 chain, EAGLE-1/2 and EAGLE-3). A "perfect" EAGLE head (the target has no attention output, so its
  next-token choice depends on the current token only, and the head copies the target's layers) makes every
  draft along the top-1 path right: each verify step must then accept exactly `depth` tokens, which exercises
  the full-acceptance bookkeeping (count = D + 1 committed pairs).
* The drafter's KV-cache path equals a from-scratch computation: after several verify steps every tree
  candidate's token and cumulative score (and the whole top-1 chain) equal what `unrolled_hidden` (the training
  path) computes from target features recomputed over the committed history.
* Dynamic tree invariants: topological order, valid parents, depth <= depth, fixed N, <= top_k children,
  distinct siblings.
* Format round trips (EAGLE-1/2, EAGLE-3, speculators) with the exact tensor names, and bad inputs.
* Training (slow): the loss falls and top-1 rises on a learnable tiny target; rerunning resumes.
* Shipped heads on SmolLM2-135M (slow): greedy output equals plain on a few Spec-Bench prompts; prints alpha, tau.
"""
from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from specjax import engine, spec_engine
from specjax.backoff import Adaptive
from specjax.drafters.eagle import EagleDrafter, EagleDrafterError, load_eagle_drafter
from specjax.heads.eagle import HeadConfig, head_config, head_logits, init_from_target, unrolled_hidden
from specjax.heads.eagle_io import (HEAD_FORMATS, HeadFormatError, HeadMismatchError, load_head, save_head)
from specjax.kv_cache import init_cache
from specjax.models.llama import forward

from spec_helpers import make_sampling, outputs, run_plain, run_spec, tiny_buckets, tiny_config, tiny_params

V = 64
BATCH = 2
MAX_NEW = 20
LAYERS = 3
E3_LAYERS = (0, 1, 2)
VD = 40  # EAGLE-3 draft vocabulary of the tiny heads
PROMPTS = [[7, 3, 9, 12, 40], [33, 17, 50, 2, 61, 8, 8, 19, 44]]
TREE = dict(top_k=3, depth=3, total_tokens=8)


def buckets_for(drafter):
    return tiny_buckets(BATCH, prompt_len=16, max_new=MAX_NEW, extra=drafter.tree.num_nodes + 8)


def noisy(tree, seed, scale=0.05):
    """Head params with random perturbations, so a head is not just a copy of target layers."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    out = [a if a.dtype.kind in "iu" else a + scale * jax.random.normal(k, a.shape, a.dtype)
           for a, k in zip(leaves, keys)]
    return jax.tree_util.tree_unflatten(treedef, out)


def dparams_for(params, head):
    d = {"head": head, "embed": params["embed"]}
    if "lm_head" in params:
        d["lm_head"] = params["lm_head"]
    return d


@pytest.fixture(scope="module")
def target():
    config = tiny_config(V, num_layers=LAYERS)
    return config, tiny_params(config, seed=0)


@pytest.fixture(scope="module")
def heads(target):
    """Random-ish EAGLE-1/2 (with fc bias) and EAGLE-3 heads for the random target: {kind: (HeadConfig, params)}."""
    config, params = target
    e1 = head_config(config, "eagle")
    p1 = noisy(init_from_target(e1, params, -1), 1)
    p1["fc_bias"] = 0.1 * jax.random.normal(jax.random.PRNGKey(5), (config.hidden_size,))
    e3 = head_config(config, "eagle3", draft_vocab_size=VD, feature_layers=E3_LAYERS)
    ids = np.sort(np.random.default_rng(0).choice(V, VD, replace=False)).astype(np.int32)
    p3 = noisy(init_from_target(e3, params, -1, draft_ids=ids), 2)
    return {"eagle": (e1, p1), "eagle3": (e3, p3)}


@pytest.fixture(scope="module")
def bigram():
    """A target whose attention outputs are zero (next token = f(current token)) and a 3-layer EAGLE head that
    reproduces its residual stream exactly: the head's argmax is always the target's greedy token."""
    config = tiny_config(V, num_layers=LAYERS)
    params = tiny_params(config, seed=3)
    for lp in params["layers"]:
        lp["wo"] = jnp.zeros_like(lp["wo"])
    # Unit final-norm weights: the norm then only rescales each row, which keeps the argmax. A sharp LM head
    # makes the top-1 path carry nearly all the score, so the dynamic tree always keeps and expands it.
    params["final_norm"] = jnp.ones_like(params["final_norm"])
    params["lm_head"] = params["lm_head"] * 30.0
    hcfg = head_config(config, "eagle", num_layers=LAYERS)
    head = {"fc": jnp.concatenate([jnp.eye(config.hidden_size), jnp.zeros((config.hidden_size,) * 2)]),
            "layers": [dict(lp) for lp in params["layers"]]}
    del head["layers"][0]["attn_norm"]  # EAGLE's first layer has no input norm; with wo = 0 it never mattered
    return config, params, hcfg, head


# Back-off on every other step: a verify step (idle 0) makes no row want to speculate, the plain step after it
# (idle 1 = probe_every) makes every row probe again.
ALTERNATE = Adaptive(min_gain=1e9, probe_every=1, max_gap_factor=1)
# One verify step, 10 plain steps, a probe, plain steps again.
LONG_GAP = Adaptive(min_gain=1e9, probe_every=10, max_gap_factor=1)


def plain_outputs(params, config, drafter):
    b = buckets_for(drafter)
    outs, _ = outputs(run_plain(params, config, b, PROMPTS, make_sampling(BATCH, max_new=MAX_NEW)), BATCH)
    return outs


# ============================================================================================ greedy exactness
@pytest.mark.parametrize("kind,back_off", [("eagle3", False), pytest.param("eagle", False, marks=pytest.mark.slow),
                                           ("eagle3", True)])
def test_dynamic_tree_greedy_matches_plain(target, heads, kind, back_off):
    config, params = target
    hcfg, hp = heads[kind]
    drafter = EagleDrafter(hcfg, **TREE)
    want = plain_outputs(params, config, drafter)
    st = run_spec(params, config, dparams_for(params, hp), drafter, buckets_for(drafter), PROMPTS,
                  make_sampling(BATCH, max_new=MAX_NEW), adaptive=ALTERNATE if back_off else None)
    got, _ = outputs(st.dec, BATCH)
    assert got == want
    assert int(np.sum(st.stats.verify_steps)) > 0
    assert (int(np.sum(st.stats.plain_steps)) > 0) == back_off


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_chain_greedy_matches_plain(target, heads, kind):
    config, params = target
    hcfg, hp = heads[kind]
    drafter = EagleDrafter.chain_of(hcfg, 4)
    want = plain_outputs(params, config, drafter)
    st = run_spec(params, config, dparams_for(params, hp), drafter, buckets_for(drafter), PROMPTS,
                  make_sampling(BATCH, max_new=MAX_NEW))
    assert outputs(st.dec, BATCH)[0] == want


@pytest.mark.slow
@pytest.mark.parametrize("chain", [False, True])
def test_perfect_head_accepts_every_draft_on_the_top1_path(bigram, chain):
    config, params, hcfg, head = bigram
    depth = 3
    drafter = EagleDrafter.chain_of(hcfg, depth) if chain else EagleDrafter(hcfg, **TREE)
    want = plain_outputs(params, config, drafter)
    st = run_spec(params, config, dparams_for(params, head), drafter, buckets_for(drafter), PROMPTS,
                  make_sampling(BATCH, max_new=MAX_NEW))
    got, _ = outputs(st.dec, BATCH)
    assert got == want
    steps = np.asarray(st.stats.verify_steps)
    acc = np.asarray(st.stats.accepted)
    # Every step but possibly the last (cut by max_new_tokens) accepts all `depth` drafts of the top-1 path.
    assert np.all(acc >= depth * (steps - 1)), (acc, steps)
    assert np.all(acc + steps + 1 >= MAX_NEW)


# ============================================================================================ KV cache vs scratch
@functools.partial(jax.jit, static_argnames=("config", "features"))
def _scratch_features(params, config, tokens, features):
    T = tokens.shape[1]
    cache = init_cache(config.num_layers, 1, T, config.num_kv_heads, config.head_dim)
    out = forward(params, config, tokens, jnp.arange(T, dtype=jnp.int32)[None], cache,
                  hidden_layers=engine.feature_layers(features), compute_logits=False)
    return engine.target_features(out, features)


@functools.partial(jax.jit, static_argnames=("hcfg", "steps"))
def _scratch_logp(head, hcfg, dparams, tokens, feats, row, steps):
    """Log-probs over the head's vocabulary [steps, Vo] at unroll steps 0..steps-1 of row `row`."""
    hs = unrolled_hidden(head, hcfg, dparams["embed"], tokens, feats, steps)[:, 0]  # [U, T, H]
    return jax.nn.log_softmax(head_logits(head, hcfg, dparams, hs[:, row]), axis=-1)


def _scratch(params, config, hcfg, head, dparams, seq, L, steps, width=64):
    """{target id: log-prob} per unroll step 0..steps-1 at row L-1, from target features recomputed on seq."""
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :len(seq)] = seq
    feats = _scratch_features(params, config, jnp.asarray(tokens), hcfg.features)
    logp = np.asarray(_scratch_logp(head, hcfg, dparams, jnp.asarray(tokens), feats, L - 1, steps))
    ids = np.asarray(head["draft_ids"]) if hcfg.kind == "eagle3" else np.arange(logp.shape[1])
    return [dict(zip(ids.tolist(), row.tolist())) for row in logp]


@functools.partial(jax.jit, static_argnames=("drafter",))
def _candidates(dparams, drafter, state, sampling):
    ctx = spec_engine.context(state, sampling)
    return drafter.candidates(dparams, drafter.flush_pending(dparams, state.dstate, ctx).cache, ctx)[:3]


@pytest.mark.parametrize("kind,adaptive,steps,catch_up", [
    ("eagle3", None, 3, 16), pytest.param("eagle", None, 3, 16, marks=pytest.mark.slow), ("eagle3", ALTERNATE, 6, 16),
    ("eagle", ALTERNATE, 5, 16), ("eagle3", LONG_GAP, 13, 4), ("eagle3", LONG_GAP, 13, 0)],
    ids=["eagle3", "eagle", "eagle3-with-plain-steps", "eagle-with-plain-steps", "eagle3-long-back-off-deferred",
         "eagle3-long-back-off-eager"])
def test_tree_candidates_equal_scratch_head_after_verify_steps(target, heads, kind, adaptive, steps, catch_up):
    """Every candidate's token and cumulative score equal a from-scratch unroll of the head on target features
    recomputed over the committed history (after verify steps with varying accept counts, and with the engine's
    back-off taking plain steps in between): the head's cache, positions and tree attention at every level agree
    with the training path. With a 10-step back-off and catch_up 4, the pairs of the plain steps reach the head's
    cache through buffer flushes during the back-off and one before the candidates (catch_up 0: every step)."""
    config, params = target
    hcfg, hp = heads[kind]
    drafter = EagleDrafter(hcfg, **TREE, catch_up=catch_up)
    dp = dparams_for(params, hp)
    sampling = make_sampling(BATCH, max_new=MAX_NEW)
    st = run_spec(params, config, dp, drafter, buckets_for(drafter), PROMPTS, sampling, max_steps=steps,
                  adaptive=adaptive)
    if adaptive is not None:
        plain_steps = np.asarray(st.stats.plain_steps)
        assert plain_steps.min() >= 2 and np.asarray(st.stats.verify_steps).min() >= 2, plain_steps
    if adaptive is LONG_GAP:
        assert plain_steps.min() >= 10, plain_steps
        if catch_up:
            assert np.asarray(st.dstate.pend_n).min() > 0, "nothing pending: the flush before the candidates is untested"
    tok, score, parent = (np.asarray(a) for a in _candidates(dp, drafter, st, sampling))
    hist = np.asarray(st.history)
    k = drafter.top_k
    for b in range(BATCH):
        L = int(np.asarray(st.dec.cache.lengths)[b])
        seq = hist[b, :L + 1].tolist()  # committed tokens and the root (the last emitted token)

        def path(c):  # tokens from the root's child down to candidate c
            out = []
            while c >= 0:
                out.append(int(tok[b, c]))
                c = int(parent[b, c])
            return out[::-1]

        logp0 = _scratch(params, config, hcfg, hp, dp, seq, L, 1)[0]
        best = sorted(logp0.items(), key=lambda kv: -kv[1])[:k]
        assert tok[b, :k].tolist() == [t for t, _ in best]
        np.testing.assert_allclose(score[b, :k], [v for _, v in best], atol=2e-4)
        checked = 0
        for c in range(k, tok.shape[1]):
            p = int(parent[b, c])
            pre = path(p)
            logp = _scratch(params, config, hcfg, hp, dp, seq + pre, L, len(pre) + 1)[len(pre)]
            assert tok[b, c] in logp
            np.testing.assert_allclose(score[b, c], score[b, p] + logp[int(tok[b, c])], atol=2e-4)
            checked += 1
        assert checked == (drafter.depth - 1) * k * k


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_chain_proposal_equals_scratch_unroll(target, heads, kind):
    config, params = target
    hcfg, hp = heads[kind]
    gamma = 4
    drafter = EagleDrafter.chain_of(hcfg, gamma)
    dp = dparams_for(params, hp)
    sampling = make_sampling(BATCH, max_new=MAX_NEW)
    st = run_spec(params, config, dp, drafter, buckets_for(drafter), PROMPTS, sampling, max_steps=4)
    prop, _ = spec_engine.propose_jit(dp, drafter, st, sampling)
    toks = np.asarray(prop.tokens)
    hist = np.asarray(st.history)
    for b in range(BATCH):
        L = int(np.asarray(st.dec.cache.lengths)[b])
        seq = hist[b, :L + 1].tolist() + toks[b, 1:].tolist()
        logps = _scratch(params, config, hcfg, hp, dp, seq, L, gamma)
        assert toks[b, 1:].tolist() == [max(lp, key=lp.get) for lp in logps]


# ============================================================================================ tree invariants
def _check_tree(tokens, parents, valid, depth, top_k, n):
    assert tokens.shape == (n,) and parents[0] == -1 and valid[0]
    d = np.zeros(n, int)
    kids = {}
    for j in range(1, n):
        if not valid[j]:
            continue
        p = int(parents[j])
        assert 0 <= p < j and valid[p], (j, p)
        d[j] = d[p] + 1
        kids.setdefault(p, []).append(int(tokens[j]))
    assert d.max() <= depth
    for p, ks in kids.items():
        assert len(ks) <= top_k and len(set(ks)) == len(ks), (p, ks)
    return d


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_dynamic_tree_invariants(target, heads, kind):
    config, params = target
    hcfg, hp = heads[kind]
    drafter = EagleDrafter(hcfg, top_k=4, depth=4, total_tokens=20)
    dp = dparams_for(params, hp)
    sampling = make_sampling(BATCH, max_new=MAX_NEW)
    from spec_helpers import spec_start

    st = spec_start(params, config, dp, drafter, buckets_for(drafter), PROMPTS, sampling)
    prop, _ = spec_engine.propose_jit(dp, drafter, st, sampling)
    assert prop.q is None and drafter.mode == "deterministic"
    assert prop.tokens.shape == (BATCH, drafter.total_tokens + 1) == (BATCH, drafter.tree.num_nodes)
    assert drafter.tree.max_depth == drafter.depth
    for b in range(BATCH):
        t, p, v = (np.asarray(a[b]) for a in (prop.tokens, prop.parents, prop.valid))
        d = _check_tree(t, p, v, drafter.depth, drafter.top_k, drafter.total_tokens + 1)
        assert int(v.sum()) == drafter.total_tokens + 1  # no ties in float32 scores: every slot is a real node
        assert d.max() >= 2  # the budget reaches past the first level
        assert t[0] == int(st.dec.last_token[b])


# ============================================================================================ merged lookup
def test_merge_puts_the_lookup_chain_first_and_shifts_the_head_nodes():
    from specjax.drafters.base import Proposal
    from specjax.drafters.with_lookup import merge

    # Head: 6 nodes (root + 5): 1 and 2 under the root, 3 under 1, 4 under 3, 5 under 2; row 1 lacks node 5.
    head = Proposal(jnp.array([[90, 11, 12, 13, 14, 15], [91, 21, 22, 23, 24, 25]]),
                    jnp.array([[-1, 0, 0, 1, 3, 2]] * 2),
                    jnp.array([[True] * 6, [True] * 5 + [False]]), None)
    # Lookup chains of 2: row 0 matched (both tokens), row 1 found nothing.
    look = Proposal(jnp.array([[90, 71, 72], [91, 0, 0]]), jnp.array([[-1, 0, 1]] * 2),
                    jnp.array([[True, True, True], [True, False, False]]), None)
    out = merge(head, look)
    # Row 0: chain as nodes 1-2, then head nodes 1-3 as nodes 3-5 with parents shifted by 2 (root stays 0).
    assert np.asarray(out.tokens[0]).tolist() == [90, 71, 72, 11, 12, 13]
    assert np.asarray(out.parents[0]).tolist() == [-1, 0, 1, 0, 0, 3]
    assert np.asarray(out.valid[0]).all()
    # Row 1: the head's proposal unchanged.
    for got, want in zip(out[:3], head[:3]):
        assert np.asarray(got[1]).tolist() == np.asarray(want[1]).tolist()


def _repeating_prompts(target):
    """Two prompts whose first greedy token already occurs in them (followed by other prompt tokens), so n-gram
    lookup (min 1) matches from the first verify step on: random 12-token prompts, kept when they qualify."""
    from spec_helpers import last_logits

    config, params = target
    rng, found = np.random.default_rng(0), []
    while len(found) < BATCH:
        seq = rng.integers(0, V, 12).tolist()
        if int(np.argmax(last_logits(params, config, seq))) in seq[:-1]:
            found.append(seq)
    return found


def test_lookup_merged_into_eagle3_tree(target, heads):
    """Through the drafter: where the context repeats, nodes 1..g are what n-gram lookup proposes and the rest
    are the head's own best nodes; the tree keeps the head's node budget and the deeper of the two depths."""
    from spec_helpers import spec_start
    from specjax.drafters.with_lookup import WithLookup
    from specjax.drafters.ngram import NgramDrafter

    config, params = target
    hcfg, hp = heads["eagle3"]
    base = EagleDrafter(hcfg, **TREE)
    lookup = NgramDrafter(4, 1, 3)
    drafter = WithLookup(base, lookup)
    assert drafter.tree.num_nodes == base.tree.num_nodes and drafter.tree.max_depth == 4
    dp = dparams_for(params, hp)
    sampling = make_sampling(BATCH, max_new=MAX_NEW)
    st = spec_start(params, config, dp, drafter, buckets_for(drafter), _repeating_prompts(target), sampling)
    got, _ = spec_engine.propose_jit(dp, drafter, st, sampling)
    want, _ = spec_engine.propose_jit(dp, base, st, sampling)
    look, _ = spec_engine.propose_jit({}, lookup, st, sampling)
    assert np.asarray(look.valid)[:, 1].all()  # both rows matched
    g, keep = 4, base.tree.num_nodes - 5
    for b in range(BATCH):
        t, p = np.asarray(got.tokens[b]), np.asarray(got.parents[b])
        assert t[1:g + 1].tolist() == np.asarray(look.tokens[b, 1:]).tolist()
        assert p[1:g + 1].tolist() == [0, 1, 2, 3]
        assert t[g + 1:].tolist() == np.asarray(want.tokens[b, 1:1 + keep]).tolist()
        hp_ = np.asarray(want.parents[b, 1:1 + keep])
        assert p[g + 1:].tolist() == np.where(hp_ > 0, hp_ + g, 0).tolist()


@pytest.mark.parametrize("back_off", [False, True])
def test_lookup_merged_tree_greedy_matches_plain(target, heads, back_off):
    from specjax.drafters.with_lookup import WithLookup
    from specjax.drafters.ngram import NgramDrafter

    config, params = target
    hcfg, hp = heads["eagle3"]
    drafter = WithLookup(EagleDrafter(hcfg, **TREE), NgramDrafter(4, 1, 3))
    b = buckets_for(drafter)
    prompts = _repeating_prompts(target)
    want, _ = outputs(run_plain(params, config, b, prompts, make_sampling(BATCH, max_new=MAX_NEW)), BATCH)
    st = run_spec(params, config, dparams_for(params, hp), drafter, b, prompts, make_sampling(BATCH, max_new=MAX_NEW),
                  adaptive=ALTERNATE if back_off else None)
    assert outputs(st.dec, BATCH)[0] == want
    assert int(np.sum(st.stats.verify_steps)) > 0


def test_lookup_merge_settings_are_checked(target, heads):
    from specjax.config import ConfigError, SpeculativeConfig
    from specjax.drafters.with_lookup import MergedDrafterError, WithLookup
    from specjax.drafters.ngram import NgramDrafter

    hcfg = heads["eagle3"][0]
    with pytest.raises(MergedDrafterError, match="lookup_tokens"):
        WithLookup(EagleDrafter(hcfg, top_k=2, depth=2, total_tokens=4), NgramDrafter(4, 1, 3))
    with pytest.raises(ConfigError, match="lookup_tokens.*eagle, eagle3, medusa or draft_model"):
        SpeculativeConfig(method="ngram", lookup_tokens=3)
    with pytest.raises(ConfigError, match="lookup_tokens"):
        SpeculativeConfig(method="eagle3", lookup_tokens=-1)


def test_drafter_settings_are_checked(heads):
    hcfg = heads["eagle"][0]
    with pytest.raises(EagleDrafterError, match="total_tokens"):
        EagleDrafter(hcfg, top_k=2, depth=5, total_tokens=3)
    with pytest.raises(EagleDrafterError, match="candidates"):
        EagleDrafter(hcfg, top_k=2, depth=2, total_tokens=7)
    with pytest.raises(EagleDrafterError, match=">= 1"):
        EagleDrafter(hcfg, top_k=0)
    assert EagleDrafter.chain_of(hcfg, 4).tree.is_chain


# ============================================================================================ formats
EXPECTED_EAGLE3 = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
    p + s for p in ("midlayer.",) for s in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "hidden_norm.weight",
        "input_layernorm.weight", "post_attention_layernorm.weight")}


def _names(path):
    with safe_open(os.path.join(path, "model.safetensors"), "numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _same(a, b):
    fa, ta = jax.tree_util.tree_flatten(jax.tree_util.tree_map(np.asarray, a))
    fb, tb = jax.tree_util.tree_flatten(jax.tree_util.tree_map(np.asarray, b))
    assert ta == tb
    for x, y in zip(fa, fb):
        np.testing.assert_array_equal(x, y)


def test_eagle_round_trip_with_reference_tensor_names(target, heads, tmp_path):
    config, params = target
    hcfg = head_config(config, "eagle", num_layers=2)
    hp = noisy(init_from_target(hcfg, params, -1), 3)
    hp["fc_bias"] = jnp.ones((config.hidden_size,))
    save_head(str(tmp_path), hcfg, hp, dtype="float32", meta={"target": "tiny"})
    t = _names(str(tmp_path))
    H = config.hidden_size
    assert t["fc.weight"].shape == (H, 2 * H) and "fc.bias" in t
    assert "layers.1.input_layernorm.weight" in t and "layers.0.input_layernorm.weight" not in t
    assert t["layers.0.self_attn.q_proj.weight"].shape == (config.num_heads * config.head_dim, H)
    assert not any("embed" in n or "lm_head" in n for n in t)
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["num_hidden_layers"] == 2 and cfg["hidden_size"] == H
    got_cfg, got = load_head(str(tmp_path), config)
    assert got_cfg == hcfg
    _same(got, hp)


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_eagle3_round_trip_with_reference_tensor_names(target, heads, tmp_path, fmt):
    config, params = target
    hcfg, hp = heads["eagle3"]
    save_head(str(tmp_path), hcfg, hp, fmt=fmt, dtype="float32", meta={"target": "tiny"})
    t = _names(str(tmp_path))
    want = EXPECTED_EAGLE3 if fmt == "eagle3" else {n.replace("midlayer.", "layers.0.") for n in EXPECTED_EAGLE3}
    assert set(t) == want
    H = config.hidden_size
    assert t["fc.weight"].shape == (H, 3 * H)
    pre = "midlayer." if fmt == "eagle3" else "layers.0."
    assert t[pre + "self_attn.q_proj.weight"].shape == (config.num_heads * config.head_dim, 2 * H)
    assert t["lm_head.weight"].shape == (VD, H)
    assert t["d2t"].dtype == np.int64 and t["t2d"].dtype == bool and t["t2d"].shape == (V,)
    ids = np.asarray(hp["draft_ids"])
    np.testing.assert_array_equal(np.arange(VD) + t["d2t"], ids)  # target id = i + d2t[i]
    assert t["t2d"].sum() == VD and t["t2d"][ids].all()
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["draft_vocab_size"] == VD
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in E3_LAYERS]
    if fmt == "speculators":
        assert cfg["speculators_config"]["algorithm"] == "eagle3"
        assert cfg["transformer_layer_config"]["hidden_size"] == H
    got_cfg, got = load_head(str(tmp_path), config)
    assert got_cfg == hcfg
    _same(got, hp)


def test_eagle3_without_recorded_layers_gets_the_reference_default(heads, tmp_path):
    hcfg, hp = heads["eagle3"]
    save_head(str(tmp_path), hcfg, hp, dtype="float32")
    cfg = json.load(open(tmp_path / "config.json"))
    del cfg["eagle_aux_hidden_state_layer_ids"], cfg["specjax_head"]
    json.dump(cfg, open(tmp_path / "config.json", "w"))
    big = tiny_config(V, num_layers=30)
    got, _ = load_head(str(tmp_path), big)
    assert got.feature_layers == (1, 14, 26)  # inputs of layers 2, 15, 27 = outputs of 1, 14, 26


def test_loaded_head_drafts_like_the_in_memory_one(target, heads, tmp_path):
    config, params = target
    hcfg, hp = heads["eagle3"]
    save_head(str(tmp_path), hcfg, hp, dtype="float32")
    drafter, dp = load_eagle_drafter(str(tmp_path), "eagle3", config, params, **TREE)
    assert drafter == EagleDrafter(hcfg, **TREE)
    _same(dp["head"], hp)
    with pytest.raises(EagleDrafterError, match="use method 'eagle3'"):
        load_eagle_drafter(str(tmp_path), "eagle", config, params)


def test_formats_are_registered():
    assert {"eagle", "eagle3", "speculators"} <= set(HEAD_FORMATS)


# ============================================================================================ bad input
def _one_line(e):
    assert "\n" not in str(e.value), str(e.value)


def test_hidden_size_mismatch_is_a_clear_error(target, heads, tmp_path):
    config, _ = target
    save_head(str(tmp_path), *heads["eagle"])
    with pytest.raises(HeadMismatchError, match="hidden size") as e:
        load_head(str(tmp_path), tiny_config(V, num_layers=LAYERS, hidden_size=48, head_dim=12))
    _one_line(e)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_vocabulary_mismatch_is_a_clear_error(target, heads, tmp_path, kind):
    save_head(str(tmp_path), *heads[kind])
    with pytest.raises(HeadMismatchError, match="vocabulary") as e:
        load_head(str(tmp_path), tiny_config(V + 8, num_layers=LAYERS))
    _one_line(e)


def test_feature_layers_beyond_the_target_are_an_error(heads, tmp_path):
    save_head(str(tmp_path), *heads["eagle3"])
    with pytest.raises(HeadMismatchError, match="layers") as e:
        load_head(str(tmp_path), tiny_config(V, num_layers=2))
    _one_line(e)


def test_draft_ids_outside_the_vocabulary_are_an_error(target, heads, tmp_path):
    config, _ = target
    save_head(str(tmp_path), *heads["eagle3"])
    from safetensors.numpy import save_file

    t = _names(str(tmp_path))
    t["d2t"] = t["d2t"] + V
    t.pop("t2d")
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(HeadMismatchError, match="outside the target vocabulary") as e:
        load_head(str(tmp_path), config)
    _one_line(e)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "head.pt"])
def test_pickled_checkpoints_are_refused_with_a_conversion_hint(target, tmp_path, name):
    config, _ = target
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / name).write_bytes(b"\x80\x04not really a pickle")
    for path in (str(tmp_path), str(tmp_path / name)):
        with pytest.raises(HeadFormatError, match="safetensors") as e:
            load_head(path, config)
        assert "weights_only=True" in str(e.value) and name in str(e.value)
        _one_line(e)


def test_unknown_corrupt_and_incomplete_files_are_errors(target, heads, tmp_path):
    config, _ = target
    from safetensors.numpy import save_file

    (tmp_path / "config.json").write_text("{}")
    save_file({"something.weight": np.zeros((2, 2), np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(HeadFormatError, match="unrecognised head format") as e:
        load_head(str(tmp_path), config)
    _one_line(e)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")
    with pytest.raises(HeadFormatError, match="corrupt"):
        load_head(str(tmp_path), config)
    save_head(str(tmp_path), *heads["eagle3"])
    t = _names(str(tmp_path))
    t.pop("midlayer.hidden_norm.weight")
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(HeadFormatError, match="midlayer.hidden_norm.weight"):
        load_head(str(tmp_path), config)
    with pytest.raises(HeadFormatError, match="does not exist"):
        load_head(str(tmp_path / "nowhere"), config)


def test_head_config_errors():
    from specjax.heads.eagle import HeadConfigError

    with pytest.raises(HeadConfigError, match="one decoder layer"):
        HeadConfig("eagle3", 8, 16, 2, 1, 4, V, num_layers=2, draft_vocab_size=8, feature_layers=(0, 1, 2))
    with pytest.raises(HeadConfigError, match="unknown head kind"):
        HeadConfig("medusa", 8, 16, 2, 1, 4, V)


# ============================================================================================ training
class _IdTokenizer:
    """Prompts written as space-separated token ids."""

    stop_token_ids = (2,)

    def apply_chat_template(self, messages):
        return messages[0]["content"]

    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids, **kw):
        return " ".join(str(int(t)) for t in ids)


def _tiny_dataset(path, params, config, n=24, prompt=8, new=24):
    """Distillation data from the target's own greedy answers to random prompts (`specjax.train.data`)."""
    from spec_helpers import tiny_llm
    from specjax.train.data import generate_dataset, save_dataset
    from specjax.train.prompts import Prompt

    rng = np.random.default_rng(0)
    prompts = [Prompt(i, "x", " ".join(map(str, rng.integers(3, V, rng.integers(4, prompt + 1))))) for i in range(n)]
    llm = tiny_llm(config, params)
    llm.tokenizer = _IdTokenizer()
    arrays = generate_dataset(llm, prompts, max_new=new, top_k=8, sample_every=0, batch=8, progress=False)
    arrays["heldout"] = np.arange(n) % 4 == 0
    save_dataset(path, arrays, {"target": "tiny", "stop_token_ids": [2]})


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_training_learns_and_resumes(bigram, tmp_path, kind):
    from spec_helpers import save_hf_llama
    from specjax.train import eagle as train_heads

    config, params, _, _ = bigram
    save_hf_llama(str(tmp_path / "target"), config, params)
    _tiny_dataset(str(tmp_path / "data.npz"), params, config)
    argv = ["--kind", kind, "--data", str(tmp_path / "data.npz"), "--out", str(tmp_path / "run"), "--target",
            str(tmp_path / "target"), "--batch", "4", "--bucket", "32", "--draft-vocab", "48", "--loss-vocab", "0",
            "--feature-layers", "0,1,2", "--eval-every", "30", "--checkpoint-every", "15", "--lr", "3e-3",
            "--eval-unroll", "3", "--no-progress"]
    first = train_heads.main(argv + ["--steps", "30"])
    recs = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    evals = [r for r in recs if r["kind"] == "eval"]
    trains = [r for r in recs if r["kind"] == "train"]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 30
    assert np.mean([r["loss"] for r in trains[-5:]]) < np.mean([r["loss"] for r in trains[:5]])
    assert evals[-1]["top1"][0] > evals[0]["top1"][0]
    assert os.path.isfile(tmp_path / "run" / "head" / "training_curve.png")
    hcfg, _ = load_head(str(tmp_path / "run" / "head"), config)
    assert hcfg.kind == kind
    # The same command again resumes from the last checkpoint: no new training steps are logged.
    again = train_heads.main(argv + ["--steps", "30"])
    assert again["heldout"]["top1"] == first["heldout"]["top1"]
    assert len([x for x in open(tmp_path / "run" / "metrics.jsonl")]) == len(recs)
    with pytest.raises(train_heads.HeadTrainError, match="other settings"):
        train_heads.main(argv + ["--steps", "30", "--lr", "1e-3"])
