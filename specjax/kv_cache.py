"""Fixed-capacity KV cache pytree: writes at per-sequence offsets and static-shape compaction.

Capacity is a shape-setting value (allocated once for the worst case of a request bucket); per-sequence
lengths are data. Everything here is pure; the engine donates the cache across jitted steps.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class KVCache(NamedTuple):
    k: jax.Array  # [L, B, S, Hkv, D]
    v: jax.Array  # [L, B, S, Hkv, D]
    lengths: jax.Array  # [B] int32: committed entries per sequence (slots >= lengths are free)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]


def init_cache(num_layers: int, batch: int, capacity: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32) -> KVCache:
    shape = (num_layers, batch, capacity, num_kv_heads, head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))


def write_kv(ck, cv, layer, k_new, v_new, lengths):
    """Write T new entries per sequence at slots [lengths[b], lengths[b] + T) of one layer.

    ck/cv [L, B, S, Hkv, D], layer: scalar int, k_new/v_new [B, T, Hkv, D], lengths [B].
    A scatter (not a copy of the layer) so that XLA updates the loop-carried cache in place. Writes past the
    capacity are dropped; callers check capacity on the host before they get here.
    """
    B, T = k_new.shape[:2]
    b = jnp.arange(B)[:, None]
    s = lengths[:, None] + jnp.arange(T)[None, :]  # [B, T]
    ck = ck.at[layer, b, s].set(k_new.astype(ck.dtype), mode="drop")
    cv = cv.at[layer, b, s].set(v_new.astype(cv.dtype), mode="drop")
    return ck, cv


def compact(cache: KVCache, src_nodes: jax.Array, num_keep: jax.Array) -> KVCache:
    """Move the accepted path of a verified tree into place and advance the lengths.

    The tree's N nodes were written at slots [lengths, lengths + N) in node order. src_nodes [B, P] lists,
    in depth order, the node index that must end up at slot lengths + j (node 0, the root, is always first);
    num_keep [B] is how many of those P entries are kept. Fixed shapes: P is the tree's max depth + 1, the
    window is gathered and written back whole, entries past num_keep are left as garbage beyond the length.
    """
    L, B, S, H, D = cache.k.shape
    P = src_nodes.shape[1]
    b = jnp.arange(B)[:, None]
    src = cache.lengths[:, None] + src_nodes  # [B, P]
    dst = cache.lengths[:, None] + jnp.arange(P)[None, :]
    src = jnp.clip(src, 0, S - 1)
    k = cache.k.at[:, b, dst].set(cache.k[:, b, src], mode="drop")
    v = cache.v.at[:, b, dst].set(cache.v[:, b, src], mode="drop")
    return KVCache(k, v, cache.lengths + num_keep.astype(jnp.int32))
