"""The GGUF-block product (specjax.kernels.gguf_matmul): the jnp dequantization against the gguf package's, the C++
kernel against the float32 kernel on the dequantized weight (bit for bit) and against itself row by row, the XLA
implementation, the validator and the op table's choice."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from helpers import random_gguf_blocks
from specjax.backends import ops
from specjax.errors import SpecjaxError
from specjax.kernels import cpu_build, cpu_matmul, gguf_matmul as gm

TYPES = list(gm.TYPES)
needs_kernels = pytest.mark.skipif(not cpu_build.available(), reason="the CPU kernels do not build here")


def _blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        w = np.random.default_rng(seed).normal(0, 0.2, (n, k)).astype(np.float32)
        return np.ascontiguousarray(quants.quantize(w, GGMLQuantizationType[type_name])).reshape(n, -1)
    return random_gguf_blocks(type_name, n, k, seed)


def _reference_weights(raw: np.ndarray, type_name: str, k: int) -> np.ndarray:
    return quants.dequantize(raw, GGMLQuantizationType[type_name]).reshape(raw.shape[0], k).astype(np.float32)


@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_equals_the_gguf_package_bit_for_bit(type_name):
    k = 512
    raw = _blocks(type_name, 24, k)
    want = _reference_weights(raw, type_name, k)
    got = np.asarray(gm.dequantize(jnp.asarray(raw), type_name, k))
    assert got.shape == (24, k)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@needs_kernels
@pytest.mark.parametrize("type_name", TYPES)
def test_kernel_equals_the_float32_kernel_on_the_dequantized_weight(type_name):
    k = 512
    raw = _blocks(type_name, 70, k, seed=1)  # 70 rows: a 64-row chunk and a ragged tail
    w = jnp.asarray(_reference_weights(raw, type_name, k))
    for m in (1, 2, 5, 6, 7, 13):
        x = jnp.asarray(np.random.default_rng(m).normal(size=(m, k)), jnp.float32)
        got = np.asarray(gm.gguf_matmul(x, jnp.asarray(raw), type_name))
        want = np.asarray(cpu_matmul.small_matmul(x, w))
        np.testing.assert_array_equal(got, want)


@needs_kernels
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_0"])
def test_a_token_gets_the_same_bits_whatever_the_rows_beside_it(type_name):
    k = 768
    raw = jnp.asarray(_blocks(type_name, 40, k, seed=2))
    x = jnp.asarray(np.random.default_rng(3).normal(size=(64, k)), jnp.float32)
    alone = np.stack([np.asarray(gm.gguf_matmul(x[i:i + 1], raw, type_name))[0] for i in range(64)])
    for m in (3, 9, 64):
        np.testing.assert_array_equal(np.asarray(gm.gguf_matmul(x[:m], raw, type_name)), alone[:m])


@needs_kernels
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_0", "Q8_0"])
def test_nonfinite_and_subnormal_scales_give_the_references_values(type_name):
    k = 256
    raw = _blocks(type_name, 8, k, seed=4).copy()
    t = gm.TYPES[type_name]
    where = 208 if type_name == "Q6_K" else 0
    specials = np.array([np.nan, np.inf, -np.inf, 6e-8, 0.0, -0.0, 1e-6, 65504.0], np.float16).view(np.uint8)
    for row in range(8):
        raw[row, where:where + 2] = specials[2 * row:2 * row + 2]
    w = _reference_weights(raw, type_name, k)
    got_w = np.asarray(gm.dequantize(jnp.asarray(raw), type_name, k))
    np.testing.assert_array_equal(got_w, w)  # NaNs in the same places
    x = jnp.asarray(np.random.default_rng(5).normal(size=(2, k)), jnp.float32)
    got = np.asarray(gm.gguf_matmul(x, jnp.asarray(raw), type_name))
    want = np.asarray(cpu_matmul.small_matmul(x, jnp.asarray(w)))
    np.testing.assert_array_equal(got, want)
    assert t.values in (32, 256)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K", "Q5_1"])
def test_the_xla_implementation_matches_the_reference(type_name):
    k = 512
    raw = jnp.asarray(_blocks(type_name, 16, k, seed=6))
    x = jnp.asarray(np.random.default_rng(7).normal(size=(3, k)), jnp.float32)
    got = jax.jit(lambda x, b: gm.xla_gguf_matmul(x, b, type_name=type_name))(x, raw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(gm.gguf_matmul_reference(x, raw, type_name)),
                               rtol=1e-5, atol=1e-5)


def test_the_validator_names_what_is_wrong():
    raw = jnp.asarray(_blocks("Q4_K", 4, 256))
    x = jnp.ones((2, 256), jnp.float32)
    cases = [
        (lambda: gm.validate_gguf_matmul_inputs(x, raw, "Q3_K"), "Q3_K.*supported: Q4_0"),
        (lambda: gm.validate_gguf_matmul_inputs(jnp.ones((2, 512)), raw, "Q4_K"), "take 288 bytes"),
        (lambda: gm.validate_gguf_matmul_inputs(x, raw.astype(jnp.int32), "Q4_K"), "uint8"),
        (lambda: gm.validate_gguf_matmul_inputs(x, raw[0], "Q4_K"), "uint8 \\[N, row_bytes\\]"),
        (lambda: gm.validate_gguf_matmul_inputs(x.astype(jnp.int32), raw, "Q4_K"), "float"),
        (lambda: gm.row_bytes("Q6_K", 100), "whole number of 256-value blocks"),
    ]
    for call, match in cases:
        with pytest.raises(gm.GgufMatmulInputError, match=match) as err:
            call()
        assert isinstance(err.value, SpecjaxError)


@needs_kernels
def test_the_table_picks_the_kernel_on_cpu_and_xla_under_an_override(monkeypatch):
    raw = jnp.asarray(_blocks("Q6_K", 8, 256))
    x = jnp.ones((1, 256), jnp.float32)
    assert ops.select("gguf_matmul", x, raw, type_name="Q6_K").name in ("kernel", "kernel_q8")
    monkeypatch.setenv(ops.ENV, "gguf_matmul=xla")
    assert ops.select("gguf_matmul", x, raw, type_name="Q6_K").name == "xla"


# ------------------------------------------------------------------------------ int8 activations


@needs_kernels
@pytest.mark.parametrize("type_name", gm.Q8_TYPES)
def test_the_int8_activation_kernel_matches_its_reference_and_is_row_invariant(type_name):
    k = 512
    raw = jnp.asarray(_blocks(type_name, 70, k, seed=8))
    x = jnp.asarray(np.random.default_rng(9).normal(size=(13, k)), jnp.float32)
    got = np.asarray(gm.gguf_matmul_q8(x, raw, type_name))
    want = np.asarray(gm.gguf_matmul_q8_reference(x, raw, type_name))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    exact = np.asarray(gm.gguf_matmul(x, raw, type_name))
    assert not np.array_equal(got, exact)  # the activations really were rounded
    alone = np.stack([np.asarray(gm.gguf_matmul_q8(x[i:i + 1], raw, type_name))[0] for i in range(13)])
    for m in (1, 4, 7, 13):
        np.testing.assert_array_equal(np.asarray(gm.gguf_matmul_q8(x[:m], raw, type_name)), alone[:m])


def test_activation_rounding_is_per_32_values_and_keeps_zero_blocks_zero():
    x = np.zeros((1, 64), np.float32)
    x[0, 32:] = np.linspace(-2.0, 1.0, 32)
    q, d = gm.quantize_activations(jnp.asarray(x))
    q, d = np.asarray(q), np.asarray(d)
    assert d[0, 0] == 0 and not q[0, :32].any()
    assert d[0, 1] == np.float32(2.0) / np.float32(127.0) and q[0, 32] == -127
    np.testing.assert_allclose(q[0, 32:] * d[0, 1], x[0, 32:], atol=d[0, 1] / 2 + 1e-7)
    assert gm.activation_block("Q4_K") == gm.activation_block("Q6_K") == 256 and gm.activation_block("Q5_0") == 32
    q256, d256 = gm.quantize_activations(jnp.asarray(np.tile(x, (1, 4))), 256)
    assert d256.shape == (1, 1) and np.asarray(d256)[0, 0] == d[0, 1]


@needs_kernels
def test_the_table_prefers_the_int8_kernel_only_where_the_cpu_has_vnni(monkeypatch):
    raw = jnp.asarray(_blocks("Q4_K", 8, 256))
    x = jnp.ones((1, 256), jnp.float32)
    monkeypatch.setattr(gm, "cpu_flags", lambda: ("avx512_vnni", "avx512bw", "avx512vl"))
    assert ops.select("gguf_matmul", x, raw, type_name="Q4_K").name == "kernel_q8"
    monkeypatch.setattr(gm, "cpu_flags", lambda: ("avx2",))
    assert ops.select("gguf_matmul", x, raw, type_name="Q4_K").name == "kernel"
    raw5 = jnp.asarray(_blocks("Q5_K", 8, 256))
    monkeypatch.setattr(gm, "cpu_flags", lambda: ("avx512_vnni", "avx512bw", "avx512vl"))
    assert ops.select("gguf_matmul", x, raw5, type_name="Q5_K").name == "kernel"  # not an int8 format
