"""A CPU kernel for the few-row products of decoding: y [M, N] = x [M, K] . w [N, K]^T, w float32 or bfloat16.

XLA:CPU runs products with 2-16 rows (a verify block, a batch of one-token rows) through a general matrix-product
path that repacks the weight on each call, so verifying 5 tokens costs about twice a one-token step although both
read the same weights; and it runs bfloat16 products by first converting the weight to float32, which makes
bfloat16 decoding several times slower than float32. The C++ kernel (`cpu/small_matmul.cc`) streams each weight
row once, holds a 4-row x 6-token block of float32 accumulators in registers and widens bfloat16 in registers.

The four parts, as for every specjax kernel:
- kernel body: `cpu/small_matmul.cc` (register tiles in `cpu/tiles.h`), an XLA FFI handler, compiled on first use
  with the machine's C++ compiler and registered by `specjax.kernels.cpu_build`. Without a compiler, specjax warns
  once and uses XLA's dot.
- jitted wrapper: `small_matmul(x, w)`.
- pure-jnp reference: `small_matmul_reference(x, w)`.
- input validator: `validate_small_matmul_inputs(x, w)`.

Which implementation a projection runs is the op table's choice (`specjax.backends.ops`, op `matmul`), made
when a function is traced: this module gives it `is_supported` (the validator) and `prefers`, the `auto` policy:
the kernel on the CPU platform for float32 weights with 1-16 rows and bfloat16 weights with at most 64 rows (where
it measured faster: reports/decode_cpu/README.md), XLA's dot otherwise; for any number of rows inside
`row_invariant()`, where the engines trace their decode and verify steps. `SPECJAX_KERNELS=matmul=kernel` takes
the kernel for every product it supports, `matmul=xla` never.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels import cpu_build
from specjax.kernels.cpu_build import KernelBuildError
from specjax.errors import SpecjaxError

FFI_TARGET = "specjax_small_matmul"
# Row limits of the `auto` policy: above 16 rows (float32) and 64 rows (bfloat16) XLA's blocked product wins or the
# kernel's gain is unmeasured. One-token float32 steps gain too (reports/decode_cpu/README.md, "A CPU kernel for the
# few-row products"), and plain and verify steps then share one summation order.
AUTO_F32_ROWS = (1, 16)
AUTO_BF16_ROWS = (1, 64)


class SmallMatmulInputError(SpecjaxError, ValueError):
    """Inputs the kernel cannot take (rank, shapes or dtypes), with what to change."""


# ------------------------------------------------------------------------------------------- reference, validator


def small_matmul_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] . w [N, K]^T -> [..., N] float32, in plain jnp (float32 math)."""
    return jax.lax.dot_general(x.astype(jnp.float32), w.astype(jnp.float32), (((x.ndim - 1,), (1,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST)


def validate_small_matmul_inputs(x, w) -> None:
    """Raises SmallMatmulInputError unless x [..., K] is floating and w [N, K] is float32 or bfloat16.

    Works on arrays and on jax.ShapeDtypeStruct alike (shapes and dtypes only)."""
    xs, ws = tuple(x.shape), tuple(w.shape)
    if len(xs) < 1:
        raise SmallMatmulInputError(f"x must have at least one axis [..., K], got shape {xs}")
    if len(ws) != 2:
        raise SmallMatmulInputError(f"w must be 2-D [N, K] (a weight stored [out, in]), got shape {ws}")
    if xs[-1] != ws[1]:
        raise SmallMatmulInputError(f"x [..., K={xs[-1]}] and w [N, K={ws[1]}] disagree on K")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise SmallMatmulInputError(f"x must be floating point, got {np.dtype(x.dtype).name}")
    if np.dtype(w.dtype) not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16)):
        raise SmallMatmulInputError(f"w must be float32 or bfloat16, got {np.dtype(w.dtype).name}; cast the weight")


# ------------------------------------------------------------------------------------------------- the wrapper


def _ffi(x2: jax.Array, w: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct((x2.shape[0], w.shape[0]), jnp.float32)
    # vmap runs the product once per mapped element: the weight is never broadcast.
    return jax.ffi.ffi_call(FFI_TARGET, out, vmap_method="sequential")(x2, w)


@jax.custom_vjp
def _kernel_2d(x2: jax.Array, w: jax.Array) -> jax.Array:
    return _ffi(x2, w)


def _kernel_fwd(x2, w):
    return _ffi(x2, w), (x2, w)


def _kernel_bwd(res, dy):
    # Gradients through XLA's dots: training runs large blocks, where the kernel is not meant to be used anyway.
    x2, w = res
    dx = jnp.dot(dy, w.astype(jnp.float32))
    dw = jnp.dot(dy.T, x2).astype(w.dtype)
    return dx, dw


_kernel_2d.defvjp(_kernel_fwd, _kernel_bwd)


def _small_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    validate_small_matmul_inputs(x, w)
    if not cpu_build.available():
        raise KernelBuildError(f"the CPU matmul kernel is unavailable: {cpu_build.unavailable_reason()}")
    lead = x.shape[:-1]
    y = _kernel_2d(x.reshape(-1, x.shape[-1]).astype(jnp.float32), w)
    return y.reshape(*lead, w.shape[0])


small_matmul = jax.jit(_small_matmul)
small_matmul.__doc__ = """x [..., K] . w [N, K]^T -> [..., N] float32 through the C++ kernel (CPU only).

Jitted entry point for direct use; models go through the op table (op `matmul`). No donation:
nothing here is a cache. Raises SmallMatmulInputError on bad shapes or dtypes, KernelBuildError without a
compiler."""


def _rows(x) -> int:
    return int(np.prod(x.shape[:-1], dtype=np.int64))


row_invariant = cpu_build.row_invariant


def is_supported(x, w, **options) -> bool:
    """Whether the kernel takes these shapes and dtypes (decided at trace time)."""
    try:
        validate_small_matmul_inputs(x, w)
    except SmallMatmulInputError:
        return False
    return True


def prefers(x, w, **options) -> bool:
    """The `auto` policy: within the row limits, or any number of rows inside `row_invariant()`."""
    if cpu_build.in_row_invariant():
        return True
    lo, hi = AUTO_BF16_ROWS if np.dtype(w.dtype) == np.dtype(jnp.bfloat16) else AUTO_F32_ROWS
    return lo <= _rows(x) <= hi


def kernel_matmul_t(x: jax.Array, w: jax.Array, *, out_dtype=None, weight_first: bool = False) -> jax.Array:
    """The kernel as the op table calls it inside a traced forward: x [..., K] . w [N, K]^T -> [..., N] in
    `out_dtype` (default: the dtype XLA's dot would give). weight_first is XLA's layout hint, nothing to the kernel."""
    if out_dtype is None:
        out_dtype = jnp.result_type(x.dtype, w.dtype)
    lead = x.shape[:-1]
    y = _kernel_2d(x.reshape(-1, x.shape[-1]).astype(jnp.float32), w)
    return y.reshape(*lead, w.shape[0]).astype(out_dtype)


available = cpu_build.available
unavailable_reason = cpu_build.unavailable_reason

__all__ = [
    "AUTO_BF16_ROWS", "AUTO_F32_ROWS", "KernelBuildError", "SmallMatmulInputError", "available", "is_supported",
    "kernel_matmul_t", "prefers", "row_invariant", "small_matmul", "small_matmul_reference", "unavailable_reason",
    "validate_small_matmul_inputs",
]
