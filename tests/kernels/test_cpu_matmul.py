"""The CPU matmul kernel (specjax.kernels.cpu_matmul): against its jnp reference, its validator, its policy, its
build errors, and the model and speculative decoding running through it."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_helpers as sh
from helpers import fresh_cache, tiny_config, tiny_params
from specjax.backends import ops
from specjax.kernels import cpu_build as cb
from specjax.kernels import cpu_matmul as cm
from specjax.models.llama import forward, fuse_projections

pytestmark = [pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel"),
              pytest.mark.skipif(not cb.available(), reason=f"kernel unavailable here: {cb.unavailable_reason()}")]


@pytest.fixture
def mode(kernel_policy):
    """Sets SPECJAX_KERNELS=matmul=<value> for one test (see conftest.kernel_policy)."""
    return lambda value: kernel_policy("matmul", value)


def _uses_kernel(x, w) -> bool:
    """Whether the kernel table gives this product the kernel here (the choice a traced forward makes)."""
    return ops.select("matmul", x, w).name == "kernel"


def _matmul(x, w, **options):
    return ops.call("matmul", x, w, **options)


def _inputs(lead, K, N, wdtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((*lead, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((N, K)), wdtype)
    return x, w


# Row counts cross the 6-token register tiles (6, 7, 13) and the 4-row weight tiles; K crosses the 16/32-wide
# vector steps (40, 100 leave tails); N crosses the 64-row thread chunks (130).
@pytest.mark.parametrize("wdtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("lead,K,N", [((1,), 64, 96), ((2,), 576, 130), ((5,), 40, 7), ((6,), 100, 33),
                                      ((7,), 96, 64), ((13,), 128, 130), ((20,), 32, 5), ((2, 3), 64, 9)])
def test_kernel_matches_reference(lead, K, N, wdtype):
    x, w = _inputs(lead, K, N, wdtype)
    got = np.asarray(cm.small_matmul(x, w))
    want = np.asarray(cm.small_matmul_reference(x, w))
    assert got.shape == (*lead, N) and got.dtype == np.float32
    # float32 sums in another order: error ~ sqrt(K) * eps * |terms|.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5 * np.sqrt(K))


def test_kernel_every_output_is_written():
    # NaN-filled memory would show a row or token the tiles skipped; exact zeros in, exact zeros out.
    x, w = _inputs((9,), 48, 70, jnp.float32)
    w = w.at[3].set(0.0)
    x = x.at[4].set(0.0)
    got = np.asarray(cm.small_matmul(x, w))
    assert np.isfinite(got).all()
    assert (got[:, 3] == 0).all() and (got[4] == 0).all()
    assert (got[:4, :3] != 0).all()


def test_kernel_empty_shapes():
    for lead, N in (((0,), 8), ((3,), 0)):
        x, w = _inputs(lead, 64, N, jnp.float32)
        assert cm.small_matmul(x, w).shape == (*lead, N)


@pytest.mark.parametrize("x_shape,w_shape,wdtype,match", [
    ((), (4, 4), jnp.float32, "at least one axis"),
    ((2, 8), (4, 8, 1), jnp.float32, "2-D"),
    ((2, 8), (4, 6), jnp.float32, "disagree on K"),
    ((2, 8), (4, 8), jnp.float16, "float32 or bfloat16"),
    ((2, 8), (4, 8), jnp.int32, "float32 or bfloat16"),
])
def test_validator_names_the_problem(x_shape, w_shape, wdtype, match):
    x = jax.ShapeDtypeStruct(x_shape, jnp.float32)
    w = jax.ShapeDtypeStruct(w_shape, wdtype)
    with pytest.raises(cm.SmallMatmulInputError, match=match):
        cm.validate_small_matmul_inputs(x, w)
    with pytest.raises(cm.SmallMatmulInputError, match=match):
        cm.small_matmul(jnp.zeros(x_shape, jnp.float32), jnp.zeros(w_shape, wdtype))


def test_validator_rejects_integer_x():
    with pytest.raises(cm.SmallMatmulInputError, match="x must be floating"):
        cm.validate_small_matmul_inputs(jnp.zeros((2, 8), jnp.int32), jnp.zeros((4, 8)))


def test_policy(monkeypatch):
    f32, bf16 = jnp.float32, jnp.bfloat16
    sds = jax.ShapeDtypeStruct
    monkeypatch.setenv(ops.ENV, "matmul=auto")
    assert _uses_kernel(sds((1, 1, 64), f32), sds((32, 64), f32))          # a one-token step
    assert not _uses_kernel(sds((0, 64), f32), sds((32, 64), f32))          # nothing to compute
    assert _uses_kernel(sds((1, 5, 64), f32), sds((32, 64), f32))
    assert _uses_kernel(sds((8, 2, 64), f32), sds((32, 64), f32))          # 16 rows
    assert not _uses_kernel(sds((1, 17, 64), f32), sds((32, 64), f32))
    assert _uses_kernel(sds((1, 1, 64), f32), sds((32, 64), bf16))
    assert _uses_kernel(sds((64, 64), f32), sds((32, 64), bf16))
    assert not _uses_kernel(sds((65, 64), f32), sds((32, 64), bf16))
    assert not _uses_kernel(sds((4, 64), f32), sds((32, 64), jnp.float16))  # unsupported -> XLA, no error
    with cm.row_invariant():  # decode and verify steps: one path whatever the row count
        assert _uses_kernel(sds((4, 33, 64), f32), sds((32, 64), f32))
        assert _uses_kernel(sds((4, 33, 64), f32), sds((32, 64), bf16))
        with cm.row_invariant():
            pass
        assert _uses_kernel(sds((1, 17, 64), f32), sds((32, 64), f32))
        assert not _uses_kernel(sds((4, 64), f32), sds((32, 64), jnp.float16))
    assert not _uses_kernel(sds((1, 17, 64), f32), sds((32, 64), f32))
    monkeypatch.setenv(ops.ENV, "matmul=xla")
    with cm.row_invariant():
        assert not _uses_kernel(sds((1, 64), f32), sds((32, 64), f32))
    monkeypatch.setenv(ops.ENV, "matmul=kernel")
    assert _uses_kernel(sds((300, 64), f32), sds((32, 64), f32))
    monkeypatch.setenv(ops.ENV, "matmul=xla")
    assert not _uses_kernel(sds((5, 64), f32), sds((32, 64), f32))
    monkeypatch.setenv(ops.ENV, "matmul=kernal")
    with pytest.raises(ops.KernelSelectionError, match="unknown implementation 'kernal' of op 'matmul' in "
                                                       "SPECJAX_KERNELS; did you mean 'kernel'"):
        _uses_kernel(sds((5, 64), f32), sds((32, 64), f32))


def test_matmul_op_keeps_xla_result_dtype(mode):
    mode("kernel")
    x, w = _inputs((3,), 64, 16, jnp.bfloat16)
    y = _matmul(x.astype(jnp.bfloat16), w)
    assert y.dtype == jnp.bfloat16
    assert _matmul(x, w, out_dtype=jnp.float32).dtype == jnp.float32


def test_gradient_and_vmap_through_the_kernel(mode):
    mode("kernel")
    x, w = _inputs((5,), 64, 24, jnp.float32)

    def loss(fn, x, w):
        return jnp.sum(jnp.tanh(fn(x, w)))

    gk = jax.grad(lambda x, w: loss(_matmul, x, w), argnums=(0, 1))(x, w)
    gr = jax.grad(lambda x, w: loss(cm.small_matmul_reference, x, w), argnums=(0, 1))(x, w)
    for a, b in zip(gk, gr):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    xs = jnp.stack([x, 2 * x, -x])
    got = jax.vmap(lambda x: _matmul(x, w))(xs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(cm.small_matmul_reference(xs, w)), rtol=1e-5,
                               atol=1e-4)


def test_no_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cb, "_compiler", lambda: None)
    with pytest.raises(cm.KernelBuildError, match="no C\\+\\+ compiler found \\(set CXX"):
        cb.library_path()


def test_failed_build_shows_the_compiler_error(monkeypatch, tmp_path):
    bad = tmp_path / "bad.cc"
    bad.write_text("int main( { return 0; }\n")
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cb, "SOURCES", (bad,))
    with pytest.raises(cm.KernelBuildError, match="(?s)bad.cc with .* failed:.*bad.cc:1:.*error"):
        cb.library_path()
    assert not list((tmp_path / "cache" / "kernels").glob("*.so")), "a failed build left a library behind"


def test_unavailable_kernel_falls_back_with_one_warning(monkeypatch, kernels_unbuildable):
    monkeypatch.setenv(ops.ENV, "matmul=kernel")
    x, w = _inputs((4,), 32, 8, jnp.float32)
    with pytest.warns(RuntimeWarning, match="unavailable, using XLA's dot instead: no C\\+\\+ compiler"):
        y = _matmul(x, w)
    np.testing.assert_allclose(np.asarray(y), np.asarray(cm.small_matmul_reference(x, w)), rtol=1e-5, atol=1e-5)
    with pytest.raises(cm.KernelBuildError, match="unavailable: no C\\+\\+ compiler"):
        cm._small_matmul(x, w)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-4), (jnp.bfloat16, 0.15)])
def test_model_forward_through_the_kernel(mode, dtype, tol):
    cfg = tiny_config()
    params = fuse_projections(tiny_params(cfg, dtype=dtype))
    tokens = jnp.asarray([[5, 17, 99, 3, 250, 42, 7]], jnp.int32)
    pos = jnp.arange(7, dtype=jnp.int32)[None]

    def run():
        out = jax.jit(lambda p, t, q, c: forward(p, cfg, t, q, c))(params, tokens, pos,
                                                                   fresh_cache(cfg, 1, 16, dtype))
        return np.asarray(out.logits, np.float32)

    mode("xla")
    want = run()
    mode("kernel")
    hlo = jax.jit(lambda p, t, q, c: forward(p, cfg, t, q, c)).lower(
        params, tokens, pos, fresh_cache(cfg, 1, 16, dtype)).as_text()
    assert cm.FFI_TARGET in hlo, "the kernel was not used"
    got = run()
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("method", ["draft", "tree"])
def test_greedy_speculation_equals_plain_through_the_kernel(mode, method):
    # Every product of the target and the drafter (prefill, one-token steps, chain and tree verify blocks) runs
    # in the kernel.
    mode("kernel")
    sh.assert_greedy_speculation_equals_plain(method)
