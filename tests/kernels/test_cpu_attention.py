"""The CPU attention kernel (specjax.kernels.cpu_attention): against its jnp reference and XLA's version, its
validator, its policy and fallback, and the model and speculative decoding running through it."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_helpers as sh
from helpers import fresh_cache, tiny_config, tiny_params
from specjax.kernels import cpu_attention as ca
from specjax.kernels import cpu_build as cb
from specjax.backends import ops
from specjax.kernels.xla import prefix_tree_attention
from specjax.models.llama import forward, fuse_projections

pytestmark = [pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel"),
              pytest.mark.skipif(not cb.available(), reason=f"kernel unavailable here: {cb.unavailable_reason()}")]


@pytest.fixture
def mode(kernel_policy):
    """Sets SPECJAX_KERNELS=attention=<value> for one test (see conftest.kernel_policy)."""
    return lambda value: kernel_policy("attention", value)


def _inputs(B, T, Hq, Hkv, S, D, lengths, cache_dtype=jnp.float32, tree=True, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, Hq, D)), jnp.float32)
    kc = jnp.asarray(rng.standard_normal((B, Hkv, S, D)), cache_dtype)
    vc = jnp.asarray(rng.standard_normal((B, Hkv, S, D)), cache_dtype)
    kn = jnp.asarray(rng.standard_normal((B, T, Hkv, D)), jnp.float32)
    vn = jnp.asarray(rng.standard_normal((B, T, Hkv, D)), jnp.float32)
    if tree:
        # A random tree-like mask: every token sees itself and a random subset of the others.
        tm = jnp.asarray(rng.random((B, T, T)) < 0.4) | jnp.eye(T, dtype=bool)[None]
    else:
        tm = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    return q, kc, vc, kn, vn, jnp.asarray(lengths, jnp.int32), tm


# Prefix lengths cross the 128-slot blocks (0, 1, 127, 128, 129, 300, the whole cache); D crosses the 16-lane steps
# (17, 40 leave tails); T crosses the 6-query register tiles (1, 5, 13); GQA groups 1-4.
CASES = [
    (1, 1, 9, 3, 512, 64, [256]),
    (2, 5, 9, 3, 600, 64, [0, 513]),
    (3, 13, 4, 2, 400, 40, [399, 3, 129]),
    (2, 3, 8, 8, 300, 128, [300, 128]),
    (1, 4, 2, 1, 64, 17, [127]),
    (2, 7, 6, 2, 260, 32, [1, 259]),
]


@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("B,T,Hq,Hkv,S,D,lengths", CASES)
def test_kernel_matches_reference(B, T, Hq, Hkv, S, D, lengths, cache_dtype):
    args = _inputs(B, T, Hq, Hkv, S, D, lengths, cache_dtype)
    got = np.asarray(ca.prefix_attention(*args, scale=D ** -0.5))
    want = np.asarray(ca.prefix_attention_reference(*args, scale=D ** -0.5))
    assert got.shape == (B, T, Hq, D) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("L", [40, 125, 254])  # inside one 128-slot block, and chains crossing a block boundary
def test_a_chain_in_one_call_equals_one_token_steps_bit_for_bit(cache_dtype, L):
    """Token t of a chain verified in one call attends exactly as a one-token step does once tokens < t are in the
    cache: same scores (the new keys as the cache holds them), same block and column, same order of sums. Plain
    greedy decoding and greedy verification then agree bit for bit, in float32 and bfloat16."""
    B, T, Hq, Hkv, S, D = 1, 5, 4, 2, 384, 64
    q, kc, vc, kn, vn, lengths, chain = _inputs(B, T, Hq, Hkv, S, D, [L], cache_dtype, tree=False, seed=3)
    scale = D ** -0.5
    block = np.asarray(ca.prefix_attention(q, kc, vc, kn, vn, lengths, chain, scale=scale))
    for t in range(T):
        # the cache after t one-token steps: new tokens < t written at slots L..L+t-1, as the cache stores them
        k_t = kc.at[:, :, L:L + t].set(kn[:, :t].transpose(0, 2, 1, 3).astype(cache_dtype))
        v_t = vc.at[:, :, L:L + t].set(vn[:, :t].transpose(0, 2, 1, 3).astype(cache_dtype))
        step = ca.prefix_attention(q[:, t:t + 1], k_t, v_t, kn[:, t:t + 1], vn[:, t:t + 1],
                                   lengths + t, jnp.ones((B, 1, 1), bool), scale=scale)
        np.testing.assert_array_equal(np.asarray(step)[:, 0], block[:, t], err_msg=f"token {t}")


# A 9-node draft tree: parent of each node (-1: the root, the token every path starts from).
TREE_PARENTS = [-1, 0, 0, 1, 2, 3, 1, 5, 4]


def _tree_mask(parents) -> np.ndarray:
    T = len(parents)
    m = np.zeros((T, T), bool)
    for t in range(T):
        a = t
        while a >= 0:
            m[t, a] = True
            a = parents[a]
    return m


@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("L", [40, 125, 254])
def test_a_tree_in_one_call_equals_one_token_steps_along_each_path_bit_for_bit(cache_dtype, L):
    """Node t of a tree verified in one call attends exactly as a one-token step does once the path to it is in the
    cache: its ancestors sit at the slots of their depths, whatever their index in the tree. A node's index is
    not its slot (node 6 is at depth 2), so placing nodes by index breaks this across blocks and lanes."""
    B, T, Hq, Hkv, S, D = 1, len(TREE_PARENTS), 4, 2, 384, 64
    q, kc, vc, kn, vn, lengths, _ = _inputs(B, T, Hq, Hkv, S, D, [L], cache_dtype, tree=False, seed=5)
    mask = _tree_mask(TREE_PARENTS)
    scale = D ** -0.5
    block = np.asarray(ca.prefix_attention(q, kc, vc, kn, vn, lengths, jnp.asarray(mask)[None], scale=scale))
    for t in range(T):
        path = [int(j) for j in np.flatnonzero(mask[t]) if j != t]  # ancestors in depth order
        k_t = kc.at[:, :, L:L + len(path)].set(kn[:, path].transpose(0, 2, 1, 3).astype(cache_dtype))
        v_t = vc.at[:, :, L:L + len(path)].set(vn[:, path].transpose(0, 2, 1, 3).astype(cache_dtype))
        step = ca.prefix_attention(q[:, t:t + 1], k_t, v_t, kn[:, t:t + 1], vn[:, t:t + 1],
                                   lengths + len(path), jnp.ones((B, 1, 1), bool), scale=scale)
        np.testing.assert_array_equal(np.asarray(step)[:, 0], block[:, t], err_msg=f"node {t}")
    want = np.asarray(ca.prefix_attention_reference(q, kc, vc, kn, vn, lengths, jnp.asarray(mask)[None],
                                                    scale=scale))
    np.testing.assert_allclose(block, want, rtol=2e-5, atol=2e-5)


def test_kernel_matches_the_models_xla_attention():
    # The function the kernel replaces in the model, on a causal chain block.
    q, kc, vc, kn, vn, L, tm = _inputs(2, 5, 9, 3, 300, 64, [140, 7], tree=False)
    got = np.asarray(ca.prefix_attention(q, kc, vc, kn, vn, L, tm, scale=0.125))
    want = np.asarray(prefix_tree_attention(q, kc, vc, kn, vn, L, tm, 0.125))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_queries_that_see_nothing_get_zeros_and_lengths_are_clipped():
    q, kc, vc, kn, vn, _, tm = _inputs(3, 4, 4, 2, 50, 32, [0, 0, 0])
    tm = tm.at[0].set(False)  # sequence 0: empty prefix, sees no new token either
    L = jnp.asarray([0, 999, -5], jnp.int32)  # past the capacity, negative
    got = np.asarray(ca.prefix_attention(q, kc, vc, kn, vn, L, tm, scale=0.2))
    assert np.isfinite(got).all()
    assert (got[0] == 0).all()
    want = np.asarray(ca.prefix_attention_reference(q, kc, vc, kn, vn, jnp.asarray([0, 50, 0]), tm, scale=0.2))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_kernel_reads_only_the_committed_prefix():
    # NaN beyond each sequence's length must not reach the output: the kernel never reads those slots.
    q, kc, vc, kn, vn, L, tm = _inputs(2, 3, 4, 2, 400, 32, [130, 5])
    slot = jnp.arange(400)[None, None, :, None]
    poison = slot >= L[:, None, None, None]
    kc, vc = jnp.where(poison, jnp.nan, kc), jnp.where(poison, jnp.nan, vc)
    got = np.asarray(ca.prefix_attention(q, kc, vc, kn, vn, L, tm, scale=0.2))
    assert np.isfinite(got).all()


def test_vmap_runs_the_kernel_per_element():
    q, kc, vc, kn, vn, L, tm = _inputs(1, 2, 4, 2, 64, 16, [20])
    qs = jnp.stack([q, 2 * q, -q])
    got = jax.vmap(lambda q: ca.prefix_attention(q, kc, vc, kn, vn, L, tm, scale=0.25))(qs)
    want = jnp.stack([ca.prefix_attention_reference(x, kc, vc, kn, vn, L, tm, scale=0.25) for x in qs])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def _uses_kernel(*args) -> bool:
    """Whether the kernel table gives this attention the kernel here (the choice a traced forward makes)."""
    return ops.select("attention", *args, scale=0.25).name == "kernel"


def _shapes(**change):
    s = dict(q=(2, 3, 8, 16), k_cache=(2, 4, 32, 16), v_cache=(2, 4, 32, 16), k_new=(2, 3, 4, 16),
             v_new=(2, 3, 4, 16), lengths=(2,), tree_mask=(2, 3, 3))
    d = dict(q=jnp.float32, k_cache=jnp.float32, v_cache=jnp.float32, k_new=jnp.float32, v_new=jnp.float32,
             lengths=jnp.int32, tree_mask=jnp.bool_)
    for name, value in change.items():
        if isinstance(value, tuple):
            s[name] = value
        else:
            d[name] = value
    return [jax.ShapeDtypeStruct(s[n], d[n]) for n in s]


@pytest.mark.parametrize("change,message", [
    (dict(q=(2, 3, 8)), "q must be \\[B, T, Hq, D\\]"),
    (dict(k_cache=(2, 4, 32, 8), v_cache=(2, 4, 32, 8)), "k_cache must be \\[B=2, Hkv, S, D=16\\]"),
    (dict(v_cache=(2, 4, 31, 16)), "must have one shape"),
    (dict(k_cache=(2, 3, 32, 16), v_cache=(2, 3, 32, 16)), "query heads \\(8\\) must be a multiple of KV heads \\(3\\)"),
    (dict(k_new=(2, 3, 4, 15)), "k_new must be \\[B, T, Hkv, D\\]"),
    (dict(lengths=jnp.float32), "lengths must be integer"),
    (dict(tree_mask=jnp.int32), "tree_mask must be bool"),
    (dict(k_cache=jnp.float16, v_cache=jnp.float16), "float32 or bfloat16"),
    (dict(v_cache=jnp.bfloat16), "one dtype for K and V"),
    (dict(q=jnp.int32), "q must be floating point"),
])
def test_validator_names_the_problem(change, message):
    with pytest.raises(ca.PrefixAttentionInputError, match=message):
        ca.validate_prefix_attention_inputs(*_shapes(**change))


def test_policy(monkeypatch):
    small, big = _shapes(), _shapes(q=(1, 200, 8, 16), k_new=(1, 200, 4, 16), v_new=(1, 200, 4, 16),
                                    k_cache=(1, 4, 32, 16), v_cache=(1, 4, 32, 16), lengths=(1,),
                                    tree_mask=(1, 200, 200))
    monkeypatch.setenv(ops.ENV, "attention=auto")
    assert _uses_kernel(*small) and not _uses_kernel(*big)  # prefill chunks above 128 tokens stay with XLA
    assert not _uses_kernel(*_shapes(k_cache=jnp.float16, v_cache=jnp.float16))
    monkeypatch.setenv(ops.ENV, "attention=kernel")
    assert _uses_kernel(*big)
    monkeypatch.setenv(ops.ENV, "attention=xla")
    assert not _uses_kernel(*small)
    monkeypatch.setenv(ops.ENV, "atention=kernel")
    with pytest.raises(ops.KernelSelectionError, match="unknown op 'atention' in SPECJAX_KERNELS; did you mean "
                                                       "'attention'"):
        _uses_kernel(*small)


def test_unavailable_kernel_falls_back_with_one_warning(monkeypatch, kernels_unbuildable):
    monkeypatch.setenv(ops.ENV, "attention=kernel")
    q, kc, vc, kn, vn, L, tm = _inputs(1, 2, 4, 2, 40, 16, [10])
    with pytest.warns(RuntimeWarning, match="attention kernel unavailable, using XLA's attention instead: no C"):
        y = ops.call("attention", q, kc, vc, kn, vn, L, tm, scale=0.25)
    np.testing.assert_allclose(np.asarray(y), np.asarray(prefix_tree_attention(q, kc, vc, kn, vn, L, tm, 0.25)))
    with pytest.raises(ca.KernelBuildError, match="unavailable: no C\\+\\+ compiler"):
        ca._prefix_attention(q, kc, vc, kn, vn, L, tm, 0.25)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-4), (jnp.bfloat16, 0.15)])
def test_model_forward_through_the_kernel(mode, dtype, tol):
    cfg = tiny_config()
    params = fuse_projections(tiny_params(cfg, dtype=dtype))
    tokens = jnp.asarray([[5, 17, 99, 3, 250, 42, 7], [8, 8, 1, 2, 3, 4, 5]], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (2, 7))

    def run():
        fwd = jax.jit(lambda p, t, q, c: forward(p, cfg, t, q, c))
        out = fwd(params, tokens, pos, fresh_cache(cfg, 2, 16, dtype))
        # A second block over the written cache: the kernel then reads a committed prefix.
        out2 = fwd(params, tokens[:, :3], pos[:, :3] + 7, out.cache._replace(lengths=out.cache.lengths + 7))
        return np.asarray(out.logits, np.float32), np.asarray(out2.logits, np.float32)

    mode("xla")
    want = run()
    mode("kernel")
    hlo = jax.jit(lambda p, t, q, c: forward(p, cfg, t, q, c)).lower(
        params, tokens, pos, fresh_cache(cfg, 2, 16, dtype)).as_text()
    assert ca.FFI_TARGET in hlo, "the kernel was not used"
    got = run()
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16])
def test_gradients_through_the_kernel_match_the_reference(cache_dtype):
    # Training a draft model or a head differentiates through the target's forward, which calls the kernel.
    args = _inputs(2, 5, 9, 3, 200, 40, [0, 131], cache_dtype)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((2, 5, 9, 40)), jnp.float32)

    def loss(fn):
        return lambda *x: jnp.sum(w * fn(*x, *args[5:], scale=0.2))

    got = jax.jit(jax.grad(loss(ca.prefix_attention), argnums=range(5)))(*args[:5])
    want = jax.grad(loss(ca.prefix_attention_reference), argnums=range(5))(*args[:5])
    for g, r, a in zip(got, want, args):
        assert g.dtype == a.dtype and float(jnp.abs(r.astype(jnp.float32)).max()) > 0
        tol = 2e-4 if a.dtype == jnp.float32 else 2e-2
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=tol, atol=tol)


def test_model_gradient_through_the_kernel(mode):
    cfg = tiny_config()
    params = tiny_params(cfg)
    tokens = jnp.asarray([[5, 17, 99, 3, 250, 42, 7]], jnp.int32)
    pos = jnp.arange(7, dtype=jnp.int32)[None]

    def grads():
        def loss(p):
            return jax.nn.log_softmax(forward(p, cfg, tokens, pos, fresh_cache(cfg, 1, 16)).logits)[0, :-1, 3].sum()
        return jax.tree.leaves(jax.jit(jax.grad(loss))(params))

    mode("xla")
    want = grads()
    mode("kernel")
    for g, w in zip(grads(), want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-3, atol=2e-4)


@pytest.mark.parametrize("method", ["draft", "tree"])
def test_greedy_speculation_equals_plain_through_the_kernel(mode, method):
    # Every attention of the target and the draft model (prefill, one-token steps, chain and tree verify blocks)
    # runs in the kernel; XLA's attention is not traced at all.
    mode("kernel")
    sh.assert_greedy_speculation_equals_plain(method)
