"""The Llama forward and its KV cache on tiny random models (fast, float32 unless stated).

What is proven:
- one forward equals an independent float64 NumPy forward (plain, GQA, Llama-3 rope scaling, Qwen2 biases,
  tied embeddings);
- prefill of right-padded prompts of different lengths, then one-token decode steps at per-sequence offsets,
  gives the logits of one causal forward over each whole sequence (so the cache holds the right entries);
- a tree verify forward (ancestor-or-self mask, positions = prefix length + depth) gives every node the
  logits of the plain forward of prefix + its root-to-node path, for a different tree in each row;
- the dense `mask` override, `dense_mask`, `hidden_layers`, `logit_positions`, bfloat16, and
  `kv_cache.write_kv` / `gather_path` / `write_path` on hand-checked examples.
Tolerance: max abs logit error 1e-4 against logits of magnitude ~5 (tiny_params is scaled up on purpose).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (ancestor_mask, fresh_cache, full_logits, jit_forward, llama3_config, numpy_forward,
                     numpy_inv_freq, tiny_config, tiny_params, tree_paths)
from specjax.kernels.reference import tree_attention_reference
from specjax.kv_cache import KVCache, gather_path, write_kv, write_path
from specjax.models.llama import cast_params, dense_mask, fuse_projections, rms_norm, rope_inv_freq

TOL = 1e-4

VARIANTS = {
    "llama-gqa": dict(),
    "llama3-rope-scaling": "llama3",
    "qwen2-bias": dict(attention_bias=True, architecture="Qwen2ForCausalLM"),
    "tied-mha": dict(tie_word_embeddings=True, num_kv_heads=4),
}


def variant_config(name):
    v = VARIANTS[name]
    return llama3_config() if v == "llama3" else tiny_config(**v)


def padded_batch(seqs, length, rng, vocab):
    """Right-pad with random (not zero) tokens so that padding leaking into real rows would change logits."""
    out = rng.integers(0, vocab, (len(seqs), length)).astype(np.int32)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


@pytest.mark.parametrize("layout", ["canonical", "fused"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_forward_matches_numpy_reference(name, layout):
    cfg = variant_config(name)
    params = tiny_params(cfg, seed=1)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 48)
    # The reference reads the canonical layout; the forward runs either (fused = the layout LLM runs).
    ours = full_logits(fuse_projections(params) if layout == "fused" else params, cfg, tokens)
    ref, _ = numpy_forward(params, cfg, tokens)
    assert ref.std() > 0.5, "logits too flat for the comparison to mean anything"
    np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)


def test_prefill_then_decode_matches_full_forward():
    cfg = tiny_config()
    params = tiny_params(cfg, seed=2)
    rng = np.random.default_rng(3)
    lens = [5, 11, 16]
    steps = 6
    seqs = [rng.integers(0, cfg.vocab_size, n + steps).astype(np.int32) for n in lens]
    P, capacity = 16, 32
    prompts = padded_batch([s[:n] for s, n in zip(seqs, lens)], P, rng, cfg.vocab_size)
    cache = fresh_cache(cfg, 3, capacity)
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (3, P))
    out = jit_forward(params, cfg, jnp.asarray(prompts), positions, cache)
    refs = [full_logits(params, cfg, s) for s in seqs]
    for b, n in enumerate(lens):
        np.testing.assert_allclose(np.asarray(out.logits[b, :n]), refs[b][:n], atol=TOL, rtol=0)

    cache = out.cache._replace(lengths=jnp.asarray(lens, jnp.int32))
    for i in range(steps):
        tok = jnp.asarray([[s[n + i]] for s, n in zip(seqs, lens)], jnp.int32)
        out = jit_forward(params, cfg, tok, cache.lengths[:, None], cache)
        for b, n in enumerate(lens):
            np.testing.assert_allclose(np.asarray(out.logits[b, 0]), refs[b][n + i], atol=TOL, rtol=0,
                                       err_msg=f"row {b}, decode step {i}")
        assert np.array_equal(np.asarray(out.cache.lengths), np.asarray(cache.lengths)), "forward must not move lengths"
        cache = out.cache._replace(lengths=cache.lengths + 1)
    # The per-row K entries must be those of the full sequence at the same slots.
    full = jit_forward(params, cfg, jnp.asarray(seqs[0])[None], jnp.arange(len(seqs[0]), dtype=jnp.int32)[None],
                   fresh_cache(cfg, 1, capacity))
    n0 = lens[0] + steps
    np.testing.assert_allclose(np.asarray(cache.k[1][0, :, :n0]), np.asarray(full.cache.k[1][0, :, :n0]), atol=1e-5)


def test_prefill_logit_positions_pick_rows():
    cfg = tiny_config()
    params = tiny_params(cfg, seed=4)
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 16)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))
    every = jit_forward(params, cfg, tokens, pos, fresh_cache(cfg, 2, 16)).logits
    picks = jnp.asarray([[3, 15], [0, 9]], jnp.int32)
    some = jit_forward(params, cfg, tokens, pos, fresh_cache(cfg, 2, 16), logit_positions=picks).logits
    assert some.shape == (2, 2, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(some), np.asarray(jnp.take_along_axis(every, picks[..., None], axis=1)),
                               atol=1e-6)


# A different tree in each row: a branching one and a plain chain.
TREES = [[-1, 0, 0, 1, 1, 2, 3], [-1, 0, 1, 2, 3, 4, 5]]


def _verify_setup(attention_seed=6):
    cfg = tiny_config()
    params = tiny_params(cfg, seed=attention_seed)
    rng = np.random.default_rng(7)
    lens = [7, 12]
    prefixes = [rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in lens]
    capacity = 32
    prompts = padded_batch(prefixes, 12, rng, cfg.vocab_size)
    out = jit_forward(params, cfg, jnp.asarray(prompts), jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12)),
                  fresh_cache(cfg, 2, capacity))
    cache = out.cache._replace(lengths=jnp.asarray(lens, jnp.int32))
    N = len(TREES[0])
    nodes = rng.integers(0, cfg.vocab_size, (2, N)).astype(np.int32)
    masks = np.stack([ancestor_mask(t) for t in TREES])
    depth = masks.sum(-1) - 1  # [B, N]: root has depth 0
    positions = np.asarray(lens)[:, None] + depth
    return cfg, params, cache, prefixes, nodes, masks, positions


@pytest.mark.parametrize("attention", ["reference", "kernel-reference"])
def test_tree_verify_matches_sequential_paths(attention):
    cfg, params, cache, prefixes, nodes, masks, positions = _verify_setup()
    fn = tree_attention_reference if attention == "kernel-reference" else None
    out = jit_forward(params, cfg, jnp.asarray(nodes), jnp.asarray(positions, jnp.int32), cache, jnp.asarray(masks),
                  attention_fn=fn)
    for b, parents in enumerate(TREES):
        for i, path in enumerate(tree_paths(parents)):
            seq = np.concatenate([prefixes[b], nodes[b, path]])
            ref = full_logits(params, cfg, seq)[-1]
            np.testing.assert_allclose(np.asarray(out.logits[b, i]), ref, atol=TOL, rtol=0,
                                       err_msg=f"row {b} node {i} path {path}")
    # The tree nodes sit at slots [length, length + N) in node order, the prefix untouched.
    np.testing.assert_array_equal(np.asarray(out.cache.k[0][:, :, :7]), np.asarray(cache.k[0][:, :, :7]))


def test_tree_verify_positions_matter():
    """Guard for the test above: node order positions (length + index) instead of depths give other logits."""
    cfg, params, cache, prefixes, nodes, masks, positions = _verify_setup()
    good = jit_forward(params, cfg, jnp.asarray(nodes), jnp.asarray(positions, jnp.int32), cache, jnp.asarray(masks))
    flat = np.asarray(cache.lengths)[:, None] + np.arange(nodes.shape[1])
    bad = jit_forward(params, cfg, jnp.asarray(nodes), jnp.asarray(flat, jnp.int32), cache, jnp.asarray(masks))
    # Row 0 is branching (depth != index from node 2 on); row 1 is a chain, where both coincide.
    assert np.abs(np.asarray(good.logits[0, 2:] - bad.logits[0, 2:])).max() > 1e-2
    np.testing.assert_allclose(np.asarray(good.logits[1]), np.asarray(bad.logits[1]), atol=1e-6)


def test_dense_mask_matches_brute_force():
    rng = np.random.default_rng(8)
    B, T, S = 3, 5, 16
    lengths = np.array([0, 4, 11])
    tm = rng.random((B, T, T)) < 0.5
    got = np.asarray(dense_mask(jnp.asarray(lengths, jnp.int32), jnp.asarray(tm), S))
    want = np.zeros((B, T, S), bool)
    for b in range(B):
        for t in range(T):
            for s in range(S):
                j = s - lengths[b]
                want[b, t, s] = s < lengths[b] or (0 <= j < T and tm[b, t, j])
    np.testing.assert_array_equal(got, want)


def test_dense_mask_override_equals_tree_path():
    cfg, params, cache, prefixes, nodes, masks, positions = _verify_setup()
    toks, pos, tm = jnp.asarray(nodes), jnp.asarray(positions, jnp.int32), jnp.asarray(masks)
    via_tree = jit_forward(params, cfg, toks, pos, cache, tm)
    via_mask = jit_forward(params, cfg, toks, pos, cache, mask=dense_mask(cache.lengths, tm, cache.capacity))
    # Two implementations (write-then-attend over the dense mask; prefix + tree block before the write) that
    # sum in different orders: float32 rounding apart, nothing more.
    np.testing.assert_allclose(np.asarray(via_mask.logits), np.asarray(via_tree.logits), atol=2e-5)
    np.testing.assert_array_equal(np.asarray(via_mask.cache.k[0]), np.asarray(via_tree.cache.k[0]))


def test_dense_mask_override_is_used():
    """Hiding the whole prefix turns a chain into a fresh sequence: RoPE is relative, so its logits are those of
    the chain's tokens alone at positions 0.. (while the prefix-visible result differs)."""
    cfg, params, cache, prefixes, nodes, masks, positions = _verify_setup()
    b = 1  # the chain row
    toks, pos = jnp.asarray(nodes), jnp.asarray(positions, jnp.int32)
    N = nodes.shape[1]
    no_prefix = np.zeros((2, N, cache.capacity), bool)
    lens = np.asarray(cache.lengths)
    for r in range(2):
        no_prefix[r, :, lens[r]:lens[r] + N] = masks[r]
    out = jit_forward(params, cfg, toks, pos, cache, mask=jnp.asarray(no_prefix))
    alone = full_logits(params, cfg, nodes[b])
    np.testing.assert_allclose(np.asarray(out.logits[b]), alone, atol=TOL)
    with_prefix = jit_forward(params, cfg, toks, pos, cache, jnp.asarray(masks))
    assert np.abs(np.asarray(with_prefix.logits[b]) - alone).max() > 1e-2


def test_dense_mask_with_kernel_is_refused():
    cfg, params, cache, prefixes, nodes, masks, positions = _verify_setup()
    with pytest.raises(ValueError, match="dense `mask`"):
        jit_forward(params, cfg, jnp.asarray(nodes), jnp.asarray(positions, jnp.int32), cache,
                mask=dense_mask(cache.lengths, jnp.asarray(masks), cache.capacity),
                attention_fn=tree_attention_reference)


def test_llama3_rope_scaling_frequencies():
    plain, scaled = tiny_config(), llama3_config()
    f0, f1 = np.asarray(rope_inv_freq(plain)), np.asarray(rope_inv_freq(scaled))
    np.testing.assert_allclose(f1, numpy_inv_freq(scaled), rtol=1e-6)
    wavelen = 2 * np.pi / f0
    high, low = wavelen < 64 / 4, wavelen > 64 / 1  # original_max_position_embeddings / high|low_freq_factor
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any(), "the test config must exercise all three bands"
    np.testing.assert_allclose(f1[high], f0[high], rtol=1e-6)
    np.testing.assert_allclose(f1[low], f0[low] / 8, rtol=1e-6)
    assert np.all((f1[mid] < f0[mid]) & (f1[mid] > f0[mid] / 8))


def test_llama3_rope_scaling_changes_logits():
    plain, scaled = tiny_config(), llama3_config()
    params = tiny_params(plain, seed=9)
    tokens = np.random.default_rng(10).integers(0, plain.vocab_size, 40)
    a, b = full_logits(params, plain, tokens), full_logits(params, scaled, tokens)
    # Position 0 has no rotation at all, so the first token's logits agree; later ones do not.
    np.testing.assert_allclose(a[0], b[0], atol=1e-5)
    assert np.abs(a[20:] - b[20:]).max() > 1e-2


def test_linear_rope_scaling_is_position_division():
    """Linear scaling by f at positions p equals no scaling at positions p / f."""
    lin = tiny_config(rope_scaling=(("factor", 4.0), ("rope_type", "linear")))
    plain = tiny_config()
    params = tiny_params(plain, seed=11)
    tokens = jnp.asarray(np.random.default_rng(12).integers(0, plain.vocab_size, (1, 8)), jnp.int32)
    pos = jnp.arange(0, 32, 4, dtype=jnp.int32)[None]
    a = jit_forward(params, lin, tokens, pos, fresh_cache(lin, 1, 8)).logits
    b = jit_forward(params, plain, tokens, pos // 4, fresh_cache(plain, 1, 8)).logits
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_fuse_projections_layout():
    cfg = tiny_config(attention_bias=True, architecture="Qwen2ForCausalLM")
    params = tiny_params(cfg, seed=21)
    before = jax.tree_util.tree_map(np.asarray, params)
    fused = fuse_projections(params)
    lp, fp = params["layers"][0], fused["layers"][0]
    q, kv, F = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    assert sorted(fp) == ["attn_norm", "bqkv", "mlp_norm", "w_down_t", "w_gu_t", "wo_t", "wqkv_t"]
    assert fp["wqkv_t"].shape == (q + 2 * kv, cfg.hidden_size) and fp["w_gu_t"].shape == (2 * F, cfg.hidden_size)
    # Rows are [out, in]: q rows first, then k, then v; gate rows, then up.
    np.testing.assert_array_equal(fp["wqkv_t"][q:q + kv], np.asarray(lp["wk"]).T)
    np.testing.assert_array_equal(fp["w_gu_t"][F:], np.asarray(lp["w_up"]).T)
    np.testing.assert_array_equal(fp["bqkv"][q + kv:], lp["bv"])
    np.testing.assert_array_equal(fp["w_down_t"], np.asarray(lp["w_down"]).T)
    # The input is untouched and fusing twice changes nothing.
    jax.tree_util.tree_map(np.testing.assert_array_equal, before, jax.tree_util.tree_map(np.asarray, params))
    jax.tree_util.tree_map(np.testing.assert_array_equal, fused, fuse_projections(fused))


def test_qwen2_biases_are_applied():
    biased = tiny_config(attention_bias=True, architecture="Qwen2ForCausalLM")
    plain = tiny_config()
    params = tiny_params(biased, seed=13)
    tokens = np.random.default_rng(14).integers(0, plain.vocab_size, 24)
    zero = jax.tree_util.tree_map(lambda a: a, params)
    zero["layers"] = [dict(lp, bq=0 * lp["bq"], bk=0 * lp["bk"], bv=0 * lp["bv"]) for lp in params["layers"]]
    without = {**params, "layers": [{k: v for k, v in lp.items() if k not in ("bq", "bk", "bv")}
                                    for lp in params["layers"]]}
    np.testing.assert_allclose(full_logits(zero, biased, tokens), full_logits(without, plain, tokens), atol=1e-6)
    assert np.abs(full_logits(params, biased, tokens) - full_logits(without, plain, tokens)).max() > 1e-2


def test_bfloat16_forward_close_to_float32():
    cfg = tiny_config()
    params = tiny_params(cfg, seed=15)
    tokens = np.random.default_rng(16).integers(0, cfg.vocab_size, 48)
    f32 = full_logits(params, cfg, tokens)
    bf = full_logits(cast_params(params, jnp.bfloat16), cfg, tokens)
    assert bf.dtype == np.float32  # logits always come back in float32
    err = np.abs(bf - f32).max() / np.abs(f32).max()
    assert err < 5e-2, f"bf16 relative logit error {err:.3g}"
    agree = np.mean(bf.argmax(-1) == f32.argmax(-1))
    assert agree >= 0.9, f"bf16 top-1 agrees with f32 at only {agree:.0%} of positions"


def test_bfloat16_cache_keeps_its_dtype():
    cfg = tiny_config()
    params = cast_params(tiny_params(cfg, seed=15), jnp.bfloat16)
    cache = fresh_cache(cfg, 1, 16, jnp.bfloat16)
    out = jit_forward(params, cfg, jnp.zeros((1, 4), jnp.int32), jnp.arange(4, dtype=jnp.int32)[None], cache)
    assert out.cache.k[0].dtype == jnp.bfloat16 and out.hidden.dtype == jnp.bfloat16


def test_hidden_layers_returns_requested_layers():
    cfg = tiny_config(num_layers=3)
    params = tiny_params(cfg, seed=17)
    tokens = np.random.default_rng(18).integers(0, cfg.vocab_size, 12)
    _, residuals = numpy_forward(params, cfg, tokens)
    out = jit_forward(params, cfg, jnp.asarray(tokens, jnp.int32)[None], jnp.arange(12, dtype=jnp.int32)[None],
                  fresh_cache(cfg, 1, 16), hidden_layers=(0, -1, 1))
    assert out.layer_hidden.shape == (3, 1, 12, cfg.hidden_size)
    for k, layer in enumerate((0, 2, 1)):
        np.testing.assert_allclose(np.asarray(out.layer_hidden[k, 0]), residuals[layer], atol=1e-4,
                                   err_msg=f"hidden_layers entry {k} should be layer {layer}")
    final = rms_norm(out.layer_hidden[1], params["final_norm"], cfg.rms_norm_eps)
    np.testing.assert_allclose(np.asarray(final), np.asarray(out.hidden), atol=1e-5)
    plain = jit_forward(params, cfg, jnp.asarray(tokens, jnp.int32)[None], jnp.arange(12, dtype=jnp.int32)[None],
                    fresh_cache(cfg, 1, 16), compute_logits=False)
    assert plain.layer_hidden is None and plain.logits is None


def _labelled_cache(lengths, S=10):
    """One layer, Hkv = D = 1, each slot holding 100 * row + slot so moves can be read off."""
    B = len(lengths)
    k = (100 * np.arange(B)[:, None] + np.arange(S)[None, :]).astype(np.float32)[:, None, :, None]  # [B, 1, S, 1]
    return KVCache((jnp.asarray(k),), (jnp.asarray(-k),), jnp.asarray(lengths, jnp.int32))


def test_accepted_path_is_gathered_and_written_in_depth_order():
    # Row 0: prefix of 3, six tree nodes, accepted path = nodes 0, 2, 5. Row 1: prefix of 9 in a 10-slot cache,
    # path nodes 0, 1, 4: only the first fits, the rest is dropped. Node n of row b carries 1000 * b + 10 * n + 7.
    cache = _labelled_cache([3, 9])
    nodes = (1000 * np.arange(2)[:, None] + 10 * np.arange(6)[None, :] + 7).astype(np.float32)[:, :, None, None]
    new_kv = ((jnp.asarray(nodes),), (jnp.asarray(-nodes),))  # one layer, [B, N, Hkv, D]
    path = gather_path(new_kv, jnp.asarray([[0, 2, 5], [0, 1, 4]], jnp.int32))
    np.testing.assert_array_equal(np.asarray(path[0][0])[:, :, 0, 0], [[7, 27, 57], [1007, 1017, 1047]])
    out = write_path(cache, path, cache.lengths)
    k = np.asarray(out.k[0])[:, 0, :, 0]
    np.testing.assert_array_equal(k[0], [0, 1, 2, 7, 27, 57, 6, 7, 8, 9])
    np.testing.assert_array_equal(k[1], [100, 101, 102, 103, 104, 105, 106, 107, 108, 1007])
    np.testing.assert_array_equal(np.asarray(out.v[0])[:, 0, :, 0], -k)
    np.testing.assert_array_equal(np.asarray(out.lengths), [3, 9])  # the caller advances the lengths


def test_write_kv_offsets_and_drop_past_capacity():
    ck = jnp.zeros((2, 1, 6, 1))  # [B, Hkv, S, D]
    new = jnp.asarray([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])[:, :, None, None]  # [B, T, Hkv, D]
    k, v = write_kv(ck, ck, new, -new, jnp.asarray([1, 4], jnp.int32))
    np.testing.assert_array_equal(np.asarray(k)[:, 0, :, 0], [[0, 1, 2, 3, 0, 0], [0, 0, 0, 0, 4, 5]])
    np.testing.assert_array_equal(np.asarray(v), -np.asarray(k))


@pytest.mark.parametrize("D", [576, 64, 100])
def test_rms_norm_of_a_row_does_not_depend_on_the_block_around_it(D):
    """A plain step normalises [B, 1, D], a verify block [B, T, D]: the same token must come out bit for bit the
    same (XLA's reduce sums a row in an order picked from the whole operand's shape; `fixed_order_sum` does not)."""
    from specjax.models.llama import rms_norm

    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((4, 5, D)) * rng.uniform(0.01, 3.0, (1, 1, D)), jnp.float32)
    w = jnp.asarray(rng.uniform(0.5, 1.5, D), jnp.float32)
    f = jax.jit(lambda a: rms_norm(a, w, 1e-5))
    block = np.asarray(f(x))
    np.testing.assert_array_equal(np.asarray(f(x[:, :1])), block[:, :1])
    np.testing.assert_array_equal(np.asarray(f(x[:1, :1])), block[:1, :1])
    np.testing.assert_allclose(block, np.asarray(x) / np.sqrt(np.mean(np.asarray(x) ** 2, -1, keepdims=True) + 1e-5)
                               * np.asarray(w), rtol=1e-5)
