"""A CPU kernel for the attention of decoding and verification: T new tokens over the committed KV cache and over
themselves, one call per layer.

XLA's version (`specjax.kernels.xla.prefix_tree_attention`) is a dozen small operations per layer over every slot
of the cache's capacity, masked: a one-token step over a 2048-slot cache pays for 2048 slots however short the text,
and a batch of 8 one-token rows or a 13-token verify block spends more in attention than in the projections. The
C++ kernel (`cpu/prefix_attention.cc`) reads only each sequence's committed prefix, scores every query of a KV head
against a key with one pass over K, and splits (sequence, KV head, 128-slot block) items over XLA's thread pool,
merging the blocks in a fixed order.

The four parts, as for every specjax kernel:
- kernel body: `cpu/prefix_attention.cc` (score tiles in `cpu/tiles.h`), an XLA FFI handler compiled on first
  use and registered by `specjax.kernels.cpu_build`. Without a compiler, specjax warns once and uses XLA's version.
- jitted wrapper: `prefix_attention(q, k_cache, v_cache, k_new, v_new, lengths, tree_mask, scale=)`.
- pure-jnp reference: `prefix_attention_reference(...)`, float32 math over one dense score matrix.
- input validator: `validate_prefix_attention_inputs(...)`.

Which implementation runs is the op table's choice (`specjax.backends.ops`, op `attention`), made when a function
is traced: this module gives it `is_supported` (the validator; no sliding window, which the kernel does not apply)
and `prefers`, the `auto` policy: the kernel on the CPU platform for blocks of at most `AUTO_MAX_TOKENS` new tokens
(decoding and verification; prefill chunks stay with XLA's batched products), and for any block inside
`cpu_build.row_invariant()` (the engines' decode and verify steps). `SPECJAX_KERNELS=attention=kernel` takes the
kernel for every shape it supports, `attention=xla` never; XLA's version is `specjax.kernels.xla.prefix_tree_attention`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels import cpu_build
from specjax.kernels.cpu_build import KernelBuildError
from specjax.errors import SpecjaxError

FFI_TARGET = "specjax_prefix_attention"
# Blocks of new tokens the `auto` policy gives the kernel: decode steps, chain and tree verify blocks, batches.
AUTO_MAX_TOKENS = 128


class PrefixAttentionInputError(SpecjaxError, ValueError):
    """Inputs the kernel cannot take (ranks, shapes or dtypes), with what to change."""


def validate_prefix_attention_inputs(q, k_cache, v_cache, k_new, v_new, lengths, tree_mask) -> None:
    """Raises PrefixAttentionInputError unless q [B, T, Hq, D], k_cache/v_cache [B, Hkv, S, D] (float32 or
    bfloat16, one dtype), k_new/v_new [B, T, Hkv, D], lengths [B] integer and tree_mask [B, T, T] bool agree, with
    Hq a multiple of Hkv. Works on arrays and on jax.ShapeDtypeStruct alike."""
    qs, ks, vs = tuple(q.shape), tuple(k_cache.shape), tuple(v_cache.shape)
    if len(qs) != 4:
        raise PrefixAttentionInputError(f"q must be [B, T, Hq, D], got shape {qs}")
    B, T, Hq, D = qs
    if len(ks) != 4 or ks[0] != B or ks[3] != D:
        raise PrefixAttentionInputError(f"k_cache must be [B={B}, Hkv, S, D={D}], got shape {ks}")
    Hkv = ks[1]
    if vs != ks:
        raise PrefixAttentionInputError(f"v_cache {vs} and k_cache {ks} must have one shape")
    if Hkv == 0 or Hq % Hkv:
        raise PrefixAttentionInputError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    for name, a in (("k_new", k_new), ("v_new", v_new)):
        if tuple(a.shape) != (B, T, Hkv, D):
            raise PrefixAttentionInputError(f"{name} must be [B, T, Hkv, D] = {(B, T, Hkv, D)}, got {tuple(a.shape)}")
    if tuple(lengths.shape) != (B,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise PrefixAttentionInputError(f"lengths must be integer [B={B}], got {np.dtype(lengths.dtype).name} "
                                        f"{tuple(lengths.shape)}")
    if tuple(tree_mask.shape) != (B, T, T) or np.dtype(tree_mask.dtype) != np.dtype(bool):
        raise PrefixAttentionInputError(f"tree_mask must be bool [B, T, T] = {(B, T, T)}, got "
                                        f"{np.dtype(tree_mask.dtype).name} {tuple(tree_mask.shape)}")
    if np.dtype(k_cache.dtype) != np.dtype(v_cache.dtype) or np.dtype(k_cache.dtype) not in (
            np.dtype(jnp.float32), np.dtype(jnp.bfloat16)):
        raise PrefixAttentionInputError(f"the cache must be float32 or bfloat16 with one dtype for K and V, got "
                                        f"{np.dtype(k_cache.dtype).name} / {np.dtype(v_cache.dtype).name}")
    for name, a in (("q", q), ("k_new", k_new), ("v_new", v_new)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise PrefixAttentionInputError(f"{name} must be floating point, got {np.dtype(a.dtype).name}")


def as_cached(x: jax.Array, cache: jax.Array) -> jax.Array:
    """New entries x as a cache of `cache`'s dtype holds them, in float32: rounded to bfloat16 for a bfloat16 cache.
    A token then attends to an earlier token of its own verify block exactly as to one already in the cache."""
    return x.astype(cache.dtype).astype(jnp.float32)


def prefix_attention_reference(q, k_cache, v_cache, k_new, v_new, lengths, tree_mask, *, scale: float):
    """The kernel's contract in plain jnp, float32 math: token t of sequence b attends to cache slots
    s < clip(lengths[b], 0, S) and to new tokens j with tree_mask[b, t, j]; a token that sees nothing gets zeros.
    The new keys and values are attended to as the cache will hold them (`as_cached`). Shapes as in
    `validate_prefix_attention_inputs`; returns [B, T, Hq, D] float32."""
    f32, hi = jnp.float32, jax.lax.Precision.HIGHEST
    k_new, v_new = as_cached(k_new, k_cache), as_cached(v_new, v_cache)
    B, T, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    qg = q.astype(f32).reshape(B, T, Hkv, Hq // Hkv, D)
    keys = jnp.concatenate([k_cache.astype(f32), k_new.astype(f32).transpose(0, 2, 1, 3)], axis=2)  # [B,Hkv,S+T,D]
    vals = jnp.concatenate([v_cache.astype(f32), v_new.astype(f32).transpose(0, 2, 1, 3)], axis=2)
    prefix = jnp.arange(S)[None, :] < jnp.clip(lengths, 0, S)[:, None]  # [B, S]
    visible = jnp.concatenate([jnp.broadcast_to(prefix[:, None, :], (B, T, S)), tree_mask], axis=2)  # [B, T, S+T]
    s = jnp.einsum("btkgd,bksd->btkgs", qg, keys, precision=hi) * scale
    s = jnp.where(visible[:, :, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(visible[:, :, None, None, :], jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    den = e.sum(-1, keepdims=True)
    o = jnp.einsum("btkgs,bksd->btkgd", e / jnp.where(den > 0, den, 1.0), vals, precision=hi)
    return o.reshape(B, T, Hq, D)


def _ffi(q, k_cache, v_cache, k_new, v_new, lengths, tree_mask, scale):
    f32 = jnp.float32
    out = jax.ShapeDtypeStruct(q.shape, f32)
    # vmap over a leading axis runs the kernel once per element: the cache is never broadcast.
    return jax.ffi.ffi_call(FFI_TARGET, out, vmap_method="sequential")(
        q.astype(f32), k_cache, v_cache, as_cached(k_new, k_cache), as_cached(v_new, v_cache),
        lengths.astype(jnp.int32),
        tree_mask, scale=np.float32(scale))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _kernel(q, k_cache, v_cache, k_new, v_new, lengths, tree_mask, scale):
    return _ffi(q, k_cache, v_cache, k_new, v_new, lengths, tree_mask, scale)


def _kernel_fwd(q, k_cache, v_cache, k_new, v_new, lengths, tree_mask, scale):
    return _ffi(q, k_cache, v_cache, k_new, v_new, lengths, tree_mask, scale), (
        q, k_cache, v_cache, k_new, v_new, lengths, tree_mask)


def _kernel_bwd(scale, res, dy):
    # Gradients through the reference: training (a draft model, a head whose loss passes through the target's
    # forward) differentiates the model's attention; the kernel is built for the forward of decoding only.
    q, k_cache, v_cache, k_new, v_new, lengths, tree_mask = res
    ref = lambda *x: prefix_attention_reference(*x, lengths, tree_mask, scale=scale)  # noqa: E731
    _, pullback = jax.vjp(ref, q, k_cache, v_cache, k_new, v_new)
    # lengths and tree_mask are integer and bool: no cotangents.
    return (*pullback(dy.astype(jnp.float32)), None, None)


_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def _prefix_attention(q, k_cache, v_cache, k_new, v_new, lengths, tree_mask, scale):
    validate_prefix_attention_inputs(q, k_cache, v_cache, k_new, v_new, lengths, tree_mask)
    if not cpu_build.available():
        raise KernelBuildError(f"the CPU attention kernel is unavailable: {cpu_build.unavailable_reason()}")
    return _kernel(q, k_cache, v_cache, k_new, v_new, lengths, tree_mask, scale)


prefix_attention = jax.jit(_prefix_attention, static_argnames=("scale",))
prefix_attention.__doc__ = """Attention of T new tokens over the committed cache and themselves through the C++ kernel.

q [B, T, Hq, D]; k_cache/v_cache [B, Hkv, S, D] float32 or bfloat16, slots s < lengths[b] visible to every new
token; k_new/v_new [B, T, Hkv, D] (not yet in the cache; attended to as the cache will hold them, `as_cached`);
lengths [B] int; tree_mask [B, T, T] bool; scale (static) -> [B, T, Hq, D] float32. Jitted entry point for direct
use; the model goes through the op table (op `attention`). No donation: the cache is only read. Raises
PrefixAttentionInputError on bad shapes or dtypes, KernelBuildError without a compiler. CPU platform only."""


def is_supported(q, k_cache, v_cache, k_new, v_new, lengths, tree_mask, *, scale=None, positions=None,
                 window=None) -> bool:
    """Whether the kernel takes these shapes and dtypes (decided at trace time). It applies no sliding window."""
    if window is not None:
        return False
    try:
        validate_prefix_attention_inputs(q, k_cache, v_cache, k_new, v_new, lengths, tree_mask)
    except PrefixAttentionInputError:
        return False
    return True


def prefers(q, *args, **options) -> bool:
    """The `auto` policy: blocks of at most AUTO_MAX_TOKENS new tokens, any block inside `row_invariant()`."""
    return q.shape[1] <= AUTO_MAX_TOKENS or cpu_build.in_row_invariant()


def kernel_attention(q, k_cache, v_cache, k_new, v_new, lengths, tree_mask, *, scale: float, positions=None,
                     window=None):
    """The kernel as the op table calls it inside a traced forward, output cast to q's dtype. positions is unused
    (window must be None: see `is_supported`)."""
    return _kernel(q, k_cache, v_cache, k_new, v_new, lengths, tree_mask, scale).astype(q.dtype)


available = cpu_build.available
unavailable_reason = cpu_build.unavailable_reason

__all__ = [
    "AUTO_MAX_TOKENS", "KernelBuildError", "PrefixAttentionInputError", "available", "is_supported",
    "kernel_attention", "prefers", "prefix_attention", "prefix_attention_reference", "unavailable_reason",
    "validate_prefix_attention_inputs",
]
