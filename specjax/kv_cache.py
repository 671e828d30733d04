"""Fixed-capacity KV cache pytree: writes at per-sequence offsets and static-shape compaction.

Capacity is a shape-setting value (allocated once for the worst case of a request bucket); per-sequence
lengths are data. One array per layer (not one stacked array): the forward is unrolled over layers, and
indexing a stacked cache per layer would copy it on XLA:CPU. Everything here is pure; the engine donates the
cache across jitted steps so XLA updates it in place.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class KVCache(NamedTuple):
    k: tuple  # L x [B, S, Hkv, D]
    v: tuple  # L x [B, S, Hkv, D]
    lengths: jax.Array  # [B] int32: committed entries per sequence (slots >= lengths are free)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]


def init_cache(num_layers: int, batch: int, capacity: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32) -> KVCache:
    shape = (batch, capacity, num_kv_heads, head_dim)
    return KVCache(tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   jnp.zeros((batch,), jnp.int32))


def write_kv(ck, cv, k_new, v_new, lengths):
    """Write T new entries per sequence at slots [lengths[b], lengths[b] + T) of one layer.

    ck/cv [B, S, Hkv, D], k_new/v_new [B, T, Hkv, D], lengths [B] -> updated (ck, cv).
    A scatter rather than a rebuilt array, so XLA updates the loop-carried cache in place. Writes past the
    capacity are dropped; callers check capacity on the host before they get here.
    """
    B, T = k_new.shape[:2]
    b = jnp.arange(B)[:, None]
    s = lengths[:, None] + jnp.arange(T)[None, :]  # [B, T]
    ck = ck.at[b, s].set(k_new.astype(ck.dtype), mode="drop")
    cv = cv.at[b, s].set(v_new.astype(cv.dtype), mode="drop")
    return ck, cv


def compact(cache: KVCache, src_nodes: jax.Array, num_keep: jax.Array) -> KVCache:
    """Move the accepted path of a verified tree into place and advance the lengths.

    The tree's N nodes were written at slots [lengths, lengths + N) in node order. src_nodes [B, P] lists,
    in depth order, the node index that must end up at slot lengths + j (node 0, the root, is always first);
    num_keep [B] is how many of those P entries become committed. Fixed shapes: all P entries are moved, those
    past num_keep land beyond the new length where they are free slots again.
    """
    B, S = cache.k[0].shape[:2]
    P = src_nodes.shape[1]
    b = jnp.arange(B)[:, None]
    src = jnp.clip(cache.lengths[:, None] + src_nodes, 0, S - 1)  # [B, P]
    dst = cache.lengths[:, None] + jnp.arange(P)[None, :]
    move = lambda a: a.at[b, dst].set(a[b, src], mode="drop")
    return KVCache(tuple(move(a) for a in cache.k), tuple(move(a) for a in cache.v),
                   cache.lengths + num_keep.astype(jnp.int32))
