"""Fixed-capacity KV cache pytree: writes at per-sequence offsets, and the accepted path of a verified tree written in depth order.

Capacity is a shape-setting value (allocated once for the worst case of a request bucket); per-sequence
lengths are data. One array per layer (not one stacked array): the forward is unrolled over layers, and
indexing a stacked cache per layer would copy it on XLA:CPU. Everything here is pure; the engine donates the
cache across jitted steps so XLA updates it in place.

Layout: head-major, [B, Hkv, S, D] per layer. Attention contracts over D with (B, Hkv) as batch dimensions; with
the cache in this layout XLA:CPU multiplies it where it lies, while the token-major [B, S, Hkv, D] layout made it
materialise a transposed copy of every layer's cache on every step (the figures: reports/decode_cpu/README.md,
decode_headmajor.json).

int8 entries (`init_cache(kv_dtype="int8")`): each entry is stored as int8 with one float32 scale per token and KV
head, k_scale / v_scale [B, Hkv, S] per layer (symmetric: x ~ q * scale, scale = max|x| over the head size / 127).
Per token and head rather than per channel or per block of slots, because then an entry's quantization depends on
that entry alone: appending a token never rescales the entries already there, so writing tokens one at a time
(plain decoding) or all at once (prefill, a verified path) stores the same bytes, in any order. That is what keeps
speculative decoding exact over an int8 cache: plain decoding and verification attend to the same values. The
forward reads a layer back with `dequantize` and attends in the model's dtype.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.config import ConfigError
from specjax.backends import ops

KV_DTYPES = (None, "int8")  # kv_dtype values: None = entries in the model's dtype; "int8" = scaled int8 entries
QMAX = 127  # symmetric int8 range [-127, 127]: -128 unused, so q and -q are both representable


class KVCache(NamedTuple):
    k: tuple  # L x [B, Hkv, S, D]
    v: tuple  # L x [B, Hkv, S, D]
    lengths: jax.Array  # [B] int32: committed entries per sequence (slots >= lengths are free)
    # An int8 cache's scales, L x [B, Hkv, S] float32 each (entry ~ k[..., d] * k_scale); () for a float cache.
    k_scale: tuple = ()
    v_scale: tuple = ()

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    @property
    def quantized(self) -> bool:
        return bool(self.k_scale)

    def scales(self, i: int) -> tuple:
        """Layer i's (k_scale, v_scale) for `write_kv`, () for a float cache."""
        return (self.k_scale[i], self.v_scale[i]) if self.quantized else ()


def check_kv_dtype(kv_dtype) -> None:
    """Raise ConfigError unless kv_dtype is one of KV_DTYPES."""
    if kv_dtype not in KV_DTYPES:
        raise ConfigError(f"unknown kv_cache_dtype {kv_dtype!r}; supported: None (the model's dtype), 'int8'")


def init_cache(num_layers: int, batch: int, capacity: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32,
               kv_dtype: str | None = None) -> KVCache:
    """An empty cache of L x [batch, Hkv, capacity, D] per K and V: in `dtype`, or int8 with zero scales
    (L x [batch, Hkv, capacity] float32) when kv_dtype is 'int8'."""
    check_kv_dtype(kv_dtype)
    shape = (batch, num_kv_heads, capacity, head_dim)
    zeros = lambda s, t: tuple(jnp.zeros(s, t) for _ in range(num_layers))  # noqa: E731
    lengths = jnp.zeros((batch,), jnp.int32)
    if kv_dtype == "int8":
        return KVCache(zeros(shape, jnp.int8), zeros(shape, jnp.int8), lengths, zeros(shape[:3], jnp.float32),
                       zeros(shape[:3], jnp.float32))
    return KVCache(zeros(shape, dtype), zeros(shape, dtype), lengths)


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (q [..., D] int8, scale [...] float32), symmetric over the last axis: scale = max|x| / 127
    (1 for an all-zero vector, so nothing divides by zero) and q = round(x / scale) in [-127, 127]."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / QMAX, 1.0)
    q = jnp.clip(jnp.round(x / scale[..., None]), -QMAX, QMAX).astype(jnp.int8)
    return q, scale


def dequantize(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """q [..., D] int8, scale [...] float32 -> q * scale [..., D] in `dtype`: one layer of an int8 cache read back
    (k [B, Hkv, S, D] with k_scale [B, Hkv, S]), or new entries as the cache will hold them. Every reader goes
    through here, so plain decoding and verification see the same values."""
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


def as_stored(x: jax.Array, quantized: bool) -> jax.Array:
    """New entries x [..., D] as a cache reads them back: `dequantize(quantize(x))` in x's dtype for an int8 cache,
    x itself for a float one. The attention over a block's own new tokens uses this, so a token attends to an
    earlier token of its block exactly as it would once that token is in the cache."""
    return dequantize(*quantize(x), x.dtype) if quantized else x


def write_kv(ck, cv, k_new, v_new, lengths, scales: tuple = ()):
    """Write T new entries per sequence at slots [lengths[b], lengths[b] + T) of one layer.

    ck/cv [B, Hkv, S, D], k_new/v_new [B, T, Hkv, D] (token-major, as the projections give them),
    lengths [B] -> updated (ck, cv).
    scales: () for a float cache; an int8 cache's (k_scale, v_scale) of this layer, each [B, Hkv, S] float32: the
    new entries are then quantized per token and head (`quantize`), and the result is (ck, cv, (k_scale, v_scale)).
    Scatters rather than rebuilt arrays, so XLA updates the loop-carried cache in place. Writes past the
    capacity are dropped; callers check capacity on the host before they get here.
    """
    quantized = bool(scales)
    if quantized:
        B, T = k_new.shape[:2]
        b = jnp.arange(B)[:, None]
        s = lengths[:, None] + jnp.arange(T)[None, :]  # [B, T]
        (k_new, k_s), (v_new, v_s) = quantize(k_new), quantize(v_new)  # [B, T, Hkv, D] int8, [B, T, Hkv]
        # The same advanced indices on a [B, Hkv, S] array index a [B, T, Hkv] view: the scales' own layout.
        scales = tuple(a.at[b, :, s].set(n, mode="drop") for a, n in zip(scales, (k_s, v_s)))
    # The op kv_write: on CPU the kernel writes in place where XLA would rewrite the whole layer (16-bit floats).
    ck = ops.call("kv_write", ck, k_new.astype(ck.dtype), lengths)
    cv = ops.call("kv_write", cv, v_new.astype(cv.dtype), lengths)
    return (ck, cv, scales) if quantized else (ck, cv)


def write_path(cache: KVCache, new_kv: tuple, base: jax.Array) -> KVCache:
    """Write P entries per sequence and layer at slots [base, base + P) (`write_kv` for every layer, quantized for
    an int8 cache); the lengths are left as they are. new_kv: (k, v), each a tuple over layers of [B, P, Hkv, D]
    (the forward's float entries); base [B]."""
    layers = [write_kv(ck, cv, k, v, base, cache.scales(i))
              for i, (ck, cv, k, v) in enumerate(zip(cache.k, cache.v, *new_kv))]
    return with_layers(cache, layers)


def with_layers(cache: KVCache, layers) -> KVCache:
    """`cache` with its per-layer arrays replaced by `layers`: one (k, v) or (k, v, (k_scale, v_scale)) per layer,
    as `write_kv` returns them. The lengths are left as they are."""
    k, v = (tuple(layer[j] for layer in layers) for j in (0, 1))
    if not cache.quantized:
        return cache._replace(k=k, v=v)
    return cache._replace(k=k, v=v, k_scale=tuple(layer[2][0] for layer in layers),
                          v_scale=tuple(layer[2][1] for layer in layers))


def map_entries(fn, cache: KVCache, *others: KVCache, lengths: jax.Array | None = None) -> KVCache:
    """A cache whose every per-layer array (K and V, and an int8 cache's scales: all lead with [B, Hkv, S]) is
    fn(array, the same array of each of `others`); lengths: the new lengths (default: cache's). For the slot and
    row operations that move whole entries (growing the capacity, taking a row, putting one back)."""
    fields = ("k", "v", "k_scale", "v_scale")
    new = {f: tuple(map(fn, getattr(cache, f), *(getattr(o, f) for o in others))) for f in fields}
    return KVCache(lengths=cache.lengths if lengths is None else lengths, **new)


def gather_path(new_kv: tuple, src_nodes: jax.Array) -> tuple:
    """The entries of the accepted path, in depth order: new_kv as `forward` returns it (each [B, N, Hkv, D]),
    src_nodes [B, P] node indices -> the same tuples of [B, P, Hkv, D]."""
    take = lambda a: jnp.take_along_axis(a, src_nodes[:, :, None, None], axis=1)  # noqa: E731
    return tuple(tuple(take(a) for a in layers) for layers in new_kv)
