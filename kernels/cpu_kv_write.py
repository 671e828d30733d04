"""A CPU kernel that writes new tokens into a KV cache layer in place.

XLA:CPU has no bfloat16 scatter: it widens the cache layer to float32, scatters and narrows it back, so a 16-bit
float cache had every layer's K and V rewritten whole (and copied) on every decode and verify step, a cost that
grows with the cache's capacity rather than with the tokens written. The C++ kernel (`cpu/kv_write.cc`) copies only
the new entries into the cache buffer, which XLA aliases to its output.

The four parts, as for every specjax kernel:
- kernel body: `cpu/kv_write.cc`, an XLA FFI handler compiled on first use and registered by
  `specjax.kernels.cpu_build`. Without a compiler, specjax warns once and keeps XLA's scatter.
- jitted wrapper: `kv_write(cache, new, lengths)`, the cache donated.
- pure-jnp reference: `kv_write_reference(...)`, XLA's scatter with out-of-range slots dropped.
- input validator: `validate_kv_write_inputs(...)`.

Which implementation writes is the op table's choice (`specjax.backends.ops`, op `kv_write`, called by
`specjax.kv_cache.write_kv`), made when a function is traced: this module gives it `is_supported` (the validator)
and `prefers`, the `auto` policy: the kernel on the CPU platform for bfloat16 and float16 caches, the ones XLA:CPU
widens. `SPECJAX_KERNELS=kv_write=kernel` takes it for every cache dtype it copies (float32 and int8 too),
`kv_write=xla` never. Under a device mesh the scatter stays with XLA, which can partition it (the table's rule for
every custom call). Values are copied bit for bit, so the choice never changes a result.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import SpecjaxError
from specjax.kernels import cpu_build
from specjax.kernels.cpu_build import KernelBuildError

FFI_TARGET = "specjax_kv_write"
# Element types the kernel copies (it moves bytes: 1, 2 or 4 per element).
DTYPES = tuple(np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8))
# The ones XLA:CPU rewrites whole on every scatter: `auto` takes the kernel for these.
AUTO_DTYPES = tuple(np.dtype(d) for d in (jnp.bfloat16, jnp.float16))


class KvWriteInputError(SpecjaxError, ValueError):
    """Inputs the kernel cannot take (ranks, shapes or dtypes), with what to change."""


def validate_kv_write_inputs(cache, new, lengths) -> None:
    """Raises KvWriteInputError unless cache [B, H, S, D], new [B, T, H, D] of the same dtype (one of `DTYPES`) and
    lengths [B] integer agree. Works on arrays and on jax.ShapeDtypeStruct alike."""
    cs, ns, ls = tuple(cache.shape), tuple(new.shape), tuple(lengths.shape)
    if len(cs) != 4:
        raise KvWriteInputError(f"cache must be [B, H, S, D], got shape {cs}")
    if len(ns) != 4:
        raise KvWriteInputError(f"new must be [B, T, H, D], got shape {ns}")
    B, H, _, D = cs
    if (ns[0], ns[2], ns[3]) != (B, H, D):
        raise KvWriteInputError(f"new {ns} does not fit cache {cs}: expected [{B}, T, {H}, {D}]")
    if ls != (B,):
        raise KvWriteInputError(f"lengths must be [{B}] (one per sequence), got shape {ls}")
    if not np.issubdtype(np.dtype(lengths.dtype), np.integer):
        raise KvWriteInputError(f"lengths must be integer, got {np.dtype(lengths.dtype).name}")
    dt = np.dtype(cache.dtype)
    if dt not in DTYPES:
        raise KvWriteInputError(f"cache dtype {dt.name} is not supported: one of "
                                f"{', '.join(d.name for d in DTYPES)}")
    if np.dtype(new.dtype) != dt:
        raise KvWriteInputError(f"new is {np.dtype(new.dtype).name} but the cache is {dt.name}: cast it first")


def kv_write_reference(cache: jax.Array, new: jax.Array, lengths: jax.Array) -> jax.Array:
    """cache [B, H, S, D] with new [B, T, H, D] at slots lengths[b] + t of row b; slots outside [0, S) dropped."""
    B, T = new.shape[:2]
    b = jnp.arange(B)[:, None]
    s = lengths.astype(jnp.int32)[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    # A negative slot would wrap around under numpy indexing: send it past the end, where "drop" discards it.
    s = jnp.where(s < 0, cache.shape[2], s)
    # Advanced indices on axes 0 and 2 around a slice: the indexed view is [B, T, H, D], new's own layout.
    return cache.at[b, :, s].set(new.astype(cache.dtype), mode="drop")


def _ffi(cache, new, lengths):
    out = jax.ShapeDtypeStruct(cache.shape, cache.dtype)
    return jax.ffi.ffi_call(FFI_TARGET, out, input_output_aliases={0: 0}, vmap_method="sequential")(
        cache, new, lengths.astype(jnp.int32))


@jax.custom_vjp
def _kernel(cache, new, lengths):
    return _ffi(cache, new, lengths)


def _kernel_fwd(cache, new, lengths):
    return _ffi(cache, new, lengths), (cache, new, lengths)


def _kernel_bwd(res, dy):
    # Through the reference: a model trained with a 16-bit cache on CPU differentiates the attention over what was
    # written. lengths is integer: no cotangent.
    cache, new, lengths = res
    _, pullback = jax.vjp(lambda c, n: kv_write_reference(c, n, lengths), cache, new)
    return (*pullback(dy), None)


_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def _kv_write(cache, new, lengths):
    validate_kv_write_inputs(cache, new, lengths)
    if not cpu_build.available():
        raise KernelBuildError(f"the CPU KV-write kernel is unavailable: {cpu_build.unavailable_reason()}")
    return _kernel(cache, new, lengths)


kv_write = jax.jit(_kv_write, donate_argnums=(0,))
kv_write.__doc__ = """cache [B, H, S, D] with new [B, T, H, D] written at slots lengths[b] + t through the C++ kernel.

Jitted entry point for direct use, the cache donated (written in place); models go through the op table (op
`kv_write`). Slots outside [0, S) are dropped. Raises KvWriteInputError on bad shapes or dtypes, KernelBuildError
without a compiler. CPU platform only."""


def is_supported(cache, new, lengths) -> bool:
    """Whether the kernel takes these shapes and dtypes (decided at trace time; new already in the cache's dtype)."""
    try:
        validate_kv_write_inputs(cache, new, lengths)
    except KvWriteInputError:
        return False
    return True


def prefers(cache, new, lengths) -> bool:
    """The `auto` policy: the 16-bit float caches XLA:CPU rewrites whole on every scatter."""
    return np.dtype(cache.dtype) in AUTO_DTYPES


def kernel_kv_write(cache: jax.Array, new: jax.Array, lengths: jax.Array) -> jax.Array:
    """The kernel as the op table calls it inside a traced forward (new in the cache's dtype; no validation)."""
    return _kernel(cache, new, lengths)


available = cpu_build.available
unavailable_reason = cpu_build.unavailable_reason

__all__ = [
    "AUTO_DTYPES", "DTYPES", "KernelBuildError", "KvWriteInputError", "available", "is_supported", "kernel_kv_write",
    "kv_write", "kv_write_reference", "prefers", "unavailable_reason", "validate_kv_write_inputs",
]
