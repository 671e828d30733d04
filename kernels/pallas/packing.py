"""GQA row packing shared by the Pallas kernels.

The G = Hq / Hkv query heads that share a KV head are stacked into the row axis of one tile, so each K/V block
is read from memory once per KV head, not once per query head, and a single decode token (T = 1) still fills
G rows of the matrix unit. Row r = t * G + g of KV head h holds query head h * G + g of token t.
"""
from __future__ import annotations

import jax.numpy as jnp


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def next_power_of_2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def pack_queries(q, num_kv_heads: int, rows_padded: int):
    """[B, T, Hq, D] -> [B, Hkv, Rp, D], rows r = t * G + g, zero rows beyond T * G."""
    batch, num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    packed = q.reshape(batch, num_tokens, num_kv_heads, group, head_dim)
    packed = packed.transpose(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, num_tokens * group, head_dim)
    return jnp.pad(packed, ((0, 0), (0, 0), (0, rows_padded - num_tokens * group), (0, 0)))


def unpack_rows(packed, num_tokens: int, num_q_heads: int):
    """[B, Hkv, Rp, D] -> [B, T, Hq, D], inverse of pack_queries (padding rows dropped)."""
    batch, num_kv_heads, _, head_dim = packed.shape
    group = num_q_heads // num_kv_heads
    out = packed[:, :, : num_tokens * group].reshape(batch, num_kv_heads, num_tokens, group, head_dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(batch, num_tokens, num_q_heads, head_dim)


def unpack_row_stat(packed, num_tokens: int, num_q_heads: int):
    """[B, Hkv, Rp] -> [B, T, Hq], for per-row statistics such as the LSE."""
    batch, num_kv_heads, _ = packed.shape
    group = num_q_heads // num_kv_heads
    out = packed[:, :, : num_tokens * group].reshape(batch, num_kv_heads, num_tokens, group)
    return out.transpose(0, 2, 1, 3).reshape(batch, num_tokens, num_q_heads)


def pack_tree_mask(tree_mask, group: int, rows_padded: int, cols_padded: int):
    """[B, T, T] bool -> [B, Rp, Cp] int32: row r = t * G + g copies tree row t; padding is 0 (not visible).

    int32 because bool refs are not portable across the Triton and Mosaic lowerings.
    """
    batch, num_tokens, _ = tree_mask.shape
    rows = jnp.repeat(tree_mask, group, axis=1)
    rows = jnp.pad(rows, ((0, 0), (0, rows_padded - num_tokens * group), (0, cols_padded - num_tokens)))
    return rows.astype(jnp.int32)
