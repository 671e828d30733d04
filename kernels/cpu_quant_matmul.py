"""A CPU kernel for weight-only quantized projections: y [M, N] = x [M, K] . dequantize(w) [N, K]^T.

XLA:CPU multiplies by an int8 or 4-bit weight by converting the whole weight to float32 on every call, so quantized
weights would be several times slower than float32 instead of reading a quarter or an eighth of the bytes. The C++
kernel (`cpu/quant_matmul.cc`) widens the codes in registers, block by block, and multiplies them with the float32
kernel's register tiles and summation order, for any number of rows: one summation order for plain steps and verify
blocks is what keeps greedy speculation exact for a quantized target.

Formats (`kind`, static; codes, scale and minimum are arrays; see `specjax.models.quant` for how they are made):
    kind    codes                      scale / minimum            value of w[o, k]
    int8    int8 [N, K]                float32 [N, 1]             codes * scale                 (group = K)
    int4    uint8 [N, K/2] (4-bit)     float32 [N, K/group] (both) nibble * scale + minimum
    q8_0    int8 [N, K]                float16 [N, K/32]          codes * scale
    q4_0    uint8 [N, K/2]             float16 [N, K/32]          (nibble - 8) * scale
    q4_1    uint8 [N, K/2]             float16 [N, K/32] (both)   nibble * scale + minimum
4-bit codes are packed in GGUF's order inside every 32 values (byte j of a block: value j in the low nibble, value
j + 16 in the high one).

The four parts, as for every specjax kernel:
- kernel body: `cpu/quant_matmul.cc`, an XLA FFI handler compiled on first use and registered by
  `specjax.kernels.cpu_build`. Without a compiler, specjax warns once and uses XLA (`xla_quant_matmul`).
- jitted wrapper: `quant_matmul(x, codes, scale, minimum, kind=, group=)`.
- pure-jnp reference: `quant_matmul_reference(...)` (float32 math on the dequantized weight); the XLA
  implementation the op table falls back to is `xla_quant_matmul`.
- input validator: `validate_quant_matmul_inputs(...)`.
Which one runs is the op table's choice (`specjax.backends.ops`, op `quant_matmul`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import SpecjaxError
from specjax.kernels import cpu_build
from specjax.kernels.cpu_build import KernelBuildError

FFI_TARGET = "specjax_quant_matmul"
BLOCK = 32  # GGUF block length, the granularity of 4-bit packing and of the kernel's groups
BITS = {"int8": 8, "q8_0": 8, "w8a8": 8, "int4": 4, "q4_0": 4, "q4_1": 4}
KERNEL_KINDS = ("int8", "int4", "q8_0", "q4_0", "q4_1")  # w8a8 multiplies int8 activations (Qwix), not here


class QuantMatmulInputError(SpecjaxError, ValueError):
    """Inputs the kernel cannot take (kind, group, shapes or dtypes), with what to change."""


def logical_shape(codes, kind: str) -> tuple[int, int]:
    """The [N, K] shape of the weight that `codes` of `kind` stand for."""
    n, c = codes.shape
    return int(n), int(c) * (1 if BITS[kind] == 8 else 2)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """uint8 [..., N, K/2] -> the nibbles [..., N, K] as uint8, GGUF's order per 32-block (works in jnp and jit)."""
    *lead, n, h = packed.shape
    b = packed.reshape(*lead, n, h // (BLOCK // 2), 1, BLOCK // 2)
    both = jnp.concatenate([b & 15, b >> 4], axis=-2)  # [..., N, K/32, 2, 16]
    return both.reshape(*lead, n, 2 * h)


def dequantize(codes, scale, minimum, *, kind: str, group: int, dtype=jnp.float32) -> jax.Array:
    """The float weight [N, K] the codes stand for, computed in float32 and cast to `dtype` (jnp; jittable)."""
    n, k = logical_shape(codes, kind)
    f32 = jnp.float32
    if BITS[kind] == 8:
        c = codes.astype(f32)
    else:
        c = unpack_nibbles(codes).astype(f32)
        if minimum is None:
            c = c - 8.0
    c = c.reshape(n, k // group, group)
    v = c * scale.astype(f32)[..., None]
    if minimum is not None:
        v = v + minimum.astype(f32)[..., None]
    return v.reshape(n, k).astype(dtype)


def validate_quant_matmul_inputs(x, codes, scale, minimum, *, kind: str, group: int) -> None:
    """Raises QuantMatmulInputError unless the kernel takes these: a kind of `KERNEL_KINDS`, group a positive
    multiple of 32 dividing K, x [..., K] floating, scale [N, K/group] (and minimum alike, when present).
    Works on arrays and on jax.ShapeDtypeStruct alike (shapes and dtypes only)."""
    if kind not in KERNEL_KINDS:
        raise QuantMatmulInputError(f"kind {kind!r} is not one the kernel takes: {', '.join(KERNEL_KINDS)}")
    if len(codes.shape) != 2:
        raise QuantMatmulInputError(f"codes must be 2-D [N, K or K/2], got shape {tuple(codes.shape)}")
    n, k = logical_shape(codes, kind)
    if group <= 0 or group % BLOCK or k % group:
        raise QuantMatmulInputError(f"group {group} must be a positive multiple of {BLOCK} that divides K={k}")
    if not x.shape or x.shape[-1] != k:
        raise QuantMatmulInputError(f"x [..., K={x.shape[-1] if x.shape else None}] and the weight [N, K={k}] "
                                    "disagree on K")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise QuantMatmulInputError(f"x must be floating point, got {np.dtype(x.dtype).name}")
    for name, a in (("scale", scale), ("minimum", minimum)):
        if a is not None and tuple(a.shape) != (n, k // group):
            raise QuantMatmulInputError(f"{name} must be [N, K/group] = {(n, k // group)}, got {tuple(a.shape)}")


def quant_matmul_reference(x, codes, scale, minimum, *, kind: str, group: int) -> jax.Array:
    """x [..., K] . dequantize(w)^T -> [..., N] float32 in plain jnp (float32 math)."""
    w = dequantize(codes, scale, minimum, kind=kind, group=group)
    return jax.lax.dot_general(x.astype(jnp.float32), w, (((x.ndim - 1,), (1,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST)


def xla_quant_matmul(x, codes, scale, minimum, *, kind: str, group: int, out_dtype=None) -> jax.Array:
    """XLA's product, in x's dtype by default: int8 as `(x @ codes^T) * scale` (the weight only widened, its one
    scale per output applied after the product), the other kinds dequantized inside the jitted forward and multiplied
    by XLA's dot. On XLA:CPU this converts the whole weight on every call, which is why the CPU has the kernel."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    if kind == "int8":
        y = jax.lax.dot_general(x, codes.astype(x.dtype), dims, preferred_element_type=jnp.float32)
        return (y * scale[:, 0]).astype(out_dtype)
    w = dequantize(codes, scale, minimum, kind=kind, group=group, dtype=x.dtype)
    return jax.lax.dot_general(x, w, dims, preferred_element_type=out_dtype)


# ------------------------------------------------------------------------------------------------- the wrapper


def _ffi(x2, codes, scale, minimum, kind: str, group: int) -> jax.Array:
    n = codes.shape[0]
    out = jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32)
    has_min = minimum is not None
    minimum = minimum if has_min else jnp.zeros((1,), scale.dtype)
    return jax.ffi.ffi_call(FFI_TARGET, out, vmap_method="sequential")(
        x2, codes, scale, minimum, bits=np.int64(BITS[kind]), group=np.int64(group), has_min=has_min)


def kernel_quant_matmul(x, codes, scale, minimum, *, kind: str, group: int, out_dtype=None) -> jax.Array:
    """The kernel as the op table calls it inside a traced forward (no validation, no jit): [..., N] in
    `out_dtype` (default x's dtype)."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    lead = x.shape[:-1]
    y = _ffi(x.reshape(-1, x.shape[-1]).astype(jnp.float32), codes, scale, minimum, kind, group)
    return y.reshape(*lead, codes.shape[0]).astype(out_dtype)


def _quant_matmul(x, codes, scale, minimum, kind, group):
    validate_quant_matmul_inputs(x, codes, scale, minimum, kind=kind, group=group)
    if not cpu_build.available():
        raise KernelBuildError(f"the CPU quantized-matmul kernel is unavailable: {cpu_build.unavailable_reason()}")
    return kernel_quant_matmul(x, codes, scale, minimum, kind=kind, group=group, out_dtype=jnp.float32)


quant_matmul = jax.jit(_quant_matmul, static_argnames=("kind", "group"))
quant_matmul.__doc__ = """x [..., K] . dequantize(w)^T -> [..., N] float32 through the C++ kernel (CPU only).

Jitted entry point for direct use; the model goes through the op table (`quant.linear`). No donation. Raises
QuantMatmulInputError on inputs the kernel does not take, KernelBuildError without a compiler."""


def is_supported(x, codes, scale, minimum, *, kind: str, group: int, out_dtype=None) -> bool:
    """Whether the kernel takes these inputs (shapes and dtypes only; decided at trace time)."""
    try:
        validate_quant_matmul_inputs(x, codes, scale, minimum, kind=kind, group=group)
    except QuantMatmulInputError:
        return False
    return True


__all__ = [
    "BITS", "BLOCK", "FFI_TARGET", "KERNEL_KINDS", "KernelBuildError", "QuantMatmulInputError", "dequantize",
    "is_supported", "kernel_quant_matmul", "logical_shape", "quant_matmul", "quant_matmul_reference",
    "unpack_nibbles", "validate_quant_matmul_inputs", "xla_quant_matmul",
]
