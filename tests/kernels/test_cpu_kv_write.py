"""The CPU KV-write kernel (specjax.kernels.cpu_kv_write): bit for bit against its reference, in place in a compiled
decode loop where XLA's scatter rewrites a bfloat16 layer whole, its validator and policy, and a bfloat16 model
decoding through it."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import fresh_cache, tiny_config, tiny_params
from specjax.backends import ops
from specjax.kernels import cpu_build as cb
from specjax.kernels import cpu_kv_write as kw
from specjax.kv_cache import write_kv
from specjax.models.llama import forward, fuse_projections

pytestmark = [pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel"),
              pytest.mark.skipif(not cb.available(), reason=f"kernel unavailable here: {cb.unavailable_reason()}")]


@pytest.fixture
def mode(kernel_policy):
    """Sets SPECJAX_KERNELS=kv_write=<value> for one test (see conftest.kernel_policy)."""
    return lambda value: kernel_policy("kv_write", value)


def _uses_kernel(cache, new, lengths) -> bool:
    """Whether the kernel table gives this write the kernel here (the choice a traced forward makes)."""
    return ops.select("kv_write", cache, new, lengths).name == "kernel"


def _write(cache, new, lengths):
    """What `kv_cache.write_kv` does for one array: the op kv_write, new cast to the cache's dtype."""
    return ops.call("kv_write", cache, new.astype(cache.dtype), lengths)


def _inputs(B, T, H, S, D, lengths, dtype, seed=0):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.dtype(jnp.int8):
        cache = jnp.asarray(rng.integers(-127, 128, (B, H, S, D)), dtype)
        new = jnp.asarray(rng.integers(-127, 128, (B, T, H, D)), dtype)
    else:
        cache = jnp.asarray(rng.standard_normal((B, H, S, D)), dtype)
        new = jnp.asarray(rng.standard_normal((B, T, H, D)), dtype)
    return cache, new, jnp.asarray(lengths, jnp.int32)


# Ragged rows, a block that runs past the capacity (dropped), a full cache, one token and a verify block.
CASES = [
    (1, 1, 3, 16, 64, [0]),
    (3, 5, 3, 16, 64, [0, 7, 13]),
    (2, 4, 2, 8, 17, [8, 6]),
    (4, 13, 1, 32, 8, [1, 19, 30, 2]),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32, jnp.int8])
@pytest.mark.parametrize("B,T,H,S,D,lengths", CASES)
def test_kernel_equals_reference_bit_for_bit(B, T, H, S, D, lengths, dtype):
    cache, new, L = _inputs(B, T, H, S, D, lengths, dtype)
    want = np.asarray(kw.kv_write_reference(cache, new, L))
    got = np.asarray(kw.kv_write(jnp.array(cache), new, L))
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    # The reference itself: each new entry sits at its slot, everything else is untouched.
    c, n = np.asarray(cache), np.asarray(new)
    for b in range(B):
        for t in range(T):
            if lengths[b] + t < S:
                np.testing.assert_array_equal(want[b, :, lengths[b] + t], n[b, t])
        kept = [s for s in range(S) if not lengths[b] <= s < lengths[b] + T]
        np.testing.assert_array_equal(want[b][:, kept], c[b][:, kept])


def _decode_loop_hlo(write, dtype, S=128):
    """Compiled text of a 10-step loop that writes one token per step into a [2, 3, S, 64] cache layer."""
    B, H, D = 2, 3, 64

    def body(i, carry):
        cache, x = carry
        return write(cache, (x * (i + 1)).astype(cache.dtype), jnp.full((B,), i, jnp.int32)), x

    f = jax.jit(lambda c, x: jax.lax.fori_loop(0, 10, body, (c, x)), donate_argnums=(0,))
    return f.lower(jnp.zeros((B, H, S, D), dtype), jnp.ones((B, 1, H, D), jnp.float32)).compile().as_text()


def _whole_layer_ops(hlo: str) -> int:
    """Operations producing a whole [2, 3, 128, 64] layer other than the loop's own plumbing: copies, converts and
    fusions that rewrite it (the kernel's call writes only the new entries and is not counted)."""
    n = 0
    for line in hlo.splitlines():
        m = re.match(r"\s*(ROOT )?%\S+ = \w+\[2,3,128,64\]\S* (copy|convert|fusion|scatter)\(", line)
        n += bool(m)
    return n


def test_a_bfloat16_layer_is_written_in_place_where_xlas_scatter_rewrites_it(mode):
    # The reason the kernel exists: XLA:CPU widens a bfloat16 scatter to float32, converting (and copying) the whole
    # layer on every step. If a later XLA writes bfloat16 in place itself, the first assertion fails and the
    # kernel can go.
    mode("xla")
    assert _whole_layer_ops(_decode_loop_hlo(_write, jnp.bfloat16)) > 0
    mode("auto")
    hlo = _decode_loop_hlo(_write, jnp.bfloat16)
    assert "specjax_kv_write" in hlo
    assert _whole_layer_ops(hlo) == 0


def test_the_loop_gives_the_same_bits_either_way(mode):
    B, H, S, D = 2, 3, 16, 8
    x = jnp.asarray(np.random.default_rng(1).standard_normal((B, 1, H, D)), jnp.float32)

    def run():
        def body(i, cache):
            return _write(cache, (x * (i + 1)).astype(cache.dtype), jnp.asarray([i, 2 * i], jnp.int32))
        return np.asarray(jax.jit(lambda c: jax.lax.fori_loop(0, 12, body, c))(jnp.zeros((B, H, S, D), jnp.bfloat16)))

    mode("xla")
    want = run()
    mode("auto")
    got = run()
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_write_kv_goes_through_it_for_bfloat16(mode):
    cache, new, L = _inputs(2, 3, 2, 8, 16, [1, 6], jnp.bfloat16)
    mode("auto")
    hlo = jax.jit(lambda c, v, k, l: write_kv(c, c, k, v, l)).lower(cache, new, new, L).as_text()
    assert "specjax_kv_write" in hlo
    ck, cv = jax.jit(lambda c, k, l: write_kv(c, c, k, k, l))(cache, new, L)
    want = kw.kv_write_reference(cache, new, L)
    np.testing.assert_array_equal(np.asarray(ck).view(np.uint16), np.asarray(want).view(np.uint16))


def test_vmap_runs_the_kernel_per_element():
    cache, new, L = _inputs(1, 2, 2, 8, 4, [3], jnp.bfloat16)
    caches = jnp.stack([cache, cache + 1, cache * 2])
    got = jax.vmap(lambda c: kw._kv_write(c, new, L))(caches)
    want = jnp.stack([kw.kv_write_reference(c, new, L) for c in caches])
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


def test_gradients_equal_the_references(mode):
    cache, new, L = _inputs(2, 3, 2, 8, 4, [1, 6], jnp.float32)
    w = jnp.asarray(np.random.default_rng(2).standard_normal(cache.shape), jnp.float32)

    def loss(write):
        return lambda c, n: jnp.sum(jnp.sin(write(c, n, L)) * w)

    mode("kernel")
    got = jax.grad(loss(_write), argnums=(0, 1))(cache, new)
    want = jax.grad(loss(kw.kv_write_reference), argnums=(0, 1))(cache, new)
    for g, x in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(x))
    assert np.abs(np.asarray(got[1])).sum() > 0  # the new entries receive gradient; the dropped slot gets none


def _shapes(**change):
    s = dict(cache=(2, 3, 16, 8), new=(2, 4, 3, 8), lengths=(2,))
    d = dict(cache=jnp.bfloat16, new=jnp.bfloat16, lengths=jnp.int32)
    for name, value in change.items():
        if isinstance(value, tuple):
            s[name] = value
        else:
            d[name] = value
    return [jax.ShapeDtypeStruct(s[n], d[n]) for n in s]


@pytest.mark.parametrize("change,message", [
    (dict(cache=(2, 3, 16)), "cache must be \\[B, H, S, D\\]"),
    (dict(new=(2, 4, 3)), "new must be \\[B, T, H, D\\]"),
    (dict(new=(2, 4, 2, 8)), "does not fit cache \\(2, 3, 16, 8\\): expected \\[2, T, 3, 8\\]"),
    (dict(lengths=(3,)), "lengths must be \\[2\\]"),
    (dict(lengths=jnp.float32), "lengths must be integer"),
    (dict(cache=jnp.float64, new=jnp.float64), "cache dtype float64 is not supported: one of float32, bfloat16"),
    (dict(new=jnp.float32), "new is float32 but the cache is bfloat16: cast it first"),
])
def test_validator_names_the_problem(change, message):
    with pytest.raises(kw.KvWriteInputError, match=message):
        kw.validate_kv_write_inputs(*_shapes(**change))


def test_policy(monkeypatch):
    bf16, f32 = _shapes(), _shapes(cache=jnp.float32, new=jnp.float32)
    monkeypatch.setenv(ops.ENV, "kv_write=auto")
    assert _uses_kernel(*bf16) and _uses_kernel(*_shapes(cache=jnp.float16, new=jnp.float16))
    assert not _uses_kernel(*f32)  # XLA already writes float32 in place
    monkeypatch.setenv(ops.ENV, "kv_write=kernel")
    assert _uses_kernel(*f32)
    monkeypatch.setenv(ops.ENV, "kv_write=xla")
    assert not _uses_kernel(*bf16)
    monkeypatch.setenv(ops.ENV, "kv_write")
    with pytest.raises(ops.KernelSelectionError, match="'kv_write' is not op=implementation"):
        _uses_kernel(*bf16)


def test_unavailable_kernel_falls_back_with_one_warning(monkeypatch, kernels_unbuildable):
    monkeypatch.setenv(ops.ENV, "kv_write=auto")
    cache, new, L = _inputs(1, 2, 2, 8, 4, [3], jnp.bfloat16)
    with pytest.warns(RuntimeWarning, match="KV-cache write kernel unavailable, using XLA's scatter instead"):
        got = _write(cache, new, L)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16),
                                  np.asarray(kw.kv_write_reference(cache, new, L)).view(np.uint16))
    with pytest.raises(kw.KernelBuildError, match="unavailable: no C\\+\\+ compiler"):
        kw._kv_write(cache, new, L)


def test_bfloat16_model_decodes_the_same_bits_through_the_kernel(mode):
    cfg = tiny_config()
    params = fuse_projections(tiny_params(cfg, dtype=jnp.bfloat16))
    tokens = jnp.asarray([[5, 17, 99, 3, 250, 42, 7], [8, 8, 1, 2, 3, 4, 5]], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (2, 7))

    def run():
        fwd = jax.jit(lambda p, t, q, c: forward(p, cfg, t, q, c))
        out = fwd(params, tokens, pos, fresh_cache(cfg, 2, 16, jnp.bfloat16))
        cache = out.cache._replace(lengths=out.cache.lengths + 7)
        steps = []
        for i in range(3):  # one-token steps over the written cache
            o = fwd(params, tokens[:, i:i + 1], pos[:, :1] + 7 + i, cache)
            cache = o.cache._replace(lengths=o.cache.lengths + 1)
            steps.append(np.asarray(o.logits, np.float32))
        return steps, [np.asarray(k).view(np.uint16) for k in cache.k]

    mode("xla")
    want = run()
    mode("auto")
    got = run()
    for g, w in zip(got[0], want[0]):
        np.testing.assert_array_equal(g, w)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_array_equal(g, w)
