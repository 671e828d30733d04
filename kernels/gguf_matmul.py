"""Products with GGUF tensors kept as the file stores them: y [M, N] = x [M, K] . dequantize(blocks)^T.

A weight is `blocks` uint8 [N, row_bytes], each row a run of ggml blocks of one type: Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0 (32 values a block) or Q4_K, Q5_K, Q6_K (256 values a block), byte for byte as in the file. Nothing is
unpacked at load time, so a model maps its file's bytes and a decode step reads 4.5-8.5 bits a weight.

The four parts, as for every specjax kernel:
- kernel body: `cpu/gguf_matmul.cc`, an XLA FFI handler built and registered by `specjax.kernels.cpu_build`;
  it decodes each 32-value sub-block in registers and multiplies in the float32 kernel's order, so a token's
  result does not depend on how many tokens share the call (plain steps and verify blocks agree bit for bit) and
  equals the float32 product over the dequantized weight;
- jitted wrapper: `gguf_matmul(x, blocks, type_name)` (CPU platform, kernels built);
- pure-jnp reference: `gguf_matmul_reference` over `dequantize` (jittable: how GPU and TPU run these weights,
  dequantizing inside the jitted forward);
- input validator: `validate_gguf_matmul_inputs`.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.compile_cache import cpu_flags
from specjax.errors import SpecjaxError
from specjax.kernels import cpu_build

FFI_TARGET = "specjax_gguf_matmul"
FFI_TARGET_Q8 = "specjax_gguf_matmul_q8"
# The formats of the int8-activation product (`cpu/gguf_matmul_q8.cc`) and the CPU features that make it fast
# (its portable fallback is exact too, but slower than the float32 decoding).
Q8_TYPES = ("Q4_K", "Q6_K", "Q5_0", "Q8_0")
Q8_FLAGS = ("avx512_vnni", "avx512bw", "avx512vl")
Q8_BLOCK = 32  # activations per int8 scale


class BlockType(NamedTuple):
    ggml_id: int  # ggml.h's enum ggml_type
    values: int  # values per block
    nbytes: int  # bytes per block


TYPES = {
    "Q4_0": BlockType(2, 32, 18),
    "Q4_1": BlockType(3, 32, 20),
    "Q5_0": BlockType(6, 32, 22),
    "Q5_1": BlockType(7, 32, 24),
    "Q8_0": BlockType(8, 32, 34),
    "Q4_K": BlockType(12, 256, 144),
    "Q5_K": BlockType(13, 256, 176),
    "Q6_K": BlockType(14, 256, 210),
}


class GgufMatmulInputError(SpecjaxError, ValueError):
    """Inputs the GGUF block product cannot take (type, ranks, shapes, dtypes), with what is supported."""


def row_bytes(type_name: str, k: int) -> int:
    """Bytes of one row of `k` values of this type."""
    t = block_type(type_name)
    if k <= 0 or k % t.values:
        raise GgufMatmulInputError(f"a row of {type_name} holds a whole number of {t.values}-value blocks; "
                                   f"{k} values is not one")
    return k // t.values * t.nbytes


def block_type(type_name: str) -> BlockType:
    if type_name not in TYPES:
        raise GgufMatmulInputError(f"GGUF type {type_name!r} has no block product; supported: {', '.join(TYPES)}")
    return TYPES[type_name]


def validate_gguf_matmul_inputs(x, blocks, type_name: str, k: int | None = None) -> None:
    """Raises GgufMatmulInputError unless x [..., K] float and blocks uint8 [N, K / values * nbytes] agree."""
    t = block_type(type_name)
    if getattr(blocks, "ndim", None) != 2 or jnp.dtype(blocks.dtype) != jnp.uint8:
        raise GgufMatmulInputError(f"blocks must be uint8 [N, row_bytes], got {getattr(blocks, 'dtype', None)} "
                                   f"{getattr(blocks, 'shape', None)}")
    if getattr(x, "ndim", 0) < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise GgufMatmulInputError(f"x must be a float array [..., K], got {getattr(x, 'dtype', None)} "
                                   f"{getattr(x, 'shape', None)}")
    k = x.shape[-1] if k is None else k
    if x.shape[-1] != k:
        raise GgufMatmulInputError(f"x has {x.shape[-1]} inputs, the weight {k}")
    if blocks.shape[1] != row_bytes(type_name, k):
        raise GgufMatmulInputError(f"{type_name} rows of {k} values take {row_bytes(type_name, k)} bytes, "
                                   f"blocks has {blocks.shape[1]}")
    del t


# ------------------------------------------------------------------------------------------------ reference


def _half(b: jax.Array) -> jax.Array:
    """uint8 [..., 2] little-endian float16 -> float32 [...]."""
    bits = b[..., 0].astype(jnp.uint16) | (b[..., 1].astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _u32(b: jax.Array) -> jax.Array:
    """uint8 [..., 4] little-endian -> uint32 [...]."""
    b = b.astype(jnp.uint32)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _nibbles32(qs: jax.Array) -> jax.Array:
    """uint8 [..., 16] -> codes [..., 32]: value j in the low nibble of byte j, value j + 16 in its high one."""
    return jnp.concatenate([qs & 15, qs >> 4], axis=-1).astype(jnp.int32)


def _high_bits32(qh: jax.Array) -> jax.Array:
    """uint32 [...] -> [..., 32] int32: bit j of the word as the 5th bit (16) of value j."""
    return (((qh[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & 1) << 4).astype(jnp.int32)


def _k_scales(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Q4_K / Q5_K: uint8 [..., 12] -> (scale, minimum) int32 [..., 8], 6 bits each."""
    s = s.astype(jnp.int32)
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = jnp.concatenate([d & 63, (md & 15) | ((d >> 6) << 4)], axis=-1)
    mn = jnp.concatenate([m & 63, (md >> 4) | ((m >> 6) << 4)], axis=-1)
    return sc, mn


def _blocks_values(b: jax.Array, type_name: str) -> jax.Array:
    """uint8 [..., nbytes] blocks of one type -> float32 [..., values]; every operation as the kernel rounds it."""
    f32 = jnp.float32
    if type_name == "Q8_0":
        return b[..., 2:].view(jnp.int8).astype(f32) * _half(b[..., 0:2])[..., None]
    if type_name == "Q4_0":
        return (_nibbles32(b[..., 2:]) - 8).astype(f32) * _half(b[..., 0:2])[..., None]
    if type_name == "Q4_1":
        return _nibbles32(b[..., 4:]).astype(f32) * _half(b[..., 0:2])[..., None] + _half(b[..., 2:4])[..., None]
    if type_name == "Q5_0":
        q = _nibbles32(b[..., 6:]) | _high_bits32(_u32(b[..., 2:6]))
        return (q - 16).astype(f32) * _half(b[..., 0:2])[..., None]
    if type_name == "Q5_1":
        q = _nibbles32(b[..., 8:]) | _high_bits32(_u32(b[..., 4:8]))
        return q.astype(f32) * _half(b[..., 0:2])[..., None] + _half(b[..., 2:4])[..., None]
    lead = b.shape[:-1]
    if type_name in ("Q4_K", "Q5_K"):
        sc, mn = _k_scales(b[..., 4:16])
        scale = _half(b[..., 0:2])[..., None] * sc.astype(f32)  # [..., 8]
        offset = -(_half(b[..., 2:4])[..., None] * mn.astype(f32))
        qs = b[..., 16:144] if type_name == "Q4_K" else b[..., 48:176]
        qs = qs.reshape(*lead, 4, 1, 32) >> jnp.array([0, 4], jnp.uint8).reshape(2, 1)
        q = (qs & 15).reshape(*lead, 8, 32).astype(jnp.int32)  # sub-block j: chunk j // 2, nibble j % 2
        if type_name == "Q5_K":
            qh = b[..., 16:48].reshape(*lead, 1, 32) >> jnp.arange(8, dtype=jnp.uint8).reshape(8, 1)
            q = q | ((qh & 1).astype(jnp.int32) << 4)
        return (q.astype(f32) * scale[..., None] + offset[..., None]).reshape(*lead, 256)
    if type_name == "Q6_K":
        ql = b[..., 0:128].reshape(*lead, 2, 1, 64) >> jnp.array([0, 4], jnp.uint8).reshape(2, 1)
        ql = (ql & 15).reshape(*lead, 2, 4, 32)  # [half, quarter, value]: quarter = 2 * nibble + 32-byte run
        qh = b[..., 128:192].reshape(*lead, 2, 1, 32) >> jnp.array([0, 2, 4, 6], jnp.uint8).reshape(4, 1)
        q = (ql.astype(jnp.int32) | ((qh & 3).astype(jnp.int32) << 4)) - 32  # [..., 2, 4, 32]
        scale = _half(b[..., 208:210])[..., None] * b[..., 192:208].view(jnp.int8).astype(f32)  # [..., 16]
        return (q.reshape(*lead, 16, 16).astype(f32) * scale[..., None]).reshape(*lead, 256)
    raise GgufMatmulInputError(f"GGUF type {type_name!r} has no block product; supported: {', '.join(TYPES)}")


@functools.partial(jax.jit, static_argnames=("type_name", "k", "dtype"))
def dequantize(blocks: jax.Array, type_name: str, k: int, dtype=jnp.float32) -> jax.Array:
    """uint8 [N, row_bytes] -> the float weight [N, k] (computed in float32, cast to dtype). Pure jnp, jitted (also
    inside a jitted forward, where it inlines)."""
    t = block_type(type_name)
    n = blocks.shape[0]
    b = blocks.reshape(n, k // t.values, t.nbytes)
    return _blocks_values(b, type_name).reshape(n, k).astype(dtype)


def gguf_matmul_reference(x: jax.Array, blocks: jax.Array, type_name: str) -> jax.Array:
    """x [..., K] . dequantize(blocks)^T -> [..., N] float32, in plain jnp."""
    w = dequantize(blocks, type_name, x.shape[-1])
    return jax.lax.dot_general(x.astype(jnp.float32), w, (((x.ndim - 1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


# ------------------------------------------------------------------------------------------------ the kernel


def xla_gguf_matmul(x, blocks, *, type_name: str, out_dtype=None) -> jax.Array:
    """XLA's product, in x's dtype by default: the blocks dequantized inside the jitted forward (how GPU and TPU run
    these weights) and multiplied by XLA's dot. On XLA:CPU that converts the whole weight on every call, which is
    why the CPU has the kernel."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    w = dequantize(blocks, type_name, x.shape[-1], x.dtype)
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=out_dtype)


def _ffi(target: str, x, blocks, type_name: str, out_dtype) -> jax.Array:
    """One of the two C++ products (`target`) on x [..., K]: [..., N] in `out_dtype` (default x's dtype)."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    out = jax.ShapeDtypeStruct((x2.shape[0], blocks.shape[0]), jnp.float32)
    y = jax.ffi.ffi_call(target, out, vmap_method="sequential")(x2, blocks, type=np.int64(TYPES[type_name].ggml_id))
    return y.reshape(*lead, blocks.shape[0]).astype(out_dtype)


def kernel_gguf_matmul(x, blocks, *, type_name: str, out_dtype=None) -> jax.Array:
    """The kernel as the op table calls it inside a traced forward (no validation, no jit): [..., N] in
    `out_dtype` (default x's dtype)."""
    return _ffi(FFI_TARGET, x, blocks, type_name, out_dtype)


def is_supported(x, blocks, *, type_name: str, out_dtype=None) -> bool:
    """Whether the kernel takes these inputs (shapes and dtypes only; decided at trace time)."""
    try:
        validate_gguf_matmul_inputs(x, blocks, type_name)
    except GgufMatmulInputError:
        return False
    return True


def _gguf_matmul(x, blocks, type_name):
    validate_gguf_matmul_inputs(x, blocks, type_name)
    if not cpu_build.available():
        raise cpu_build.KernelBuildError(f"the CPU GGUF-block kernel is unavailable: {cpu_build.unavailable_reason()}")
    return kernel_gguf_matmul(x, blocks, type_name=type_name, out_dtype=jnp.float32)


gguf_matmul = jax.jit(_gguf_matmul, static_argnames=("type_name",))
gguf_matmul.__doc__ = """x [..., K] . dequantize(blocks)^T -> [..., N] float32 through the C++ kernel (CPU only).

Jitted entry point for direct use; the model goes through the op table (`quant.linear`). Raises
GgufMatmulInputError on inputs the kernel does not take, KernelBuildError without a compiler."""


# ------------------------------------------------------------------------------ int8 activations (as llama.cpp)


def activation_block(type_name: str) -> int:
    """Values per int8 activation scale: 256 for the K-quants (their sub-block scales then multiply integer
    sums, as llama.cpp's Q8_K), 32 otherwise."""
    return TYPES[type_name].values


def quantize_activations(x: jax.Array, block: int = Q8_BLOCK) -> tuple[jax.Array, jax.Array]:
    """x [..., K] float -> (int8 codes [..., K], scales [..., K / block] float32): per `block` values
    d = max|x| / 127 and codes round-to-nearest-even(x * (1 / d)), clipped to +-127 (0 where the block is all
    zeros), as the kernel computes them."""
    x = x.astype(jnp.float32)
    b = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    d = jnp.max(jnp.abs(b), axis=-1) / jnp.float32(127.0)
    inv = jnp.where(d != 0, jnp.float32(1.0) / jnp.where(d != 0, d, 1.0), 0.0)
    q = jnp.clip(jnp.round(b * inv[..., None]), -127, 127).astype(jnp.int8)
    return q.reshape(x.shape), d


def gguf_matmul_q8_reference(x: jax.Array, blocks: jax.Array, type_name: str) -> jax.Array:
    """The int8-activation product in plain jnp: x rounded by `quantize_activations` (per
    `activation_block(type_name)` values), times the dequantized weight, in float32 (the kernel sums in another
    order: equal up to float32 rounding)."""
    block = activation_block(type_name)
    q, d = quantize_activations(x, block)
    xr = (q.astype(jnp.float32).reshape(*q.shape[:-1], -1, block) * d[..., None]).reshape(x.shape)
    return gguf_matmul_reference(xr, blocks, type_name)


def q8_kernel_gguf_matmul(x, blocks, *, type_name: str, out_dtype=None) -> jax.Array:
    """The int8-activation kernel as the op table calls it inside a traced forward: [..., N] in `out_dtype`."""
    return _ffi(FFI_TARGET_Q8, x, blocks, type_name, out_dtype)


def q8_is_supported(x, blocks, *, type_name: str, out_dtype=None) -> bool:
    return type_name in Q8_TYPES and is_supported(x, blocks, type_name=type_name)


def q8_prefers(x, blocks, *, type_name: str, out_dtype=None) -> bool:
    """`auto` takes the int8-activation kernel where the CPU has integer dot-product instructions."""
    return set(Q8_FLAGS) <= set(cpu_flags())


def _gguf_matmul_q8(x, blocks, type_name):
    validate_gguf_matmul_inputs(x, blocks, type_name)
    if type_name not in Q8_TYPES:
        raise GgufMatmulInputError(f"the int8-activation product takes {', '.join(Q8_TYPES)}, not {type_name}")
    if not cpu_build.available():
        raise cpu_build.KernelBuildError(f"the CPU GGUF-block kernel is unavailable: {cpu_build.unavailable_reason()}")
    return q8_kernel_gguf_matmul(x, blocks, type_name=type_name, out_dtype=jnp.float32)


gguf_matmul_q8 = jax.jit(_gguf_matmul_q8, static_argnames=("type_name",))
gguf_matmul_q8.__doc__ = """q8(x) [..., K] . dequantize(blocks)^T -> [..., N] float32 through the int8-activation
kernel (CPU only), x rounded as `quantize_activations` does."""


__all__ = ["FFI_TARGET_Q8", "Q8_FLAGS", "Q8_TYPES", "activation_block", "gguf_matmul_q8", "gguf_matmul_q8_reference",
           "q8_is_supported", "q8_kernel_gguf_matmul", "q8_prefers", "quantize_activations",
"BlockType", "FFI_TARGET", "GgufMatmulInputError", "TYPES", "block_type", "dequantize", "gguf_matmul",
           "gguf_matmul_reference", "is_supported", "kernel_gguf_matmul", "row_bytes", "validate_gguf_matmul_inputs",
           "xla_gguf_matmul"]
